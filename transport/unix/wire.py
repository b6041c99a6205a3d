"""How messages are laid out on a same-host AF_UNIX stream, and how a connection is admitted.

Owns: the admission handshake (fixed binary records, never msgpack: nothing a peer sends is
decoded before it is admitted), the framing of a message on the stream, and the
incremental reader that cuts the stream back into messages.

Admission (NOTE [Same-host admission] in docs/same-host.md), connector C, acceptor A::

    C -> A  HELLO    magic "RRU3" | id u32 | incarnation u64 | limit u64 | nonce_c 32 bytes
    A -> C  WELCOME  magic "RRU3" | id u32 | incarnation u64 | limit u64 | nonce_s 32 | mac_a 32
    C -> A  PROOF    mac_c 32
    A -> C  ADMIT    b"OK!!"

    mac_x = HMAC-SHA256(secret, label_x | nonce_c | nonce_s | id_c | inc_c | limit_c | id_a | inc_a | limit_a)
    with label "rrefrt-unix-acceptor" / "rrefrt-unix-connector" (secret b"" when none).

``limit`` is the sender's ``max_message_size``: the largest payload (the sum of a message's
frames) it accepts. Each side refuses, at the call site, a message over the other's limit
(``MessageTooLarge``), as the zmq transport does with the limit in its HELLO; the MACs
cover both limits.

Both sides also check SO_PEERCRED (the peer's uid must be ours) before reading a byte.

A message on the stream (little endian)::

    u32 header_len | u16 n_frames | u8 flags | u8 pad
    n_frames x u64  frame length; bit 63 set = the frame is in shared memory
    if flags & SHM:  u32 segment id | u8 fd attached | 3 pad | u64 lease
    header (header_len bytes: wire.encode_header's msgpack array)
    the inline frames, in order

Frames in shared memory are laid out by ``shm.layout`` in the named segment; the fd of a
segment rides (SCM_RIGHTS) on the first message that uses it on this connection. The
receiver returns a segment by a mark in the segment, not by a message (NOTE [Segments] (5)
in ``shm``).

Transport kinds of this transport beside wire's HELLO/HELLO_ACK/PING/RESPONSE (1-4):

    kind             meta                    meaning
    SHM_FORGET (9)   [segment id, ...]       the sender closed these segments: drop their fds
    BYE (10)         None                    orderly close: the peer is going away
    CLOSE (11)       [cause]                 the sender closes this connection after a
                                             protocol error in what it read (NOTE
                                             [Protocol errors] in rrefrt_transport.unix.transport),
                                             or gives this plane up (``abandon``): the
                                             connection ends, not the peer; both go on
                                             over the composite's inner transport
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import hmac
import mmap
import os
import secrets
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from rrefrt_transport import wire

SHM_FORGET, BYE, CLOSE = 9, 10, 11

MAGIC = b"RRU3"
_ID = struct.Struct("<4sIQQ32s")  # magic, id, incarnation, limit (max_message_size), nonce
HELLO_LEN = _ID.size
WELCOME_LEN = _ID.size + 32
PROOF_LEN = 32
ADMIT = b"OK!!"

_PREFIX = struct.Struct("<IHBx")
_SHMDESC = struct.Struct("<IB3xQ")
_LEN = struct.Struct("<Q")
_PREFIX_1 = struct.Struct("<IHBxQ")  #: the prefix and table of a message with one frame
#: a frame of at most this many bytes is copied into the message's first buffer by encode
SMALL_FRAME = 4096
#: ... and so are the frames of a message with several, if they add up to at most this many
JOIN_FRAMES = 16384
FLAG_SHM = 1
SHM_BIT = 1 << 63


class ProtocolError(ValueError):
    """An admitted connection broke the framing: it is closed, its peer is not judged dead
    (NOTE [Protocol errors] in rrefrt_transport.unix.transport)."""

    def cause(self) -> str:
        """Why the connection is closed, as its close and the log say it."""
        return f"it broke the same-host framing ({self})"


class FdsDropped(ProtocolError):
    """The kernel dropped file descriptors the peer sent (``MSG_CTRUNC``): this process had
    none free. Closed the same way; the cause is ours, not the peer's."""

    def cause(self) -> str:
        return str(self)


# ------------------------------------------------------------------ admission
def hello(my_id: int, my_inc: int, my_limit: int) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(32)
    return _ID.pack(MAGIC, my_id, my_inc, my_limit, nonce), nonce


def parse_id(raw: bytes) -> tuple[int, int, int, bytes]:
    """(id, incarnation, limit, nonce) of a HELLO or of the start of a WELCOME."""
    magic, wid, inc, limit, nonce = _ID.unpack(raw[: _ID.size])
    if magic != MAGIC:
        raise ProtocolError("not an rrefrt same-host peer (or one of another version)")
    return wid, inc, limit, nonce


def mac(secret: bytes | None, role: str, nonce_c: bytes, nonce_s: bytes, c: tuple[int, int, int],
        a: tuple[int, int, int]) -> bytes:
    """``c`` and ``a``: (id, incarnation, limit) of the connector and of the acceptor."""
    label = b"rrefrt-unix-acceptor" if role == "acceptor" else b"rrefrt-unix-connector"
    msg = label + nonce_c + nonce_s + struct.pack("<IQQIQQ", *c, *a)
    return hmac.new(secret or b"", msg, hashlib.sha256).digest()


def welcome(my_id: int, my_inc: int, my_limit: int, nonce_s: bytes, mac_a: bytes) -> bytes:
    return _ID.pack(MAGIC, my_id, my_inc, my_limit, nonce_s) + mac_a


# ------------------------------------------------------------------ framing
def encode(
    kind: int, msg_id: int, meta: Any, frames: Sequence[Any], shm: tuple[int, bool, Sequence[bool], int] | None = None
) -> list[Any]:
    """The buffers of one message: [prefix+table+header, *inline frames]. ``frames`` are
    byte views; with ``shm`` = (segment id, fd attached, in-segment flag per frame, lease) the
    flagged frames are not sent (the caller copied them into the segment) but keep their
    place in the table, so the receiver rebuilds the frames in their original order."""
    header = wire.encode_header(kind, msg_id, meta)
    if shm is None and len(frames) <= 1:  # fast path: a call or answer, a control message
        if not frames:
            return [_PREFIX.pack(len(header), 0, 0) + header]
        f = frames[0]
        n = len(f)
        head = _PREFIX_1.pack(len(header), 1, 0, n)
        if n <= SMALL_FRAME:  # one buffer: one iovec for sendmsg, one copy of a few bytes
            return [b"".join((head, header, f))]
        return [head + header, f]
    if shm is None:
        lens = [len(f) for f in frames]
        table = b"".join([_LEN.pack(n) for n in lens])
        head = _PREFIX.pack(len(header), len(frames), 0) + table + header
        if sum(lens) <= JOIN_FRAMES:  # one buffer, one iovec: a call with a small tensor
            return [b"".join([head, *frames])]
        return [head, *(f for f in frames if len(f))]
    flags = shm[2]
    table = b"".join(_LEN.pack(len(f) | SHM_BIT if s else len(f)) for f, s in zip(frames, flags))
    parts = [_PREFIX.pack(len(header), len(frames), FLAG_SHM if shm else 0), table]
    if shm is not None:
        parts.append(_SHMDESC.pack(shm[0], 1 if shm[1] else 0, shm[3]))
    parts.append(header)
    return [b"".join(parts), *(f for f, s in zip(frames, flags) if not s and len(f))]


@dataclass(slots=True)
class Incoming:
    """A message cut from the stream; the header is still undecoded."""

    header: bytes
    frames: list[Any]  #: every frame in order; None where the frame is in shared memory
    shm_sizes: Sequence[int] = ()  #: sizes of those, in order
    seg_id: int = 0
    fd_attached: bool = False
    lease: int = 0  #: of the segment, for this message (NOTE [Segments] (5) in shm.py)


_ALIGN = 64  #: NOTE [Large bodies]: where the largest frame of a large body starts
_MAP_BODIES = 32 << 20  #: NOTE [Large bodies]: glibc's largest mmap threshold
_MAP_ROUND = 1 << 20  #: NOTE [Large bodies]: mappings are whole MiBs (a slightly larger body reuses one)


class BodyPool:
    """NOTE [Large bodies]: anonymous mappings that hold large bodies, each taken back once
    neither the frames cut from it nor anything built on them (a tensor) is referenced, and
    kept (up to ``max_idle`` bytes) for the next body of about its size: its pages are
    resident, so the socket fills it without a page fault per 4 KB (writing 64 MB into a
    fresh mapping took 30 ms here, into a resident one 6 ms). Any thread may drop the last
    frame, at any moment (a garbage collection, inside ``take`` too): the finalizer only
    appends to a deque, and ``take`` sorts what came back under its lock."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._idle: list[mmap.mmap] = []
        self._idle_bytes = 0
        self._returned: collections.deque = collections.deque()  #: given back, not sorted yet
        #: bytes in ``_returned`` (approximate between two ``take``: finalizers add to it
        #: without the lock; ``take`` sets it again)
        self._returned_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  #: bodies placed in a kept mapping (tests)
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it

    def take(self, n: int) -> memoryview:
        """A writable byte view of ``n`` bytes at the start of a page-aligned mapping."""
        size = -(-n // _MAP_ROUND) * _MAP_ROUND
        m = None
        with self._lock:
            while self._returned:
                back = self._returned.popleft()
                if self._idle_bytes + len(back) <= self.max_idle:
                    self._idle.append(back)
                    self._idle_bytes += len(back)
            self._returned_bytes = 0
            for i in range(len(self._idle)):
                if size <= len(self._idle[i]) <= size + (size >> 2):
                    m = self._idle.pop(i)
                    self._idle_bytes -= len(m)
                    self.reused += 1
                    break
        if m is None:
            m = mmap.mmap(-1, size)
        holder = (ctypes.c_char * n).from_buffer(m)
        weakref.finalize(holder, self._give_back, m)
        return memoryview(holder).cast("B")

    def _give_back(self, m: mmap.mmap) -> None:
        """The last view of ``m`` went (any thread, any moment): keep it for ``take`` if the
        pool has room (no lock: see the class), else let it go (unmapped with its exporter)."""
        if self._idle_bytes + self._returned_bytes + len(m) <= self.max_idle:
            self._returned_bytes += len(m)
            self._returned.append(m)


#: NOTE [Large bodies]: this process's pool (every channel's reader takes from it)
BODIES = BodyPool(160 << 20)


class Reader:
    """Cuts a byte stream into ``Incoming`` messages. Small messages are parsed out of one
    reusable buffer; a message with a large body gets its own bytearray that the socket
    reads straight into (its frames alias it: no copy after the kernel's)."""

    BUF = 1 << 18
    BIG = 1 << 16

    def __init__(self, max_body: int) -> None:
        self.buf = bytearray(self.BUF)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.max_body = max_body
        self.big: Any = None  #: the buffer (a view) that holds a large message's body being filled
        self.big_view: memoryview | None = None
        self.big_fill = 0
        self.big_meta: tuple | None = None

    def target(self) -> memoryview:
        """Where the next recv should write."""
        if self.big_view is not None:
            return self.big_view[self.big_fill :]
        if self.end == len(self.buf):
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        return self.view[self.end :]

    def filled(self, n: int, out: list[Incoming]) -> None:
        """``n`` bytes were written at ``target()``; append complete messages to ``out``."""
        if self.big_view is not None:
            self.big_fill += n
            if self.big_fill == len(self.big_view):
                self._finish_big(out)
            return
        self.end += n
        while self._parse_one(out):
            pass

    def _parse_one(self, out: list[Incoming]) -> bool:
        avail = self.end - self.start
        if avail < _PREFIX.size:
            return False
        s = self.start
        hlen, nfr, flags, = _PREFIX.unpack_from(self.buf, s)
        if hlen > wire.MAX_HEADER_BYTES or nfr > wire.MAX_FRAMES:
            raise ProtocolError("message prefix out of bounds")
        if nfr == 1 and not flags and avail >= _PREFIX_1.size:  # fast path: one inline frame, whole
            n = _PREFIX_1.unpack_from(self.buf, s)[3]
            b0 = s + _PREFIX_1.size
            if not n & SHM_BIT and avail - _PREFIX_1.size >= hlen + n and hlen + n <= self.max_body:
                view = self.view
                f0 = b0 + hlen
                # bytes, not views: the pickle stream is read through BytesIO, which shares bytes
                out.append(Incoming(bytes(view[b0:f0]), [bytes(view[f0 : f0 + n])]))
                self.start = f0 + n
                return True
        table = _PREFIX.size + 8 * nfr + (_SHMDESC.size if flags & FLAG_SHM else 0)
        if table > len(self.buf):
            raise ProtocolError("message table too large")
        if avail < table:
            return False
        lens = [x[0] for x in _LEN.iter_unpack(self.buf[s + _PREFIX.size : s + _PREFIX.size + 8 * nfr])]
        inline = [n if not n & SHM_BIT else -1 for n in lens]
        shm_sizes = [n & ~SHM_BIT for n in lens if n & SHM_BIT]
        seg_id, fd_att, lease = 0, False, 0
        if flags & FLAG_SHM:
            seg_id, att, lease = _SHMDESC.unpack_from(self.buf, s + table - _SHMDESC.size)
            fd_att = bool(att)
        body = hlen + sum(n for n in inline if n > 0)
        if body > self.max_body:
            raise ProtocolError("message larger than the size limit")
        meta = (hlen, inline, shm_sizes, seg_id, fd_att, lease)
        if avail - table >= body:
            b0 = s + table
            self.start = b0 + body
            if not shm_sizes and body < self.BIG:
                # NOTE [Small frames own their bytes]: the header and the first frame (a
                # payload's pickle stream) as bytes, each further frame (a tensor's bytes) a
                # bytearray of its own: writable and aligned, so a tensor is rebuilt over it
                # without another copy; one copy out of the read buffer per frame, no slices
                view = self.view
                f0 = b0 + hlen
                frames: list[Any] = []
                for n in inline:
                    frames.append(bytes(view[f0 : f0 + n]) if not frames else bytearray(view[f0 : f0 + n]))
                    f0 += n
                out.append(Incoming(bytes(view[b0 : b0 + hlen]), frames))
                return True
            raw = bytes(self.view[b0 : b0 + body])
            out.append(self._cut(raw, meta))
            return True
        if body + table <= len(self.buf) - s or body < self.BIG:
            if s > 0 and table + body > len(self.buf) - s:  # make room by compacting
                n = self.end - s
                self.buf[:n] = self.buf[s : self.end]
                self.start, self.end = 0, n
            return False
        # NOTE [Large bodies]: the body placed so that its largest frame starts on a 64-byte
        # boundary: a tensor is rebuilt over it without a copy (the frames follow the
        # header, so they are rarely aligned by chance; before this a 64 MB float tensor
        # over the tcp stream plane was cloned on receipt). From ``_MAP_BODIES`` on, in a
        # mapping of ``BODIES``: a bytearray of that size (malloc maps it afresh) took a
        # page fault per 4 KB as the socket filled it, and a memset
        pos, at, largest = hlen, hlen, 0
        for n in inline:
            if n > largest:
                at, largest = pos, n
            pos += max(n, 0)
        if body >= _MAP_BODIES:
            whole = BODIES.take(body + _ALIGN)
            base = 0  # page-aligned
        else:  # the heap (malloc reuses freed blocks of this size: no page faults per message)
            whole = memoryview(bytearray(body + _ALIGN))
            base = ctypes.addressof(ctypes.c_char.from_buffer(whole.obj))
        pad = -(base + at) % _ALIGN
        view = whole[pad : pad + body]
        have = avail - table
        view[:have] = self.view[s + table : self.end]
        self.start = self.end = 0
        self.big, self.big_view, self.big_fill, self.big_meta = whole, view, have, meta
        return False

    def _finish_big(self, out: list[Incoming]) -> None:
        big, meta = self.big_view, self.big_meta
        self.big = self.big_view = self.big_meta = None
        self.big_fill = 0
        assert big is not None and meta is not None
        out.append(self._cut(big, meta))

    @staticmethod
    def _cut(raw: Any, meta: tuple) -> Incoming:
        hlen, inline, shm_sizes, seg_id, fd_att, lease = meta
        mv = memoryview(raw)
        frames, pos = [], hlen
        for n in inline:
            if n < 0:
                frames.append(None)
            else:
                frames.append(mv[pos : pos + n])
                pos += n
        return Incoming(bytes(mv[:hlen]), frames, shm_sizes, seg_id, fd_att, lease)
