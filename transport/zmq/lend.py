"""Zero-copy sends from the caller's memory: large frames lent to libzmq, and given back.

Owns: NOTE [Lent frames] - which frames of a message the ZeroMQ transport sends without a
copy from the caller's own memory, the message record that carries them through the data
loop (``Lent``), and the calling thread's bounded wait until libzmq has let go of them.

NOTE [Lent frames]: API.md promises that the arguments of ``rpc_async`` are a snapshot once it
returns. The data loop sends later, on its own thread, so the transport used to copy every
buffer frame on the calling thread (the former ``records.snapshot``): one extra copy of
every tensor per direction, ~100 ms for 64 MB on a loaded 2-core machine. Instead:

Rule 1: a frame is lent when it is a C-contiguous buffer of at least ``LEND_MIN`` bytes that
    is not ``bytes`` (immutable: sent as it is, as before) nor a ``zmq.Frame`` (a received
    frame: immutable, shared by libzmq's reference count), and the sending thread is not the
    data loop's own (it must not wait for itself). Smaller mutable frames are copied, as
    before: below ``LEND_MIN`` the copy costs less than the hand-offs of the wait (measured
    here: a copy of 1 MB takes 0.04 ms, 4 MB 0.3 ms, 64 MB 80-140 ms; the wait wakes two
    more threads, 0.05-0.2 ms on a loaded 2-core machine). A sender of a large frame waits
    about as long as its bytes take to leave; threads that must never wait (the same-host
    plane's receiver answering inline) only send small messages.
Rule 2: the loop sends a lent frame as a tracked ``zmq.Frame`` (no copy; libzmq writes the
    socket straight from the caller's memory), then drops its own references so that the
    tracker completes as soon as libzmq is done with the bytes.
Rule 3: ``request`` / ``send`` return only once every lent frame was released: libzmq sent
    it (the tracker is done), or the message was dropped (dead peer, closed, fenced). So the
    snapshot holds as before, and the same way as on the same-host plane (whose sending
    thread writes before it returns). The wait is bounded: it ends when the peer is declared
    dead, the transport closes, the request's deadline passes, or after ``WAIT_MAX_S``;
    a message still in a backlog then is never sent (peer dead, closing) or, at the deadline,
    copied and swapped in (the snapshot still holds).
    One that libzmq is already writing (a peer that stopped reading mid-message) is left to
    libzmq, whose reference keeps the memory alive; only then may a later mutation reach
    the wire, to a peer that is dead or whose request has failed (``lent_unreleased``).
Rule 4: the state moves under the message's own lock: WAITING -> SENDING (the loop) or
    WAITING -> COPIED / DROPPED (the caller, Rule 3), and SENDING -> WAITING when libzmq
    refused it (no route yet: it goes to the backlog). Neither sends nor waits under the
    lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import zmq

LEND_MIN = 4 << 20  #: lend frames from this size (Rule 1)
WAIT_MAX_S = 120.0  #: the longest a sender waits for libzmq to release its frames (Rule 3)
POLL_S = 0.1  #: how often a waiting sender looks at the peer's liveness and the clock

WAITING, SENDING, SENT, COPIED, DROPPED = range(5)


def lendable(f: Any) -> bool:
    """Rule 1, for one frame (the thread is the caller's business)."""
    if isinstance(f, (bytes, zmq.Frame)):
        return False
    try:
        mv = memoryview(f)
    except TypeError:
        return False
    return mv.nbytes >= LEND_MIN and mv.c_contiguous


class Lent(list):
    """A message (header, frames) some of whose frames are lent; in a peer's backlog like
    any other message (a list of frames)."""

    __slots__ = ("lock", "state", "released", "trackers", "lent")

    def __init__(self, frames: Sequence[Any], lent: list[bool]) -> None:
        super().__init__(frames)
        self.lock = threading.Lock()
        self.state = WAITING
        self.released = threading.Event()  #: set when SENT (trackers known) or DROPPED
        self.trackers: list[zmq.MessageTracker] = []
        self.lent = lent  #: per frame: sent as a tracked zmq.Frame while WAITING


def prepare(frames: Sequence[Any], in_loop: bool, nbytes: int = 0) -> tuple[list[Any], int]:
    """The frames to hand to the loop: immutable ones as they are, small mutable ones copied
    (the snapshot), large ones lent (Rule 1). Returns (message, ``nbytes`` + bytes lent);
    the message is a ``Lent`` iff something was lent."""
    lent = [False] * len(frames)
    out: list[Any] = []
    start = nbytes
    for i, f in enumerate(frames):
        if isinstance(f, (bytes, zmq.Frame)):
            out.append(f)
        elif not in_loop and lendable(f):
            lent[i] = True
            nbytes += memoryview(f).nbytes
            out.append(f)
        else:
            out.append(bytes(f))
    return (Lent(out, lent) if nbytes > start else out), nbytes


def begin(msg: Lent) -> list[Any] | None:
    """Loop thread, before a send (Rule 2, 4): the parts to send, lent frames as tracked
    ``zmq.Frame``s; None when the message was copied meanwhile (send it as usual); [] when
    its sender gave up on it (peer dead, transport closing): send nothing."""
    with msg.lock:
        if msg.state == DROPPED:
            return []
        if msg.state != WAITING:
            return None
        msg.state = SENDING
    return [zmq.Frame(f, track=True) if lent else f for f, lent in zip(msg, msg.lent)]


def finish(msg: Lent, parts: list[Any], sent: bool) -> None:
    """Loop thread, after the send of ``begin``'s parts (Rule 2, 4)."""
    trackers = [p.tracker for p in parts if isinstance(p, zmq.Frame) and p.tracker is not None]
    parts.clear()  # our references to the zmq.Frames: libzmq's are the last ones (Rule 2)
    with msg.lock:
        if not sent:
            msg.state = WAITING  # no route yet: into the backlog, retried later
            return
        msg.state = SENT
        msg.trackers = trackers
        msg[:] = []  # the loop is done with the caller's memory
    msg.released.set()


def drop(msg: Any) -> None:
    """Loop thread: the message will never be sent (dead peer, closed, fenced)."""
    if isinstance(msg, Lent):
        with msg.lock:
            if msg.state == WAITING:
                msg.state = DROPPED
        msg.released.set()


def await_release(msg: Lent, gone: Callable[[], bool], deadline: float | None) -> bool:
    """Calling thread (Rule 3): wait until libzmq released every lent frame, the message was
    dropped, ``gone()`` (peer dead, transport closed) or the bound passed. Returns True iff
    nobody reads the caller's memory any more (released, dropped or swapped for a copy)."""
    end = time.monotonic() + WAIT_MAX_S
    if deadline is not None:
        end = min(end, deadline)
    over = lambda: gone() or time.monotonic() >= end  # noqa: E731
    while not msg.released.wait(POLL_S):
        if gone():  # still queued: never sent now (nobody to send it to, or closing)
            with msg.lock:
                if msg.state == WAITING:
                    msg.state = DROPPED
        elif time.monotonic() < end:
            continue
        copies = [bytes(f) if lent else f for f, lent in zip(list(msg), msg.lent)] if msg.state == WAITING else None
        with msg.lock:
            if msg.state == WAITING and copies is not None:  # still queued: it goes as a copy
                msg[:] = copies
                msg.state = COPIED
            state = msg.state
        if state in (COPIED, DROPPED):
            return True
        if state == WAITING:  # bounced back into the backlog meanwhile: look again
            continue
        if not msg.released.wait(1.0):  # SENDING: the loop is inside one non-blocking send
            return False
        break
    if msg.state == DROPPED:
        return True
    for tracker in msg.trackers:
        while True:
            try:
                tracker.wait(POLL_S)
                break
            except zmq.NotDone:
                if over():
                    return False
    return True
