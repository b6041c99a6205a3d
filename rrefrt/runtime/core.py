"""The worker itself, as every part of its runtime sees it: identity, options, the group's
members, the RRef context, the thread pools, the transport and the runtime's own counters.

Owns: that shared state and the lookups on it (``worker_info``, ``worker_name``,
``timeout``, ``check_running``). It calls no part: the parts (rrefrt/runtime/*.py) are given
this object by the composition root (``root.Runtime``, a subclass that adds the parts and
the message dispatch) and call down into it, never up.

State and who writes it:
    info, options, pid, ctx, pool, callbacks   set here, never replaced
    transport           set once by the root, right after the parts exist (the transport is
                        built from the root's callbacks)
    workers_by_id/name  the group (``set_world``; dynamic groups: ``forget_worker``)
    accepting, closed   the life cycle (shutdown steps, ``Runtime.close``)
    devices             the validated device plan, set by init_rpc after the rendezvous
    group               (rendezvous, world size), set by init_rpc; read by shutdown
    inflight            the calls in flight, both directions (the caller's requests and
                        the callee; read by debug info, stack queries and shutdown)
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Any, Callable

from rrefrt import arguments, state
from rrefrt.errors import ArgumentError, ShutdownError, WorkerUnavailableError
from rrefrt.options import RpcBackendOptions, WorkerInfo
from rrefrt.pool import WorkerPool
from rrefrt.protocol.context import RRefContext
from rrefrt.protocol.ids import IdGenerator
from rrefrt.runtime.inflight import InFlight

if TYPE_CHECKING:
    from rrefrt.payload.devices import DevicePlan
    from rrefrt_transport.base import Transport

__all__ = ["WorkerCore", "BoundPool"]


class BoundPool(WorkerPool):
    """A pool whose tasks run bound to their runtime (NOTE [Runtime binding] in state.py)."""

    def __init__(self, core: "WorkerCore", name: str, num_threads: int) -> None:
        super().__init__(name, num_threads)
        self._core = core

    def submit(self, fn: Callable[..., Any], *args: Any, reject_when_exhausted: bool = False) -> None:
        super().submit(_run_bound, self._core, fn, args, reject_when_exhausted=reject_when_exhausted)


def _run_bound(core: "WorkerCore", fn: Callable[..., Any], args: tuple) -> None:
    with state.bound(core):
        fn(*args)


class WorkerCore:
    def __init__(self, info: WorkerInfo, options: RpcBackendOptions) -> None:
        self.info = info
        self.options = options
        self.pid = os.getpid()
        self.ctx = RRefContext(info.id, IdGenerator(info.id))
        #: user functions (num_worker_threads, compensated when blocked)
        self.pool = BoundPool(self, f"rrefrt-{info.name}-worker", options.num_worker_threads)
        #: future callbacks, serving fetches, releasing values, unpickling creation errors
        self.callbacks = BoundPool(self, f"rrefrt-{info.name}-callback", 4)
        self.workers_by_id: dict[int, WorkerInfo] = {info.id: info}
        self.workers_by_name: dict[str, WorkerInfo] = {info.name: info}
        #: dynamic groups: name -> why a former member is gone ("left the group", ...); a
        #: later call to it fails with WorkerUnavailableError saying so (rrefrt/group/membership.py)
        self.departed: dict[str, str] = {}
        #: the runtime's own counters (bad_frames_dropped, duplicate_calls_dropped,
        #: control_retries), merged with the transport's in get_debug_info
        self.stats: collections.Counter = collections.Counter()
        #: NOTE [Retries]: the ack wait per attempt of a control message, and the attempts
        self.control_retry_interval = 2.0
        self.control_attempts = 15
        self.accepting = True
        self.closed = False
        #: (rendezvous, world_size) of the group, set by init_rpc (None in unit tests)
        self.group: Any = None
        #: how many api._wait_all_workers barriers this worker has entered (each one's phase name)
        self.user_barriers = 0
        #: the validated device plan (routes per peer, the call scope), set by init_rpc after
        #: the rendezvous; None until then (and in unit tests: CPU tensors, no maps)
        self.devices: DevicePlan | None = None
        #: the calls in flight here, both directions (rrefrt/runtime/inflight.py)
        self.inflight = InFlight()
        #: the transport (set by the composition root once the parts exist)
        self.transport: Transport = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ the group
    def set_world(self, workers: "list[WorkerInfo] | tuple[WorkerInfo, ...]") -> None:
        for w in workers:
            self.workers_by_id[w.id] = w
            self.workers_by_name[w.name] = w

    def forget_worker(self, w: WorkerInfo, reason: str) -> None:
        """Dynamic groups: ``w`` left or was evicted; lookups of it fail, saying ``reason``."""
        self.departed[w.name] = reason
        if self.workers_by_name.get(w.name) == w:
            del self.workers_by_name[w.name]
        if self.workers_by_id.get(w.id) == w:
            del self.workers_by_id[w.id]

    def worker_infos(self) -> list[WorkerInfo]:
        """The current members, this worker included, by id."""
        return sorted(self.workers_by_id.values(), key=lambda w: w.id)

    # ------------------------------------------------------------------ lookups
    def worker_info(self, to: Any = None) -> WorkerInfo:
        if to is None:
            return self.info
        if self.departed:
            gone = to.name if isinstance(to, WorkerInfo) else to if isinstance(to, str) else None
            if gone in self.departed and gone not in self.workers_by_name:
                raise WorkerUnavailableError(
                    f"worker {gone!r} {self.departed[gone]}: it is no longer a member of this RPC group "
                    "(could not find destination)"
                )
        if isinstance(to, WorkerInfo):
            w = self.workers_by_id.get(to.id)
            if w is None or w.name != to.name:
                raise WorkerUnavailableError(f"could not find destination: {to!r} is not a member of this RPC group")
            return w
        if isinstance(to, str):
            w = self.workers_by_name.get(to)
            if w is None:
                known = ", ".join(sorted(self.workers_by_name))
                raise WorkerUnavailableError(f"could not find destination: unknown worker name {to!r}; the group has: {known}")
            return w
        if isinstance(to, int) and not isinstance(to, bool):
            w = self.workers_by_id.get(to)
            if w is None:
                raise WorkerUnavailableError(f"could not find destination: unknown worker id {to}; ids run 0..{len(self.workers_by_id) - 1}")
            return w
        raise ArgumentError(f"'to' must be a worker name, id or WorkerInfo, not {type(to).__name__}")

    def worker_name(self, worker_id: int) -> str:
        w = self.workers_by_id.get(worker_id)
        return w.name if w is not None else f"<worker {worker_id}>"

    def timeout(self, timeout: float | None) -> float:
        """A call's timeout in seconds (0: none); ArgumentError for NaN, inf or a non-number."""
        t = arguments.call_timeout(timeout)
        return self.options.rpc_timeout if t is None else t

    def is_local(self, peer: int) -> bool:
        """Whether ``peer`` runs on this host (the transport decides)."""
        return bool(self.transport.is_local(peer))

    def check_running(self) -> None:
        if self.closed or not self.accepting:
            raise ShutdownError(f"RPC on worker {self.info.name!r} is shutting down or shut down")
