"""remote() creation: both ends of PYTHON_REMOTE, and nothing else.

Owns: on the owner, the creations not yet answered (``accepts``), their accept timer and the
handling of duplicates; on the creator, the sending of the creation, the fetches waiting for
an unconfirmed creation (``fetches``), and the loss of a creation. Imports from rrefrt:
errors, futures, ids, messages, rref_context, serialization. The RRef context keeps the
protocol state proper (forks, users, tombstones); this object keeps the request ids and
timers that only the runtime knows.

NOTE [Creation acks]
    A remote() sends one RemoteRequest (PYTHON_REMOTE) and retries it until it is
    answered (NOTE [Retries]). The owner answers it exactly once per delivery:

    1. On arrival (I/O thread) the owner registers the creator's fork (fork id = RRef id)
       and starts the function on the pool. It does not answer at once: the answer waits up
       to ``ACCEPT_DELAY_S`` for the value, so a quick creation costs one message back,
       ``[status, [], 1]`` - accepted and done, with the error as payload if it failed.
    2. If the value takes longer, the accept timer answers ``[OK, [], 0]`` (accepted only,
       which stops the creator's retries) and the result follows later as a REMOTE_RET
       (itself retried until acknowledged). Whoever pops ``accepts`` first answers: the
       finished call or the timer, never both.
    3. A duplicate (a retry whose first copy arrived, or a duplicated message) never runs the
       function twice (``RRefContext.on_remote_request`` returns None). It is answered at
       once: done with the result if the value exists, accepted otherwise; its pending
       accept, if any, is dropped (the creator may have given that request id up).
    4. A creator whose retries are exhausted gives the creation up as lost (CreationLost):
       the RRef fails with RRefCreationError, its waiting to_here() calls fail at once, and
       a UserDelete goes to the owner, whose tombstone stops a late creation from running
       and frees a value whose answer alone was lost.
    So a creator sees one answer per attempt, never two (the old "accepted, then REMOTE_RET
    although the value was ready" double acknowledgement is gone).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import transport

from . import serialization as ser
from .control import CreationLost
from .errors import RRefCreationError, fresh
from .futures import Future
from .ids import ForkId
from .messages import ERROR, OK, RemoteRequest, RemoteRet, Response
from .rref_context import FAILED, PENDING, OwnerRecord

log = logging.getLogger("rrefrt")

#: NOTE [Creation acks]: how long a creation's answer waits for the value, so that a quick
#: creation costs one answer; well below the creator's retry interval
ACCEPT_DELAY_S = 0.05


class CreationTracker:
    def __init__(self, rt: Any) -> None:
        self.rt = rt
        #: rref id -> (creator, msg_id): creations delivered here and not yet answered;
        #: popped by whoever answers first, the finished call or the accept timer (owner side)
        self.accepts: dict[Any, tuple[int, int]] = {}
        #: fork id -> to_here futures of a not yet confirmed remote(), failed if it is lost
        #: (creator side; removed by their answer, ``forget_fetch``); under ``_lock``
        self.fetches: dict[ForkId, list[Future[Any]]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ creator side
    def send(self, msg: RemoteRequest, frames: Sequence[Any]) -> None:
        """remote(): send the creation (first attempt on the caller's thread, so that a
        closed transport raises there; retries from the control thread)."""
        rt, fid, dest = self.rt, msg.fork_id, msg.dest

        def on_ack(err: Any) -> None:  # transport thread
            if isinstance(err, transport.RequestTimeout):
                rt.control.put(CreationLost(fid, dest))

        def on_reply(meta: Any, fr: Sequence[Any]) -> None:  # transport thread
            try:
                resp = Response.decode(meta)
            except Exception:
                rt.stats["bad_frames_dropped"] += 1
                return
            if resp.done:  # accepted and already done: this answer is the result
                self.settle(fid, dest, resp.status, fr)

        rt.control.request(msg, on_ack, frames, on_reply=on_reply)

    def settle(self, fork_id: ForkId, owner: int, status: int, frames: Sequence[Any]) -> None:
        """The result of a creation made here arrived (a done answer or a REMOTE_RET). An
        error payload is unpickled on the callback pool (user code), never on the control
        or I/O thread; the context learns it on the control thread."""
        rt = self.rt
        if status == OK:  # no user code: the context learns it on this thread (NOTE [Inline protocol])
            rt.control.perform(rt.ctx.on_remote_ret(fork_id, None))
            return

        def decode() -> None:
            err = ser.loads_error(frames, rt.worker_name(owner))
            rt.control.perform(rt.ctx.on_remote_ret(fork_id, err))

        rt.callbacks.submit(decode)

    def on_remote_ret(self, src: int, msg_id: int, msg: RemoteRet, frames: Sequence[Any]) -> None:
        """I/O thread: a REMOTE_RET arrived; acknowledge it and settle the creation."""
        self.rt.callee.ack(src, msg_id, msg)
        self.settle(msg.rref_id, src, msg.status, frames)

    def add_fetch(self, fork_id: ForkId, fut: Future[Any]) -> None:
        """A to_here() of an unconfirmed creation: it fails at once if the creation is lost.
        Its answer calls ``forget_fetch`` (no done callback: that would cost a callback-pool
        hop per to_here)."""
        with self._lock:
            self.fetches.setdefault(fork_id, []).append(fut)

    def forget_fetch(self, fork_id: ForkId, fut: Future[Any]) -> None:
        with self._lock:
            waiting = self.fetches.get(fork_id)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self.fetches[fork_id]

    def on_lost(self, fork_id: ForkId, dest: int) -> None:
        """Control thread: the creation was never acknowledged (NOTE [Creation acks] 4)."""
        rt = self.rt
        error = RRefCreationError(
            f"RRef creation failed: worker {rt.worker_name(dest)!r} never acknowledged the creation "
            f"of RRef {fork_id} after {rt.control_attempts} attempts (the message was lost)"
        )
        rt.control.perform(rt.ctx.abandon_user(fork_id, error))
        with self._lock:
            waiting = self.fetches.pop(fork_id, [])
        for fut in waiting:
            fut._fail(fresh(error))

    # ------------------------------------------------------------------ owner side
    def on_request(self, src: int, msg_id: int, msg: RemoteRequest) -> OwnerRecord | None:
        """I/O thread: a creation arrived. Returns the record to run the function for, or
        None for a duplicate, answered here (NOTE [Creation acks] 3)."""
        rt = self.rt
        rec = rt.ctx.on_remote_request(msg.rref_id, msg.fork_id, src, msg.type_name)
        if rec is None:
            self.accepts.pop(msg.rref_id, None)
            done = rt.ctx.owned_record(msg.rref_id)
            if done is not None and done.state != PENDING:  # the value exists: say so
                failed = done.state == FAILED
                frames = ser.dumps_error(done.error, rt.info.name) if failed else []
                rt.callee.respond(src, msg_id, Response(ERROR if failed else OK, (), True).meta(True), frames, msg)
            else:
                rt.callee.respond(src, msg_id, Response(OK, (), False).meta(True), [], msg)  # accepted (again)
            rt.stats["duplicate_calls_dropped"] += 1
            return None
        self.accepts[rec.rref_id] = (src, msg_id)
        rt.transport.call_later(ACCEPT_DELAY_S, lambda rid=rec.rref_id: self._accept_now(rid))
        return rec

    def _accept_now(self, rref_id: Any) -> None:
        """Transport thread timer: the value is taking a while, accept its creation now."""
        accept = self.accepts.pop(rref_id, None)
        if accept is not None:
            self.rt.callee.respond(accept[0], accept[1], Response(OK, (), False).meta(True), [], RemoteRequest)

    def finished(self, rec: OwnerRecord, creator: int, exc: BaseException | None) -> None:
        """Pool thread: the creating function finished; answer the creator (NOTE
        [Creation acks] 1 and 2)."""
        rt = self.rt
        frames = [] if exc is None else ser.dumps_error(exc, rt.info.name)
        status = OK if exc is None else ERROR
        accept = self.accepts.pop(rec.rref_id, None)
        if accept is not None:  # not yet accepted: accept and result in one answer
            rt.callee.respond(accept[0], accept[1], Response(status, (), True).meta(True), frames, RemoteRequest)
            return
        rt.control.perform([RemoteRet(creator, rec.rref_id, status, tuple(frames))])

