"""The bounds of the transports' spins (transport/spin.py): when a loop spins before it
sleeps and for how long (NOTE [Receiver spin] in transport/unix/receiver.py), with a
scripted clock and poll, so no timing of this machine decides the outcome."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from rrefrt_transport import spin


class _Clock:
    """A clock that moves only when the spin polls (one microsecond per poll)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.polls = 0

    def now(self) -> float:
        return self.t

    def poll_until(self, due: float | None) -> Any:
        def poll_once() -> list:
            self.polls += 1
            self.t += 1e-6
            return [("fd", None, 1)] if due is not None and self.t >= due else []
        return poll_once


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(spin, "_now", c.now)
    monkeypatch.setattr(spin.os, "sched_yield", lambda: None)
    return c


def _loop_spin(clock: _Clock, gap: float, since: float) -> spin.LoopSpin:
    ls = spin.LoopSpin(150e-6)
    ls.gap, ls.last = gap, clock.t - since
    return ls


def test_a_loop_spins_while_messages_come_often(clock: _Clock) -> None:
    """(1): the last two at most 2 x 150 us apart and the last just now: up to 150 us."""
    stats: collections.Counter = collections.Counter()
    ls = _loop_spin(clock, gap=100e-6, since=10e-6)
    assert ls.before_sleep(clock.poll_until(clock.t + 120e-6), 1.0, stats, "rx_spin")
    assert stats["rx_spin_hits"] == 1
    ls = _loop_spin(clock, gap=100e-6, since=10e-6)
    assert ls.before_sleep(clock.poll_until(None), 1.0, stats, "rx_spin") == []
    assert 147 <= clock.polls - 120 <= 153, "a miss spins the bound, 150 us"


def test_a_loop_stretches_its_spin_to_the_next_message_due(clock: _Clock) -> None:
    """(4): messages 400 us apart (a 1 MB ping-pong) are past (1)'s reach; the loop spins
    until 1.5 x the last gap after the last message, and catches the next at 420 us."""
    stats: collections.Counter = collections.Counter()
    ls = _loop_spin(clock, gap=400e-6, since=50e-6)
    assert ls.before_sleep(clock.poll_until(clock.t + 370e-6), 1.0, stats, "rx_spin")
    assert stats["rx_spin_hits"] == 1
    clock.polls = 0
    ls = _loop_spin(clock, gap=400e-6, since=50e-6)
    assert ls.before_sleep(clock.poll_until(None), 1.0, stats, "rx_spin") == []
    assert 547 <= clock.polls <= 553, "a miss ends 600 us after the last message"
    clock.polls = 0
    ls = _loop_spin(clock, gap=400e-6, since=50e-6)
    assert ls.before_sleep(clock.poll_until(None), 0.0001, stats, "rx_spin") == []
    assert 97 <= clock.polls <= 103, "never past the sleep's own timeout"


@pytest.mark.parametrize("gap,since", [(spin.STRETCH_MAX + 1e-6, 10e-6), (400e-6, 601e-6)])
def test_no_stretch_for_messages_far_apart_or_one_overdue(clock: _Clock, gap: float, since: float) -> None:
    ls = _loop_spin(clock, gap=gap, since=since)
    assert ls.before_sleep(clock.poll_until(None), 1.0, collections.Counter(), "rx_spin") is None
    assert clock.polls == 0


def test_stretched_spins_that_miss_pause_like_any_other(clock: _Clock) -> None:
    stats: collections.Counter = collections.Counter()
    ls = spin.LoopSpin(150e-6)
    for _ in range(spin.SPIN_MISSES):
        ls.gap, ls.last = 400e-6, clock.t
        assert ls.before_sleep(clock.poll_until(None), 1.0, stats, "rx_spin") == []
    assert stats["rx_spin_pauses"] == 1 and ls.spin_skip == spin.SPIN_PAUSE
    ls.gap, ls.last = 400e-6, clock.t
    assert ls.before_sleep(clock.poll_until(None), 1.0, stats, "rx_spin") is None
    assert ls.spin_skip == spin.SPIN_PAUSE - 1
