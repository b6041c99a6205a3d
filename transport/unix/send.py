"""The send path of the same-host transport (``rrefrt_transport.unix.transport``, Rule 1 there): checks, shared
memory for large frames, the per-peer queue and send lock, the direct write when the lock is
free and nothing is queued, partial writes and EVENT_WRITE. A mixin of ``UnixTransport``,
split out to keep modules small; it uses that class's state and owns none of its own.
Imports only the standard library and its siblings (never zmq, torch, rrefrt).
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from typing import Any, Sequence

from rrefrt_transport.unix import shm

from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.errors import AgentClosed, MessageTooLarge

_SEND_FLAGS = socket.MSG_NOSIGNAL
_WAIT = 0.05  #: slice of a blocked sender's wait, between checks that the peer is still alive

#: this process's pid, kept current across fork (a per-request getpid() was a syscall per call)
_PID = os.getpid()


def _after_fork() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class Send:
    # ------------------------------------------------------------------ sending
    def _check_usable(self: Any) -> None:
        if _PID != self._pid:
            raise AgentClosed(f"the transport of worker {self.name!r} was created in another process (fork)")
        if self._closing:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed")

    def _check_size(self: Any, frames: Sequence[Any]) -> None:
        if not frames:
            return
        if len(frames) == 1 and type(frames[0]) is bytes:  # the common case: one small frame
            if len(frames[0]) <= self.config.max_message_size:
                return
        total = sum(f.nbytes if isinstance(f, memoryview) else len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in frames)
        if total > self.config.max_message_size:
            raise MessageTooLarge(f"message of {total} bytes exceeds the limit of {self.config.max_message_size} bytes")

    def _send_app(self: Any, peer: Any, kind: int, msg_id: int, meta: Any, frames: Sequence[Any], label: str) -> None:
        hook = self.fault_hook
        if hook is not None:
            bufs = unix_wire.encode(kind, msg_id, meta, [bytes(memoryview(f).cast("B")) for f in frames])
            for delay in hook(peer.spec.id, label):
                if delay <= 0:
                    self._write(peer, bufs, ())
                else:
                    self._push_timer(time.monotonic() + delay, lambda: self._write(peer, bufs, (), block=False))
            return
        if not frames or (
            len(frames) == 1 and type(frames[0]) is bytes and (n := len(frames[0])) < unix_wire.SMALL_FRAME
            and (n < self.shm_threshold or not self.shm_threshold)
        ):  # the common case (a call or an answer): nothing for shared memory, nothing to cast
            self._write(peer, unix_wire.encode(kind, msg_id, meta, frames), ())
            return
        views = [f if isinstance(f, bytes) else memoryview(f).cast("B") for f in frames]
        big = [v for v in views if self.shm_threshold and len(v) >= self.shm_threshold]
        if not big:
            self._write(peer, unix_wire.encode(kind, msg_id, meta, views), ())
            return
        flags = [bool(self.shm_threshold) and len(v) >= self.shm_threshold for v in views]
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
        if not self._write(peer, bufs, (seg.fd,) if attach else ()):
            self._pool.peer_gone(peer.spec.id)

    def _write(self: Any, peer: Any, bufs: list, fds: Sequence[int], block: bool = True) -> bool:
        """Queue one message to ``peer`` and write it (Rule 1). False if the peer is gone.

        On the receiver thread (a callback answering at once) the write never blocks: what
        the socket does not take now is snapshot and written on EVENT_WRITE, so two
        processes answering each other from their receiver threads cannot wait on each
        other's full sockets with nobody reading."""
        if block and threading.get_ident() == self._lead.leader:
            block = False
        if not fds and peer.state == "up" and not self._closing and peer.send_lock.acquire(blocking=False):
            # the fast path: the lock is free; with nothing queued or half-written ahead of this
            # message (checked under the lock: a message of this thread queued earlier must go
            # first) it is written at once, without a place in the queue
            try:
                direct = not peer.outq and peer.cur is None
                ok = self._write_now(peer, bufs, block) if direct else True
            finally:
                peer.send_lock.release()
            if direct:
                if (peer.outq or peer.cur is not None) and not peer.want_write:
                    self._try_flush(peer)  # queued while this thread held the lock (Rule 1)
                if ok and block:
                    self._n_sent += 1
                return ok
        if not block:
            bufs = [b if isinstance(b, bytes) else bytes(b) for b in bufs]
        with peer.q_lock:
            peer.queued += 1
            seq = peer.queued
            peer.outq.append((seq, bufs, fds))
        if not block:
            self._try_flush(peer)
            return True
        while peer.written < seq:
            if peer.state == "dead" or self._closing:
                return False
            if peer.send_lock.acquire(timeout=_WAIT):
                try:
                    ok = self._drain(peer, seq)
                finally:
                    peer.send_lock.release()
                if not ok:
                    return False
        if (peer.outq or peer.cur is not None) and not peer.want_write:
            self._try_flush(peer)
        self._n_sent += 1
        return True

    def _write_now(self: Any, peer: Any, bufs: list, block: bool) -> bool:
        """Write one message directly (send lock held, nothing queued or half-written). What
        the socket does not take becomes ``peer.cur`` with the seq already written, so that
        finishing it moves ``written`` for nobody; it is finished here (``block``) or, never
        blocking, on EVENT_WRITE (a snapshot of the rest: the caller's buffers may change)."""
        sock = peer.sock
        if sock is None:
            return False
        try:
            n = sock.sendmsg(bufs, (), _SEND_FLAGS)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._broken(peer, f"its socket failed: {e.strerror or e}")
            return False
        self._bytes_sent += n
        if len(bufs) == 1 and type(bufs[0]) is bytes:
            if n == len(bufs[0]):
                return True
            rest = [memoryview(bufs[0])[n:]]
        else:
            rest = []
            for b in bufs:
                v = b if type(b) is bytes else memoryview(b).cast("B")
                if n >= len(v):
                    n -= len(v)
                    continue
                rest.append(memoryview(v)[n:] if n else v)
                n = 0
            if not rest:
                return True
        if not block:
            rest = [bytes(v) for v in rest]
        peer.cur = [peer.written, rest, ()]
        return self._drain(peer, peer.written if block else None)

    def _try_flush(self: Any, peer: Any) -> None:
        while (peer.outq or peer.cur is not None) and not peer.want_write and peer.state == "up":
            if not peer.send_lock.acquire(blocking=False):
                return  # its holder re-checks the queue after releasing
            try:
                ok = self._drain(peer, None)
            finally:
                peer.send_lock.release()
            if not ok:
                return  # broken: the receiver thread declares the peer dead

    def _drain(self: Any, peer: Any, until: int | None) -> bool:
        """Write queued messages (send lock held). ``until``: block until that seq is written;
        None: never block, ask for EVENT_WRITE when the socket is full."""
        sock = peer.sock
        if sock is None:
            return False
        while True:
            if peer.cur is None:
                if until is not None and peer.written >= until:
                    return True
                if not peer.outq:
                    return True
                seq, bufs, fds = peer.outq.popleft()
                peer.cur = [seq, [memoryview(b).cast("B") if not isinstance(b, bytes) else b for b in bufs], fds]
            seq, rest, fds = peer.cur
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = sock.sendmsg(rest, anc, _SEND_FLAGS)
                    peer.cur[2] = ()
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
                if not rest:
                    peer.written = seq
                    peer.cur = None
                continue
            if until is None:
                if not peer.want_write:
                    peer.want_write = True
                    self._watch_needed = True
                    self._ring()
                return True
            if peer.state == "dead" or self._closing:
                return False
            self._wait_writable(sock)

    @staticmethod
    def _wait_writable(sock: socket.socket) -> None:
        import select

        p = select.poll()
        p.register(sock.fileno(), select.POLLOUT)
        p.poll(int(_WAIT * 1000))

    def _broken(self: Any, peer: Any, cause: str) -> None:
        self._call_soon(lambda: self._declare_dead(peer, cause))
