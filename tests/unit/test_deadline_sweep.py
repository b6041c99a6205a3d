"""DeadlineSweep (rrefrt/runtime/sweep.py): one timer for many deadlines, nothing missed.

A fake clock and a fake timer list stand in for the transport; the real transport's use
is checked end to end in tests/protocol/test_remote_inline.py (at most one such timer per
side after 300 quick creations).
"""

from __future__ import annotations

import threading

import pytest

from rrefrt.runtime import sweep as sweep_mod
from rrefrt.runtime.sweep import DeadlineSweep


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Entries:
    """Deadlines owned by the test; ``sweep`` records what it handled."""

    def __init__(self) -> None:
        self.due: list[float] = []
        self.handled: list[float] = []
        self.lock = threading.Lock()

    def peek(self) -> float | None:
        with self.lock:
            return min(self.due) if self.due else None

    def sweep(self, until: float) -> None:
        with self.lock:
            done = sorted(d for d in self.due if d <= until)
            self.due = [d for d in self.due if d > until]
        self.handled += done


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(sweep_mod.time, "monotonic", c.monotonic)
    return c


def make(clock, entries, immediate=False):
    timers: list[tuple[float, object]] = []

    def call_later(delay, fn):
        if immediate:  # like the protocol simulation's transport: at once, so early
            fn()
        else:
            timers.append((clock.now + delay, fn))
    return DeadlineSweep(call_later, entries.peek, entries.sweep), timers


def fire_due(clock, timers):
    """Run every timer due by now, in due order (timers they arm included)."""
    while True:
        ready = sorted((t for t in timers if t[0] <= clock.now), key=lambda t: t[0])
        if not ready:
            return
        timers.remove(ready[0])
        ready[0][1]()


def add(entries, s, due):
    with entries.lock:
        entries.due.append(due)  # the entry exists before the schedule (NOTE [Deadline sweeps])
    s.schedule(due)


def test_many_deadlines_share_one_timer(clock):
    e = Entries()
    s, timers = make(clock, e)
    for i in range(100):
        add(e, s, 100.05 + i * 0.001)
    assert len(timers) == 1 and s.armed
    clock.now = 100.2
    fire_due(clock, timers)
    assert len(e.handled) == 100 and not e.due
    assert not timers and not s.armed  # nothing left: no timer


def test_the_sweep_re_arms_for_the_next_deadline_only(clock):
    e = Entries()
    s, timers = make(clock, e)
    add(e, s, 101.0)
    add(e, s, 105.0)
    clock.now = 101.0
    fire_due(clock, timers)
    assert e.handled == [101.0]
    assert [t for t, _ in timers] == [105.0]  # one timer, due at the next deadline
    clock.now = 105.0
    fire_due(clock, timers)
    assert e.handled == [101.0, 105.0] and not timers


def test_an_earlier_deadline_replaces_the_timer_and_the_old_one_does_nothing(clock):
    e = Entries()
    s, timers = make(clock, e)
    add(e, s, 110.0)
    add(e, s, 101.0)
    assert sorted(t for t, _ in timers) == [101.0, 110.0]
    clock.now = 101.0
    fire_due(clock, timers)
    assert e.handled == [101.0]
    # the live timer re-armed for 110; the replaced one (also due at 110) is inert
    clock.now = 110.0
    fire_due(clock, timers)
    assert e.handled == [101.0, 110.0] and not timers and not s.armed


def test_an_entry_added_while_the_sweep_runs_is_not_missed(clock):
    e = Entries()
    s, timers = make(clock, e)
    add(e, s, 101.0)
    inner = e.sweep

    def sweep_and_add(until):
        inner(until)
        add(e, s, 102.0)  # the live timer is still recorded: no second timer from here
    s._sweep = sweep_and_add
    clock.now = 101.0
    _, fn = timers.pop()
    fn()
    assert e.handled == [101.0]
    assert [t for t, _ in timers] == [102.0]  # the sweep's peek saw it and re-armed
    s._sweep = inner
    clock.now = 102.0
    fire_due(clock, timers)
    assert e.handled == [101.0, 102.0] and not timers


def test_a_timer_that_runs_at_once_still_handles_what_it_was_planned_for(clock):
    """The protocol simulation runs a timer on the scheduling thread, early: the sweep gets
    its planned time, and no lock is held while it runs (it would deadlock)."""
    e = Entries()
    s, _ = make(clock, e, immediate=True)
    add(e, s, 101.0)
    add(e, s, 102.0)
    assert e.handled == [101.0, 102.0] and not s.armed


def test_a_closed_transport_raises_and_records_no_timer(clock):
    e = Entries()

    def closed(delay, fn):
        raise RuntimeError("transport closed")
    s = DeadlineSweep(closed, e.peek, e.sweep)
    with pytest.raises(RuntimeError):
        add(e, s, 101.0)
    assert not s.armed
