"""The control loop: the one thread that owns the RRef protocol actions and their retries.

Owns: the control queue and its typed items, the control thread, the performance of every
action the RRef context returns, and the retry policy of protocol messages (NOTE
[Retries]). It is given the worker's core (rrefrt/runtime/core.py) and
the replies; the two homes above it, serving a fetch (the callee) and a lost creation
(remote() creation), are callables the composition root hands in (no module state).

Rule 1: user code never runs on the control thread: no unpickling of payloads, no pickling
        of values, no value destructors. Work that may run user code is handed to the
        callback pool (its home in the table below); only ids and records are handled here.
Rule 2: the control thread never waits except on its own queue (bounded ``get``), so a pool
        full of blocked nested calls cannot stall the protocol.

Home threads (each action or item kind runs on exactly one kind of thread):

    what                                 home            why there
    ForkRequest / ChildAccept(s)/        any (no lock)   protocol sends; retried from the
      UserDelete / RemoteRet (send)                       control thread
    Retry (an ack timed out)             control         NOTE [Retries]
    Incoming Fetch / ForkRequest /       its reader      protocol state (RRef context);
      ChildAccept(s) / UserDelete(s)                      NOTE [Inline protocol]
    Dropped / FlushDrops (an RRef's      control, or a   G1 bookkeeping; NOTE [Drops]
      __del__)                           caller's thread (applied in the __del__ itself
                                                         when the context's lock is free;
                                                         sent from these threads)
    Acked (final ack of a request)       transport       context update, sends (inline)
    CreationLost                         control         see rrefrt/runtime/creation.py
    PeerDied                             control         G3
    ServeFetch                           callback pool   pickles the value (__reduce__); or
                                                         the pool thread that set the value,
                                                         or the reader of a fetch of a plain
                                                         value (callee.serve_fetch_inline)
    Release                              callback pool   the value's __del__ may run
    error payload of a RemoteRet /       callback pool   unpickles a user exception, then
      PYTHON_REMOTE answer                                 settles the creation

Any thread that holds no lock may call ``perform(actions)`` and ``on_incoming(...)``: they
run at once on the calling thread (NOTE [Inline protocol]). ``Perform`` and ``Incoming``
items are still accepted on the queue (tests and tools build them).

NOTE [Inline protocol]: the RRef context is a monitor (every event is one method under its
lock that returns the actions to perform afterwards), and every transport's ``request`` /
``respond`` may be called from any thread, its own receiver thread included (there it never
blocks: what the socket does not take is written later). So a protocol message is handled
by the thread that read it and its consequences are sent by that thread: a fork request is
acknowledged, a fork confirmed, a delete applied and a child accept sent with no hop
through this thread (measured: each hop cost a thread wake-up, 40-80 us on a loaded
2-core host, and the owner's drain and user->user forks paid several per RRef). The
control thread keeps what must not run on a caller's or the transport's thread: retries
(NOTE [Retries]), an RRef's ``__del__`` (``Dropped``: it may fire inside the garbage
collector while this very thread holds the context lock), lost creations and peer deaths.
Rule 1 still holds for every thread this runs on: user code (pickling a value, a
destructor) goes to the callback pool or, for a fetch of a plain value, is no user code at
all (``callee.serve_fetch_inline``).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import rrefrt_transport as transport
from rrefrt.runtime import collection
from rrefrt.errors import RpcError, RRefCreationError
from rrefrt.protocol.ids import ForkId
from rrefrt.pool import current_pool
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.replies import Replies
from rrefrt.protocol.drops import DONE, KEPT
from rrefrt.protocol.messages import (
    DELETES_PER_MESSAGE,
    ERROR,
    Response,
    Action,
    ChildAccept,
    ChildAccepts,
    Fetch,
    ForkRequest,
    Message,
    Release,
    Releases,
    RemoteRet,
    ServeFetch,
    UserDelete,
    UserDeletes,
    batch_actions,
    batch_kind,
    child_accepts,
)

log = logging.getLogger("rrefrt")


# ---------------------------------------------------------------------------- control items
@dataclass(frozen=True, slots=True)
class Incoming:
    """A protocol message that arrived (decoded once, on the I/O thread)."""

    src: int
    msg_id: int
    msg: Message


@dataclass(frozen=True, slots=True)
class Perform:
    """Actions returned by the RRef context on another thread. The list is emptied as it
    is performed, so no reference to a released value stays behind here (Rule 1)."""

    actions: list = field(compare=False)


@dataclass(frozen=True, slots=True)
class Dropped:
    """The Python object of a user fork went away."""

    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class FlushDrops:
    """RRef objects went away (``drop``): apply what ``drops`` holds (NOTE [Drops])."""


@dataclass(frozen=True, slots=True)
class Acked:
    """The final outcome of a protocol request: acknowledged (``error`` None), or not."""

    msg: Message
    error: BaseException | None
    #: the answer's meta, where the sender wants it (a fork request: registered or lost)
    answer: list = field(default_factory=list)


def _lost_fork(answer: list, msg: ForkRequest, owner: str) -> RpcError | None:
    """The owner's answer ``[meta, frames]`` to fork request ``msg``: None if it registered
    the fork; the error the RRef fails with if its value was gone (an ERROR answer naming
    the error's type and text: ``RRefCreationError`` or ``RpcError``)."""
    if not answer or type(answer[0]) is not list or answer[0][:1] != [ERROR]:
        return None
    frames = answer[1] if len(answer) > 1 else []
    try:
        kind, text = bytes(frames[0]).decode(), bytes(frames[1]).decode()
    except (IndexError, TypeError, UnicodeDecodeError):
        kind, text = "RpcError", f"RRef {msg.rref_id} no longer exists on its owner"
    cls = RRefCreationError if kind == "RRefCreationError" else RpcError
    return cls(f"{text} (owner {owner!r}, fork {msg.fork_id})")


@dataclass(frozen=True, slots=True)
class Retry:
    """A protocol request's ack did not come in time: send it again (NOTE [Retries])."""

    msg: Message
    attempt: int
    on_ack: Callable[[Any], None] = field(compare=False)
    on_reply: Callable[[Any, Sequence[Any]], None] | None = field(default=None, compare=False)
    frames: tuple = ()


@dataclass(frozen=True, slots=True)
class CreationLost:
    """A remote() made here was never acknowledged by ``dest``."""

    fork_id: ForkId
    dest: int


@dataclass(frozen=True, slots=True)
class PeerDied:
    peer: int


@dataclass(frozen=True, slots=True)
class Sync:
    """Sets ``event`` once every item enqueued before it was handled."""

    event: threading.Event = field(compare=False)


ControlItem = Incoming | Perform | Dropped | FlushDrops | Acked | Retry | CreationLost | PeerDied | Sync


_FLUSH = FlushDrops()


#: NOTE [Drops]: in ``drops``, "a drop applied in its ``__del__`` whose actions wait in the
#: context" (``RRefContext.try_user_dropped``)
_APPLIED = object()


class _Drops(collections.deque):
    """The fork ids of RRef objects that went away, not yet applied (NOTE [Drops]). True
    also while a flush is sending what it took: a caller about to send checks
    ``if control.drops`` and then waits in ``flush_drops`` for that flush, so its call
    leaves after those deletes too, not just after the ones still queued."""

    flushing = False

    def __bool__(self) -> bool:
        return self.flushing or len(self) > 0


#: NOTE [Drops]: how long a thread waits for another thread's flush before sending anyway
FLUSH_WAIT = 2.0
#: NOTE [Drops]: the most a drop waits for the control thread once it is awake (its
#: deletes usually leave sooner, with the program's next call)
DROP_DELAY = 0.02
#: NOTE [Drops]: the drops that a wake-up of the control thread sends at once (fewer wait
#: for ``DROP_DELAY`` or the program's next call)
FIRST_BATCH = 32
#: the control thread's wait when it has nothing to do (it re-checks ``_stop``)
IDLE_WAIT = 0.5


#: NOTE [Release home]: values whose release runs no user code (exact types, not subclasses)
_NO_DESTRUCTOR = frozenset({type(None), bool, int, float, complex, str, bytes})


def _ignore_ack(err: Any) -> None:
    return None


#: serve_fetch(sf): answer a fetch with its value (the callee's; may run user code)
ServeFetchHome = Callable[[ServeFetch], None]
#: creation_lost(fork_id, dest): a remote() made here was never acknowledged (creation's)
CreationLostHome = Callable[[ForkId, int], None]


class ControlLoop:
    def __init__(self, core: WorkerCore, replies: Replies, serve_fetch: ServeFetchHome,
                 creation_lost: CreationLostHome) -> None:
        self.core = core
        self.replies = replies
        self._serve_fetch = serve_fetch
        self._creation_lost = creation_lost
        self.queue: queue.SimpleQueue[ControlItem] = queue.SimpleQueue()
        #: fork ids of RRef objects that went away, not yet applied (NOTE [Drops])
        self.drops: _Drops = _Drops()
        self._flush_lock = threading.Lock()  #: one flusher at a time (NOTE [Drops])
        #: the thread that holds ``_flush_lock`` (0: none; NOTE [Drops before a collection])
        self._flusher = 0
        #: a FlushDrops is in the queue and has not started (NOTE [Drops]: one wake-up for
        #: many drops)
        self._flush_queued = False
        #: the control thread flushes drops every ``DROP_DELAY`` rather than being woken per
        #: drop (NOTE [Drops], "one wake-up per burst")
        self._batching = False
        self._stop = False
        self._pid = os.getpid()  #: the process whose control thread this is (NOTE [Drops before a collection])
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-{core.info.name}-control", daemon=True)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Incoming: self._on_incoming,
            Perform: lambda item: self._perform(item.actions),
            Dropped: lambda item: self._perform(self.core.ctx.user_dropped(item.fork_id)),
            FlushDrops: self._on_flush,
            Acked: self._on_acked,
            Retry: lambda item: self.request(item.msg, item.on_ack, item.frames, item.attempt, item.on_reply),
            CreationLost: lambda item: self._creation_lost(item.fork_id, item.dest),
            PeerDied: lambda item: self._perform(self.core.ctx.on_peer_dead(item.peer)),
            Sync: self._on_sync,
        }

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()
        collection.register(self)  # NOTE [Drops before a collection] in rrefrt/runtime/collection.py

    def flush_before_collection(self) -> threading.Event | None:
        """The gc hook, before a full collection (NOTE [Drops before a collection] in
        rrefrt/runtime/collection.py): ask the control thread to send the deletes decided so far;
        the event it sets once they are sent, or None when there is nothing to send or no
        waiting is safe."""
        if self._stop or self.core.closed or os.getpid() != self._pid:
            return None  # a forked child inherits the loops, not their threads (NOTE [Fork safety])
        if not (self.core.ctx.unsent_count or self.drops):  # ``drops``: true too while a flush sends
            return None
        me = threading.get_ident()
        if (self._flusher == me or not self.core.ctx.lock_free() or self.on_control_thread()
                or not self._thread.is_alive()):
            return None  # the flush would wait for this very thread (or there is none)
        ev = threading.Event()
        self.queue.put(Sync(ev))
        return ev

    def put(self, item: ControlItem) -> None:
        self.queue.put(item)

    def drop(self, fork_id: ForkId) -> None:
        """An RRef object went away (its ``__del__``, maybe inside the garbage collector while
        this thread holds the context lock): apply the drop to the context at once if its lock
        is free (``try_user_dropped``, a non-blocking acquire: the deletes it decides wait in
        the context, marked by one ``_APPLIED`` in ``drops``), else remember the fork id; then
        wake the control thread unless a wake-up is already queued (none when the applied
        drop decided nothing to send). Never waits for a lock,
        never sends (a deque append and at most one SimpleQueue put).

        Applying here, not at the flush, moves the per-RRef work of a burst of drops (the
        benchmark's ``del rrefs; gc.collect()``) out of the thread that sends next: that flush
        only takes the deletes, grouped by owner, and sends one message per owner (or lets them
        ride in its call). No drop is left behind: a marker is appended after the context took
        the drop's actions and only when ``drops`` is empty; a flush takes the context's
        actions after it popped, so it sees every action decided before the last element it
        popped. The wake-up flag is read after the append, and the control thread clears it
        before it drains the deque. If the flag reads True, the FlushDrops that the thread
        which set it queued has not cleared it yet, so that flush drains after this append;
        if it reads False, this drop queues one itself (two threads may both queue one: a
        spare flush finds the deque empty)."""
        drops = self.drops
        done = self.core.ctx.try_user_dropped(fork_id)
        if done == DONE:
            return  # applied, nothing to send: no wake-up
        if done == KEPT:
            if not len(drops):  # a marker: "something to send" (``flush_drops`` skips it)
                drops.append(_APPLIED)
        else:
            drops.append(fork_id)
        if not self._flush_queued and not self._batching:
            self._flush_queued = True
            self.queue.put(_FLUSH)

    def flush_drops(self, keep_for: int | None = None) -> tuple:
        """Apply the drops remembered so far, take the actions of those applied in their
        ``__del__`` (``drop``), and send the deletes - one message per owner, at most
        ``DELETES_PER_MESSAGE`` deletes each - on this thread (which holds no lock).
        ``keep_for``: a worker this thread is about to send a call or a creation to; up to
        ``DELETES_PER_MESSAGE`` deletes to it are not sent but returned as ``((rref_id,
        fork_id), ...)``, to ride in that message (NOTE [Piggybacked deletes] in
        docs/protocol.md).

        NOTE [Drops]: an RRef's ``__del__`` applies its drop to the context when the
        context's lock is free (``drop``); what it decides waits there for a thread that may
        send. The control thread sends it (at most ``DROP_DELAY`` after the
        first drop woke it; drops that come while it batches wake nothing), and so does every
        thread about to send a call or a creation (``Caller``), so that the deletes of the
        RRefs a program dropped leave before its next message: on one connection they then
        reach the owner first, as torch's do (its deletes leave from the destructor). The
        owner's count then drops by the time it answers that next call (the benchmark's
        "owner drain" row). One thread flushes at a time (``_flush_lock``), and ``drops``
        reads true while it sends: a thread about to send a call waits (bounded,
        ``FLUSH_WAIT``) for a flush in progress elsewhere, so that no delete it popped
        leaves after the call. Sends never wait for this lock's holder, and nothing here
        waits while holding another lock (the context's lock is taken and released inside
        ``take_dropped``)."""
        drops, ctx = self.drops, self.core.ctx
        kept: tuple = ()
        if not self._flush_lock.acquire(timeout=FLUSH_WAIT):
            log.warning("worker %r: another thread has been sending the deletes of dropped RRefs for over "
                        "%.0f s; not waiting for it any longer", self.core.info.name, FLUSH_WAIT)
            return kept
        self._flusher = threading.get_ident()
        try:
            drops.flushing = True
            while len(drops):
                fids: list[ForkId] = []
                try:
                    for _ in range(DELETES_PER_MESSAGE):
                        fid = drops.popleft()
                        if fid is not _APPLIED:
                            fids.append(fid)
                except IndexError:
                    pass
                deletes, actions = ctx.take_dropped(fids)
                if len(actions) > 1:
                    actions = batch_kind(actions, ChildAccept, child_accepts)
                for dest, pairs in deletes.items():
                    for i in range(0, len(pairs), DELETES_PER_MESSAGE):
                        chunk = tuple(pairs[i : i + DELETES_PER_MESSAGE])
                        if dest == keep_for and not kept:
                            kept = chunk  # NOTE [Piggybacked deletes]: rides in the call
                        elif len(chunk) == 1:
                            actions.append(UserDelete(dest, *chunk[0]))
                        else:
                            actions.append(UserDeletes(dest, chunk))
                self._perform(actions)
        finally:
            drops.flushing = False
            self._flusher = 0
            self._flush_lock.release()
        return kept

    def deletes_delivered(self, dest: int, deletes: tuple, error: BaseException | None) -> None:
        """The message that carried ``deletes`` (``flush_drops(keep_for=...)``) was answered
        (``error`` None: the owner applied them before it handled the message, so this is
        their ack), or failed with delivery unknown: they go again on their own, retried
        and acknowledged as ever (the owner's handling is idempotent). Any thread that
        holds no lock (NOTE [Piggybacked deletes] in docs/protocol.md)."""
        if not deletes:
            return
        if error is None:
            self.core.ctx.on_user_deletes_ack([fid for _, fid in deletes])
            return
        self.perform([UserDeletes(dest, deletes)])

    def _on_flush(self, item: FlushDrops) -> None:
        """A drop woke this thread: if the drops so far add up to ``FIRST_BATCH`` or more
        actions, send them at once - their owner starts on them while the program may still
        be dropping (the rest of a ``del``, a garbage collection); then flush every
        ``DROP_DELAY`` while drops keep coming (``_run``), so that the rest of a burst - or a
        loop that drops one RRef per call, whose deletes ride in its next call - shares this
        wake-up."""
        self._flush_queued = False
        self._batching = True  # before ``_flush_queued`` is read again: see ``drop``
        if self.core.ctx.unsent_count + len(self.drops) >= FIRST_BATCH:
            self.flush_drops()

    def _on_sync(self, item: Sync) -> None:
        self.flush_drops()  # "everything enqueued so far" includes the drops
        item.event.set()

    def _batch_tick(self) -> None:
        """``DROP_DELAY`` passed with nothing else to do: flush what is left; stop batching
        once a tick finds nothing. No drop is left behind: ``_batching`` is cleared before
        the deque is read again, and a drop that read it true was appended before."""
        if self.drops:
            self.flush_drops()
            return
        self._batching = False
        if self.drops:  # a drop that saw ``_batching`` true just before it was cleared
            self._batching = True

    def on_control_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def perform(self, actions: list[Action]) -> None:
        """Perform ``actions`` now, on this thread (NOTE [Inline protocol]); the caller holds
        no lock."""
        if actions:
            self._perform(batch_actions(actions))

    def sync(self, deadline: float) -> bool:
        """Wait (bounded) until everything enqueued so far is handled."""
        if self.on_control_thread():
            return True
        ev = threading.Event()
        self.queue.put(Sync(ev))
        return ev.wait(max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float = 2.0) -> None:
        self._stop = True
        collection.unregister(self)
        self.queue.put(Sync(threading.Event()))
        if self._thread.ident is not None and not self.on_control_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ control thread
    def _run(self) -> None:
        q = self.queue
        while not self._stop:
            try:
                item = q.get(timeout=DROP_DELAY if self._batching else IDLE_WAIT)
            except queue.Empty:
                if self._batching:
                    self._batch_tick()
                continue
            try:
                self._handlers[type(item)](item)
            except Exception:
                log.exception("control item %s failed on worker %r", type(item).__name__, self.core.info.name)
            del item

    def _on_incoming(self, item: Incoming) -> None:
        self.on_incoming(item.src, item.msg_id, item.msg)

    def on_incoming(self, src: int, msg_id: int, msg: Message) -> None:
        """A protocol message arrived: update the context, acknowledge, perform the
        consequences - on the calling thread (NOTE [Inline protocol])."""
        ctx = self.core.ctx
        if isinstance(msg, Fetch):
            sf = ctx.on_fetch(msg.rref_id, src, msg_id)
            if sf is not None:
                self._perform([sf])
            return
        if isinstance(msg, ForkRequest):
            lost = ctx.on_fork_request(msg.rref_id, msg.fork_id, src)
            if lost is not None:  # the value is gone: the requester's RRef fails from now on
                # the error's type and text (not pickled: the requester reads it on its I/O thread)
                frames = [type(lost).__name__.encode(), str(lost).encode()]
                self.replies.respond(src, msg_id, Response(ERROR).meta(), frames, msg)
                return
            actions: list[Action] = []
        elif isinstance(msg, ChildAccept):
            actions = ctx.on_child_accept(msg.fork_id)
        elif isinstance(msg, ChildAccepts):
            actions = ctx.on_child_accepts(msg.fork_ids)
        elif isinstance(msg, UserDelete):
            actions = ctx.on_user_delete(msg.rref_id, msg.fork_id)
        elif isinstance(msg, UserDeletes):
            actions = ctx.on_user_deletes(msg.deletes)
        else:
            raise TypeError(f"{type(msg).__name__} is not handled by the control thread")
        self.replies.ack(src, msg_id, msg)
        self.perform(actions)  # batched: the parents a ChildAccepts frees delete in one message

    def _on_acked(self, item: Acked) -> None:
        msg, err, ctx = item.msg, item.error, self.core.ctx
        if isinstance(msg, ForkRequest):
            if err is None:
                lost = _lost_fork(item.answer, msg, self.core.worker_name(msg.dest))
                self._perform(ctx.on_fork_request_ack(msg.fork_id, lost))
            elif isinstance(err, transport.RequestTimeout):  # retries exhausted
                self._perform(ctx.give_up_user(
                    msg.fork_id, RpcError(f"the owner never confirmed fork {msg.fork_id} of this RRef")))
        elif isinstance(msg, UserDelete):
            # acknowledged, or never (retries exhausted: the owner will report the leak), or
            # the owner died: either way this worker is done with the fork
            ctx.on_user_delete_ack(msg.fork_id)
        elif isinstance(msg, UserDeletes):
            ctx.on_user_deletes_ack([fid for _, fid in msg.deletes])

    def _perform(self, actions: list[Action]) -> None:
        """On the control thread: send protocol messages, hand the rest to their homes.
        Empties ``actions`` as it goes.

        NOTE [Release home]: a ``Release`` may hold the last reference to a value, whose
        destructor is user code. The slot in ``actions`` is cleared and the record goes to
        the callback pool in a one-element box that the pool empties; the control thread
        keeps only the box, so the record's last reference goes on the pool. The Releases
        of one list share one box (one pool task however many values a batch of deletes
        frees). A box whose values are all of built-in types with no destructor to run
        (``_NO_DESTRUCTOR``: an int, a short str) and no error is freed here instead."""
        box: list[Any] = []
        for i in range(len(actions)):
            a = actions[i]
            actions[i] = None  # type: ignore[call-overload]
            try:
                if type(a) is Release:
                    # the value's destructor must run on the callback pool: hand over the
                    # only reference held here, then forget it (NOTE [Release home])
                    box.append(a.record)
                elif type(a) is Releases:
                    box += a.records
                    a.records.clear()
                elif type(a) is ForkRequest:
                    answer: list[Any] = []
                    self.request(a, lambda e, m=a, ans=answer: self._on_acked(Acked(m, e, ans)),
                                 on_reply=lambda meta, fr, ans=answer: ans.extend((meta, list(fr))))
                elif isinstance(a, (UserDelete, UserDeletes)):
                    self.request(a, lambda e, m=a: self._on_acked(Acked(m, e)))
                elif type(a) is RemoteRet:
                    self._remote_ret(a)
                elif isinstance(a, (ChildAccept, ChildAccepts)):
                    self.request(a, _ignore_ack)
                elif isinstance(a, ServeFetch):
                    if current_pool() is not None:  # a pool thread (set_value): user code may run here
                        self._serve_fetch(a)
                    else:
                        self.core.callbacks.submit(self._serve_fetch, a)
            except transport.AgentClosed:
                log.debug("protocol message %r not sent: transport closed", a)
            except RuntimeError as e:  # a stopped pool at close
                log.debug("action %r dropped: %s", a, e)
            del a
        if box and all(type(r.value) in _NO_DESTRUCTOR and r.error is None for r in box):
            box.clear()  # nothing user-defined can run: freed here, no pool task (NOTE [Release home])
        if box:
            try:
                self.core.callbacks.submit(box.clear)
            except RuntimeError as e:  # a stopped pool at close
                log.debug("release of %d value(s) dropped: %s", len(box), e)
            del box

    def _remote_ret(self, ret: RemoteRet) -> None:
        """Send a creation's result. An error too large to send goes as a SerializationError
        that says so: its creator waits for the creation to end, and must hear that it did."""
        try:
            self.request(ret, _ignore_ack, ret.payload)
        except transport.MessageTooLarge as e:
            err = tuple(self.replies.too_large(e, "the error of remote()"))
            self.request(RemoteRet(ret.dest, ret.rref_id, ERROR, err), _ignore_ack, err)

    def request(
        self, msg: Message, on_ack: Callable[[Any], None], frames: Sequence[Any] = (), attempt: int = 1,
        on_reply: Callable[[Any, Sequence[Any]], None] | None = None,
    ) -> None:
        """Send a protocol message and retry it until acknowledged. On the control thread,
        except the first attempt of a remote() (the caller's thread, so it can raise).

        NOTE [Retries]: a control message whose ack does not come within
        ``core.control_retry_interval`` is sent again (``core.control_attempts`` times at most);
        the receivers' handlers are idempotent, and deleted forks leave tombstones, so a
        duplicate or late retry changes nothing. A dead peer stops the retries (G3 cleans
        up). The transport's callback only enqueues the retry: it is sent from here.
        """
        core = self.core
        frames = tuple(frames)

        def done(meta: Any, fr: Sequence[Any], err: Any) -> None:  # transport thread
            if isinstance(err, transport.RequestTimeout) and attempt < core.control_attempts and not core.closed:
                core.stats["control_retries"] += 1
                self.queue.put(Retry(msg, attempt + 1, on_ack, on_reply, frames))
                return
            if isinstance(err, transport.RequestTimeout):
                log.error("%s to worker %r was never acknowledged after %d attempts", msg.NAME,
                          core.worker_name(msg.dest), attempt)
            if err is None and on_reply is not None:
                on_reply(meta, fr)
            on_ack(err)

        try:
            core.transport.request(msg.dest, msg.KIND, msg.meta(), frames, core.control_retry_interval, done, msg.NAME)
        except transport.TransportError as e:
            if attempt == 1:
                raise
            on_ack(e)
