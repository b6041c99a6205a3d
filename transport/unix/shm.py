"""Pooled shared-memory segments for large frames between processes of one host.

Owns: the sender's pool of memfd segments (created, pre-faulted, lent, returned, closed) and
the receiver's mapping of a segment it was sent (frames that alias it, and the mark it
leaves when the last of them is gone).

NOTE [Segments]:

1. A segment is an anonymous ``memfd_create`` file (no name in /dev/shm, nothing on any
   file system): it exists while some process holds its fd or a mapping of it, so it can
   never outlive the processes of the job, whatever kills them. Its fd travels to a peer
   once (SCM_RIGHTS, on the first message that uses it); later messages name it by id.
2. The sender copies a message's large frames into one segment (each frame at a
   page-aligned offset): that is the only copy end to end. The receiver maps a segment
   once, whole, when its fd arrives (``MAP_POPULATE``: page tables filled in one go, no
   fault per page later), and a message's frames are memoryviews of that mapping through
   one small exporter object per message (a ctypes array over the used bytes: a plain
   memoryview cannot say when its last derived view died). When that exporter is freed
   (the runtime dropped the frames and whatever it built on them) ``weakref.finalize``
   fires and the receiver marks the segment released in the segment itself (5); the
   sender takes it back into its pool when it next needs one. A receiver that is told to
   copy out (``copy_out``) copies the frames and marks the segment at once.
3. A segment lent to a peer comes back when its mark says so. When that peer dies or its
   connection closes first, the segment is closed on our side instead and never lent
   again (``peer_gone``): a peer whose connection closed may go on running (its plane was
   abandoned, or it was fenced while stopped and resumed) with views of the segment in
   tensors it holds; lent to anyone else, the segment would show that peer another
   message's bytes, and what it writes into its tensors would land in that message. Its
   pages live on in the peer's mappings until they go (or the peer exits). The pool keeps
   at most ``max_idle_bytes`` of idle segments; a segment returned beyond that is closed,
   and peers that hold its fd are told to forget it (``SHM_FORGET``), as are the other
   holders of a segment closed for a gone peer.
4. Segments are pre-faulted when created (``posix_fallocate`` allocates the shmem pages),
   and sized in powers of two from ``MIN_SEGMENT`` so that a pool serves varying sizes.
5. Release marks, not messages. Past a segment's frames (its ``size``) lies one cache line
   (``TRAILER``) of two 64-bit words: the lease, which the sender writes when it lends the
   segment (a number that grows with every lease; the message names it too), and the
   release, where the receiver writes the message's lease once the last view of its
   frames is gone. The sender reclaims a lent segment whose release equals its lease when
   no idle segment fits a send (``acquire``) and on every heartbeat (``sweep``, which also
   closes what exceeds the idle cap); ``lent`` does not count marked ones. So a release
   costs the receiver one store - no message, no wake-up of either side's loop - where a
   1 MB round trip used to carry two SHM_RELEASE messages, each waking a sleeping loop,
   and the caller could not read its own answer because the callee's release followed it
   (NOTE [Own reads] in ``receiver``; A/B: 0.95x the time for 0.89x the CPU per call). A
   receiver refuses a message whose lease is not the segment's now, and marks with the
   message's lease: so a message or a mark that outlived its lease (a bug, a crafted
   message) never reads another message's bytes nor returns a segment lent since.
   Order: the receiver stores its release after its last read of the frames, the sender
   reads the release before it writes the segment again (x86's order for these; between
   processes on one host).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger("rrefrt.transport")

PAGE = mmap.PAGESIZE
MIN_SEGMENT = 1 << 20
#: NOTE [Segments] (5): bytes past a segment's frames: its lease and release words
TRAILER = 64
_WORD = struct.Struct("<Q")
#: where the two words sit, counted back from the end of the segment (both sides map it whole)
_LEASE_BACK, _RELEASE_BACK = 16, 8


def align(n: int) -> int:
    return (n + PAGE - 1) & ~(PAGE - 1)


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Page-aligned offsets of frames of ``sizes`` packed in one segment, and the bytes used."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = align(end + n)
    return offsets, max(end, PAGE)


def _size_class(n: int) -> int:
    size = MIN_SEGMENT
    while size < n:
        size <<= 1
    return size


def lease_of(mapping: mmap.mmap) -> int:
    """The lease a sender wrote past the frames of the segment ``mapping`` maps."""
    return _WORD.unpack_from(mapping, len(mapping) - _LEASE_BACK)[0]


def released_lease(mapping: mmap.mmap) -> int:
    """The lease its receiver last marked released."""
    return _WORD.unpack_from(mapping, len(mapping) - _RELEASE_BACK)[0]


def mark_released(mapping: mmap.mmap, lease: int) -> None:
    """The receiver: every frame of lease ``lease`` of this segment is gone (NOTE [Segments]
    (5)). A mapping already closed (its sender closed the segment) takes no mark."""
    try:
        _WORD.pack_into(mapping, len(mapping) - _RELEASE_BACK, lease)
    except (ValueError, TypeError):  # (what a closed mmap raises: its length, its buffer)
        pass


@dataclass(eq=False)
class Segment:
    id: int
    fd: int
    size: int  #: bytes for frames; the file has ``TRAILER`` more
    map: mmap.mmap
    #: peers this segment's fd was sent to (they may map it by id from then on)
    known_by: set[int] = field(default_factory=set)
    #: peer it is lent to now; None while idle in the pool
    lent_to: int | None = None
    lease: int = 0  #: the number of its current (or last) lease

    def released(self) -> bool:
        """Its receiver marked the current lease released."""
        return released_lease(self.map) == self.lease


class SegmentPool:
    """The sender side: segments lent to peers and reclaimed once released. Thread-safe."""

    def __init__(self, name: str, max_idle_bytes: int = 256 << 20) -> None:
        self._name = name
        self._max_idle = max_idle_bytes
        self._lock = threading.Lock()
        self._next_id = 1
        self._leases = 0
        self._idle: dict[int, list[Segment]] = {}  #: size class -> idle segments
        self._idle_bytes = 0
        self._all: dict[int, Segment] = {}  #: id -> every live segment
        self._lent: dict[int, Segment] = {}  #: id -> segments lent now
        #: (peer, segment id) of segments closed by ``acquire``: ``sweep`` hands them on
        self._forget: list[tuple[int, int]] = []
        self._dropped = 0  #: segments closed because their peer went before marking them
        self._closed = False

    def acquire(self, nbytes: int, peer: int) -> Segment:
        """A segment of at least ``nbytes``, lent to ``peer`` until it marks it released."""
        size = _size_class(nbytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("segment pool closed")
            seg = self._idle_fit(size)
            if seg is None and self._lent:
                self._forget += self._reclaim()
                seg = self._idle_fit(size)
            if seg is not None:
                self._lend(seg, peer)
                return seg
            seg_id = self._next_id
            self._next_id += 1
        seg = self._create(seg_id, size)
        with self._lock:
            if self._closed:
                self._destroy(seg)
                raise RuntimeError("segment pool closed")
            self._all[seg_id] = seg
            self._lend(seg, peer)
        return seg

    def _idle_fit(self, size: int) -> Segment | None:
        for cls in (size, size * 2, size * 4):  # a larger idle segment serves too
            free = self._idle.get(cls)
            if free:
                seg = free.pop()
                self._idle_bytes -= seg.size
                return seg
        return None

    def _lend(self, seg: Segment, peer: int) -> None:
        self._leases += 1
        seg.lease = self._leases
        _WORD.pack_into(seg.map, len(seg.map) - _LEASE_BACK, seg.lease)
        seg.lent_to = peer
        self._lent[seg.id] = seg

    def _create(self, seg_id: int, size: int) -> Segment:
        fd = os.memfd_create(f"rrefrt-{self._name}-{seg_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size + TRAILER)
            os.posix_fallocate(fd, 0, size + TRAILER)  # allocate the pages now, not on first touch
            m = mmap.mmap(fd, size + TRAILER, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                          mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return Segment(seg_id, fd, size, m)

    def _reclaim(self) -> list[tuple[int, int]]:
        """Under the lock: every lent segment marked released goes back (NOTE [Segments] (5))."""
        forget: list[tuple[int, int]] = []
        for seg in [s for s in self._lent.values() if s.released()]:
            forget += self._unlend(seg)
        return forget

    def _unlend(self, seg: Segment) -> list[tuple[int, int]]:
        del self._lent[seg.id]
        seg.lent_to = None
        return self._park(seg)

    def sweep(self) -> list[tuple[int, int]]:
        """Reclaim what receivers released. Returns (peer, segment id) pairs of segments
        closed since the last sweep, which those peers should forget."""
        with self._lock:
            forget, self._forget = self._forget, []
            if self._lent:
                forget += self._reclaim()
            return forget

    def _park(self, seg: Segment) -> list[tuple[int, int]]:
        if self._closed or self._idle_bytes + seg.size > self._max_idle:
            del self._all[seg.id]
            forget = [(p, seg.id) for p in seg.known_by]
            self._destroy(seg)
            return forget
        self._idle.setdefault(seg.size, []).append(seg)
        self._idle_bytes += seg.size
        return []

    def peer_gone(self, peer: int) -> list[tuple[int, int]]:
        """``peer`` died or its connection closed: no segment is known by it any more; one
        lent to it comes back if it marked it released, and is closed otherwise (NOTE
        [Segments] (3): it may still hold views of it)."""
        forget: list[tuple[int, int]] = []
        with self._lock:
            for seg in list(self._all.values()):
                seg.known_by.discard(peer)
                if seg.lent_to == peer:
                    forget += self._unlend(seg) if seg.released() else self._drop(seg)
        return [f for f in forget if f[0] != peer]

    def _drop(self, seg: Segment) -> list[tuple[int, int]]:
        """Under the lock: close lent ``seg`` for good; its other holders are to forget it."""
        del self._lent[seg.id]
        del self._all[seg.id]
        seg.lent_to = None
        self._dropped += 1
        self._destroy(seg)
        return [(p, seg.id) for p in seg.known_by]

    def dropped(self) -> int:
        """Segments closed because the peer they were lent to went before marking them."""
        return self._dropped

    def lent(self) -> int:
        """Segments lent now and not yet marked released."""
        with self._lock:
            return sum(1 for s in self._lent.values() if not s.released())

    def count(self) -> int:
        with self._lock:
            return len(self._all)

    @staticmethod
    def _destroy(seg: Segment) -> None:
        try:
            seg.map.close()
        except BufferError:  # a view is still being filled by a sender: unmapped when it goes
            pass
        os.close(seg.fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = list(self._all.values())
            self._all.clear()
            self._idle.clear()
            self._lent.clear()
            self._idle_bytes = 0
        for seg in segs:
            self._destroy(seg)


def map_segment(fd: int) -> mmap.mmap:
    """The receiver side: map a segment a peer sent, whole and once (page tables filled now,
    ``MAP_POPULATE``); ``fd`` may be closed afterwards (the mapping keeps its own)."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)


def frames_of(
    mapping: mmap.mmap, sizes: Sequence[int], lease: int, copy_out: bool = False
) -> list[memoryview | bytes]:
    """Frames of ``sizes`` laid out by ``layout`` in a mapped segment, lent under ``lease``
    (the message says which).

    The frames alias the mapping through one small per-message exporter (a ctypes array
    over the used bytes); the segment is marked released (NOTE [Segments] (5)) - on
    whichever thread drops the last view - once neither the frames nor anything built on
    them (a memoryview, a numpy array, a tensor) is referenced any more. With ``copy_out``
    the frames are copied out and the segment marked before returning. Raises ValueError
    for frames that do not fit the segment and for a lease that is not the segment's now
    (a peer that broke the protocol: NOTE [Segments] (5))."""
    offsets, used = layout(sizes)
    if used > len(mapping) - TRAILER:
        raise ValueError(f"frames of {used} bytes in a segment of {len(mapping) - TRAILER}")
    if lease_of(mapping) != lease:
        raise ValueError(f"lease {lease} of the message is not the segment's now ({lease_of(mapping)})")
    if copy_out:
        try:
            return [mapping[o : o + n] for o, n in zip(offsets, sizes)]
        finally:
            mark_released(mapping, lease)
    holder = (ctypes.c_char * used).from_buffer(mapping)
    weakref.finalize(holder, mark_released, mapping, lease)
    whole = memoryview(holder).cast("B")
    frames: list[memoryview | bytes] = [whole[o : o + n] for o, n in zip(offsets, sizes)]
    return frames


def unmap(mapping: mmap.mmap) -> None:
    """Drop a received segment's mapping now, or when the last frame aliasing it goes."""
    try:
        mapping.close()
    except BufferError:
        pass


def count_memfds(pid: int | None = None) -> int:
    """How many memfd segments process ``pid`` (default: this one) holds open (tests)."""
    base = f"/proc/{pid or os.getpid()}/fd"
    n = 0
    for name in os.listdir(base):
        try:
            if os.readlink(f"{base}/{name}").startswith("/memfd:rrefrt-"):
                n += 1
        except OSError:
            pass
    return n
