"""The runtime of one worker: the composition root of its parts, and the dispatch of messages.

Owns: the parts, built here and each given its collaborators (never the runtime itself:
a part sees only what it uses, with real types), the handler table that sits beside the
message table of rrefrt/protocol/messages.py, and closing. The shared state is the
worker's core (``WorkerCore``, which this class extends). The transport is built by the
caller (rrefrt/api.py or a test) from the callbacks given to ``make_transport``, never here.

The parts, each over the ones below it (the import-linter contract "one worker's parts"):

    part        module        job
    caller      caller.py     rpc_async / rpc_sync / remote / to_here of the program
    callee      callee.py     running peers' calls on the pool; serving fetches
    creation    creation.py   remote() creation on both ends (NOTE [Creation acks])
    requests    requests.py   requests in flight, their answers, translate()
    payloads    payloads.py   pickling with forks; RRef objects from received forks
    lifecycle   lifecycle.py  calls in flight, wait_idle, release of RRefs, debug info
    control     control.py    the control thread: protocol actions and retries
    replies     replies.py    answers and acks
    core        core.py       identity, group, RRef context, pools, transport, counters

The control loop performs two kinds of work that belong above it: serving a fetch (the
callee's) and a lost creation (creation's). Its two "homes" are handed to it as callables
(``_serve_fetch``, ``_creation_lost`` below), so that it imports and calls nothing above.
The graceful shutdown's steps are rrefrt/runtime/shutdown.py's.

Threads and what runs where:
    transport thread   decodes each message once (``messages.decode``), turns fork data into
                       RRef objects (no user code), hands calls to the user pool, handles
                       protocol messages itself (NOTE [Inline protocol] in control.py), serves
                       fetches of plain values, completes futures lazily.
    control thread     retries, RRef drops (``__del__``), lost creations, peer deaths; never
                       user code (see rrefrt/runtime/control.py).
    user pool          user functions (num_worker_threads, compensated when blocked).
    callback pool      callbacks of futures; serving fetches; releasing values; unpickling
                       creation errors.
    event loop thread  ``async def`` user functions (started on first use).

Module state: none. Two runtimes can live in one process (unit tests over
transport/inproc.py); the API's current runtime lives in rrefrt/state.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rrefrt.futures import Future
from rrefrt.options import RpcBackendOptions, WorkerInfo
from rrefrt.protocol.context import OwnerRecord
from rrefrt.protocol.ids import ForkId
from rrefrt.protocol.messages import (
    ChildAccept,
    ChildAccepts,
    Fetch,
    ForkRequest,
    MalformedMessage,
    PythonCall,
    RemoteRequest,
    RemoteRet,
    ServeFetch,
    StackQuery,
    UserDelete,
    UserDeletes,
    decode,
)
from rrefrt.rref import RRef
from rrefrt.runtime.callee import Callee
from rrefrt.runtime.caller import Caller
from rrefrt.runtime.control import ControlLoop, PeerDied
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.creation import ACCEPT_DELAY_S, CreationTracker
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads
from rrefrt.runtime.replies import Replies
from rrefrt.runtime.requests import Requests, translate
from rrefrt_transport.base import OnMessage, OnPeerDead, Transport

__all__ = ["Runtime", "translate", "ACCEPT_DELAY_S"]

#: make_transport(on_message, on_peer_dead) -> a transport (not started)
MakeTransport = Callable[[OnMessage, OnPeerDead], Transport]

#: a message handler: (src, msg_id, decoded message, frames), on the transport thread
Handler = Callable[[int, int, Any, Sequence[Any]], None]


class Runtime(WorkerCore):
    def __init__(self, info: WorkerInfo, options: RpcBackendOptions, make_transport: MakeTransport) -> None:
        super().__init__(info, options)
        self.replies = Replies(self)
        self.control = ControlLoop(self, self.replies, serve_fetch=self._serve_fetch, creation_lost=self._creation_lost)
        self.lifecycle = Lifecycle(self, self.control)
        self.payloads = Payloads(self, self.control, host=self)
        self.requests = Requests(self, self.control, self.lifecycle, self.payloads)
        self.creation = CreationTracker(self, self.control, self.replies, self.requests)
        self.callee = Callee(self, self.control, self.lifecycle, self.payloads, self.replies, self.creation)
        self.caller = Caller(self, self, self.control, self.lifecycle, self.payloads, self.requests, self.creation,
                             self.callee)
        #: the handler table, beside messages.MESSAGES: message class -> handler. All run
        #: on the transport thread: they hand user code on (to a pool) and never block.
        self._handlers: dict[type, Handler] = {
            PythonCall: self.callee.on_python_call,
            RemoteRequest: self.callee.on_remote_request,
            RemoteRet: self.creation.on_remote_ret,
            Fetch: self.callee.on_fetch,
            ForkRequest: self.on_protocol,
            ChildAccept: self.on_protocol,
            ChildAccepts: self.on_protocol,
            UserDelete: self.on_protocol,
            UserDeletes: self.on_protocol,
            StackQuery: self.callee.on_stack_query,  # docs/stuck.md
        }
        self.transport = make_transport(self.on_message, self.on_peer_dead)
        self.control.start()

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

    def register_users(self, recs: list[Any]) -> None:
        """Register received forks with their owners now (NOTE [Lazy registration])."""
        self.control.perform(self.ctx.register_users(recs))

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
        (NOTE [Inline protocol] in rrefrt/runtime/control.py)."""
        self.control.on_incoming(src, msg_id, msg)

    def on_peer_dead(self, peer: int, cause: str) -> None:
        self.control.put(PeerDied(peer))

    def sync_control(self, deadline: float) -> bool:
        """Wait (bounded) until everything enqueued for the control thread so far is done."""
        return self.control.sync(deadline)

    # ------------------------------------------------------------------ the control loop's homes
    def _serve_fetch(self, sf: ServeFetch) -> None:
        self.callee.serve_fetch(sf)

    def _creation_lost(self, fork_id: ForkId, dest: int) -> None:
        self.creation.on_lost(fork_id, dest)

    # ------------------------------------------------------------------ life cycle
    def debug_info(self) -> dict[str, Any]:
        return self.lifecycle.debug_info()

    def close(self) -> None:
        """Stop everything; bounded; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.accepting = False
        self.transport.close()
        self.control.stop(2.0)
        self.pool.stop()
        self.callbacks.stop()
        self.callee.stop(2.0)
