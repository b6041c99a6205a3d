"""The runtime of one worker: the composition of its parts, and the dispatch of messages.

Owns: the parts below, the state they share (the worker's identity, the group, the RRef
context, the thread pools, the runtime's own counters) and the handler table that sits
beside the message table of rrefrt/messages.py. Imports from rrefrt: everything below it
(errors, options, messages, rref_context, pool and the parts); transport only through the
``transport.base.Transport`` protocol - the transport is built by the caller (rrefrt/api.py
or a test) from the callbacks given to ``make_transport``, never here.

    part        module      job
    caller      caller.py   rpc_async/rpc_sync/remote/fetch, responses, forks, translate
    callee      callee.py   running peers' calls on the pool, replies, serving fetches
    control     control.py  the control thread: protocol actions and retries (home-thread table)
    creation    creation.py remote() creation on both ends (NOTE [Creation acks])
    lifecycle   lifecycle.py calls in flight, wait_idle, release, debug info, close, shutdown

Threads and what runs where:
    transport thread   decodes each message once (``messages.decode``), turns fork data into
                       RRef objects (no user code), hands calls to the user pool, handles
                       protocol messages itself (NOTE [Inline protocol] in control.py), serves
                       fetches of plain values, completes futures lazily.
    control thread     retries, RRef drops (``__del__``), lost creations, peer deaths; never
                       user code (see rrefrt/control.py).
    user pool          user functions (num_worker_threads, compensated when blocked).
    callback pool      callbacks of futures; serving fetches; releasing values; unpickling
                       creation errors.
    event loop thread  ``async def`` user functions (started on first use).

Module state: none. Two runtimes can live in one process (unit tests over
transport/inproc.py); the API's current runtime lives in rrefrt/state.py.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Sequence

from .callee import Callee
from .caller import Caller, translate
from .control import ControlLoop, Incoming, PeerDied
from .creation import ACCEPT_DELAY_S, CreationTracker
from .errors import ArgumentError, ShutdownError, WorkerUnavailableError
from .futures import Future
from .ids import ForkId, IdGenerator
from .lifecycle import Lifecycle
from .messages import (
    ChildAccept,
    ChildAccepts,
    Fetch,
    ForkRequest,
    MalformedMessage,
    PythonCall,
    RemoteRequest,
    RemoteRet,
    UserDelete,
    UserDeletes,
    decode,
)
from .options import RpcBackendOptions, WorkerInfo
from . import state
from .pool import WorkerPool
from .rref import RRef
from .rref_context import OwnerRecord, RRefContext

__all__ = ["Runtime", "translate", "ACCEPT_DELAY_S"]

#: make_transport(on_message, on_peer_dead) -> a transport.base.Transport (not started)
MakeTransport = Callable[[Callable[..., None], Callable[[int, str], None]], Any]


class BoundPool(WorkerPool):
    """A pool whose tasks run bound to their runtime (NOTE [Runtime binding] in state.py)."""

    def __init__(self, rt: Any, name: str, num_threads: int) -> None:
        super().__init__(name, num_threads)
        self._rt = rt

    def submit(self, fn: Callable[..., Any], *args: Any, reject_when_exhausted: bool = False) -> None:
        super().submit(_run_bound, self._rt, fn, args, reject_when_exhausted=reject_when_exhausted)


def _run_bound(rt: Any, fn: Callable[..., Any], args: tuple) -> None:
    with state.bound(rt):
        fn(*args)


class Runtime:
    #: the handler table, beside messages.MESSAGES: message class -> (part, method). All run
    #: on the transport thread: they hand user code on (to a pool) and never block.
    HANDLERS: dict[type, tuple[str, str]] = {
        PythonCall: ("callee", "on_python_call"),
        RemoteRequest: ("callee", "on_remote_request"),
        RemoteRet: ("creation", "on_remote_ret"),
        Fetch: ("callee", "on_fetch"),
        ForkRequest: ("runtime", "on_protocol"),
        ChildAccept: ("runtime", "on_protocol"),
        ChildAccepts: ("runtime", "on_protocol"),
        UserDelete: ("runtime", "on_protocol"),
        UserDeletes: ("runtime", "on_protocol"),
    }

    def __init__(self, info: WorkerInfo, options: RpcBackendOptions, make_transport: MakeTransport) -> None:
        self.info = info
        self.options = options
        self.pid = os.getpid()
        self.ctx = RRefContext(info.id, IdGenerator(info.id))
        self.pool = BoundPool(self, f"rrefrt-{info.name}-worker", options.num_worker_threads)
        self.callbacks = BoundPool(self, f"rrefrt-{info.name}-callback", 4)
        self.workers_by_id: dict[int, WorkerInfo] = {info.id: info}
        self.workers_by_name: dict[str, WorkerInfo] = {info.name: info}
        #: dynamic groups: name -> why a former member is gone ("left the group", ...); a
        #: later call to it fails with WorkerUnavailableError saying so (rrefrt/membership.py)
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
        self.devices: Any = None
        self.lifecycle = Lifecycle(self)
        self.control = ControlLoop(self)
        self.creation = CreationTracker(self)
        self.caller = Caller(self)
        self.callee = Callee(self)
        self._control = self.control.queue  # fork-safety tests replace it with a recorder
        self._handlers: dict[type, Callable[[int, int, Any, Sequence[Any]], None]] = {
            cls: getattr(self if part == "runtime" else getattr(self, part), method)
            for cls, (part, method) in self.HANDLERS.items()
        }
        self.transport = make_transport(self.on_message, self.on_peer_dead)
        self.control.start()

    @property
    def agent(self) -> Any:
        """The transport (old name, kept for tests and tools that inspect it)."""
        return self.transport

    def set_world(self, workers: Sequence[WorkerInfo]) -> None:
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
        if timeout is None or timeout < 0:
            return self.options.rpc_timeout
        return float(timeout)


    def is_local(self, peer: int) -> bool:
        """Whether ``peer`` runs on this host (the transport decides; False if it cannot say)."""
        fn = getattr(self.transport, "is_local", None)
        return bool(fn(peer)) if fn is not None else False

    def check_running(self) -> None:
        if self.closed or not self.accepting:
            raise ShutdownError(f"RPC on worker {self.info.name!r} is shutting down or shut down")

    # ------------------------------------------------------------------ the API's calls
    def rpc_async(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]:
        return self.caller.rpc_async(to, func, args, kwargs, timeout)

    def rpc_sync(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
        return self.caller.rpc_sync(to, func, args, kwargs, timeout)

    def remote(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
        return self.caller.remote(to, func, args, kwargs, timeout)

    def fetch(self, rref: RRef[Any], timeout: float, waited: bool = False) -> Future[Any]:
        return self.caller.fetch(rref, timeout, waited)

    def owner_value(self, rec: OwnerRecord, timeout: float) -> Any:
        return self.caller.owner_value(rec, timeout)

    def enqueue_drop(self, fork_id: ForkId) -> None:
        """RRef.__del__: never sends, never blocks (a SimpleQueue put)."""
        if not self.closed:
            self.control.drop(fork_id)

    # ------------------------------------------------------------------ transport callbacks
    def on_message(self, src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        """Transport thread: decode once, then the handler table. Malformed input is counted
        and dropped before anything is unpickled or any state changes."""
        try:
            msg = decode(kind, meta, self.info.id)
        except MalformedMessage:
            self.stats["bad_frames_dropped"] += 1
            return
        try:
            self._handlers[type(msg)](src, msg_id, msg, frames)
        except Exception:  # e.g. fork data naming an impossible owner: nothing was run
            self.stats["bad_frames_dropped"] += 1

    def on_protocol(self, src: int, msg_id: int, msg: Any, frames: Sequence[Any]) -> None:
        """Fork requests, child accepts and deletes: handled on this (the transport's) thread
        (NOTE [Inline protocol] in rrefrt/control.py)."""
        self.control.on_incoming(src, msg_id, msg)

    def to_control(self, src: int, msg_id: int, msg: Any, frames: Sequence[Any]) -> None:
        """The old route of protocol messages, through the control thread (kept for tools)."""
        self.control.put(Incoming(src, msg_id, msg))

    def on_peer_dead(self, peer: int, cause: str) -> None:
        self.control.put(PeerDied(peer))

    def sync_control(self, deadline: float) -> bool:
        """Wait (bounded) until everything enqueued for the control thread so far is done."""
        return self.control.sync(deadline)

    # ------------------------------------------------------------------ life cycle
    def wait_idle(self, deadline: float) -> bool:
        return self.lifecycle.wait_idle(deadline)

    def release_rrefs(self, deadline: float) -> list[str]:
        return self.lifecycle.release_rrefs(deadline)

    def debug_info(self) -> dict[str, Any]:
        return self.lifecycle.debug_info()

    def close(self) -> None:
        self.lifecycle.close()
