"""RecentIds (rrefrt/protocol/recent.py): a set that forgets its members after a horizon, for the
runtime's tables of finished things (issue 21 item 8). No processes: an injected clock."""

from __future__ import annotations

from rrefrt.protocol.recent import RecentIds


def test_members_live_between_one_and_two_horizons() -> None:
    now = [0.0]
    s = RecentIds(10.0, clock=lambda: now[0])
    s.add("a")
    now[0] = 9.9
    s.add("b")
    assert "a" in s and "b" in s and len(s) == 2
    now[0] = 10.0  # the generation of a and b is 10 s old: it becomes the previous one
    s.add("c")
    assert {"a", "b", "c"} == set(s) and len(s) == 3
    now[0] = 19.9
    assert "a" in s  # between one and two horizons: still there
    now[0] = 20.0
    s.add("d")  # a second rotation: a and b (added at 0 and 9.9) are gone
    assert set(s) == {"c", "d"} and "a" not in s and "b" not in s


def test_a_member_added_again_stays_a_generation_more() -> None:
    now = [0.0]
    s = RecentIds(10.0, clock=lambda: now[0])
    s.add("a")
    now[0] = 10.0
    s.add("a")  # re-added after the rotation: moves to the current generation
    assert len(s) == 1
    now[0] = 20.0
    s.add("b")
    assert "a" in s and len(s) == 2


def test_limit_bounds_the_members_at_any_rate() -> None:
    s = RecentIds(3600.0, limit=100, clock=lambda: 0.0)
    for i in range(10_000):
        s.add(i)
    assert len(s) <= 200 and 9_999 in s and 9_900 in s and 0 not in s
    s.discard(9_999)
    assert 9_999 not in s
