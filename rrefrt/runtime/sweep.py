"""One transport timer for many deadlines.

Owns: the one timer a set of deadlines shares and the rule that keeps exactly one live:
it is due at the earliest pending deadline, re-armed after each sweep for the next one,
replaced (the old one does nothing when it fires) when an earlier deadline arrives. The
deadlines themselves stay with the owner of the entries, which gives two functions:

- ``peek()``: the earliest pending deadline, or None; called under this object's lock
  (it may take the owner's own lock inside it, never the other way round);
- ``sweep(until)``: handle every entry due by ``until``; called on the timer's thread,
  never under this object's lock (it may answer peers, fail futures, run callbacks).

NOTE [Deadline sweeps]
    A timer per entry (a creation's accept, a parked to_here()'s deadline) woke the
    transport's thread once per entry, long after most entries had been answered, and held
    a heap entry meanwhile. Here nothing is missed: an owner adds its entry *before* it
    calls ``schedule``; the sweep reads ``peek()`` under the lock after it ran, so an entry
    added before that is seen there, and one added after finds no timer due at or before
    its deadline and arms one. While a sweep runs, its own planned time stays recorded, so
    a ``schedule`` for a later deadline leaves the re-arming to it.

    ``call_later`` is never called under the lock: a transport may run a timer at once
    (the protocol simulation's does, which also makes a timer early), and ``sweep`` gets
    the later of its planned time and now, so an early timer still handles what it was
    planned for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["DeadlineSweep"]


class DeadlineSweep:
    def __init__(self, call_later: Callable[[float, Callable[[], None]], object],
                 peek: Callable[[], float | None], sweep: Callable[[float], None]) -> None:
        self._call_later = call_later
        self._peek = peek
        self._sweep = sweep
        self._lock = threading.Lock()
        #: when the live timer is due (None: no timer), and its token (under ``_lock``)
        self._due: float | None = None
        self._token = 0

    @property
    def armed(self) -> bool:
        """Whether a timer is live (for tests and debugging)."""
        return self._due is not None

    def schedule(self, due: float) -> None:
        """An entry due at ``due`` was added (before this call). Raises what ``call_later``
        raises (a closed transport); no timer is then recorded for it."""
        with self._lock:
            if self._due is not None and self._due <= due:
                return  # the live timer (or the sweep under way) comes first
            self._token += 1
            self._due, token = due, self._token
        self._arm(token, due)

    def _arm(self, token: int, due: float) -> None:
        try:
            self._call_later(max(0.0, due - time.monotonic()), lambda: self._fire(token, due))
        except BaseException:
            with self._lock:
                if self._token == token:
                    self._due = None
            raise

    def _fire(self, token: int, planned: float) -> None:
        with self._lock:
            if token != self._token:
                return  # replaced by a timer for an earlier deadline
        try:
            self._sweep(max(planned, time.monotonic()))
        finally:
            with self._lock:
                nxt = None
                if token == self._token:  # still the live timer: it arms the next
                    nxt = self._due = self._peek()
                    if nxt is not None:
                        self._token += 1
                        token = self._token
            if nxt is not None:
                self._arm(token, nxt)
