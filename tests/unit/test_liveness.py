"""The liveness table on its own: a fake clock, no sockets, no threads, no processes."""

from __future__ import annotations

import pytest

from rrefrt_transport.liveness import TRANSITIONS, Event, LivenessTable, PeerState

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def table(timeout: float = 3.0, grace: float = 0.5) -> tuple[LivenessTable, Clock]:
    clock = Clock()
    t = LivenessTable(timeout, grace, clock)
    t.add([1, 2, 3])
    return t, clock


def run(t: LivenessTable, clock: Clock, until: float, step: float = 0.1) -> list:
    out = []
    while clock.t < until:
        clock.t = round(clock.t + step, 6)
        out += t.tick()
        t.validate()
    return out


def test_joining_peers_become_up_when_heard_and_are_never_judged_by_silence_while_joining() -> None:
    t, clock = table()
    assert t.joining() == [1, 2, 3]
    assert run(t, clock, 110.0) == []  # 10 s of silence while joining: nobody dies
    t.heard(1)
    assert t.state(1) is PeerState.UP and t.joining() == [2, 3]


def test_silence_past_the_timeout_is_death_and_heartbeats_keep_a_peer_alive() -> None:
    t, clock = table(timeout=3.0)
    for p in (1, 2):
        t.heard(p)
    verdicts = []
    while clock.t < 105.0:
        clock.t = round(clock.t + 0.1, 6)
        t.heard(1)  # 1 keeps talking; 2 went silent at 100.0
        verdicts += t.tick()
    assert [v.peer for v in verdicts] == [2]
    assert "no heartbeat for over 3.0s" in verdicts[0].cause
    assert t.state(2) is PeerState.DEAD and t.state(1) is PeerState.UP
    assert t.dead() == {2} and t.cause(2) == verdicts[0].cause


def test_lost_route_is_death_after_the_grace_unless_it_returns() -> None:
    t, clock = table(grace=0.5)
    t.heard(1)
    t.heard(2)
    t.route(1, False)
    t.route(2, False)
    assert t.state(1) is PeerState.SUSPECT
    clock.t += 0.2
    t.route(1, False)  # a failed probe does not restart the grace
    t.route(2, True)  # 2's route came back
    assert t.state(2) is PeerState.UP
    verdicts = run(t, clock, clock.t + 0.5, step=0.05)
    assert [v.peer for v in verdicts] == [1] and "connection was lost" in verdicts[0].cause
    assert 100.5 < clock.t <= 100.8


def test_dead_is_final_and_a_notice_is_reported_once() -> None:
    t, clock = table()
    t.heard(1)
    v = t.declare(1, "worker 'B' declared it dead: silent")
    assert v is not None and v.peer == 1 and t.state(1) is PeerState.DEAD
    assert t.declare(1, "again") is None  # already dead: no second verdict
    t.heard(1)
    t.route(1, True)
    assert t.state(1) is PeerState.DEAD and t.cause(1) == "worker 'B' declared it dead: silent"
    assert t.declare(99, "not a member") is None
    assert t.declare(2, "while joining") is not None  # a joining peer can be declared dead too


def test_a_stalled_table_does_not_judge_by_silence_after_it_resumes() -> None:
    """Rule 3: this process was stopped for 10 s; on resume it must first listen."""
    t, clock = table(timeout=3.0)
    t.heard(1)
    t.tick()
    clock.t += 10.0  # SIGSTOP of this process
    assert t.tick() == []
    assert t.state(1) is PeerState.UP
    # and it does judge again if the silence goes on after the resume
    verdicts = run(t, clock, clock.t + 3.5)
    assert [v.peer for v in verdicts] == [1]


def test_next_deadline_and_the_transition_table() -> None:
    t, clock = table(timeout=3.0, grace=0.5)
    assert t.next_deadline() is None  # only joining peers
    t.heard(1)
    assert t.next_deadline() == pytest.approx(103.0)
    t.route(1, False)
    assert t.next_deadline() == pytest.approx(100.5)
    # DEAD has no way out; every state reachable from JOINING
    assert not [k for k in TRANSITIONS if k[0] is PeerState.DEAD]
    assert TRANSITIONS[(PeerState.SUSPECT, Event.HEARD)] is PeerState.UP
    assert {v for v in TRANSITIONS.values()} == {PeerState.UP, PeerState.SUSPECT, PeerState.DEAD}


def test_without_judging_silence_only_a_lost_route_or_a_notice_kills() -> None:
    """The zmq transport: libzmq's heartbeats close the connection of a silent peer, so
    silence alone (a held GIL, say) is never death."""
    clock = Clock()
    t = LivenessTable(0.6, 0.5, clock, judge_silence=False)
    t.add([1])
    t.heard(1)
    assert run(t, clock, clock.t + 30.0) == [] and t.state(1) is PeerState.UP
    assert t.next_deadline() is None
    t.route(1, False)
    verdicts = run(t, clock, clock.t + 1.0)
    assert [v.peer for v in verdicts] == [1]
