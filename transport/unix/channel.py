"""One same-host peer's connection (``rrefrt_transport.unix.transport``): its socket, its
state, the requests waiting for its answers, the ordered send queue with its bound, send
lock and writer, and what its reads left over (received fds, mapped segments).

Thread roles (Rule 1 of ``rrefrt_transport.unix.transport``): any thread writes through
``write``; the thread that leads the receiver loop reads (``read_some``), writes the queue
on EVENT_WRITE and tears the connection down. The read side (``read_some``, ``reader``,
received fds and segments) belongs to whoever holds the read token (``claim_read``): the
loop's thread while it reads, or a caller's thread that reads its own answer (NOTE [Own
reads] in ``rrefrt_transport.unix.receiver``).

NOTE [Send queue bound]: no thread ever waits for a peer that does not read. A sending
thread writes its own message, zero copy, for as long as the socket keeps taking bytes
within ``_GRACE`` (5 ms; never past the request's deadline); what is left then, and every
message that finds others queued ahead of it, is copied into the peer's queue (``outq``,
or ``cur`` for the rest of a message half written) and written by whoever next holds the
send lock, the receiver thread on EVENT_WRITE included. So ``request`` returns at once
while a peer is stopped, or holds its GIL in a long C call, and calls to other peers never
wait behind it. The queue is bounded per peer in bytes (``extra["unix_queue_bytes"]``,
64 MiB by default; frames in shared memory do not count, only the bytes of the stream): a
message that does not fit waits, on the sending thread, until the queue has room, at most
until the request's own deadline. A request whose deadline passes first is not sent and
fails at that deadline with ``RequestTimeout`` naming the worker, like any call that was
not answered in time. A message without a deadline (a one-way message, a response, a
request with timeout 0) waits for room while the peer is up, bounded by its death
(heartbeats, EOF) or by close. A message never waits for room when nothing is queued (a
single message larger than the bound is taken), nor on the receiver thread, which must
never block (its answers, segment releases, PINGs and BYE are queued whatever the bound).
"""

from __future__ import annotations

import array
import collections
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from rrefrt_transport.base import PeerSpec
from rrefrt_transport.liveness import PeerState
from rrefrt_transport.unix import shm
from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.unix.timers import Pending

_SEND_FLAGS = socket.MSG_NOSIGNAL
_ANC = socket.CMSG_SPACE(4 * 32)
_WAIT = 0.05  #: slice of a wait for room in the queue, between checks that the peer is still up
_NUDGE = 0.005  #: slice of that wait while another thread holds the send lock
#: a sending thread writes on its own message while the socket takes bytes within this long
_GRACE = 0.005
#: NOTE [Send queue bound]: the default bound of a peer's queue, in bytes
QUEUE_BYTES = 64 << 20

UP, JOINING, DEAD = PeerState.UP, PeerState.JOINING, PeerState.DEAD


class ChannelLost(Exception):
    """A read found the connection over (EOF, a reset): its process is gone; the message
    says why."""


class ChannelHost(Protocol):
    """What a channel needs of its transport."""

    closing: bool  #: the transport closes: nothing more is sent

    def on_loop_thread(self) -> bool:
        """Whether the calling thread leads the receiver loop (it must never block)."""

    def want_write(self, ch: "Channel") -> None:
        """``ch``'s socket is full: the loop writes the rest on EVENT_WRITE."""

    def broken(self, ch: "Channel", cause: str) -> None:
        """A write failed: the loop declares the peer dead."""


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


def _writable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` takes bytes within ``timeout`` seconds (no lock is waited for)."""
    p = select.poll()
    try:
        p.register(sock.fileno(), select.POLLOUT)
    except (OSError, ValueError):
        return False  # closed meanwhile: the caller sees the peer's death
    return bool(p.poll(max(1, int(timeout * 1000))))


class Channel:
    """A peer of this transport and the stream to it (module docstring)."""

    def __init__(self, spec: PeerSpec, host: ChannelHost, queue_bytes: int, stats: collections.Counter) -> None:
        self.spec = spec
        self.id = spec.id
        self._host = host
        self._stats = stats
        self.queue_bytes = queue_bytes
        self.state = JOINING  #: JOINING -> UP -> DEAD (final)
        #: its connection was asked for (NOTE [Lazy same-host connections]); under the
        #: transport's join lock
        self.connecting = False
        self.sock: socket.socket | None = None
        self.reader: unix_wire.Reader | None = None
        self.pending: dict[int, Pending] = {}  #: msg_id -> request to this peer
        self.send_lock = threading.Lock()
        self.q_lock = threading.Lock()
        self.room = threading.Condition(self.q_lock)  #: notified when ``qbytes`` falls
        self.outq: collections.deque = collections.deque()  #: (buffers, fds, size) to write
        self.cur: list | None = None  #: [remaining buffers, fds, size] of the message being written
        #: bytes in ``outq`` and ``cur`` (a message counts whole until written); under ``q_lock``;
        #: at most ``queue_bytes`` unless one message alone is larger (NOTE [Send queue bound])
        self.qbytes = 0
        self.waiting = 0  #: threads waiting for room in the queue (under ``q_lock``)
        self.want_write = False
        self.last_rx = 0.0  #: when a byte last arrived (NOTE [Unix liveness])
        self.rx_fds: collections.deque = collections.deque()  #: fds received, not yet claimed
        self.segs: dict[int, Any] = {}  #: segment id -> our mapping of a segment it sent
        self.bye = False  #: it said BYE: its EOF is an orderly close
        #: the largest payload we may send it: the smaller of our max_message_size and the one
        #: it told at admission (0 until then)
        self.limit = 0
        #: why its connection was closed after a protocol error (NOTE [Protocol errors]); "" else.
        #: state is then DEAD (final for the connection) but the peer was not judged dead
        self.closed = ""
        self.bytes_sent = 0
        self.bytes_received = 0
        #: the read token (NOTE [Own reads] in rrefrt_transport.unix.receiver): a thread reads
        #: this channel now; taken and given back under ``_read_mu``
        self.reading = False
        self._read_mu = threading.Lock()
        self.reads_ended = False  #: the connection is over: the read side closes (``end_reads``)
        #: NOTE [Own reads] (7): spins in a row that ended without an answer, and how many
        #: waits skip the spin now (the read token's holder alone updates them)
        self.spin_misses = 0
        self.spin_skip = 0
        #: NOTE [Own reads] (7): how long the last own read waited (for its answer, or its bound)
        self.last_wait = 1.0

    def claim_read(self, if_busy: Callable[[], None] | None = None) -> bool:
        """Take the read token; False: another thread reads this channel now (then
        ``if_busy`` runs under the token's lock: the loop mutes the socket there, so that
        it cannot stay muted after the holder gave the token back)."""
        with self._read_mu:
            if self.reading:
                if if_busy is not None:
                    if_busy()
                return False
            self.reading = True
            return True

    def release_read(self, then: Callable[[], None] | None = None) -> None:
        """Give the token back; ``then`` (unmute the socket) runs under the token's lock. If
        the connection ended meanwhile (``end_reads``), its read side is closed now."""
        if then is None:
            self.reading = False  # one store: a claim under the lock sees either value
        else:
            with self._read_mu:
                self.reading = False
                then()
        if self.reads_ended:  # read after the store: ``end_reads`` sets it before it claims
            self._end_reads_if_free()

    def end_reads(self) -> None:
        """The connection is over: drop a half-read body (NOTE [Large bodies]) and unmap the
        segments it sent (frames still referenced keep theirs until they go). The read side
        is the token holder's: done at once if nobody holds the token, else by the holder
        when it gives the token back (a caller reading its own answer may be decoding a
        message that attached a segment's fd)."""
        self.reads_ended = True
        self._end_reads_if_free()

    def _end_reads_if_free(self) -> None:
        with self._read_mu:
            if self.reading:
                return
            self.reading = True
        try:
            self.reader = None
            self._release_received()
        finally:
            self.reading = False

    def __repr__(self) -> str:
        return f"Channel({self.spec.name!r}, {self.state.value})"

    def open(self, sock: socket.socket, max_body: int, limit: int) -> None:
        """Admission passed: ``sock`` carries messages now (loop thread)."""
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        except OSError:
            pass
        self.sock, self.reader = sock, unix_wire.Reader(max_body)
        self.limit = limit
        self.last_rx = time.monotonic()
        self.state = UP

    # ------------------------------------------------------------------ writing (any thread)
    def idle(self) -> bool:
        """Nothing queued or half written."""
        return not self.outq and self.cur is None

    def room_for(self, nbytes: int, deadline: float | None) -> bool:
        """NOTE [Send queue bound]: wait until ``nbytes`` more fit in the queue (or it is
        empty), at most until ``deadline`` (None: while the peer is up). The waiting thread
        writes the queue itself whenever the socket takes bytes (the receiver thread may be
        busy in a callback). False: the message must not be sent (the deadline passed, the
        peer is gone, or we close)."""
        bound = self.queue_bytes
        if self.qbytes + nbytes <= bound or self._host.on_loop_thread():
            return True
        with self.q_lock:
            self.waiting += 1
        try:
            while self.qbytes and self.qbytes + nbytes > bound:
                if self.state is not UP or self._host.closing:
                    return False
                left = _WAIT if deadline is None else min(_WAIT, deadline - time.monotonic())
                if left <= 0:
                    self._stats["send_queue_full_timeouts"] += 1
                    return False
                if self.send_lock.acquire(blocking=False):
                    try:
                        emptied = self.drain()
                    finally:
                        self.send_lock.release()
                    if emptied is None:
                        return False  # the socket failed: the loop declares the peer gone
                    if not emptied and self.state is UP and self.qbytes + nbytes > bound:
                        if self.sock is not None:
                            _writable(self.sock, left)
                else:  # another thread writes: it notifies when a message is out
                    with self.room:
                        if self.qbytes + nbytes > bound:
                            self.room.wait(min(left, _NUDGE))
        finally:
            with self.q_lock:
                self.waiting -= 1
            if (self.outq or self.cur is not None) and not self.want_write:
                self.try_flush()  # NOTE [Flush hand-over]: the loop may have found the lock ours
        return True

    def write(self, bufs: list, fds: Sequence[int] = (), deadline: float | None = None) -> bool:
        """Write one message now, or queue it behind what is queued (Rule 1 of
        ``rrefrt_transport.unix.transport``, NOTE [Send queue bound]): never waits for a peer
        that does not read (``_write_now``); what the socket does not take is copied (unless
        immutable: bytes) and written on EVENT_WRITE. False if the peer is gone."""
        if not fds and self.state is UP and not self._host.closing and self.send_lock.acquire(blocking=False):
            # the fast path: the lock is free; with nothing queued or half-written ahead of this
            # message (checked under the lock: a message of this thread queued earlier must go
            # first) it is written at once, without a place in the queue
            try:
                direct = not self.outq and self.cur is None
                ok = self._write_now(bufs, deadline) if direct else True
            finally:
                self.send_lock.release()
            if direct:
                if (self.outq or self.cur is not None) and not self.want_write:
                    self.try_flush()  # queued while this thread held the lock (Rule 1)
                return ok
        if self.state is DEAD:
            return False
        snap = [b if _immutable(b) else bytes(b) for b in bufs]
        size = sum(len(b) for b in snap)
        with self.q_lock:
            self.outq.append((snap, fds, size))
            self.qbytes += size
        self.try_flush(force=not self._host.on_loop_thread())
        return self.state is not DEAD

    def _sendmsg(self, sock: socket.socket, bufs: list) -> int:
        """One ``sendmsg`` of ``bufs``: the bytes it took (0 when the socket is full), or -1
        when the socket failed (the peer is then reported broken)."""
        try:
            n = sock.sendmsg(bufs, (), _SEND_FLAGS)
        except BlockingIOError:
            return 0
        except OSError as e:
            self._host.broken(self, f"its socket failed: {e.strerror or e}")
            return -1
        self.bytes_sent += n
        return n

    def _write_now(self, bufs: list, deadline: float | None) -> bool:
        """Write one message directly (send lock held, nothing queued or half-written). A
        sending thread that is not the receiver's goes on writing its own message, zero copy,
        for as long as the socket keeps taking bytes within ``_GRACE`` (the peer reads) and
        ``deadline`` has not passed. The rest becomes ``cur`` (a snapshot: the caller's
        buffers may change once it returns), written on EVENT_WRITE."""
        sock = self.sock
        if sock is None:
            return False
        n = self._sendmsg(sock, bufs)
        if n < 0:
            return False
        if len(bufs) == 1 and type(bufs[0]) is bytes and n == len(bufs[0]):
            return True
        if n == sum([b.nbytes if type(b) is memoryview else len(b) for b in bufs]):
            return True  # the whole message, in more than one buffer
        rest = _advance([b if type(b) is bytes else memoryview(b).cast("B") for b in bufs], n)
        if rest and n and not self._host.on_loop_thread():
            while rest and (deadline is None or time.monotonic() < deadline) and _writable(sock, _GRACE):
                n = self._sendmsg(sock, rest)
                if n < 0:
                    return False
                rest = _advance(rest, n)
        if not rest:
            return True
        self._stats["writes_left_to_loop"] += 1
        rest = [v if _immutable(v) else bytes(v) for v in rest]
        size = sum(len(v) for v in rest)
        with self.q_lock:
            self.qbytes += size
        self.cur = [rest, (), size]
        self._ask_write()
        return True

    def _ask_write(self) -> None:
        """The socket is full: the receiver thread writes the rest on EVENT_WRITE."""
        if not self.want_write:
            self.want_write = True
            self._host.want_write(self)

    def try_flush(self, force: bool = False) -> None:
        """Write what is queued if the send lock is free. ``force``: also when the receiver
        thread already waits for EVENT_WRITE (a sender tries the socket itself: the receiver
        thread may be busy in a callback).

        NOTE [Flush hand-over]: a full socket leaves the rest to the loop (EVENT_WRITE), but
        the loop may take that event while this thread still holds the send lock: its own
        flush then finds the lock taken and leaves, with ``want_write`` cleared. So a holder
        whose drain stopped at a full socket goes round again once it released the lock if
        ``want_write`` was cleared meanwhile: either the socket takes bytes now, or the drain
        asks for EVENT_WRITE anew (found with 64 MB inline messages over TCP: a request
        stranded in the queue with no thread left to write it)."""
        while (self.outq or self.cur is not None) and (force or not self.want_write) and self.state is UP:
            if not self.send_lock.acquire(blocking=False):
                return  # its holder re-checks the queue after releasing
            try:
                emptied = self.drain()
            finally:
                self.send_lock.release()
            if emptied is None or not emptied and (self.want_write or self.state is not UP):
                # broke (reported: the loop declares the peer gone; going round would write
                # to the failed socket again and again, on the loop's own thread), or full
                # with EVENT_WRITE asked for
                return
            force = False  # round again only while nobody waits for EVENT_WRITE

    def drain(self) -> bool | None:
        """Write queued messages (send lock held) until the queue is empty (True) or the
        socket is full (False, after asking for EVENT_WRITE) or broke (None: reported to the
        host, or no socket). Never blocks."""
        sock = self.sock
        if sock is None:
            return None
        while True:
            if self.cur is None:
                if not self.outq:
                    return True
                bufs, fds, size = self.outq.popleft()
                self.cur = [list(bufs), fds, size]
            rest, fds = self.cur[0], self.cur[1]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = sock.sendmsg(rest, anc, _SEND_FLAGS)
                    self.cur[1] = ()
                else:
                    n = sock.sendmsg(rest, (), _SEND_FLAGS)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._host.broken(self, f"its socket failed: {e.strerror or e}")
                return None
            if n:
                self.bytes_sent += n
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
                    done = self.cur[2]
                    self.cur = None
                    with self.q_lock:
                        self.qbytes -= done
                        if self.waiting:
                            self.room.notify_all()
                continue
            self._ask_write()
            return False

    # ------------------------------------------------------------------ reading (loop thread)
    def read_some(self, msgs: list) -> bool:
        """Read until a message is complete or the socket is empty (then return True).
        Raises ChannelLost (EOF, a failed read) or ``unix_wire.ProtocolError``."""
        sock, reader = self.sock, self.reader
        assert sock is not None and reader is not None
        got, drained = 0, False
        try:
            while not msgs:
                target = reader.target()
                try:
                    n, anc, flags, _ = sock.recvmsg_into([target], _ANC)
                except (BlockingIOError, InterruptedError):
                    drained = True
                    break
                except OSError as e:
                    raise ChannelLost(f"its connection failed ({e.strerror or e}): its process is gone") from None
                if anc:
                    for level, typ, data in anc:
                        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                            fds = array.array("i")
                            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                            self.rx_fds.extend(fds)
                if flags & socket.MSG_CTRUNC:  # the kernel dropped fds it sent: no fd number was free
                    raise unix_wire.FdsDropped(
                        "a shared-memory segment's file descriptor it sent could not be received: this "
                        "process has no file descriptor free (RLIMIT_NOFILE: raise it with `ulimit -n`)"
                    )
                if n == 0:
                    raise ChannelLost(
                        "it shut down" if self.bye else "its connection closed: its process exited or was killed"
                    )
                got += n
                self.last_rx = time.monotonic()  # any byte is a sign of life (NOTE [Unix liveness])
                reader.filled(n, msgs)  # raises ProtocolError (NOTE [Protocol errors])
                if n < len(target):
                    # a short read: the socket was empty, so no recv that would only say EAGAIN
                    # (a syscall, and a release of the GIL to the caller's thread, per wake); the
                    # selector is level-triggered and reports what arrives after this read
                    drained = True
                    break
        finally:
            self.bytes_received += got
        return drained

    def bytes_waiting(self) -> bool:
        """Whether bytes wait that the loop has not read yet (it was busy in a callback); an
        EOF or error counts too (the read path reports it with its cause)."""
        assert self.sock is not None
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return True

    def map_segment(self, seg_id: int, attached: bool) -> Any:
        """The mapping of segment ``seg_id`` it sent (its fd came with this message if
        ``attached``). Raises IndexError, KeyError, OSError or ValueError for a segment it
        never sent (NOTE [Protocol errors])."""
        if attached:
            old = self.segs.pop(seg_id, None)
            if old is not None:
                shm.unmap(old)
            fd = self.rx_fds.popleft()
            try:
                self.segs[seg_id] = shm.map_segment(fd)
            finally:
                os.close(fd)
        return self.segs[seg_id]

    def forget_segment(self, seg_id: int) -> None:
        mapping = self.segs.pop(seg_id, None)
        if mapping is not None:
            shm.unmap(mapping)

    # ------------------------------------------------------------------ the end (loop thread)
    def close_socket(self, shutdown_only_if_busy: bool = True) -> None:
        """Shut the socket down; close it unless a sender holds the send lock (it sees the
        shut-down socket fail, and the state DEAD)."""
        sock = self.sock
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not shutdown_only_if_busy:
            sock.close()
        elif self.send_lock.acquire(blocking=False):
            sock.close()
            self.send_lock.release()

    def drop_queue(self) -> None:
        """Forget what is queued; a sender waiting for room sees the end (NOTE [Send queue bound])."""
        with self.room:
            self.outq.clear()
            self.qbytes = 0
            self.room.notify_all()

    def _release_received(self) -> None:
        """Unmap the segments it sent (frames still referenced keep theirs until they go),
        close the fds not yet claimed (read token held)."""
        for mapping in self.segs.values():
            shm.unmap(mapping)
        for fd in self.rx_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.segs.clear()
        self.rx_fds.clear()
