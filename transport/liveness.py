"""The liveness table: who is joining, up, suspect or dead, and why. Pure logic, no I/O.

Owns: each peer's ``PeerState``, the evidence it was judged on (when it was last heard,
since when its route is gone, since when this worker suspects it by silence, which members
suspect it too) and the decision to declare it dead. The heartbeat thread
(``rrefrt_transport.zmq.heartbeat``) feeds it events and performs what it returns; tests drive it with
a fake clock (``tests/unit/test_liveness.py``).

Rule 1: every transition is an entry of ``TRANSITIONS``; a (state, event) pair that is not
    in the table leaves the state as it is. DEAD is final: a peer declared dead is fenced
    for the life of the transport (its late messages are dropped, it is told FENCED).
Rule 2: a peer is declared dead when (a) its route has been gone for ``route_grace`` seconds
    (a killed peer: its connections close at once), (b) with ``judge_silence``, its silence
    is death by Rule 6, or (c) another member says so (DEAD_NOTICE). The zmq transport
    judges silence by its echo connections, which libzmq answers without the GIL (NOTE
    [Liveness] in ``rrefrt_transport.zmq.heartbeat``: a stopped, frozen or partitioned peer's echo
    falls silent; a process whose GIL is held for long still echoes, so it is not declared
    dead). No transport uses ZMTP heartbeats any more.
Rule 3: when the table itself was not ticked for ``heartbeat_timeout / 2`` (this process was
    stopped, or starved of CPU), silence proves nothing about the others: every clock of
    "last heard" restarts at the late tick, so that a process resumed after SIGSTOP first
    reads what its peers sent (FENCED, say) before it judges anyone by silence.
Rule 4: thread safety: the table holds one lock; its methods never call out while holding
    it, and return the decisions (``Verdict``) for the caller to act on.

Silence is judged in the rules below (issue 22: at 64-128 workers on 2 cores healthy
workers were declared dead during the join, on the word of one starved observer). Terms:
*settled* peers are those UP or SUSPECT (heard at least once, not dead); a peer's *silence*
is ``now - max(heard_at, join_mark)`` where ``join_mark`` is Rule 7's; T is
``heartbeat_timeout``.

Rule 5 (an observer suspects itself first): when this worker has two or more settled
    peers and every one of them has been silent for over T, the likely problem is this
    worker (starved of CPU, its liveness I/O thread not run, cut off), not all of them at
    once: it accuses nobody, restarts every clock of "last heard" as Rule 3 does, and counts
    the episode (``isolations``). Its *own liveness is current* when (i) its ticks are on
    time (Rule 3), (ii) its own echo came back within T / 2 where the caller feeds it
    (``heard_self``; never fed: no condition), and (iii) some settled peer other than the
    one judged was heard within T / 2 (no such peer exists: no condition). Only a worker
    whose own liveness is current suspects anyone, and only then does its silence verdict
    stand (Rule 6). A route loss (a crash) is judged all the same.
Rule 6 (a death by silence needs a second witness): a settled peer X silent for over T is
    *suspected* here (``suspects``; the caller tells the other members, again every beat
    while it lasts). It becomes dead (event SILENT) when, with this worker's own liveness
    current,
    (a) another member W suspects X too: W's suspicion (``suspicion(X, W)``) arrived within
        the last T and after X was last heard here, and W itself is settled and not
        suspected here ("confirmed by" W); or
    (b) X is this worker's only settled peer (a group of two, or the last two alive), or
        every other settled peer answered this suspicion that it does not watch X
        (``unwatched``: lazy connections watch only the peers a worker talks to): no second
        witness can exist, so this worker's own, current liveness is the witness; or
    (c) nobody confirmed it for ``lone_factor`` x T of silence (default 2 x T: one link cut,
        the other witnesses still hear X).
    Bounds, from the last echo of X: (a) T + one beat (the later witness's suspicion) + a
    tick, so a SIGSTOPped peer of a group of three or more is dead within T + interval +
    1 s as before; (b) T + a tick; (c) ``lone_factor`` x T + a tick. A worker starved or
    cut off alone never gets a second witness for its suspicions (the others hear the
    accused) and, hearing nobody, suspects nobody (Rule 5).
Rule 7 (silence during the join is judged by the join's progress): adding JOINING peers
    (``add``, ``replace``) starts a join, with a deadline ``join_timeout`` later (``add``'s
    argument, else the table's); each peer heard for the first time is progress. The join
    mark is the clock of the last progress, capped by the deadline: silence is counted
    from it at the earliest, so while peers keep arriving no settled peer is judged by
    silence, and once the group has formed every peer gets a full T from its last arrival
    (the first period after the group forms). JOINING peers themselves are never judged by
    silence (the join's own timeout bounds them). Bound: a death by silence during a join
    is seen at most Rule 6's bound after the last arrival, and never later than
    ``join_timeout`` + Rule 6's bound after the join began.
Rule 8 (first contact; NOTE [Lazy connections] in ``rrefrt_transport.zmq.agent``): a peer
    watched from its first contact on (``add(..., mark=False, contact_timeout=C)``) starts
    no join (Rule 7's mark is the group's join, not one pair's first word) and is JOINING
    until first heard; if it is still not heard C seconds later (its echo never answered:
    it is gone, or unreachable from here), it is dead (event UNREACHABLE) when this
    worker's own liveness is current (Rule 5). Bound: a peer that died before a worker
    first used it is dead for that worker C + a tick after the first use.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable


class PeerState(enum.Enum):
    JOINING = "joining"  #: the mesh is forming; not yet heard from
    UP = "up"  #: heard from recently, route present
    SUSPECT = "suspect"  #: its route is gone; dead unless it returns within route_grace
    DEAD = "dead"  #: final (fenced)


class Event(enum.Enum):
    HEARD = "heard"  #: a message arrived from the peer on the liveness connection
    ROUTE_OK = "route_ok"  #: a send to the peer was accepted (its connection exists)
    ROUTE_LOST = "route_lost"  #: a send failed: no connection to the peer
    GRACE_EXPIRED = "grace_expired"  #: SUSPECT for longer than route_grace
    SILENT = "silent"  #: UP or SUSPECT and its silence is death (Rule 6)
    NOTICE = "notice"  #: another member declared it dead, or we are closing on it
    UNREACHABLE = "unreachable"  #: JOINING past its first contact's deadline (Rule 8)


S, E = PeerState, Event
#: (state, event) -> next state. Anything missing: no change (Rule 1).
TRANSITIONS: dict[tuple[PeerState, Event], PeerState] = {
    (S.JOINING, E.HEARD): S.UP,
    (S.JOINING, E.NOTICE): S.DEAD,
    (S.JOINING, E.UNREACHABLE): S.DEAD,
    (S.UP, E.ROUTE_LOST): S.SUSPECT,
    (S.UP, E.SILENT): S.DEAD,
    (S.UP, E.NOTICE): S.DEAD,
    (S.SUSPECT, E.HEARD): S.UP,
    (S.SUSPECT, E.ROUTE_OK): S.UP,
    (S.SUSPECT, E.GRACE_EXPIRED): S.DEAD,
    (S.SUSPECT, E.SILENT): S.DEAD,
    (S.SUSPECT, E.NOTICE): S.DEAD,
}
_SETTLED = (S.UP, S.SUSPECT)


@dataclass(frozen=True)
class Verdict:
    """A peer newly declared dead: the caller fails its requests and tells the others."""

    peer: int
    cause: str


@dataclass
class _Entry:
    state: PeerState = PeerState.JOINING
    heard_at: float = 0.0  #: clock of the last HEARD (or of the first tick / the join)
    lost_at: float = 0.0  #: clock of the ROUTE_LOST that made it SUSPECT
    cause: str = ""  #: why it is DEAD
    silent_at: float | None = None  #: since when this worker suspects it by silence (Rule 6)
    suspected_by: dict[int, float] = field(default_factory=dict)  #: member -> when its suspicion arrived
    unwatched_by: dict[int, float] = field(default_factory=dict)  #: member -> when it said it does not watch this peer
    contact_by: float | None = None  #: Rule 8: heard by then, or dead


class LivenessTable:
    def __init__(
        self,
        heartbeat_timeout: float,
        route_grace: float,
        clock: Callable[[], float],
        judge_silence: bool = True,
        lone_factor: float = 2.0,
        join_timeout: float = 60.0,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.judge_silence = judge_silence  #: Rule 2 (b)
        self.route_grace = route_grace
        self.lone_factor = lone_factor  #: Rule 6 (c): silence unconfirmed for this many T is death
        self.join_timeout = join_timeout  #: Rule 7: the join's deadline unless ``add`` names one
        self.isolations = 0  #: Rule 5: how often this worker heard from none of its peers
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[int, _Entry] = {}  #: peer id -> entry; members only, never removed
        self._last_tick: float | None = None
        self._self_heard: float | None = None  #: Rule 5 (ii): the last echo of this worker's own
        self._progress_at = float("-inf")  #: Rule 7: the last join progress (an add, an arrival)
        self._join_deadline = float("-inf")  #: Rule 7: progress after this does not count

    # ------------------------------------------------------------------ queries (any thread)
    def state(self, peer: int) -> PeerState | None:
        with self._lock:
            e = self._peers.get(peer)
            return e.state if e else None

    def cause(self, peer: int) -> str:
        with self._lock:
            e = self._peers.get(peer)
            return e.cause if e else ""

    def dead(self) -> set[int]:
        with self._lock:
            return {p for p, e in self._peers.items() if e.state is S.DEAD}

    def live(self) -> list[int]:
        with self._lock:
            return [p for p, e in self._peers.items() if e.state is not S.DEAD]

    def joining(self) -> list[int]:
        with self._lock:
            return [p for p, e in self._peers.items() if e.state is S.JOINING]

    def members(self) -> list[int]:
        with self._lock:
            return list(self._peers)

    def suspects(self) -> list[int]:
        """Peers this worker suspects by silence, not dead yet (Rule 6): tell the others."""
        with self._lock:
            return [p for p, e in self._peers.items() if e.silent_at is not None and e.state in _SETTLED]

    # ------------------------------------------------------------------ events
    def add(
        self, peers: Iterable[int], join_timeout: float | None = None, mark: bool = True,
        contact_timeout: float | None = None,
    ) -> None:
        """Members, JOINING unless known; new ones start a join (Rule 7) that ends at the
        latest ``join_timeout`` (else the table's) from now - unless ``mark`` is False (a
        first contact, Rule 8: dead unless heard within ``contact_timeout``)."""
        now = self._clock()
        with self._lock:
            fresh = False
            for p in peers:
                if p not in self._peers:
                    self._peers[p] = _Entry(heard_at=now, contact_by=None if contact_timeout is None else now + contact_timeout)
                    fresh = True
            if fresh and mark:
                self._start_join(now, join_timeout)

    def drop(self, peer: int) -> None:
        """Forget ``peer`` (a new incarnation of its id is not watched until first contact)."""
        with self._lock:
            self._peers.pop(peer, None)

    def replace(self, peer: int, join_timeout: float | None = None) -> None:
        """A new incarnation of ``peer`` joins (dynamic groups): judged afresh, JOINING."""
        now = self._clock()
        with self._lock:
            self._peers[peer] = _Entry(heard_at=now)
            self._start_join(now, join_timeout)

    def heard(self, peer: int, at: float | None = None) -> None:
        """``peer`` was heard from now, or at clock ``at`` (a transport that notes each
        arrival itself and feeds the table once per tick); a clock never moves back."""
        with self._lock:
            e = self._peers.get(peer)
            if e is None or e.state is S.DEAD:
                return
            now = self._clock() if at is None else at
            if at is None or now > e.heard_at or e.state is S.JOINING:
                e.heard_at = max(e.heard_at, now)
                e.silent_at = None
                if e.state is S.JOINING:
                    self._progress_at = now  # an arrival: the join makes progress (Rule 7)
            self._step(e, E.HEARD)

    def heard_self(self) -> None:
        """This worker's own echo came back (Rule 5 (ii))."""
        with self._lock:
            self._self_heard = self._clock()

    def route(self, peer: int, ok: bool) -> None:
        with self._lock:
            e = self._peers.get(peer)
            if e is None:
                return
            before = e.state
            if self._step(e, E.ROUTE_OK if ok else E.ROUTE_LOST) is S.SUSPECT and before is not S.SUSPECT:
                e.lost_at = self._clock()

    def declare(self, peer: int, cause: str, add: bool = False) -> Verdict | None:
        """Declare ``peer`` dead (a DEAD_NOTICE, say); a Verdict iff it was not dead yet.
        ``add``: also a member not watched here (its death is learnt from those who do)."""
        with self._lock:
            e = self._peers.get(peer)
            if e is None and add:
                e = self._peers[peer] = _Entry(heard_at=self._clock())
            if e is None or e.state is S.DEAD:
                return None
            self._step(e, E.NOTICE)
            e.cause = cause
            return Verdict(peer, cause)

    def suspicion(self, peer: int, by: int) -> Verdict | None:
        """Member ``by`` suspects ``peer`` by silence (Rule 6): recorded; a Verdict iff that
        confirms this worker's own suspicion now."""
        now = self._clock()
        with self._lock:
            e = self._peers.get(peer)
            if e is None or by == peer or by not in self._peers:
                return None
            e.suspected_by[by] = now
            if e.silent_at is None or e.state not in _SETTLED or not self._own_liveness_current(now, peer):
                return None
            return self._judge_silence(peer, e, now)

    def unwatched(self, peer: int, by: int) -> None:
        """Member ``by`` answered our suspicion of ``peer``: it does not watch it (Rule 6 (b))."""
        now = self._clock()
        with self._lock:
            e = self._peers.get(peer)
            if e is not None and by != peer:
                e.unwatched_by[by] = now

    def tick(self) -> list[Verdict]:
        """Judge every peer by the clock (Rules 2-3, 5-7); return those newly dead."""
        now = self._clock()
        out: list[Verdict] = []
        with self._lock:
            last, self._last_tick = self._last_tick, now
            if last is not None and now - last > self.heartbeat_timeout / 2:  # Rule 3
                self._restart_clocks(now)
                for e in self._peers.values():
                    if e.state is S.SUSPECT:
                        e.lost_at = max(e.lost_at, now)
                return out
            settled = [e for e in self._peers.values() if e.state in _SETTLED]
            isolated = (
                self.judge_silence
                and len(settled) >= 2
                and all(self._silence(e, now) > self.heartbeat_timeout for e in settled)
            )
            if isolated:  # Rule 5
                self.isolations += 1
                self._restart_clocks(now)
            for p, e in self._peers.items():
                v: Verdict | None = None
                if e.state is S.SUSPECT and now - e.lost_at > self.route_grace:
                    v = self._kill(p, e, E.GRACE_EXPIRED, f"its connection was lost for over {self.route_grace:.1f}s")
                elif (
                    e.state is S.JOINING and e.contact_by is not None and now > e.contact_by
                    and self._own_liveness_current(now, p)
                ):  # Rule 8
                    v = self._kill(p, e, E.UNREACHABLE, "it never answered a heartbeat within "
                                   f"{now - e.heard_at:.1f}s of this worker's first contact (gone, or unreachable)")
                elif (
                    self.judge_silence
                    and not isolated
                    and e.state in _SETTLED
                    and self._silence(e, now) > self.heartbeat_timeout
                    and self._own_liveness_current(now, p)
                ):
                    if e.silent_at is None:
                        e.silent_at = now
                    v = self._judge_silence(p, e, now)
                if v is not None:
                    out.append(v)
        return out

    def next_deadline(self) -> float | None:
        """The clock at which ``tick`` could next declare someone dead (for the poll timeout)."""
        with self._lock:
            due = [
                e.lost_at + self.route_grace if e.state is S.SUSPECT else self._ref(e) + self.heartbeat_timeout
                for e in self._peers.values()
                if e.state is S.SUSPECT or (e.state is S.UP and self.judge_silence)
            ]
        return min(due) if due else None

    def validate(self) -> None:
        """Invariants: a dead peer has a cause; a suspect one has a loss time."""
        with self._lock:
            for p, e in self._peers.items():
                assert e.state is not S.DEAD or e.cause, f"peer {p} dead without a cause"
                assert e.state is not S.SUSPECT or e.lost_at, f"peer {p} suspect without a loss time"

    # ------------------------------------------------------------------ under the lock
    def _start_join(self, now: float, join_timeout: float | None) -> None:
        self._progress_at = now
        self._join_deadline = max(self._join_deadline, now + (self.join_timeout if join_timeout is None else join_timeout))

    def _ref(self, e: _Entry) -> float:
        """Rule 7: silence is counted from the last hearing, or the join's last progress."""
        return max(e.heard_at, min(self._progress_at, self._join_deadline))

    def _silence(self, e: _Entry, now: float) -> float:
        return now - self._ref(e)

    def _restart_clocks(self, now: float) -> None:
        for e in self._peers.values():
            e.heard_at = max(e.heard_at, now)
            e.silent_at = None

    def _own_liveness_current(self, now: float, judged: int) -> bool:
        """Rule 5 (ii), (iii); (i) holds in ``tick`` past Rule 3, and in ``suspicion`` as of
        the last tick."""
        half = self.heartbeat_timeout / 2
        if self._self_heard is not None and now - self._self_heard > half:
            return False
        others = [e for p, e in self._peers.items() if p != judged and e.state in _SETTLED]
        return not others or any(self._silence(e, now) <= half for e in others)

    def _judge_silence(self, p: int, e: _Entry, now: float) -> Verdict | None:
        """Rule 6 for a peer suspected here, with this worker's own liveness current."""
        t = self.heartbeat_timeout
        for w, at in e.suspected_by.items():
            we = self._peers.get(w)
            if we is not None and we.state in _SETTLED and we.silent_at is None and now - at <= t and at > e.heard_at:
                return self._kill(p, e, E.SILENT, f"it sent no heartbeat for over {t:.1f}s (confirmed by worker id {w})")
        since = e.silent_at if e.silent_at is not None else now
        if not any(q != p and qe.state in _SETTLED and e.unwatched_by.get(q, float("-inf")) < since
                   for q, qe in self._peers.items()):
            return self._kill(p, e, E.SILENT, f"it sent no heartbeat for over {t:.1f}s")
        if self._silence(e, now) > self.lone_factor * t:
            return self._kill(p, e, E.SILENT, f"it sent no heartbeat for over {self.lone_factor * t:.1f}s")
        return None

    def _kill(self, p: int, e: _Entry, event: Event, cause: str) -> Verdict | None:
        if self._step(e, event) is not S.DEAD:
            return None
        e.cause = cause
        return Verdict(p, cause)

    @staticmethod
    def _step(e: _Entry, event: Event) -> PeerState:
        e.state = TRANSITIONS.get((e.state, event), e.state)
        return e.state
