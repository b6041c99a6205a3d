"""The public API: init_rpc, rpc_sync/rpc_async/remote, shutdown and friends.

Owns: the life cycle of the current runtime (the one process-global, in ``state``).
Nothing imports it but ``rrefrt/__init__``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import threading
import time
from typing import Any, Callable

import rrefrt_transport as transport
from rrefrt import arguments, debug, profiling as _profiling, state
from rrefrt.payload import serialization
from rrefrt import hooks as _autograd
from rrefrt.payload.devices import DeviceInfo, DevicePlan
from rrefrt.agent_view import AgentView
from rrefrt.errors import ArgumentError, AuthenticationError, RpcError, RpcTimeoutError, ShutdownError, WorkerUnavailableError
from rrefrt.futures import Future
from rrefrt.options import RpcBackendOptions, WorkerInfo, check_worker_name
from rrefrt.group.membership import MAX_RANKS, Membership, shutdown_dynamic
from rrefrt.group.rendezvous import DYNAMIC, Record, Rendezvous, RendezvousError, bind_host, resolve
from rrefrt.runtime.shutdown import format_calls, shutdown_graceful
from rrefrt.rref import RRef
from rrefrt.runtime.root import Runtime

log = logging.getLogger("rrefrt")

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_worker_infos",
    "get_rpc_timeout",
    "get_debug_info",
]

#: serializes init_rpc and shutdown of this process (the current runtime's rendezvous lives
#: on the runtime itself, ``rt.group``: no other module state)
_init_lock = threading.Lock()

#: NOTE [Default transport]: "auto" - AF_UNIX and shared memory between workers of one host,
#: zmq for the rest (transport/auto.py). RREFRT_TRANSPORT=zmq (or RREFRT_SAME_HOST=0) goes
#: back to zmq everywhere; any registered transport can be named.
DEFAULT_TRANSPORT = "auto"


def _after_fork_in_child() -> None:
    """NOTE [Fork safety]: a thread of the parent may have held ``_init_lock`` (inside
    init_rpc or shutdown) at the fork; it does not exist in the child, so the child gets a
    fresh lock and may call init_rpc afresh. The inherited runtime is left alone (unusable:
    ``state.current`` checks the pid), nothing is closed or sent."""
    global _init_lock
    _init_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join an RPC group as worker ``name``; returns once every worker is reachable.

    Without ``world_size`` (and without WORLD_SIZE in the environment) the worker joins a
    *dynamic* group through the store at ``init_method``: it may start before or after the
    others, members learn of it, and its ``shutdown()`` leaves the group without a barrier
    (see docs/dynamic-groups.md). A name or rank already taken raises RendezvousError
    ("... is not unique"). ``backend`` is None or ``BackendType.TENSORPIPE``; ``rank`` an int
    (-1: RANK from the environment), ``world_size`` an int >= 1 or None: anything else raises
    ArgumentError at once, as do bad options (``RpcBackendOptions.validate``)."""
    check_worker_name(name)
    arguments.backend_type(backend)  # accepted for compatibility: rrefrt has one backend
    options = rpc_backend_options or RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise ArgumentError(  # torch's phrase
            f"Argument rpc_backend_options must be an instance of RpcBackendOptions (rrefrt.RpcBackendOptions), "
            f"got {type(options).__name__}")
    if type(options) is not RpcBackendOptions:
        # a subclass is another backend's options, as in torch (which infers the backend from
        # the options' class); rrefrt has one backend, whose options are RpcBackendOptions
        # (TensorPipeRpcBackendOptions is the same class). torch's phrases, which its tests match
        if backend is None:
            raise ArgumentError(
                f"Could not infer backend for options {options!r}: rrefrt's backend takes rrefrt.RpcBackendOptions "
                f"(or TensorPipeRpcBackendOptions), not the subclass {type(options).__qualname__}")
        raise ArgumentError(
            f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. Got {type(options).__qualname__} "
            "(rrefrt.RpcBackendOptions, the same class, is accepted)")
    options.validate()  # again: a field may have been set after construction
    # -1 (or None): RANK from the environment; a rank >= world_size is the rendezvous's to
    # report, to the whole group (rrefrt/group/rendezvous.py)
    rank = -1 if rank is None else arguments.integer(
        "rank", rank, minimum=-1, what="an int >= 0 (or -1 to read RANK from the environment)")
    if world_size is not None:
        world_size = arguments.integer("world_size", world_size, minimum=1, what="an int >= 1 (or None)")
    with _init_lock:
        if state.current_or_none() is not None:
            raise RpcError("RPC is already initialized on this process; call rrefrt.shutdown() first")
        spec = resolve(options.init_method, rank, world_size)
        dynamic = spec.world_size == DYNAMIC  # docs/dynamic-groups.md, rrefrt/group/membership.py
        deadline = time.monotonic() + options.init_timeout
        incarnation = random.SystemRandom().getrandbits(63)
        secret = job_secret(options)
        info = WorkerInfo(name, spec.rank)
        # published, not raised: a bad map fails init on every worker at once after the
        # rendezvous (DevicePlan.build), instead of one worker stopping and the others waiting
        dinfo = DeviceInfo.local(name, options.devices, options.device_maps)
        options.set_devices(list(dinfo.devices))  # the launcher's RREFRT_DEVICE when empty
        host = bind_host(spec.master_addr)
        config = transport.TransportConfig(
            worker_id=info.id,
            name=info.name,
            incarnation=incarnation,
            host=host,
            heartbeat_interval=options.heartbeat_interval,
            heartbeat_timeout=options.heartbeat_timeout,
            route_grace=min(0.5, options.heartbeat_timeout),
            max_message_size=options.max_message_size,
            secret=secret.encode() if isinstance(secret, str) else secret,
            world_size=spec.world_size or MAX_RANKS,
            kind=os.environ.get("RREFRT_TRANSPORT", DEFAULT_TRANSPORT),
            # NOTE [Lazy connections] in transport/zmq/agent.py: RREFRT_CONNECT=eager forms
            # the whole mesh at the join, as before
            connect="eager" if os.environ.get("RREFRT_CONNECT", "lazy").strip().lower() == "eager" else "lazy",
            # dynamic: the same-host plane forms once, at a join; later peers go through zmq
            extra={"auto_inner": "zmq", **({"same_host": False} if dynamic else {})},
        )
        # the transport is built from the runtime's callbacks; it chooses its own endpoints
        rt = Runtime(info, options, lambda on_message, on_peer_dead: transport.create(config, on_message, on_peer_dead))
        rdzv: Rendezvous | Membership | None = None
        try:
            if secret is None:
                warn_unauthenticated(host)
            # before the agent starts: a peer may call us as soon as the mesh forms
            serialization.set_unpickle_allowlist(options.unpickle_allowlist)
            address = rt.transport.listen()
            rt.transport.start()
            rdzv = (Membership if dynamic else Rendezvous)(spec, options.init_timeout, secret, name)
            me = Record(name, spec.rank, spec.world_size, incarnation, address.to_wire(), {"devices": dinfo.to_meta()})
            records = rdzv.join(me, deadline)
            hosts = {r.name: r.address.get("host") for r in records}
            same = lambda peer: hosts.get(peer) == address.host  # noqa: E731
            rt.devices = rdzv.device_plan(records, same) if isinstance(rdzv, Membership) else DevicePlan.build(
                name, {r.name: DeviceInfo.from_meta(r.name, r.meta.get("devices")) for r in records}, same,
            )
            rt.set_world([WorkerInfo(r.name, r.rank) for r in records])
            # current before the mesh is up: a peer that finished joining first may already
            # call us, and its function may use the API
            state.set_current(rt)
            peers = [
                transport.PeerSpec(r.rank, r.name, r.incarnation, transport.PeerAddress.from_wire(r.address))
                for r in records
            ]
            try:
                if isinstance(rdzv, Membership):  # and follows joins, leaves, evictions from now on
                    rdzv.connect(rt, peers, max(0.1, deadline - time.monotonic()))
                else:
                    rt.transport.connect_peers(peers, max(0.1, deadline - time.monotonic()))
            except transport.AuthenticationFailed as e:
                raise AuthenticationError(
                    f"{e}. Every worker of a job must use the same secret (RREFRT_SECRET or "
                    "RpcBackendOptions(secret=...)), or none may; see docs/security.md",
                    e.peers,
                ) from None
            except transport.TransportError as e:
                raise RendezvousError(str(e)) from None
        except BaseException:
            state.set_current(None)
            serialization.set_unpickle_allowlist(None)
            rt.close()
            if rdzv is not None:
                rdzv.close(failed=True)
            raise
        rt.group = (rdzv, spec.world_size)
        state.set_current(rt)
        _profiling.install()  # when torch is imported: RPC calls show in its profiler
        _install_dump(rt, spec.rank, rdzv)
        log.info("worker %r (rank %d of %s) joined the group", name, spec.rank, spec.world_size or "a dynamic group")


def job_secret(options: RpcBackendOptions) -> str | bytes | None:
    """The per-job secret that keys CURVE authentication: the option, else RREFRT_SECRET
    (which rrefrt-run sets), else None (no authentication)."""
    if options.secret is not None:
        return options.secret
    return os.environ.get("RREFRT_SECRET") or None


def warn_unauthenticated(bind_address: str) -> bool:
    """Log one warning when a worker without a secret listens beyond loopback; return
    whether it did."""
    try:
        if ipaddress.ip_address(bind_address).is_loopback:
            return False
    except ValueError:  # a host name: treat it as reachable from elsewhere
        pass
    log.warning(
        "rrefrt is listening on %s without authentication: anyone who can reach this address can "
        "run arbitrary code in this process (payloads are pickled). Set the same RREFRT_SECRET "
        "(or RpcBackendOptions(secret=...)) on every worker; see docs/security.md",
        bind_address,
    )
    return True


def _check_call(to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments every call kind takes, checked before anything is sent (rrefrt/arguments.py):
    the positional and keyword arguments in canonical form."""
    if to is None:  # get_worker_info(None) is this worker; a call needs a destination
        raise WorkerUnavailableError(
            "could not find destination: 'to' is None; pass a worker name, id or WorkerInfo "
            "(rrefrt.get_worker_info() names this worker)"
        )
    if not callable(func):
        raise ArgumentError(f"func must be callable, got {type(func).__name__} {func!r:.80}")
    arguments.call_timeout(timeout)
    return arguments.call_args(args), arguments.call_kwargs(kwargs)


def rpc_sync(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result. ``args`` is a
    tuple or list (not a string), ``kwargs`` a dict, ``timeout`` finite seconds (-1: the
    default, 0: none): anything else raises ArgumentError, and ``to=None``
    WorkerUnavailableError, before anything is sent."""
    args, kwargs = _check_call(to, func, args, kwargs, timeout)
    if _profiling.active():  # inside torch's legacy profiler: record the call (NOTE [RPC profiling])
        return _profiling.profiled_call("sync", rpc_sync, to, func, args, kwargs, timeout)
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("rpc_sync", state.current().rpc_sync, to, func, args, kwargs, timeout)
    return state.current().rpc_sync(to, func, args, kwargs, timeout)


def rpc_async(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]:
    """Like rpc_sync, returning a Future at once."""
    args, kwargs = _check_call(to, func, args, kwargs, timeout)
    if _profiling.active():  # inside torch's legacy profiler: record the call (NOTE [RPC profiling])
        return _profiling.profiled_call("async", rpc_async, to, func, args, kwargs, timeout)
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("rpc_async", state.current().rpc_async, to, func, args, kwargs, timeout)
    return state.current().rpc_async(to, func, args, kwargs, timeout)


def remote(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
    """Run ``func`` on ``to`` and return an RRef to its result, owned by ``to``."""
    args, kwargs = _check_call(to, func, args, kwargs, timeout)
    if _profiling.active():  # inside torch's legacy profiler: record the call (NOTE [RPC profiling])
        return _profiling.profiled_call("remote", remote, to, func, args, kwargs, timeout)
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("remote", state.current().remote, to, func, args, kwargs, timeout)
    return state.current().remote(to, func, args, kwargs, timeout)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    return state.current().worker_info(worker_name)


def get_worker_infos() -> list[WorkerInfo]:
    """The current members of the group, this worker included (in a dynamic group it
    changes as workers join, leave or are evicted)."""
    return state.current().worker_infos()


def get_rpc_timeout() -> float:
    return state.current().options.rpc_timeout


def _install_dump(rt: Runtime, rank: int, rdzv: Any) -> None:
    """NOTE [Job dump] in rrefrt/debug.py: where the launcher named a dump directory,
    SIGUSR1 writes this worker's threads and calls in flight there, and the store says
    where to find this worker (for ``python -m rrefrt.debug dump``)."""
    directory = os.environ.get(debug.DUMP_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return
    name = rt.info.name

    def calls() -> str:
        return format_calls(f"calls in flight on {name!r}:", rt.lifecycle.calls_in_flight(stacks=True))

    if debug.install_dump_signal(directory, rank, lambda: f"worker {name!r}", calls):
        debug.publish_dump_target(getattr(rdzv, "store", None), rank, directory)


def get_debug_info() -> dict[str, Any]:
    """This worker's counters (int values: the RRef context's ``num_*``, the transport's
    ``agent.*``, the pool's ``pool.*``) and ``calls_in_flight``: the calls in flight here in
    both directions, oldest first, each a dict with id, direction ("incoming"/"outgoing"),
    function, peer, age (s) and state (docs/stuck.md). Safe to poll from any thread."""
    return state.current().debug_info()


# ---------------------------------------------------------------- torch's private helpers
# Private in torch, called by torch programs in the wild; these have the same meaning here
# (docs/compatibility.md lists the private helpers that differ).

def _set_rpc_timeout(rpc_timeout: float) -> None:
    """torch's ``rpc._set_rpc_timeout``: the default timeout (seconds) of every later call,
    fetch and RRef wait made by this worker (``get_rpc_timeout()`` returns it)."""
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) or rpc_timeout < 0:
        raise ArgumentError(f"_set_rpc_timeout expects a number of seconds >= 0, got {rpc_timeout!r}")
    state.current().options.rpc_timeout = float(rpc_timeout)


def _get_debug_info() -> dict[str, Any]:
    """torch's ``rpc._get_debug_info``: rrefrt's counters (``get_debug_info()``)."""
    return get_debug_info()


def _rref_context_get_debug_info() -> dict[str, str]:
    """torch's ``rpc._rref_context_get_debug_info``: the RRef context's counters alone, as
    strings (``num_owner_rrefs``, ``num_forks``, ``num_pending_users``, ...; and
    ``num_pending_futures``, always "0": rrefrt's context keeps no futures, a fetch waits on
    its call's). One lock and no transport or pool: cheap enough to poll while the protocol
    settles (``get_debug_info()`` has these counters and everything else)."""
    info = {k: str(v) for k, v in state.current().ctx.counts().items()}
    info.setdefault("num_pending_futures", "0")
    return info


def _get_current_rpc_agent() -> AgentView:
    """torch's ``rpc._get_current_rpc_agent``: a view with ``get_worker_infos()``,
    ``get_worker_info(name=None)`` and ``get_debug_info()`` (rrefrt/agent_view.py)."""
    return AgentView(state.current())


def _wait_all_workers(timeout: float | None = None) -> None:
    """torch's ``rpc.api._wait_all_workers``: a barrier of every worker of the group, through
    the rendezvous store; each worker must call it the same number of times. Raises
    RpcTimeoutError naming the workers that did not arrive within ``timeout`` seconds
    (None: the options' ``shutdown_timeout``, as torch bounds it by its shutdown timeout)."""
    rt = state.current()
    timeout = rt.options.shutdown_timeout if timeout is None else timeout
    rdzv, world_size = rt.group
    if world_size == DYNAMIC:
        raise RpcError("_wait_all_workers needs a group of fixed size (init_rpc with world_size)")
    rt.user_barriers += 1
    phase = f"wait_all_workers/{rt.user_barriers}"
    missing = rdzv.barrier(phase, rt.info.id, world_size, time.monotonic() + timeout, set())
    if missing:
        names = ", ".join(repr(rt.workers_by_id[r].name) if r in rt.workers_by_id else f"rank {r}" for r in missing)
        raise RpcTimeoutError(
            f"_wait_all_workers on {rt.info.name!r} timed out after {timeout:.2f} seconds: worker(s) {names} did not arrive"
        )


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the group. Graceful: finish in-flight calls, delete this worker's RRef users,
    wait for owners to drain, meet everyone at a barrier, check for leaks - all bounded by
    ``timeout`` (0: the options' shutdown_timeout); the steps are rrefrt/runtime/lifecycle.py's. Raises ShutdownError naming workers
    that never arrived, RRefLeakError for leaks in strict mode; the runtime is closed
    either way. In a dynamic group there is no barrier: the worker finishes its calls,
    deletes its RRef users and leaves; calls to it then fail with WorkerUnavailableError."""
    graceful = arguments.flag("graceful", graceful, constructor=False)
    timeout = arguments.call_timeout(timeout, meaning="pass 0 for the options' shutdown_timeout") or 0
    rt = state.current_or_none()
    if rt is None:
        if state.inherited():
            raise ShutdownError(f"shutdown() has nothing to shut down: {state.FORKED}")
        raise ShutdownError("shutdown() called but RPC is not running on this process")
    with _init_lock:
        if state.current_or_none() is not rt:
            return
        rdzv: Rendezvous
        rdzv, world_size = rt.group
        error: BaseException | None = None
        try:
            if world_size == DYNAMIC:  # leave a dynamic group: no barrier (rrefrt/group/membership.py)
                limit = timeout if timeout and timeout > 0 else rt.options.shutdown_timeout
                error = shutdown_dynamic(rt, rdzv, graceful, limit)
            elif graceful:
                limit = timeout if timeout and timeout > 0 else rt.options.shutdown_timeout
                error = shutdown_graceful(rt, rdzv, world_size, limit)
        finally:
            state.set_current(None)
            serialization.set_unpickle_allowlist(None)
            debug.uninstall_dump_signal()
            rt.close()
            rdzv.close()
        if error is not None:
            raise error
