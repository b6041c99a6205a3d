"""The send path of the same-host transport (``rrefrt_transport.unix.transport``, Rule 1 there): checks (the
receiver's size limit), shared memory for large frames, the per-peer queue, its bound and
send lock, the direct write when the lock is free and nothing is queued, partial writes and
EVENT_WRITE. A mixin of ``UnixTransport``, split out to keep modules small; it uses that
class's state and owns none of its own.

NOTE [Send queue bound]: no thread ever waits for a peer that does not read. A sending
thread writes its own message, zero copy, for as long as the socket keeps taking bytes
within ``_GRACE`` (5 ms; never past the request's deadline); what is left then, and every
message that finds others queued ahead of it, is copied into the peer's queue (``outq``,
or ``cur`` for the rest of a message half written) and written by whoever next holds the
send lock, the receiver thread on EVENT_WRITE included. So ``request`` returns at once
while a peer is stopped, or holds its GIL in a long C call, and calls to other peers never
wait behind it. The queue is
bounded per peer in bytes (``extra["unix_queue_bytes"]``, 64 MiB by default; frames in
shared memory do not count, only the bytes of the stream): a message that does not fit
waits, on the sending thread, until the queue has room, at most until the request's own
deadline. A request whose deadline passes first is not sent and fails at that deadline
with ``RequestTimeout`` naming the worker, like any call that was not answered in time. A
message without a deadline (a one-way message, a response, a request with timeout 0) waits
for room while the peer is up, bounded by its death (heartbeats, EOF) or by close. A
message never waits for room when nothing is queued (a single message larger than the
bound is taken), nor on the receiver thread, which must never block (its answers, segment
releases, PINGs and BYE are queued whatever the bound).
"""

from __future__ import annotations

import array
import os
import select
import socket
import threading
import time
from typing import Any, Sequence

from rrefrt_transport.unix import shm

from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.errors import AgentClosed, MessageTooLarge

_SEND_FLAGS = socket.MSG_NOSIGNAL
_WAIT = 0.05  #: slice of a wait for room in the queue, between checks that the peer is still up
_NUDGE = 0.005  #: slice of that wait while another thread holds the send lock
#: a sending thread writes on its own message while the socket takes bytes within this long
_GRACE = 0.005
#: NOTE [Send queue bound]: the default bound of a peer's queue, in bytes
QUEUE_BYTES = 64 << 20

#: this process's pid, kept current across fork (a per-request getpid() was a syscall per call)
_PID = os.getpid()


def _after_fork() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _advance(views: list, n: int) -> list:
    """What is left of ``views`` (bytes or byte memoryviews) once ``n`` bytes were written."""
    if not n:
        return [v for v in views if len(v)]
    rest = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        rest.append(memoryview(v)[n:] if n else v)
        n = 0
    return rest


def _immutable(b: Any) -> bool:
    """Bytes, or a view of bytes: it cannot change once ``request`` returns (no copy)."""
    return type(b) is bytes or (type(b) is memoryview and type(b.obj) is bytes)


def _writable(sock: Any, timeout: float) -> bool:
    """Whether ``sock`` takes bytes within ``timeout`` seconds (no lock is waited for)."""
    p = select.poll()
    try:
        p.register(sock.fileno(), select.POLLOUT)
    except (OSError, ValueError):
        return False  # closed meanwhile: the caller sees the peer's death
    return bool(p.poll(max(1, int(timeout * 1000))))


class Send:
    # ------------------------------------------------------------------ sending
    def _check_usable(self: Any) -> None:
        if _PID != self._pid:
            raise AgentClosed(f"the transport of worker {self.name!r} was created in another process (fork)")
        if self._closing:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed")

    def _check_size(self: Any, dest: int, frames: Sequence[Any]) -> None:
        """MessageTooLarge if ``frames`` exceed the limit of ``dest`` (the smaller of ours and
        the one it told at admission). ``_min_limit`` is the smallest of all: a message under
        it needs no look-up."""
        if not frames:
            return
        if len(frames) == 1 and type(frames[0]) is bytes:  # the common case: one small frame
            if len(frames[0]) <= self._min_limit:
                return
        total = sum(f.nbytes if isinstance(f, memoryview) else len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)
        if total <= self._min_limit:
            return
        own = self.config.max_message_size
        peer = self._peers.get(dest) if dest != self.id else None
        limit = peer.limit if peer is not None and peer.limit else own
        if total > limit:
            whose = "" if limit == own else f" of worker {self.peer_name(dest)!r}"
            raise MessageTooLarge(f"message of {total} bytes exceeds the limit{whose} of {limit} bytes")

    def _send_app(
        self: Any, peer: Any, kind: int, msg_id: int, meta: Any, frames: Sequence[Any], label: str,
        deadline: float | None,
    ) -> bool:
        """Write or queue one message of the runtime's; False: not sent (the peer is gone, the
        transport closed, or ``deadline`` passed before the queue had room)."""
        hook = self.fault_hook
        if hook is not None:
            bufs = unix_wire.encode(kind, msg_id, meta, [bytes(memoryview(f).cast("B")) for f in frames])
            if peer.qbytes and not self._room(peer, sum(map(len, bufs)), deadline):
                return False
            for delay in hook(peer.spec.id, label):
                if delay <= 0:
                    self._write(peer, bufs, ())
                else:
                    self._push_timer(time.monotonic() + delay, lambda: self._write(peer, bufs, ()))
            self._n_sent += 1
            return True
        if not frames or (
            len(frames) == 1 and type(frames[0]) is bytes and (n := len(frames[0])) < unix_wire.SMALL_FRAME
            and (n < self.shm_threshold or not self.shm_threshold)
        ):  # the common case (a call or an answer): nothing for shared memory, nothing to cast
            bufs = unix_wire.encode(kind, msg_id, meta, frames)
            if peer.qbytes and not self._room(peer, len(bufs[0]), deadline):
                return False
            ok = self._write(peer, bufs, (), deadline)
            self._n_sent += ok
            return ok
        views = [f if isinstance(f, bytes) else memoryview(f).cast("B") for f in frames]
        flags = [bool(self.shm_threshold) and len(v) >= self.shm_threshold for v in views]
        if peer.qbytes and not self._room(peer, sum(len(v) for v, f in zip(views, flags) if not f), deadline):
            return False
        if not any(flags):
            ok = self._write(peer, unix_wire.encode(kind, msg_id, meta, views), (), deadline)
            self._n_sent += ok
            return ok
        big = [v for v, f in zip(views, flags) if f]
        sizes = [len(v) for v in big]
        offsets, used = shm.layout(sizes)
        seg = self._pool.acquire(used, peer.spec.id)
        dst = memoryview(seg.map)
        for o, v in zip(offsets, big):
            dst[o : o + len(v)] = v  # the one copy of a large frame
        dst.release()
        attach = peer.spec.id not in seg.known_by
        seg.known_by.add(peer.spec.id)
        self._stats["shm_frames_sent"] += len(big)
        bufs = unix_wire.encode(kind, msg_id, meta, views, (seg.id, attach, flags))
        if not self._write(peer, bufs, (seg.fd,) if attach else (), deadline):
            self._pool.peer_gone(peer.spec.id)
            return False
        self._n_sent += 1
        return True

    def _room(self: Any, peer: Any, nbytes: int, deadline: float | None) -> bool:
        """NOTE [Send queue bound]: wait until ``nbytes`` more fit in ``peer``'s queue (or it
        is empty), at most until ``deadline`` (None: while the peer is up). The waiting thread
        writes the queue itself whenever the socket takes bytes (the receiver thread may be
        busy in a callback). False: the message must not be sent (the deadline passed, the
        peer is gone, or we close)."""
        bound = self.queue_bytes
        if peer.qbytes + nbytes <= bound or threading.get_ident() == self._lead.leader:
            return True
        with peer.q_lock:
            peer.waiting += 1
        try:
            while peer.qbytes and peer.qbytes + nbytes > bound:
                if peer.state != "up" or self._closing:
                    return False
                left = _WAIT if deadline is None else min(_WAIT, deadline - time.monotonic())
                if left <= 0:
                    self._stats["send_queue_full_timeouts"] += 1
                    return False
                if peer.send_lock.acquire(blocking=False):
                    try:
                        emptied = self._drain(peer)
                    finally:
                        peer.send_lock.release()
                    if not emptied and peer.state == "up" and peer.qbytes + nbytes > bound:
                        if peer.sock is not None:
                            _writable(peer.sock, left)
                else:  # another thread writes: it notifies when a message is out
                    with peer.room:
                        if peer.qbytes + nbytes > bound:
                            peer.room.wait(min(left, _NUDGE))
        finally:
            with peer.q_lock:
                peer.waiting -= 1
        return True

    def _write(self: Any, peer: Any, bufs: list, fds: Sequence[int], deadline: float | None = None) -> bool:
        """Write one message to ``peer`` now, or queue it behind what is queued (Rule 1 of
        ``rrefrt_transport.unix.transport``, NOTE [Send queue bound]): never waits for a peer that does not
        read (``_write_now``); what the socket does not take is copied (unless immutable:
        bytes) and written on EVENT_WRITE. False if the peer is gone."""
        if not fds and peer.state == "up" and not self._closing and peer.send_lock.acquire(blocking=False):
            # the fast path: the lock is free; with nothing queued or half-written ahead of this
            # message (checked under the lock: a message of this thread queued earlier must go
            # first) it is written at once, without a place in the queue
            try:
                direct = not peer.outq and peer.cur is None
                ok = self._write_now(peer, bufs, deadline) if direct else True
            finally:
                peer.send_lock.release()
            if direct:
                if (peer.outq or peer.cur is not None) and not peer.want_write:
                    self._try_flush(peer)  # queued while this thread held the lock (Rule 1)
                return ok
        if peer.state == "dead":
            return False
        snap = [b if _immutable(b) else bytes(b) for b in bufs]
        size = sum(len(b) for b in snap)
        with peer.q_lock:
            peer.outq.append((snap, fds, size))
            peer.qbytes += size
        self._try_flush(peer, force=threading.get_ident() != self._lead.leader)
        return peer.state != "dead"

    def _sendmsg(self: Any, peer: Any, sock: Any, bufs: list) -> int:
        """One ``sendmsg`` of ``bufs``: the bytes it took (0 when the socket is full), or -1
        when the socket failed (the peer is then reported broken)."""
        try:
            n = sock.sendmsg(bufs, (), _SEND_FLAGS)
        except BlockingIOError:
            return 0
        except OSError as e:
            self._broken(peer, f"its socket failed: {e.strerror or e}")
            return -1
        self._bytes_sent += n
        return n

    def _write_now(self: Any, peer: Any, bufs: list, deadline: float | None) -> bool:
        """Write one message directly (send lock held, nothing queued or half-written). A
        sending thread that is not the receiver's goes on writing its own message, zero copy,
        for as long as the socket keeps taking bytes within ``_GRACE`` (the peer reads) and
        ``deadline`` has not passed. The rest becomes ``peer.cur`` (a snapshot: the caller's
        buffers may change once it returns), written on EVENT_WRITE."""
        sock = peer.sock
        if sock is None:
            return False
        n = self._sendmsg(peer, sock, bufs)
        if n < 0:
            return False
        if len(bufs) == 1 and type(bufs[0]) is bytes and n == len(bufs[0]):
            return True
        rest = _advance([b if type(b) is bytes else memoryview(b).cast("B") for b in bufs], n)
        if rest and n and threading.get_ident() != self._lead.leader:
            while rest and (deadline is None or time.monotonic() < deadline) and _writable(sock, _GRACE):
                n = self._sendmsg(peer, sock, rest)
                if n < 0:
                    return False
                rest = _advance(rest, n)
        if not rest:
            return True
        rest = [v if _immutable(v) else bytes(v) for v in rest]
        size = sum(len(v) for v in rest)
        with peer.q_lock:
            peer.qbytes += size
        peer.cur = [rest, (), size]
        self._want_write(peer)
        return True

    def _want_write(self: Any, peer: Any) -> None:
        """The socket is full: the receiver thread writes the rest on EVENT_WRITE."""
        if not peer.want_write:
            peer.want_write = True
            self._watch_needed = True
            self._ring()

    def _try_flush(self: Any, peer: Any, force: bool = False) -> None:
        """Write what is queued if the send lock is free. ``force``: also when the receiver
        thread already waits for EVENT_WRITE (a sender tries the socket itself: the receiver
        thread may be busy in a callback)."""
        while (peer.outq or peer.cur is not None) and (force or not peer.want_write) and peer.state == "up":
            if not peer.send_lock.acquire(blocking=False):
                return  # its holder re-checks the queue after releasing
            try:
                emptied = self._drain(peer)
            finally:
                peer.send_lock.release()
            if not emptied:
                return  # the socket is full (EVENT_WRITE is asked for) or broke (declared dead)

    def _drain(self: Any, peer: Any) -> bool:
        """Write queued messages (send lock held) until the queue is empty (True) or the
        socket is full (False, after asking for EVENT_WRITE) or broke (False). Never blocks."""
        sock = peer.sock
        if sock is None:
            return False
        while True:
            if peer.cur is None:
                if not peer.outq:
                    return True
                bufs, fds, size = peer.outq.popleft()
                peer.cur = [list(bufs), fds, size]
            rest, fds = peer.cur[0], peer.cur[1]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = sock.sendmsg(rest, anc, _SEND_FLAGS)
                    peer.cur[1] = ()
                else:
                    n = sock.sendmsg(rest, (), _SEND_FLAGS)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._broken(peer, f"its socket failed: {e.strerror or e}")
                return False
            if n:
                self._bytes_sent += n
                while n:
                    head = rest[0]
                    if n >= len(head):
                        n -= len(head)
                        rest.pop(0)
                    else:
                        rest[0] = memoryview(head)[n:]
                        n = 0
                while rest and not len(rest[0]):  # empty frames: nothing to write
                    rest.pop(0)
                if not rest:
                    done = peer.cur[2]
                    peer.cur = None
                    with peer.q_lock:
                        peer.qbytes -= done
                        if peer.waiting:
                            peer.room.notify_all()
                continue
            self._want_write(peer)
            return False

    def _broken(self: Any, peer: Any, cause: str) -> None:
        self._call_soon(lambda: self._declare_dead(peer, cause))
