"""Dynamic groups: ``init_rpc`` without a world size joins a running group; ``shutdown``
leaves it; members that die are evicted (docs/dynamic-groups.md).

Owns: the membership of a dynamic group as the store records it (claims of names and ranks,
the event log), this worker's view of it (``members``), and the follower thread that keeps
the runtime's worker tables, device plan and transport mesh in step with the log. Imports
from rrefrt: errors, options, devices, rendezvous (Record, GroupSpec, RendezvousError),
store, torch_store. The transport only through ``rt.transport`` (``add_peers`` /
``remove_peer`` of the Transport protocol) and its address types.

Keys (under ``rpc/dyn/``; no generations: a dynamic group lives as long as its store):

    name/<name>       claim counter of a name: 1 = held; released (-1) on leave / eviction
    rank/<r>          claim counter of a rank: never released (NOTE [Ranks are not reused])
    events            counter: the number of events appended so far
    event/<n>         msgpack [kind, rank, incarnation, name, record, cause]; kind is
                      "join" (record: the joiner's rendezvous Record), "leave" or "evict"
    gone/<r>/<inc>    add(1) == 1 wins the right to end incarnation <inc> of rank <r>: the
                      leaver and every member that saw it die race for it; one event results

NOTE [Membership log]
  There is no lock: every change is one append (``n = add(events, 1)``, then
  ``set(event/<n>)``), so a worker that dies half-way blocks nobody (torch's group token
  can). The log is the truth: a joiner reads events 1..n-1 to build its member table and
  connects to those members; members learn of it by following the log (a parked store
  ``wait`` on the next event: milliseconds). A counted event whose record is still missing
  after ``EVENT_GRACE_S`` is skipped and re-checked on every later pass, so a slow writer
  is still met late rather than never.

NOTE [Ranks are not reused]
  RRef and fork ids carry the owner's rank, and peers fence a dead rank for the life of
  their transport, so a rank that left or was evicted is not handed out again while the
  group lives: a joiner that claims it is refused with a clear error (names are reused).

NOTE [Who hosts the store]
  rrefrt-run hosts it (RREFRT_STORE_HOSTED=1), or torch's store where torch holds one, or
  ``file://``; otherwise the first worker that binds MASTER_PORT hosts it and the others
  join as clients. That worker's shutdown ends the store: after it no one can join or
  leave through the log (members keep calling each other; the follower logs it once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any, Callable
from typing import TYPE_CHECKING

import msgpack

import rrefrt_transport as transport
from rrefrt.runtime.collection import collect_fully
from rrefrt.payload.devices import DeviceInfo, DevicePlan
from rrefrt.errors import AuthenticationError, RpcError, ShutdownError
from rrefrt.options import WorkerInfo
from rrefrt.group.rendezvous import GroupSpec, Record, RendezvousError, torch_pg_initialized
from rrefrt.group.store import PortInUseError, StoreAuthError, StoreClient, StoreError, StoreServer
from rrefrt.group.torch_store import default_group_store, file_store


if TYPE_CHECKING:
    from rrefrt.runtime.root import Runtime

log = logging.getLogger("rrefrt.membership")

PREFIX = "rpc/dyn/"
#: the highest rank + 1 a dynamic group accepts (the CURVE key space of a secret job)
MAX_RANKS = 1024
#: the follower's longest parked wait for the next event (also its pace for evictions)
FOLLOW_S = 0.5
#: a counted event whose record is missing this long is skipped (NOTE [Membership log])
EVENT_GRACE_S = 5.0
#: a member a joiner cannot reach this long (at least 3 heartbeat timeouts) is evicted
#: rather than waited for until init_timeout (NOTE [Unreachable members])
JOIN_GRACE_S = 15.0

JOIN, LEAVE, EVICT = "join", "leave", "evict"
LEFT = "left the group"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    rank: int
    incarnation: int
    name: str
    record: bytes = b""
    cause: str = ""

    def to_wire(self) -> bytes:
        return msgpack.packb([self.kind, self.rank, self.incarnation, self.name, self.record, self.cause])

    @classmethod
    def from_wire(cls, data: bytes) -> "Event":
        kind, rank, inc, name, record, cause = msgpack.unpackb(data)
        return cls(str(kind), int(rank), int(inc), str(name), bytes(record), str(cause))


def _open_store(spec: GroupSpec, secret: str | bytes | None, who: str, timeout: float) -> tuple[Any, StoreServer | None]:
    """NOTE [Who hosts the store]."""
    if spec.file_path is not None:
        return file_store(spec.file_path, -1, timeout), None
    store = default_group_store(spec.master_addr, spec.master_port, timeout, spec.explicit) if torch_pg_initialized() else None
    if store is not None:
        return store, None
    if os.environ.get("RREFRT_STORE_HOSTED") != "1":
        try:
            server = StoreServer(spec.master_addr, spec.master_port, secret=secret, label=who)
        except PortInUseError:
            server = None  # someone hosts it already (or the port is taken: the client says so)
        if server is not None:
            try:
                return StoreClient(spec.master_addr, spec.master_port, timeout, secret, identity=who), server
            except BaseException:
                server.close()
                raise
    return StoreClient(spec.master_addr, spec.master_port, timeout, secret, identity=who), None


class Membership:
    """A dynamic group as one worker sees it. ``join`` (init_rpc), ``follow`` (after the
    mesh is up), ``leave`` (shutdown), ``close``. Stored as the runtime's ``group``."""

    def __init__(self, spec: GroupSpec, timeout: float, secret: str | bytes | None, name: str) -> None:
        self.spec = spec
        self.name = name
        self.where = spec.file_path or f"{spec.master_addr}:{spec.master_port}"
        self.who = f"worker {name!r} (rank {spec.rank}, pid {os.getpid()} on {socket.gethostname()})"
        #: duck-typed like Rendezvous for lifecycle's messages (``server``, ``spec``)
        self.server: StoreServer | None = None
        if not 0 <= spec.rank < MAX_RANKS:
            raise RendezvousError(f"a dynamic group takes ranks in [0, {MAX_RANKS}); got rank={spec.rank}")
        try:
            self.store, self.server = _open_store(spec, secret, self.who, timeout)
        except StoreAuthError as e:
            raise AuthenticationError(f"{self.who} could not join the rendezvous store: {e}; see docs/security.md") from None
        except StoreError as e:
            raise RendezvousError(f"{self.who} could not reach the dynamic group's store at {self.where}: {e}") from None
        self.me: Record | None = None
        self.members: dict[int, Record] = {}  #: rank -> record, this worker excluded
        self._next = 1  #: the next event to read
        self._skipped: dict[int, float] = {}  #: event index -> when it was first found missing
        self._ended: set[tuple[int, int]] = set()  #: (rank, incarnation) we raced to end
        self._rt: Runtime | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_lost = False
        self._left = False  #: our leave is (being) appended
        self._name_claim: str | None = None  #: claimed, not yet in the log

    # ------------------------------------------------------------------ join (init_rpc)
    def join(self, record: Record, deadline: float) -> list[Record]:
        """Claim name and rank, append our join, read the log; return every member's record
        (ours included). Raises RendezvousError with torch's "is not unique" phrase."""
        try:
            return self._join(record, deadline)
        except StoreError as e:
            raise RendezvousError(
                f"{self.who} could not join the dynamic group: its store at {self.where} failed ({e}); the "
                "worker that hosts it may have left") from None

    def _join(self, record: Record, deadline: float) -> list[Record]:
        st = self.store
        if st.check(["rpc/init_count"]):
            raise RendezvousError(
                f"{self.who}: the store at {self.where} serves a static group (started with a world size); "
                "RPC group mixes statically and dynamically initialized members which is not supported."
            )
        self._catch_up(st.add(self.key("events"), 0), deadline)
        if st.add(self.key(f"name/{record.name}"), 1) != 1:
            st.add(self.key(f"name/{record.name}"), -1)
            held = [r for r in self.members.values() if r.name == record.name]
            by = f" (held by rank {held[0].rank})" if held else " (held by a member that is joining)"
            raise RendezvousError(
                f"{self.who} cannot join the group at {self.where}: RPC worker name {record.name!r} is not unique"
                f"{by}; give every worker its own name"
            )
        if st.add(self.key(f"rank/{record.rank}"), 1) != 1:
            st.add(self.key(f"rank/{record.rank}"), -1)
            st.add(self.key(f"name/{record.name}"), -1)
            held = self.members.get(record.rank)
            by = (f"it is held by worker {held.name!r}" if held is not None else
                  "it was used by a worker that left or was evicted (ranks are not reused in a running group)")
            raise RendezvousError(
                f"{self.who} cannot join the group at {self.where}: rank {record.rank} is not unique: {by}; "
                "join with a rank not yet used in this group"
            )
        self._name_claim = record.name
        n = st.add(self.key("events"), 1)
        st.set(self.key(f"event/{n}"), Event(JOIN, record.rank, record.incarnation, record.name, record.to_wire()).to_wire())
        self.me = record
        self._catch_up(n - 1, deadline)
        self._next = max(self._next, n + 1)
        return [*self.members.values(), record]

    def key(self, suffix: str) -> str:
        return PREFIX + suffix

    def _catch_up(self, upto: int, deadline: float) -> None:
        while self._next <= upto:
            n = self._next
            left = min(EVENT_GRACE_S, deadline - time.monotonic())
            try:
                data = self.store.get(self.key(f"event/{n}"), max(0.05, left))
            except StoreError as e:
                if "did not appear" not in str(e):
                    raise
                self._skipped.setdefault(n, time.monotonic())
                log.warning("%s: membership event %d was counted but never written (its writer died?); skipped", self.who, n)
            else:
                self._apply(Event.from_wire(data))
            self._next = n + 1

    def _apply(self, ev: Event) -> None:
        me = self.me
        if me is not None and ev.rank == me.rank and ev.incarnation == me.incarnation:
            if ev.kind == EVICT:
                log.error("%s was evicted from the group: %s", self.who, ev.cause)
            return
        if ev.kind == JOIN:
            rec = Record.from_wire(ev.record)
            self.members[rec.rank] = rec
            if self._rt is not None and not self._left:  # after our leave: only counted
                self._joined(rec)
            return
        rec = self.members.get(ev.rank)
        if rec is None or rec.incarnation != ev.incarnation:
            return
        del self.members[ev.rank]
        if self._rt is not None:
            self._departed(rec, LEFT if ev.kind == LEAVE else f"was evicted from the group ({ev.cause})")

    # ------------------------------------------------------------------ the runtime's side
    def peer_specs(self, records: list[Record]) -> list[Any]:
        return [transport.PeerSpec(r.rank, r.name, r.incarnation, transport.PeerAddress.from_wire(r.address))
                for r in records]

    def device_plan(self, records: list[Record], is_local: Callable[[str], bool]) -> DevicePlan:
        """The plan over the current members; maps to workers not (yet) present are kept
        aside, not errors (they apply once that worker joins)."""
        assert self.me is not None
        infos = {r.name: DeviceInfo.from_meta(r.name, r.meta.get("devices")) for r in records}
        infos = {n: dataclasses.replace(i, maps={p: m for p, m in i.maps.items() if p in infos}) for n, i in infos.items()}
        return DevicePlan.build(self.me.name, infos, is_local)

    def connect(self, rt: Runtime, peers: list[Any], timeout: float) -> None:
        """The joiner's mesh: register every member it read, follow the log, then wait
        (``timeout``) for the members; those that leave or are evicted meanwhile are dropped
        rather than waited for (the follower removes them), those that join meanwhile are
        added. Raises what ``Transport.add_peers`` raises."""
        rt.transport.add_peers(peers, 0)
        self.follow(rt)
        deadline = time.monotonic() + timeout
        grace = min(timeout, max(JOIN_GRACE_S, 3 * rt.options.heartbeat_timeout))
        try:
            rt.transport.add_peers(peers, grace)
            return
        except transport.PeersUnreachable as e:
            if time.monotonic() >= deadline:
                raise
            late = set(e.ids)
        # NOTE [Unreachable members]: a member never heard from is never judged dead by the
        # transport (it may be slow to start); one that died before we met it would be
        # waited for until init_timeout. After the grace, the joiner evicts it.
        for rank in late:
            rec = self.members.get(rank)
            if rec is not None and (rank, rec.incarnation) not in self._ended:
                self._ended.add((rank, rec.incarnation))
                cause = f"unreachable for {grace:.0f}s by worker {self.name!r}, which was joining"
                self._end(rec, EVICT, cause)
                if self.members.pop(rank, None) is not None:  # here at once, not when the log says so
                    self._departed(rec, f"was evicted from the group ({cause})")
        rt.transport.add_peers([p for p in peers if p.id not in late], max(0.1, deadline - time.monotonic()))

    def follow(self, rt: Runtime) -> None:
        """Start following the log for ``rt`` (its members registered with its transport)."""
        self._rt = rt
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-{self.name}-membership", daemon=True)
        self._thread.start()

    def _joined(self, rec: Record) -> None:
        rt = self._rt
        info = WorkerInfo(rec.name, rec.rank)
        self._replan()
        rt.departed.pop(rec.name, None)
        rt.set_world([info])
        rt.transport.add_peers(self.peer_specs([rec]), 0)  # the joiner waits for the mesh; we need not
        log.info("worker %r: %r (rank %d) joined the group", self.name, rec.name, rec.rank)

    def _departed(self, rec: Record, reason: str) -> None:
        rt = self._rt
        rt.transport.remove_peer(rec.rank, f"it {reason}")  # pending calls fail now, naming it
        rt.forget_worker(WorkerInfo(rec.name, rec.rank), reason)
        self._replan()
        log.info("worker %r: %r (rank %d) %s", self.name, rec.name, rec.rank, reason)

    def _replan(self) -> None:
        rt, me = self._rt, self.me
        if me is None or rt.devices is None:
            return
        here = {r.name: r.address.get("host") for r in [*self.members.values(), me]}
        try:
            rt.devices = self.device_plan([*self.members.values(), me], lambda p: here.get(p) == here[me.name])
        except RpcError as e:  # a member's maps do not fit a newcomer: calls between them fail
            log.error("worker %r: the device plan could not be updated: %s", self.name, e)

    # ------------------------------------------------------------------ the follower
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except StoreError as e:
                if self._stop.is_set():
                    return
                self._store_lost = True
                log.warning(
                    "worker %r: the dynamic group's store at %s is gone (%s); joins, leaves and evictions are no "
                    "longer seen (its host left the group)", self.name, self.where, e)
                return
            except Exception:  # a membership change could not be applied here: keep following
                if self._stop.is_set():
                    return
                log.exception("worker %r: a membership change could not be applied", self.name)
                self._stop.wait(FOLLOW_S)

    def _pass(self) -> None:
        self._evict_dead()
        st, n = self.store, self._next
        for k, since in list(self._skipped.items()):  # NOTE [Membership log]: met late
            if st.check([self.key(f"event/{k}")]):
                del self._skipped[k]
                self._apply(Event.from_wire(st.get(self.key(f"event/{k}"), 1.0)))
        if st.wait([self.key(f"event/{n}")], FOLLOW_S):
            self._skipped.pop(n, None)
            self._apply(Event.from_wire(st.get(self.key(f"event/{n}"), 1.0)))
            self._next = n + 1
        elif st.add(self.key("events"), 0) >= n:
            since = self._skipped.setdefault(n, time.monotonic())
            if time.monotonic() - since > EVENT_GRACE_S:
                log.warning("worker %r: membership event %d is still missing; skipped (re-checked later)", self.name, n)
                self._next = n + 1
        elif n in self._skipped:
            del self._skipped[n]

    def _evict_dead(self) -> None:
        """Beyond torch: a member the transport declared dead is evicted (one event, by
        whoever wins ``gone/<r>/<inc>``); everyone drops it when the event arrives."""
        dead = self._rt.transport.dead_peers()
        for rank, rec in list(self.members.items()):
            if rank in dead and (rank, rec.incarnation) not in self._ended:
                self._ended.add((rank, rec.incarnation))
                self._end(rec, EVICT, f"declared dead by worker {self.name!r}")

    def _end(self, rec: Record, kind: str, cause: str) -> bool:
        st = self.store
        if st.add(self.key(f"gone/{rec.rank}/{rec.incarnation}"), 1) != 1:
            return False
        st.add(self.key(f"name/{rec.name}"), -1)
        n = st.add(self.key("events"), 1)
        st.set(self.key(f"event/{n}"), Event(kind, rec.rank, rec.incarnation, rec.name, b"", cause).to_wire())
        if kind == EVICT:
            log.warning("worker %r evicted %r (rank %d) from the group: %s", self.name, rec.name, rec.rank, cause)
        return True

    # ------------------------------------------------------------------ leave (shutdown)
    def stop_following(self, timeout: float) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(max(0.0, timeout))

    def leave(self, deadline: float, wait_for_others: bool = True) -> None:
        """Append our ``leave`` (if nobody evicted us first) and release our name. The host
        of the store then waits (bounded; not in a non-graceful shutdown) until every other
        member left or was evicted: the group cannot outlive its store (NOTE [Who hosts the
        store])."""
        self.stop_following(min(FOLLOW_S + 1.0, max(0.0, deadline - time.monotonic())))
        if self.me is None or self._store_lost:
            return
        self._left = True
        self._end(self.me, LEAVE, LEFT)
        if self.server is None or self._rt is None or not wait_for_others:
            return
        while self.members and time.monotonic() < deadline:
            self._pass()
        if self.members:
            log.warning(
                "worker %r hosts the dynamic group's store and leaves while %s remain(s): nobody can join or leave "
                "through it any more (let them leave first, or start the job with rrefrt-run, which hosts the store)",
                self.name, ", ".join(repr(r.name) for r in self.members.values()))

    def close(self, failed: bool = False) -> None:
        """Close the store client (and the store, when hosted here: NOTE [Who hosts the store])."""
        self._stop.set()
        try:
            if failed and self.me is not None:  # joined the log, then failed: leave it cleanly
                self._end(self.me, LEAVE, "failed to join")
            elif failed and self._name_claim is not None:  # claimed the name only
                self.store.add(self.key(f"name/{self._name_claim}"), -1)
        except Exception:  # the store is gone: nothing to release
            pass
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.close()
            self.server = None


def shutdown_dynamic(rt: Runtime, group: Membership, graceful: bool, limit: float) -> BaseException | None:
    """``shutdown()`` of a dynamic group's member: leave, with no group barrier (others stay).
    Graceful: finish calls in flight, delete this worker's RRef users (bounded until the
    owners acknowledge), then append ``leave``. RRefs this worker owns that members still
    hold fail there with OwnerDiedError once it is gone. Runs on a daemon thread that the
    caller waits for at most ``limit`` + 1 s (a store that stops answering cannot hang it).
    Returns the error to raise, or None; the caller closes the runtime and the group."""
    deadline = time.monotonic() + limit
    box: list[BaseException | None] = []

    def steps() -> None:
        error: BaseException | None = None
        try:
            if graceful:
                busy = not rt.lifecycle.wait_idle(deadline)
                collect_fully(deadline)  # NOTE [Drops before a collection]
                rt.control.sync(deadline)
                rt.control.perform(rt.ctx.delete_all_users())
                rt.ctx.wait_users_settled(deadline)
                rt.accepting = False
                if busy:
                    error = ShutdownError(
                        f"shutdown of {rt.info.name!r}: calls in flight had not finished at the timeout - a handler "
                        "that never returns? They were abandoned")
            rt.accepting = False
            group.leave(deadline, wait_for_others=graceful)
        except RpcError as e:
            error = e
        except Exception as e:  # the store failed under us: still close
            error = ShutdownError(f"shutdown of {rt.info.name!r} could not record its leave in the store: {e}")
        box.append(error)

    t = threading.Thread(target=steps, name=f"rrefrt-{rt.info.name}-leave", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    if box:
        return box[0]
    rt.accepting = False
    return ShutdownError(
        f"shutdown of {rt.info.name!r} did not complete within {limit:.1f}s: the dynamic group's store at "
        f"{group.where} did not answer. The runtime was closed anyway.")


__all__ = ["Membership", "Event", "MAX_RANKS", "PREFIX", "shutdown_dynamic"]
