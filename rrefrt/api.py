"""The public API: init_rpc, rpc_sync/rpc_async/remote, shutdown and friends.

Owns: the life cycle of the current runtime (the one process-global, in ``state``).
Imports from rrefrt: everything. Nothing imports it but ``rrefrt/__init__``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import secrets
import threading
import time
from typing import Any, Callable

import transport

from . import serialization, state
from .autograd import _hooks as _autograd
from .errors import AuthenticationError, RpcError, RRefLeakError, ShutdownError
from .futures import Future
from .options import RpcBackendOptions, WorkerInfo
from .rendezvous import Record, Rendezvous, RendezvousError, bind_host, host_id, resolve
from .rref import RRef
from .runtime import Runtime

log = logging.getLogger("rrefrt")

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_rpc_timeout",
    "get_debug_info",
]

_init_lock = threading.Lock()
_group: dict[str, Any] = {}  # rendezvous of the current runtime (lives with it)


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
    """Join an RPC group as worker ``name``; returns once every worker is reachable."""
    if not isinstance(name, str) or not name or len(name) > 128 or any(c.isspace() for c in name):
        raise ValueError(f"worker name must be a non-empty string without spaces, got {name!r}")
    options = rpc_backend_options or RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(f"rpc_backend_options must be rrefrt.RpcBackendOptions, got {type(options).__name__}")
    with _init_lock:
        if state.current_or_none() is not None:
            raise RuntimeError("RPC is already initialized on this process; call rrefrt.shutdown() first")
        spec = resolve(options.init_method, rank, world_size)
        deadline = time.monotonic() + options.init_timeout
        incarnation = random.SystemRandom().getrandbits(63)
        secret = job_secret(options)
        agent_options = transport.AgentOptions(
            heartbeat_interval=options.heartbeat_interval,
            heartbeat_timeout=options.heartbeat_timeout,
            route_grace=min(0.5, options.heartbeat_timeout),
            max_message_size=options.max_message_size,
            auth=transport.CurveAuth.for_job(secret, spec.rank, spec.world_size) if secret is not None else None,
        )
        info = WorkerInfo(name, spec.rank)
        assigned = os.environ.get("RREFRT_DEVICE", "")
        if not options.devices and assigned and assigned != "cpu":  # rrefrt-run's assignment
            options.set_devices([assigned])
        _check_devices(options)
        rt = Runtime(info, options, agent_options, incarnation)
        rdzv: Rendezvous | None = None
        try:
            host = bind_host(spec.master_addr)
            if secret is None:
                warn_unauthenticated(host)
            # before the agent starts: a peer may call us as soon as the mesh forms
            serialization.set_unpickle_allowlist(options.unpickle_allowlist)
            tcp = rt.agent.bind(f"tcp://{host}:0")
            ipc = ""
            if os.environ.get("RREFRT_NO_IPC") != "1":
                ipc = rt.agent.bind(f"ipc:///tmp/rrefrt-{os.getpid()}-{secrets.token_hex(6)}.sock")
            rt.agent.start()
            rdzv = Rendezvous(spec, options.init_timeout)
            me = Record(name, spec.rank, spec.world_size, incarnation, tcp, ipc, host_id())
            records = rdzv.join(me, deadline)
            rt.set_world([WorkerInfo(r.name, r.rank) for r in records])
            # current before the mesh is up: a peer that finished joining first may already
            # call us, and its function may use the API
            state.set_current(rt)
            peers = [
                transport.PeerSpec(r.rank, r.name, r.incarnation, r.ipc if (r.ipc and r.host == me.host) else r.tcp)
                for r in records
            ]
            try:
                rt.agent.connect_peers(peers, max(0.1, deadline - time.monotonic()))
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
        _group.clear()
        _group.update(rdzv=rdzv, world_size=spec.world_size)
        state.set_current(rt)
        log.info("worker %r (rank %d of %d) joined the group", name, spec.rank, spec.world_size)


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


def _check_devices(options: RpcBackendOptions) -> None:
    names = set(options.devices)
    for dmap in options.device_maps.values():
        names |= set(dmap) | set(dmap.values())
    cuda = [d for d in names if d.startswith("cuda")]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device maps / devices name CUDA devices {sorted(cuda)} but CUDA is not available here")
    count = torch.cuda.device_count()
    for d in cuda:
        idx = int(d.split(":", 1)[1]) if ":" in d else 0
        if idx >= count:
            raise ValueError(f"device {d!r} does not exist: this worker sees {count} CUDA device(s)")


def rpc_sync(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result."""
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("rpc_sync", state.current().rpc_sync, to, func, args, kwargs, timeout)
    return state.current().rpc_sync(to, func, args, kwargs, timeout)


def rpc_async(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]:
    """Like rpc_sync, returning a Future at once."""
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("rpc_async", state.current().rpc_async, to, func, args, kwargs, timeout)
    return state.current().rpc_async(to, func, args, kwargs, timeout)


def remote(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
    """Run ``func`` on ``to`` and return an RRef to its result, owned by ``to``."""
    if _autograd.active():  # inside a distributed autograd context: record the call
        return _autograd.traced_call("remote", state.current().remote, to, func, args, kwargs, timeout)
    return state.current().remote(to, func, args, kwargs, timeout)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    return state.current().worker_info(worker_name)


def get_rpc_timeout() -> float:
    return state.current().options.rpc_timeout


def get_debug_info() -> dict[str, Any]:
    return state.current().debug_info()


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the group. Graceful: finish in-flight calls, delete this worker's RRef users,
    wait for owners to drain, meet everyone at a barrier, check for leaks - all bounded by
    ``timeout`` (0: the options' shutdown_timeout). Raises ShutdownError naming workers
    that never arrived, RRefLeakError for leaks in strict mode; the runtime is closed
    either way."""
    rt = state.current_or_none()
    if rt is None:
        if state.inherited():
            raise ShutdownError(f"shutdown() has nothing to shut down: {state.FORKED}")
        raise ShutdownError("shutdown() called but RPC is not running on this process")
    with _init_lock:
        if state.current_or_none() is not rt:
            return
        rdzv: Rendezvous = _group["rdzv"]
        world_size: int = _group["world_size"]
        error: BaseException | None = None
        try:
            if graceful:
                limit = timeout if timeout and timeout > 0 else rt.options.shutdown_timeout
                error = _bounded_graceful(rt, rdzv, world_size, limit)
        finally:
            state.set_current(None)
            serialization.set_unpickle_allowlist(None)
            rt.close()
            rdzv.close()
            _group.clear()
        if error is not None:
            raise error


#: how long past its deadline a graceful shutdown may run before it is abandoned
_SHUTDOWN_GRACE = 1.0


def _bounded_graceful(rt: Runtime, rdzv: Rendezvous, world_size: int, limit: float) -> BaseException | None:
    """NOTE [Bounded shutdown]: every step of ``_graceful`` has the deadline, but a store
    request can still block in its socket beyond it (a stopped or partitioned store host
    accepts the bytes and never answers; the store client's own I/O timeout is 10 s). So the
    steps run on a daemon thread and the caller waits for the deadline plus
    ``_SHUTDOWN_GRACE`` at most; past that it gets a ShutdownError and the runtime is closed
    anyway (the abandoned thread cannot keep the process alive)."""
    deadline = time.monotonic() + limit
    box: list[BaseException | None] = []
    phase = ["start"]
    t = threading.Thread(
        target=lambda: box.append(_graceful(rt, rdzv, world_size, deadline, phase)),
        name=f"rrefrt-{rt.info.name}-shutdown",
        daemon=True,
    )
    t.start()
    t.join(max(0.0, deadline - time.monotonic()) + _SHUTDOWN_GRACE)
    if box:
        return box[0]
    rt.accepting = False
    spec = rdzv.spec
    host = rt.workers_by_id.get(0)
    return ShutdownError(
        f"shutdown of {rt.info.name!r} did not complete within {limit:.1f}s (+{_SHUTDOWN_GRACE:.0f}s): stuck in "
        f"phase {phase[0]!r}; the rendezvous store at {spec.master_addr}:{spec.master_port} "
        f"(hosted by {repr(host.name) if host else 'rank 0'} or the launcher) did not answer - its host may be "
        "stopped or unreachable. The runtime was closed anyway."
    )


def _graceful(
    rt: Runtime, rdzv: Rendezvous, world_size: int, deadline: float, phase: list[str] | None = None
) -> BaseException | None:
    me = rt.info.id
    phase = phase if phase is not None else [""]

    def names(ranks: list[int]) -> str:
        return ", ".join(repr(rt.workers_by_id[r].name) if r in rt.workers_by_id else f"rank {r}" for r in ranks)

    try:
        error: BaseException | None = None
        phase[0] = "enter barrier"
        missing = rdzv.barrier("enter", me, world_size, deadline, rt.agent.dead_peers())
        if missing:
            rt.accepting = False
            return ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never reached shutdown within the timeout"
            )
        phase[0] = "waiting for calls in flight"
        busy = not rt.wait_idle(deadline)
        phase[0] = "releasing RRefs"
        sites = rt.release_rrefs(deadline)
        phase[0] = "drained barrier"
        missing = rdzv.barrier("drained", me, world_size, deadline, rt.agent.dead_peers())
        rt.accepting = False
        leaks = rt.ctx.leaks()
        for leak in leaks:
            log.error("RRef leak on worker %r: %s", rt.info.name, leak)
        if missing:
            error = ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never finished shutdown within the timeout"
            )
        elif rt.options.strict_rref_leaks and (leaks or sites):
            lines = [f"fork still registered: {x}" for x in leaks] + [f"still referenced at shutdown: {s}" for s in sites]
            error = RRefLeakError(f"RRef leaks on worker {rt.info.name!r}:\n  " + "\n  ".join(lines), lines)
        elif busy:
            error = ShutdownError(
                f"shutdown of {rt.info.name!r}: calls in flight (run here for live peers, or sent from here) "
                "had not finished at the timeout - a handler that never returns? They were abandoned"
            )
        phase[0] = "leave barrier"
        if rdzv.server is not None:  # rank 0 hosts the store: it leaves last
            rdzv.barrier("leave", me, world_size, deadline, rt.agent.dead_peers())
        else:
            rdzv.arrive("leave", me)
        return error
    except RpcError as e:
        return e
    except Exception as e:  # the store died under us (its host left): still close
        return ShutdownError(f"shutdown of {rt.info.name!r} could not complete its barrier: {e}")

