"""The receiver loop's timers (``rrefrt_transport.unix.receiver``) and the deadlines of
requests, grouped in slices.

Thread roles: ``push``, ``arm`` and ``disarm`` from any thread (under the timer lock);
``run_due`` and the expiry of a slice on the thread that leads the receiver loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rrefrt_transport.base import OnDone

log = logging.getLogger("rrefrt.transport")

#: NOTE [Deadline buckets]: request deadlines are kept per slice of this width
TICK = 0.01


def _answered(meta: Any, frames: Sequence[Any], err: Any) -> None:
    """``on_done`` of a request already answered (see ``Pending.finish``)."""


@dataclass(slots=True)
class Pending:
    """A request waiting for its answer."""

    dest: int
    deadline: float | None
    timeout: float
    on_done: OnDone
    bucket: int = 0  #: its deadline bucket (NOTE [Deadline buckets]); 0: none

    def finish(self, meta: Any, frames: Sequence[Any], err: Any) -> None:
        """Run ``on_done`` once and drop it: the deadline's timer entry keeps this object until
        the deadline, and must not keep the runtime's future (and what its result or error
        references, RRefs included) alive that long."""
        cb, self.on_done = self.on_done, _answered
        cb(meta, frames, err)


def guard(fn: Callable[[], None]) -> None:
    """Run a callback of the loop: its exception is logged, never stops the loop."""
    try:
        fn()
    except Exception:
        log.exception("transport callback failed")


class Timers:
    """A heap of (due, seq, fn) and the deadline slices of requests.

    NOTE [Deadline buckets]: a request's deadline used to be one timer-heap entry (a
    closure) that stayed until it fell due, answered or not: at 10,000 calls/s with a 120 s
    timeout, over a million live entries, each push O(log n) under the timer lock, and a
    heap the garbage collector scanned again and again. Now requests are grouped by
    deadline in ``TICK`` slices: one timer per slice, and an answered request leaves its
    slice at once (``disarm``). A timeout fires at most ``TICK`` late, never early."""

    def __init__(self, ring: Callable[[], None], expire: Callable[[Pending, int], None]) -> None:
        self._ring = ring  #: wakes the loop (a timer due sooner than it planned to wake)
        self._expire = expire  #: a request's deadline passed unanswered (loop thread)
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count(1)
        self._next_wake = 0.0  #: when the loop plans to wake (under the lock)
        #: bucket -> {msg_id: pending} of requests not yet answered
        self.buckets: dict[int, dict[int, Pending]] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, fn: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            wake = due < self._next_wake
        if wake:
            self._ring()

    def arm(self, p: Pending, msg_id: int) -> None:
        """``p``'s deadline joins its slice (no deadline: nothing)."""
        if p.deadline is None:
            return
        b = p.bucket = int(p.deadline / TICK) + 1
        wake = False
        with self._lock:
            bucket = self.buckets.get(b)
            if bucket is None:
                bucket = self.buckets[b] = {}
                due = b * TICK
                heapq.heappush(self._heap, (due, next(self._seq), lambda: self._expire_bucket(b)))
                wake = due < self._next_wake
            bucket[msg_id] = p
        if wake:
            self._ring()

    def disarm(self, p: Pending, msg_id: int) -> None:
        """The request was answered: it leaves its deadline slice. Any thread (a caller that
        reads its own answer dispatches it), so under the lock: a slice is either still in
        ``buckets`` or taken whole by ``_expire_bucket``, never changed while it runs."""
        with self._lock:
            bucket = self.buckets.get(p.bucket)
            if bucket is not None:
                bucket.pop(msg_id, None)

    def _expire_bucket(self, b: int) -> None:
        with self._lock:
            bucket = self.buckets.pop(b, None)
        if bucket:
            for msg_id, p in list(bucket.items()):
                guard(lambda p=p, msg_id=msg_id: self._expire(p, msg_id))  # one bad entry must not stop the rest

    def next_due(self) -> float:
        """When the loop must wake next (and it plans to: under the lock, so that a timer
        pushed meanwhile rings the bell)."""
        with self._lock:
            due = self._heap[0][0] if self._heap else time.monotonic() + 1.0
            self._next_wake = due
        return due

    def run_due(self) -> float:
        """Run every timer due now (loop thread); return when the next one is due."""
        now = time.monotonic()
        lock, heap = self._lock, self._heap
        while True:
            with lock:
                if not heap or heap[0][0] > now:
                    due = heap[0][0] if heap else now + 1.0
                    self._next_wake = due
                    return due
                _, _, fn = heapq.heappop(heap)
            guard(fn)
