"""The liveness table: who is joining, up, suspect or dead, and why. Pure logic, no I/O.

Owns: each peer's ``PeerState``, the evidence it was judged on (when it was last heard,
since when its route is gone) and the decision to declare it dead. The heartbeat thread
(``rrefrt_transport.zmq.heartbeat``) feeds it events and performs what it returns; tests drive it with
a fake clock (``tests/unit/test_liveness.py``).

Rule 1: every transition is an entry of ``TRANSITIONS``; a (state, event) pair that is not
    in the table leaves the state as it is. DEAD is final: a peer declared dead is fenced
    for the life of the transport (its late messages are dropped, it is told FENCED).
Rule 2: a peer is declared dead when (a) its route has been gone for ``route_grace`` seconds
    (a killed peer: its connections close at once), (b) with ``judge_silence``, nothing
    was heard from it for ``heartbeat_timeout`` seconds once it was up, or (c) another
    member says so (DEAD_NOTICE). The zmq transport judges silence by its echo
    connections, which libzmq answers without the GIL (NOTE [Liveness] in
    ``rrefrt_transport.zmq.heartbeat``: a stopped, frozen or partitioned peer's echo falls silent; a
    process whose GIL is held for long still echoes, so it is not declared dead). No
    transport uses ZMTP heartbeats any more.
Rule 3: when the table itself was not ticked for ``heartbeat_timeout / 2`` (this process was
    stopped, or starved of CPU), silence proves nothing about the others: every clock of
    "last heard" restarts at the late tick, so that a process resumed after SIGSTOP first
    reads what its peers sent (FENCED, say) before it judges anyone by silence.
Rule 4: thread safety: the table holds one lock; its methods never call out while holding
    it, and return the decisions (``Verdict``) for the caller to act on.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
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
    SILENT = "silent"  #: UP or SUSPECT and not heard for heartbeat_timeout
    NOTICE = "notice"  #: another member declared it dead, or we are closing on it


S, E = PeerState, Event
#: (state, event) -> next state. Anything missing: no change (Rule 1).
TRANSITIONS: dict[tuple[PeerState, Event], PeerState] = {
    (S.JOINING, E.HEARD): S.UP,
    (S.JOINING, E.NOTICE): S.DEAD,
    (S.UP, E.ROUTE_LOST): S.SUSPECT,
    (S.UP, E.SILENT): S.DEAD,
    (S.UP, E.NOTICE): S.DEAD,
    (S.SUSPECT, E.HEARD): S.UP,
    (S.SUSPECT, E.ROUTE_OK): S.UP,
    (S.SUSPECT, E.GRACE_EXPIRED): S.DEAD,
    (S.SUSPECT, E.SILENT): S.DEAD,
    (S.SUSPECT, E.NOTICE): S.DEAD,
}


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


class LivenessTable:
    def __init__(
        self, heartbeat_timeout: float, route_grace: float, clock: Callable[[], float], judge_silence: bool = True
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.judge_silence = judge_silence  #: Rule 2 (b)
        self.route_grace = route_grace
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[int, _Entry] = {}  #: peer id -> entry; members only, never removed
        self._last_tick: float | None = None

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

    # ------------------------------------------------------------------ events
    def add(self, peers: Iterable[int]) -> None:
        now = self._clock()
        with self._lock:
            for p in peers:
                self._peers.setdefault(p, _Entry(heard_at=now))

    def replace(self, peer: int) -> None:
        """A new incarnation of ``peer`` joins (dynamic groups): judged afresh, JOINING."""
        with self._lock:
            self._peers[peer] = _Entry(heard_at=self._clock())

    def heard(self, peer: int, at: float | None = None) -> None:
        """``peer`` was heard from now, or at clock ``at`` (a transport that notes each
        arrival itself and feeds the table once per tick); a clock never moves back."""
        with self._lock:
            e = self._peers.get(peer)
            if e is None or e.state is S.DEAD:
                return
            e.heard_at = max(e.heard_at, self._clock() if at is None else at)
            self._step(e, E.HEARD)

    def route(self, peer: int, ok: bool) -> None:
        with self._lock:
            e = self._peers.get(peer)
            if e is None:
                return
            before = e.state
            if self._step(e, E.ROUTE_OK if ok else E.ROUTE_LOST) is S.SUSPECT and before is not S.SUSPECT:
                e.lost_at = self._clock()

    def declare(self, peer: int, cause: str) -> Verdict | None:
        """Declare ``peer`` dead (a DEAD_NOTICE, say); a Verdict iff it was not dead yet."""
        with self._lock:
            e = self._peers.get(peer)
            if e is None or e.state is S.DEAD:
                return None
            self._step(e, E.NOTICE)
            e.cause = cause
            return Verdict(peer, cause)

    def tick(self) -> list[Verdict]:
        """Judge every peer by the clock (Rule 2 a, b); return those newly dead."""
        now = self._clock()
        out: list[Verdict] = []
        with self._lock:
            last, self._last_tick = self._last_tick, now
            if last is not None and now - last > self.heartbeat_timeout / 2:  # Rule 3
                for e in self._peers.values():
                    e.heard_at = max(e.heard_at, now)
                    if e.state is S.SUSPECT:
                        e.lost_at = max(e.lost_at, now)
                return out
            for p, e in self._peers.items():
                if e.state is S.SUSPECT and now - e.lost_at > self.route_grace:
                    cause = f"its connection was lost for over {self.route_grace:.1f}s"
                    event = E.GRACE_EXPIRED
                elif (
                    self.judge_silence
                    and e.state in (S.UP, S.SUSPECT)
                    and now - e.heard_at > self.heartbeat_timeout
                ):
                    cause = f"it sent no heartbeat for over {self.heartbeat_timeout:.1f}s"
                    event = E.SILENT
                else:
                    continue
                if self._step(e, event) is S.DEAD:
                    e.cause = cause
                    out.append(Verdict(p, cause))
        return out

    def next_deadline(self) -> float | None:
        """The clock at which ``tick`` could next declare someone dead (for the poll timeout)."""
        with self._lock:
            due = [
                e.lost_at + self.route_grace if e.state is S.SUSPECT else e.heard_at + self.heartbeat_timeout
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

    @staticmethod
    def _step(e: _Entry, event: Event) -> PeerState:
        e.state = TRANSITIONS.get((e.state, event), e.state)
        return e.state
