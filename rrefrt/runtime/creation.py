"""remote() creation: both ends of PYTHON_REMOTE, and nothing else.

Owns: on the owner, the creations not yet answered (``accepts``), their accept sweep and the
handling of duplicates; on the creator, the sending of the creation, the to_here() calls
parked on its answer and the plain value it carried (``Creation``, NOTE [Inline creation
values]), the fetches waiting for an unconfirmed creation (``fetches``), and the loss of a
creation. Given the worker's core, the control loop, the replies and the requests (for
the fetches of parked to_here() calls). The RRef context keeps the protocol state proper (forks, users,
tombstones); this object keeps the request ids, timers and parked calls that only the
runtime knows.

NOTE [Creation acks]
    A remote() sends one RemoteRequest (PYTHON_REMOTE) and retries it until it is
    answered (NOTE [Retries]). The owner answers it exactly once per delivery:

    1. On arrival (I/O thread) the owner registers the creator's fork (fork id = RRef id)
       and starts the function on the pool. It does not answer at once: the answer waits up
       to ``ACCEPT_DELAY_S`` for the value, so a quick creation costs one message back,
       ``[status, [], 1]`` - accepted and done, with the error as payload if it failed.
    2. If the value takes longer, the accept sweep answers ``[OK, [], 0]`` (accepted only,
       which stops the creator's retries) and the result follows later as a REMOTE_RET
       (itself retried until acknowledged). Whoever pops ``accepts`` first answers: the
       finished call or the sweep, never both. The sweep is one transport timer for all
       creations, armed while any waits and due when the oldest is: quick creations
       (answered by their call) set no timer of their own, so they wake no thread later.
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

NOTE [Inline creation values]
    ``remote(...).to_here()`` costs one message each way when the value is quick and plain.

    1. Owner: a done answer with OK (1 above, a duplicate's answer in 3) or a REMOTE_RET with
       OK carries the value itself in its msgpack meta when ``messages.inline_value`` allows
       it (None/bool/int/float/str/bytes exactly, str/bytes up to 64 KiB): no pickle, no
       user code, nothing forked. Anything else (RRefs, tensors, containers, subclasses)
       is fetched as before.
    2. Creator: each remote() to another worker has a ``Creation`` cell, held by its RRef
       object (``RRef._creation``) and weakly by ``creating``. A to_here() of it before the
       creation's first answer sends no fetch: it parks on the cell (``park``), bounded by
       its timeout (and the creation deadline) through a transport timer that fails it with
       RpcTimeoutError naming the RRef. The first answer releases every parked call, on the
       transport thread: value carried -> completed with it; creation failed -> that error;
       accepted only, or done without a value -> the fetches are sent then (never blocking:
       a request from the transport thread is queued). A creation that ends without an
       answer fails them: lost (4 above) -> RRefCreationError, owner dead / transport closed
       -> the translated transport error (OwnerDiedError, ShutdownError).
    3. A value carried once is kept on the cell: a plain value of these types cannot change
       on the owner, so later to_here() calls return it without a message. ``RRef._check``
       runs first, so an RRef whose owner died (or whose creation failed or timed out) still
       raises. The cell dies with the RRef object.
    Answers are processed once: ``_take`` swaps the parked list out under ``_lock``, and a
    parked call is completed by exactly one of answer, timer or loss (Future._finish is
    idempotent besides).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Sequence

import rrefrt_transport as transport
from rrefrt.payload import serialization as ser
from rrefrt.runtime.control import ControlLoop, CreationLost
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.replies import Replies
from rrefrt.runtime.requests import Requests, fetch_error
from rrefrt.runtime.sweep import DeadlineSweep
from rrefrt.errors import RpcTimeoutError, RRefCreationError, fresh
from rrefrt.futures import Future
from rrefrt.protocol.ids import ForkId
from rrefrt.protocol.messages import ERROR, OK, RemoteRequest, RemoteRet, Response, StackQuery, inline_value
from rrefrt.protocol.context import FAILED, PENDING, READY, OwnerRecord

log = logging.getLogger("rrefrt")

#: NOTE [Creation acks]: how long a creation's answer waits for the value, so that a quick
#: creation costs one answer; well below the creator's retry interval
ACCEPT_DELAY_S = 0.05


#: ``Creation.value`` before an answer carried the value
UNKNOWN: Any = object()


class Parked:
    """A to_here() waiting for its creation's first answer (NOTE [Inline creation values] 2).
    Its references are dropped once it is released (answer, deadline or loss): the
    tracker's deadline heap may keep this object until its deadline, and must not keep the
    RRef, the future or the cell (a value of up to 64 KiB) that long."""

    __slots__ = ("rref", "fut", "deadline", "cell")

    def __init__(self, rref: Any, fut: Future[Any], deadline: float | None, cell: "Creation") -> None:
        self.rref: Any = rref
        self.fut: Future[Any] | None = fut
        self.deadline = deadline
        self.cell: Creation | None = cell

    def release(self) -> tuple[Any, Future[Any] | None]:
        """(rref, future) once; (None, None) if released already."""
        out = self.rref, self.fut
        self.rref = self.fut = self.cell = None
        return out


class Creation:
    """The creator's side of one remote() to another worker (NOTE [Inline creation values]).
    Held by its RRef object for good, by the tracker weakly."""

    __slots__ = ("fork_id", "value", "waiters", "__weakref__")

    def __init__(self, fork_id: ForkId) -> None:
        self.fork_id = fork_id
        #: the owner's plain value once an answer carried it (it cannot change), else UNKNOWN
        self.value: Any = UNKNOWN
        #: to_here() calls parked until the first answer; None from that answer (or the loss)
        #: on; under the tracker's ``_lock``
        self.waiters: list[Parked] | None = []


class CreationTracker:
    def __init__(self, core: WorkerCore, control: ControlLoop, replies: Replies, requests: Requests) -> None:
        self.core = core
        self.control = control
        self.replies = replies
        self.requests = requests
        #: fork id -> cell of every remote() made here whose RRef object (or unanswered
        #: creation) still exists; entries leave with the cell (creator side)
        self.creating: weakref.WeakValueDictionary[ForkId, Creation] = weakref.WeakValueDictionary()
        #: rref id -> (creator, msg_id, when the accept is due): creations delivered here and
        #: not yet answered, in arrival order; popped by whoever answers first, the finished
        #: call or the accept sweep (owner side; NOTE [Creation acks] 2)
        self.accepts: dict[Any, tuple[int, int, float]] = {}
        #: one transport timer for every accept (NOTE [Deadline sweeps] in rrefrt/runtime/sweep.py)
        self._accept_sweep = DeadlineSweep(self._call_later, self._next_accept, self._sweep_accepts)
        #: fork id -> to_here futures of a not yet confirmed remote(), failed if it is lost
        #: (creator side; removed by their answer, ``forget_fetch``); under ``_lock``
        self.fetches: dict[ForkId, list[Future[Any]]] = {}
        self._lock = threading.Lock()
        #: parked to_here() calls with a deadline, as a heap of (deadline, seq, timeout, Parked);
        #: released ones leave when they reach its top (creator side; under ``_lock``)
        self._deadlines: list[tuple[float, int, float, Parked]] = []
        self._seq = itertools.count()
        #: one transport timer for every parked deadline (NOTE [Deadline sweeps])
        self._deadline_sweep = DeadlineSweep(self._call_later, self._next_deadline, self._sweep_deadlines)

    def _call_later(self, delay: float, fn: Any) -> object:
        return self.core.transport.call_later(delay, fn)  # set by the root after this exists

    # ------------------------------------------------------------------ creator side
    def new(self, fork_id: ForkId) -> Creation:
        """The cell of a remote() about to be sent (its RRef object keeps it)."""
        cell = self.creating[fork_id] = Creation(fork_id)
        return cell

    def send(self, msg: RemoteRequest, frames: Sequence[Any], cell: Creation | None = None) -> None:
        """remote(): send the creation (first attempt on the caller's thread, so that a
        closed transport raises there; retries from the control thread). ``cell`` (the
        creation's ``Creation``) keeps the to_here() calls parked on its first answer."""
        core, fid, dest = self.core, msg.fork_id, msg.dest
        cell = cell if cell is not None else Creation(fid)

        def on_ack(err: Any) -> None:  # transport thread; after on_reply
            if msg.deletes:  # NOTE [Piggybacked deletes] in docs/protocol.md: first answer = their ack
                self.control.deletes_delivered(dest, msg.deletes, err)
            if isinstance(err, transport.RequestTimeout):
                self.control.put(CreationLost(fid, dest))  # on_lost fails the parked calls
                if not core.closed:
                    return  # (closing: the control thread may be gone, they fail here)
            parked = self._take(cell)
            if err is None:  # accepted only (or an answer on_reply could not use): fetch now
                for p in parked:
                    self._fetch_now(p)
                return
            for p in parked:
                rref, fut = p.release()
                if fut is not None:
                    fut._fail(fetch_error(rref, err))

        def on_reply(meta: Any, fr: Sequence[Any]) -> None:  # transport thread
            try:
                resp = Response.decode(meta)
            except Exception:
                core.stats["bad_frames_dropped"] += 1
                return
            if resp.done:  # accepted and already done: this answer is the result
                self.settle(fid, dest, resp.status, fr, resp.inline, cell)

        self.control.request(msg, on_ack, frames, on_reply=on_reply)

    def settle(self, fork_id: ForkId, owner: int, status: int, frames: Sequence[Any], inline: tuple = (),
               cell: Creation | None = None) -> None:
        """The result of a creation made here arrived (a done answer or a REMOTE_RET). An
        error payload is unpickled on the callback pool (user code), never on the control
        or I/O thread; the context learns it on the control thread. The parked to_here()
        calls are released (NOTE [Inline creation values] 2)."""
        core = self.core
        if cell is None:
            cell = self.creating.get(fork_id)
        if status == OK:  # no user code: the context learns it on this thread (NOTE [Inline protocol])
            if inline and cell is not None:
                cell.value = inline[0]
            self.control.perform(core.ctx.on_remote_ret(fork_id, None))
            parked = self._take(cell) if cell is not None else []
            for p in parked:
                if inline:
                    _, fut = p.release()
                    if fut is not None:
                        fut._finish(inline[0], None)
                else:
                    self._fetch_now(p)
            return
        parked = self._take(cell) if cell is not None else []

        def decode() -> None:
            err = ser.loads_error(frames, core.worker_name(owner))
            self.control.perform(core.ctx.on_remote_ret(fork_id, err))
            for p in parked:
                _, fut = p.release()
                if fut is not None:
                    fut._fail(fresh(err))

        core.callbacks.submit(decode)

    # ------------------------------------------------------------------ parked to_here() (creator)
    def park(self, cell: Creation, rref: Any, fut: Future[Any], timeout: float) -> bool:
        """to_here() of an RRef whose creation is not answered yet: wait for that answer
        instead of sending a fetch (NOTE [Inline creation values] 2). False: it was answered
        already (or no timer could be set): the caller fetches as usual."""
        p = Parked(rref, fut, time.monotonic() + timeout if timeout > 0 else None, cell)
        with self._lock:
            if cell.waiters is None:
                return False
            cell.waiters.append(p)
            if p.deadline is None:
                return True
            heapq.heappush(self._deadlines, (p.deadline, next(self._seq), timeout, p))
        try:
            self._deadline_sweep.schedule(p.deadline)
        except Exception:  # a closed transport: unpark, the fetch path raises typed
            with self._lock:
                if cell.waiters is not None and p in cell.waiters:
                    cell.waiters.remove(p)
                    return False
            return True  # released meanwhile
        return True

    def _next_deadline(self) -> float | None:
        """The deadline sweep's ``peek``: the earliest deadline of a call still parked."""
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][3].cell is None:  # released: no timer needed for them
                heapq.heappop(heap)
            return heap[0][0] if heap else None

    def _sweep_deadlines(self, until: float) -> None:
        """Transport timer: expire the parked to_here() calls whose deadline passed by
        ``until`` (NOTE [Deadline sweeps])."""
        due: list[tuple[float, Parked]] = []
        with self._lock:
            heap = self._deadlines
            while heap and (heap[0][0] <= until or heap[0][3].cell is None):
                _, _, timeout, p = heapq.heappop(heap)
                if p.cell is not None:
                    due.append((timeout, p))
        for timeout, p in due:
            self._expire(p, timeout)

    def _take(self, cell: Creation) -> list[Parked]:
        with self._lock:
            parked, cell.waiters = cell.waiters, None
        return parked or []

    def _expire(self, p: Parked, timeout: float) -> None:
        """Transport timer: a parked to_here() ran out of time before the creation's answer."""
        cell = p.cell
        if cell is None:
            return  # released meanwhile
        with self._lock:
            if cell.waiters is None or p not in cell.waiters:
                return  # released meanwhile
            cell.waiters.remove(p)
        rref, fut = p.release()
        if fut is not None:
            rec = rref._user_rec
            err = RpcTimeoutError(
                f"to_here() of {rref!r} timed out after {timeout:.3f}s (worker "
                f"{self.core.worker_name(rec.owner)!r} did not answer the RRef's creation)"
            )
            requests = self.requests  # where is the creation? (docs/stuck.md)
            query = StackQuery(rec.owner, 0, rec.rref_id)
            if not requests.ask_where(rec.owner, query, lambda answer: fut._fail(requests.where_error(err, rec.owner, answer))):
                fut._fail(err)

    def _fetch_now(self, p: Parked) -> None:
        """Transport thread: send the fetch of a parked to_here() (its creation was answered
        without the value). Never blocks; a failure to send fails the call."""
        rref, fut = p.release()
        if fut is None:
            return
        left = 0.0
        if p.deadline is not None:
            left = p.deadline - time.monotonic()
            if left <= 0:
                owner = self.core.worker_name(rref._user_rec.owner)
                fut._fail(RpcTimeoutError(f"to_here() of {rref!r} timed out (worker {owner!r} did not answer in time)"))
                return
        try:
            self.send_fetch(rref, fut, left, flush=False)
        except BaseException as e:
            fut._fail(e)

    def send_fetch(self, rref: Any, fut: Future[Any], t: float, flush: bool = True) -> None:
        """Send a FETCH for ``rref`` that completes ``fut`` (the requests' ``send_fetch``); a
        fetch of a creation not yet confirmed is remembered, so that it fails at once if the
        creation turns out lost (``add_fetch``; its answer forgets it)."""
        rec = rref._user_rec
        forget = None
        if not rec.confirmed:
            self.add_fetch(rec.fork_id, fut)
            forget = lambda: self.forget_fetch(rec.fork_id, fut)  # noqa: E731
        self.requests.send_fetch(rref, fut, t, flush, before=forget)

    def on_remote_ret(self, src: int, msg_id: int, msg: RemoteRet, frames: Sequence[Any]) -> None:
        """I/O thread: a REMOTE_RET arrived; acknowledge it and settle the creation."""
        self.replies.ack(src, msg_id, msg)
        self.settle(msg.rref_id, src, msg.status, frames, msg.inline)

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
        core = self.core
        error = RRefCreationError(
            f"RRef creation failed: worker {core.worker_name(dest)!r} never acknowledged the creation "
            f"of RRef {fork_id} after {core.control_attempts} attempts (the message was lost)"
        )
        self.control.perform(core.ctx.abandon_user(fork_id, error))
        cell = self.creating.get(fork_id)
        parked = self._take(cell) if cell is not None else []
        with self._lock:
            waiting = self.fetches.pop(fork_id, [])
        waiting += [fut for fut in (p.release()[1] for p in parked) if fut is not None]
        for fut in waiting:
            fut._fail(fresh(error))

    # ------------------------------------------------------------------ owner side
    def on_request(self, src: int, msg_id: int, msg: RemoteRequest) -> OwnerRecord | None:
        """I/O thread: a creation arrived. Returns the record to run the function for, or
        None for a duplicate, answered here (NOTE [Creation acks] 3)."""
        core = self.core
        rec = core.ctx.on_remote_request(msg.rref_id, msg.fork_id, src, msg.type_name)
        if rec is None:
            self.accepts.pop(msg.rref_id, None)
            done = core.ctx.owned_record(msg.rref_id)
            if done is not None and done.state != PENDING:  # the value exists: say so
                failed = done.state == FAILED
                frames = ser.dumps_error(done.error, core.info.name) if failed else []
                inline = () if failed else inline_value(done.value)
                self.replies.respond(src, msg_id, Response(ERROR if failed else OK, (), True, inline).meta(True), frames, msg)
            else:
                self.replies.respond(src, msg_id, Response(OK, (), False).meta(True), [], msg)  # accepted (again)
            core.stats["duplicate_calls_dropped"] += 1
            return None
        due = time.monotonic() + ACCEPT_DELAY_S
        self.accepts[rec.rref_id] = (src, msg_id, due)  # before the schedule (NOTE [Deadline sweeps])
        self._accept_sweep.schedule(due)
        return rec

    def _next_accept(self) -> float | None:
        """The accept sweep's ``peek``: when the oldest unanswered creation is due."""
        first = next(iter(self.accepts.copy().values()), None)  # a copy: pool threads pop
        return first[2] if first is not None else None

    def _sweep_accepts(self, until: float) -> None:
        """Transport timer: accept every creation whose value has taken longer than
        ``ACCEPT_DELAY_S`` (due by ``until``; NOTE [Creation acks] 2)."""
        for rref_id, (_, _, due) in self.accepts.copy().items():  # arrival order = due order
            if due > until:
                break
            accept = self.accepts.pop(rref_id, None)
            if accept is not None:
                self.replies.respond(accept[0], accept[1], Response(OK, (), False).meta(True), [], RemoteRequest)

    def finished(self, rec: OwnerRecord, creator: int, exc: BaseException | None) -> None:
        """Pool thread: the creating function finished; answer the creator (NOTE
        [Creation acks] 1 and 2)."""
        core = self.core
        frames = [] if exc is None else ser.dumps_error(exc, core.info.name)
        status = OK if exc is None else ERROR
        # NOTE [Inline creation values] 1: a plain value rides in the answer
        inline = inline_value(rec.value) if exc is None and rec.state == READY else ()
        accept = self.accepts.pop(rec.rref_id, None)
        if accept is not None:  # not yet accepted: accept and result in one answer
            self.replies.respond(accept[0], accept[1], Response(status, (), True, inline).meta(True), frames, RemoteRequest)
            return
        self.control.perform([RemoteRet(creator, rec.rref_id, status, tuple(frames), inline)])

