"""RecentIds: a set that forgets its members after a horizon, for the runtime's tables of
finished things (tombstones of deleted forks, released RRef ids, ids of calls run).

Owns nothing but its two generations. Standard library only (a leaf, like ids/errors).

NOTE [Bounded memory of finished things]
    Such a table is consulted only by a *late copy* of a message about something finished:
    a duplicated or retried fork request, creation or call, or a fork request or fetch that
    lost a race with a peer's death. Each of these leaves its sender within the retry
    horizon of a control message (``control_attempts`` x ``control_retry_interval`` = 30 s
    by default, NOTE [Retries]) and reaches the receiver in order on its connection (a
    transport never reorders one peer's messages; the fault injector delays by tens of
    milliseconds), or the peer is declared dead first (its messages are then refused by
    ``dead`` checks that need no memory). So a member is needed for a bounded time after it
    was added, never for the group's life; kept for good (as they once were), these tables
    grew by about 100-150 bytes per RRef freed and per call served, for ever: the RSS
    growth of a long soak (scripts/soak.py, docs/performance.md "Memory soak").

    Two generations: ``add`` puts a member in the current one; once the current one is
    ``horizon`` seconds old (or holds ``limit`` members) it becomes the previous one and the
    previous one is dropped. A member is thus remembered for at least ``horizon`` seconds
    (or ``limit`` later additions) and at most twice that; memory is bounded by the rate of
    additions times 2 x ``horizon`` (and by 2 x ``limit``). O(1) per operation, no timers.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Iterator

#: seconds a member is remembered at least: twice the default retry horizon of a control
#: message (15 attempts x 2 s), so every copy of a message that can still arrive finds it
HORIZON_S = 60.0


class RecentIds:
    """A set of recently added ids (NOTE [Bounded memory of finished things]). Not
    thread-safe: its owner's lock (or thread) guards it."""

    __slots__ = ("horizon", "limit", "_clock", "_current", "_previous", "_since")

    def __init__(self, horizon: float = HORIZON_S, limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon = horizon  #: seconds a member stays at least
        self.limit = limit  #: or until this many later additions (None: time only)
        self._clock = clock
        self._current: set[Hashable] = set()  #: members added since ``_since``
        self._previous: set[Hashable] = set()  #: members of the generation before
        self._since = clock()  #: when the current generation began

    def add(self, item: Hashable) -> None:
        self.generation()
        self._previous.discard(item)  # re-added: it stays a full generation more
        self._current.add(item)

    def generation(self) -> set[Hashable]:
        """The current generation, rotated first if it is due: a batch adds to it directly
        with one clock read (``RRefContext.on_user_deletes``). A member added this way
        that is also in the previous generation is counted twice by ``len`` until then."""
        now = self._clock()
        if now - self._since >= self.horizon or (self.limit is not None and len(self._current) >= self.limit):
            self._previous, self._current, self._since = self._current, set(), now
        return self._current

    def discard(self, item: Hashable) -> None:
        self._current.discard(item)
        self._previous.discard(item)

    def __contains__(self, item: object) -> bool:
        return item in self._current or item in self._previous

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def __iter__(self) -> Iterator[Hashable]:
        yield from self._current
        yield from (x for x in self._previous if x not in self._current)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecentIds):
            return set(self) == set(other)
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RecentIds({len(self)} members, horizon {self.horizon:g}s)"
