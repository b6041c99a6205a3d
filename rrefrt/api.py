"""The public API: init_rpc, rpc_sync/rpc_async/remote, shutdown and friends.

Owns: the life cycle of the current runtime (the one process-global, in ``state``).
Imports from rrefrt: everything. Nothing imports it but ``rrefrt/__init__``.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time
from typing import Any, Callable

import transport

from . import state
from .errors import RpcError, RRefLeakError, ShutdownError
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
        agent_options = transport.AgentOptions(
            heartbeat_interval=options.heartbeat_interval,
            heartbeat_timeout=options.heartbeat_timeout,
            route_grace=min(0.5, options.heartbeat_timeout),
            max_message_size=options.max_message_size,
        )
        info = WorkerInfo(name, spec.rank)
        _check_devices(options)
        rt = Runtime(info, options, agent_options, incarnation)
        rdzv: Rendezvous | None = None
        try:
            host = bind_host(spec.master_addr)
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
            except transport.TransportError as e:
                raise RendezvousError(str(e)) from None
        except BaseException:
            state.set_current(None)
            rt.close()
            if rdzv is not None:
                rdzv.close(failed=True)
            raise
        _group.clear()
        _group.update(rdzv=rdzv, world_size=spec.world_size)
        state.set_current(rt)
        log.info("worker %r (rank %d of %d) joined the group", name, spec.rank, spec.world_size)


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
    return state.current().rpc_sync(to, func, args, kwargs, timeout)


def rpc_async(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]:
    """Like rpc_sync, returning a Future at once."""
    return state.current().rpc_async(to, func, args, kwargs, timeout)


def remote(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
    """Run ``func`` on ``to`` and return an RRef to its result, owned by ``to``."""
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
                error = _graceful(rt, rdzv, world_size, time.monotonic() + limit)
        finally:
            state.set_current(None)
            rt.close()
            rdzv.close()
            _group.clear()
        if error is not None:
            raise error


def _graceful(rt: Runtime, rdzv: Rendezvous, world_size: int, deadline: float) -> BaseException | None:
    me = rt.info.id

    def names(ranks: list[int]) -> str:
        return ", ".join(repr(rt.workers_by_id[r].name) if r in rt.workers_by_id else f"rank {r}" for r in ranks)

    try:
        error: BaseException | None = None
        missing = rdzv.barrier("enter", me, world_size, deadline, rt.agent.dead_peers())
        if missing:
            rt.accepting = False
            return ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never reached shutdown within the timeout"
            )
        rt.wait_idle(deadline)
        sites = rt.release_rrefs(deadline)
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
        if rdzv.server is not None:  # rank 0 hosts the store: it leaves last
            rdzv.barrier("leave", me, world_size, deadline, rt.agent.dead_peers())
        else:
            rdzv.arrive("leave", me)
        return error
    except RpcError as e:
        return e
    except Exception as e:  # the store died under us (its host left): still close
        return ShutdownError(f"shutdown of {rt.info.name!r} could not complete its barrier: {e}")

