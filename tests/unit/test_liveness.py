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
        if clock.t > 102.0:  # and 1 misses 2 too (Rule 6 (a)): it says so every beat
            verdicts += [v for v in [t.suspicion(2, by=1)] if v]
        verdicts += t.tick()
    assert [v.peer for v in verdicts] == [2]
    assert "no heartbeat for over 3.0s" in verdicts[0].cause and 103.0 < clock.t
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


# ---------------------------------------------------------------------------- issue 22: Rules 5-7
def up_table(peers: list[int], timeout: float = 3.0, **kw) -> tuple[LivenessTable, Clock]:
    """Every peer heard once at 100.0, and the join long over (Rule 7 plays no part)."""
    clock = Clock()
    t = LivenessTable(timeout, 0.5, clock, **kw)
    t.add(peers, join_timeout=0.0)  # the join's deadline is now: its progress never counts
    for p in peers:
        t.heard(p)
    return t, clock


def step(t: LivenessTable, clock: Clock, talking: tuple[int, ...] = (), dt: float = 0.1) -> list:
    clock.t = round(clock.t + dt, 6)
    for p in talking:
        t.heard(p)
    out = t.tick()
    t.validate()
    return out


def test_rule5_an_observer_that_hears_nobody_suspects_itself_and_gives_everyone_a_fresh_timeout() -> None:
    """Every peer fell silent at once for 10 s (this worker's liveness thread starved, its
    ticks on time): nobody is accused, and when it hears again, the peers it has not heard
    yet get a full timeout from the moment its clocks restarted."""
    t, clock = up_table([1, 2, 3])
    verdicts = []
    while clock.t < 110.0:
        verdicts += step(t, clock)
    assert verdicts == [] and t.suspects() == [] and t.isolations >= 1
    t.heard(1)  # the observer hears again: 1 first, 2 and 3 a few hundred ms later
    verdicts += step(t, clock)
    assert verdicts == [] and t.suspects() == [], "peers judged on silence the observer itself caused"
    verdicts += step(t, clock, talking=(1,), dt=0.2)
    t.heard(2)
    t.heard(3)
    assert verdicts == [] and t.state(2) is t.state(3) is PeerState.UP


def test_rule5_an_observer_whose_own_echo_is_late_accuses_nobody() -> None:
    """Rule 5 (ii): its own echo has not come back for over T / 2: its silence verdicts wait."""
    t, clock = up_table([1, 2])
    t.heard_self()  # at 100.0, then never again
    verdicts = []
    while clock.t < 104.0:
        verdicts += step(t, clock, talking=(1,))
        assert t.suspicion(2, by=1) is None  # 1 misses 2 as well
    assert verdicts == [] and t.state(2) is PeerState.UP and t.suspects() == []
    t.heard_self()  # its own echo is back: now its silence verdict stands, confirmed by 1
    t.suspicion(2, by=1)
    verdicts += step(t, clock, talking=(1,))
    assert [v.peer for v in verdicts] == [2] and "confirmed by worker id 1" in verdicts[0].cause


def test_rule5_an_observer_that_heard_no_other_peer_lately_suspects_nobody() -> None:
    """Rule 5 (iii): the observer's peers fell silent together, their last echoes a tick
    apart: when the first two pass T, the third has been silent for over T / 2 too, so
    the observer's own liveness is not current and it suspects nobody (a tick later it
    finds itself cut off from all three)."""
    t, clock = up_table([1, 2, 3])
    clock.t = 100.15
    t.heard(3)
    while clock.t < 103.1:
        assert step(t, clock) == []
    assert t.suspects() == [] and t.isolations == 0, "suspected on the observer's own silence"
    step(t, clock, dt=0.1)
    assert t.suspects() == [] and t.isolations == 1


def test_rule6_one_witness_is_a_suspicion_and_a_second_one_makes_it_a_death() -> None:
    t, clock = up_table([1, 2, 3])
    verdicts = []
    while clock.t < 105.0:  # 2 is silent for 5 s: over T, under 2 T
        verdicts += step(t, clock, talking=(1, 3))
    assert verdicts == [] and t.state(2) is PeerState.UP and t.suspects() == [2]
    # a suspicion older than this worker's last hearing of 2, or from a member itself
    # suspected here, confirms nothing
    t2, clock2 = up_table([1, 2, 3])
    assert t2.suspicion(2, by=1) is None  # arrives at 100.0, when 2 was last heard
    while clock2.t < 103.5:
        assert step(t2, clock2, talking=(1, 3)) == []
    assert t2.suspects() == [2]
    # the other witness: 3 misses 2 too
    v = t.suspicion(2, by=3)
    assert v is not None and v.peer == 2 and "confirmed by worker id 3" in v.cause
    assert t.state(2) is PeerState.DEAD and t.suspects() == []
    # another member's word alone never kills a peer this worker hears
    t3, clock3 = up_table([1, 2, 3])
    while clock3.t < 110.0:
        assert step(t3, clock3, talking=(1, 2, 3)) == []
        assert t3.suspicion(2, by=1) is None
    assert t3.state(2) is PeerState.UP


def test_rule6_unconfirmed_silence_is_death_after_lone_factor_timeouts_and_a_sole_peer_after_one() -> None:
    t, clock = up_table([1, 2, 3])
    verdicts: list = []
    while not verdicts:
        verdicts += step(t, clock, talking=(1, 3))
    assert [v.peer for v in verdicts] == [2] and 106.0 < clock.t <= 106.1
    assert "no heartbeat for over 6.0s" in verdicts[0].cause
    # X is this worker's only settled peer: no second witness can exist (Rule 6 (b))
    t, clock = up_table([1])
    verdicts = []
    while not verdicts:
        verdicts += step(t, clock)
    assert [v.peer for v in verdicts] == [1] and 103.0 < clock.t <= 103.1


def test_rule7_silence_during_the_join_is_judged_by_its_progress_and_bounded_by_its_timeout() -> None:
    """1 answered at once, then fell silent (starved while the others start); the others
    arrive one every 2 s, and keep talking once there."""
    for join_timeout, formed in ((60.0, 106.0), (5.0, 105.0)):
        clock = Clock()
        t = LivenessTable(3.0, 0.5, clock)
        t.add([1, 2, 3, 4], join_timeout=join_timeout)
        t.heard(1)
        arrivals = {102.0: 2, 104.0: 3, 106.0: 4}
        talking: tuple[int, ...] = ()
        verdicts = []
        while clock.t < formed + 3.0:
            verdicts += step(t, clock, talking=talking)
            if clock.t in arrivals:
                talking += (arrivals[clock.t],)
                t.heard(arrivals[clock.t])
        assert verdicts == [] and t.suspects() == [], (join_timeout, clock.t)
        verdicts += step(t, clock, talking=talking)  # silence past T from the join mark
        assert t.suspects() == [1], join_timeout
        v = t.suspicion(1, by=2)
        assert v is not None and v.peer == 1, join_timeout


def test_a_first_contact_never_answered_is_a_death_after_its_timeout_rule_8() -> None:
    clock = Clock()
    t = LivenessTable(3.0, 0.5, clock)
    t.add([1], mark=False, contact_timeout=7.0)
    assert run(t, clock, 106.9) == []  # JOINING within its contact timeout: not judged
    (v,) = run(t, clock, 107.2)
    assert v.peer == 1 and "first contact" in v.cause and t.state(1) is PeerState.DEAD
    t.add([2], mark=False, contact_timeout=7.0)  # one heard in time is up, past its contact timeout
    out = []
    while clock.t < 115.0:
        clock.t = round(clock.t + 0.5, 6)
        t.heard(2)
        out += t.tick()
    assert out == [] and t.state(2) is PeerState.UP


def test_a_suspicion_nobody_else_can_witness_stands_alone_rule_6b() -> None:
    """Peers 1 and 2 are settled; 1 falls silent. 2 does not watch 1 (lazy connections) and
    says so: no second witness can exist, so 1 is dead at T + a tick, not 2 x T."""
    clock = Clock()
    t = LivenessTable(3.0, 0.5, clock)
    t.add([1, 2], mark=False)
    t.heard(1)
    t.heard(2)
    out = []
    while clock.t < 103.2:
        clock.t = round(clock.t + 0.1, 6)
        t.heard(2)
        out += t.tick()
    assert out == [] and t.suspects() == [1]  # suspected, nobody confirmed it yet
    t.unwatched(1, by=2)
    clock.t += 0.1
    t.heard(2)
    (v,) = t.tick()
    assert v.peer == 1 and t.state(1) is PeerState.DEAD
