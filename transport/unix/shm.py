"""Pooled shared-memory segments for large frames between processes of one host.

Owns: the sender's pool of memfd segments (created, pre-faulted, lent, returned, closed) and
the receiver's mapping of a segment it was sent (frames that alias it, and the callback
that fires when the last of them is released).

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
   fires and the receiver tells the sender (``SHM_RELEASE``), which puts the segment back
   in its pool. A receiver that is told to
   copy out (``copy_out``) copies the frames and releases at once.
3. A segment lent to a peer comes back on release or when that peer dies (its mappings
   died with it). The pool keeps at most ``max_idle_bytes`` of idle segments; a segment
   returned beyond that is closed, and peers that hold its fd are told to forget it.
4. Segments are pre-faulted when created (``posix_fallocate`` allocates the shmem pages),
   and sized in powers of two from ``MIN_SEGMENT`` so that a pool serves varying sizes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

log = logging.getLogger("rrefrt.transport")

PAGE = mmap.PAGESIZE
MIN_SEGMENT = 1 << 20


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


@dataclass(eq=False)
class Segment:
    id: int
    fd: int
    size: int
    map: mmap.mmap
    #: peers this segment's fd was sent to (they may map it by id from then on)
    known_by: set[int] = field(default_factory=set)
    #: peer it is lent to now; None while idle in the pool
    lent_to: int | None = None


class SegmentPool:
    """The sender side: segments lent to peers and returned by them. Thread-safe."""

    def __init__(self, name: str, max_idle_bytes: int = 256 << 20) -> None:
        self._name = name
        self._max_idle = max_idle_bytes
        self._lock = threading.Lock()
        self._next_id = 1
        self._idle: dict[int, list[Segment]] = {}  #: size class -> idle segments
        self._idle_bytes = 0
        self._all: dict[int, Segment] = {}  #: id -> every live segment
        self._closed = False

    def acquire(self, nbytes: int, peer: int) -> Segment:
        """A segment of at least ``nbytes``, lent to ``peer`` until ``release``."""
        size = _size_class(nbytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("segment pool closed")
            free = None
            for cls in (size, size * 2, size * 4):  # a larger idle segment serves too
                free = self._idle.get(cls)
                if free:
                    break
            if free:
                seg = free.pop()
                self._idle_bytes -= seg.size
                seg.lent_to = peer
                return seg
            seg_id = self._next_id
            self._next_id += 1
        seg = self._create(seg_id, size)
        seg.lent_to = peer
        with self._lock:
            if self._closed:
                self._destroy(seg)
                raise RuntimeError("segment pool closed")
            self._all[seg_id] = seg
        return seg

    def _create(self, seg_id: int, size: int) -> Segment:
        fd = os.memfd_create(f"rrefrt-{self._name}-{seg_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # allocate the pages now, not on first touch
            m = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return Segment(seg_id, fd, size, m)

    def release(self, seg_id: int, peer: int) -> list[tuple[int, int]]:
        """``peer`` is done with ``seg_id``. Returns (peer, segment id) pairs of segments
        closed now, which those peers should forget."""
        with self._lock:
            seg = self._all.get(seg_id)
            if seg is None or seg.lent_to != peer:
                return []
            seg.lent_to = None
            return self._park(seg)

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
        """``peer`` died or left: every segment lent to it comes back, none is known by it."""
        forget: list[tuple[int, int]] = []
        with self._lock:
            for seg in list(self._all.values()):
                seg.known_by.discard(peer)
                if seg.lent_to == peer:
                    seg.lent_to = None
                    forget += self._park(seg)
        return [f for f in forget if f[0] != peer]

    def lent(self) -> int:
        with self._lock:
            return sum(1 for s in self._all.values() if s.lent_to is not None)

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
            self._idle_bytes = 0
        for seg in segs:
            self._destroy(seg)


def map_segment(fd: int) -> mmap.mmap:
    """The receiver side: map a segment a peer sent, whole and once (page tables filled now,
    ``MAP_POPULATE``); ``fd`` may be closed afterwards (the mapping keeps its own)."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)


def frames_of(
    mapping: mmap.mmap, sizes: Sequence[int], on_release: Callable[[], None], copy_out: bool = False
) -> list[memoryview | bytes]:
    """Frames of ``sizes`` laid out by ``layout`` in a mapped segment.

    The frames alias the mapping through one small per-message exporter (a ctypes array
    over the used bytes); ``on_release`` runs - on whichever thread drops the last view,
    so it must only hand work on - once neither the frames nor anything built on them (a
    memoryview, a numpy array, a tensor) is referenced any more. With ``copy_out`` the
    frames are copied out and ``on_release`` runs before returning."""
    offsets, used = layout(sizes)
    if copy_out:
        try:
            return [mapping[o : o + n] for o, n in zip(offsets, sizes)]
        finally:
            on_release()
    holder = (ctypes.c_char * used).from_buffer(mapping)
    weakref.finalize(holder, on_release)
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
