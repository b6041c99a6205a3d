"""The RRef protocol state machine (rrefrt.protocol.context) on its own, without I/O.

Part 1 drives the RRefContexts of three simulated workers with hypothesis: a simulated
network holds the messages in flight and rules deliver them in any order, each exactly
once. Each simulated worker is a ``SimWorker``: the real dispatch of the runtime
(rrefrt.runtime.control.ControlLoop with its handler table, rrefrt.runtime.creation.CreationTracker,
rrefrt.runtime.callee.Callee.finish) over a fake transport whose sends land in the simulated
network, decoded with rrefrt.protocol.messages.decode as a receiver would. The control queue is
drained synchronously after each step, so each step is deterministic. Only what is not
protocol stays in the model: the user pool (a "run" event), serialization (a fetch answer
carries the record), and turning fork data into RRef objects. A ground truth kept by the
test (live RRef objects, forks in flight) checks G1 and G2 at every step and the absence
of leaks at teardown.

Part 2 holds deterministic tests of single scenarios (message orders that matter, peer
death, validate()).
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import queue
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rrefrt.runtime.callee import Callee
from rrefrt.runtime.control import ControlLoop, Dropped, Incoming
from rrefrt.runtime.creation import CreationTracker
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads
from rrefrt.runtime.replies import Replies
from rrefrt.runtime.requests import Requests
from rrefrt.errors import OwnerDiedError, RpcError
from rrefrt.protocol.ids import ForkId, IdGenerator, RRefId
from rrefrt.protocol.messages import (
    ChildAccept,
    Fetch,
    ForkData,
    ForkRequest,
    PythonCall,
    Release,
    RemoteRequest,
    RemoteRet,
    ServeFetch,
    UserDelete,
    decode,
)
from rrefrt.options import WorkerInfo
from rrefrt.protocol.context import FAILED, PENDING, READY, OwnerRecord, RRefContext, UserRecord

WORKERS = (0, 1, 2)
PAIRS = [(a, b) for a in WORKERS for b in WORKERS if a != b]
ZERO_COUNTS = {
    "num_owner_rrefs": 0,
    "num_forks": 0,
    "num_pending_users": 0,
    "num_pending_children": 0,
    "num_confirmed_users": 0,
    "num_deleting_users": 0,
    "num_unregistered_users": 0,
}


def new_ctx(worker: int) -> RRefContext:
    return RRefContext(worker, IdGenerator(worker))


# ====================================================================== part 1: model
@dataclass(eq=False)
class Front:
    """A Python RRef object on ``worker``: a UserRRef (``rec`` is a UserRecord) or an
    OwnerRRef (``rec`` is the OwnerRecord itself)."""

    worker: int
    kind: str  # "user" | "owner"
    rid: RRefId
    rec: Any
    pins: int = 0  # to_here() calls in progress (the object is referenced until they return)

    def __repr__(self) -> str:
        fid = self.rec.fork_id if self.kind == "user" else "-"
        return f"Front(w{self.worker} {self.kind} rref={self.rid} fork={fid})"


@dataclass(eq=False)
class Msg:
    """In flight: a protocol message (``kind`` is its class from rrefrt.protocol.messages, the one
    name it has everywhere; ``args["msg"]`` the decoded message), a response ("reply"), or
    a model event ("run": the user pool runs a creating function; "fetch_ret")."""

    kind: Any
    src: int
    dest: int
    args: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.args.items() if k not in ("value", "rec", "front", "frames")}
        name = getattr(self.kind, "NAME", self.kind)
        return f"Msg({name} {self.src}->{self.dest} {shown})"


class SimWorker:
    """What the runtime's real dispatch needs of a runtime, for one simulated worker: its
    context, and a transport / callback pool that hand everything to the model."""

    def __init__(self, machine: "RRefProtocolMachine", worker: int) -> None:
        self.m = machine
        self.id = worker
        self.info = WorkerInfo(f"w{worker}", worker)
        self.ctx = machine.ctxs[worker]
        self.stats: collections.Counter = collections.Counter()
        self.control_retry_interval, self.control_attempts, self.closed = 2.0, 15, False
        self.transport = self.callbacks = self
        #: msg_id -> (message, on_done) of the requests this worker sent
        self.pending: dict[int, tuple[Any, Any]] = {}
        # the runtime's parts, wired as the composition root wires them (rrefrt/runtime/root.py)
        core: Any = self
        self.replies = Replies(core)
        self.control = ControlLoop(core, self.replies, serve_fetch=self._serve_fetch,  # never started:
                                   creation_lost=lambda fid, dest: self.creation.on_lost(fid, dest))  # drain() runs its items
        self.lifecycle = Lifecycle(core, self.control)
        self.payloads = Payloads(core, self.control, host=core)
        self.requests = Requests(core, self.control, self.lifecycle, self.payloads)
        self.creation = CreationTracker(core, self.control, self.replies, self.requests)
        self.callee = Callee(core, self.control, self.lifecycle, self.payloads, self.replies, self.creation)

    def worker_name(self, worker: int) -> str:
        return f"w{worker}"

    # the transport
    def request(self, dest: int, kind: int, meta: Any, frames: Any, timeout: float, on_done: Any, label: str = "") -> int:
        msg = decode(kind, meta, dest)  # what the receiver's dispatch will see
        mid = next(self.m.msg_ids)
        self.pending[mid] = (msg, on_done)
        self.m.sent(self.id, msg)
        self.m.net.append(Msg(type(msg), self.id, dest, {"msg": msg, "msg_id": mid, "frames": list(frames)}))
        return mid

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Any = (), label: str = "") -> None:
        self.m.net.append(Msg("reply", self.id, dest, {"msg_id": msg_id, "meta": meta, "frames": list(frames)}))

    def call_later(self, delay: float, fn: Any) -> None:
        fn()  # the accept timer fires at once: every creation takes the slow path (REMOTE_RET)

    # the callback pool: Release and ServeFetch arrive here (their home thread)
    def submit(self, fn: Any, *args: Any) -> None:
        target = getattr(fn, "__self__", None)
        if isinstance(target, list):  # NOTE [Release home]: box.clear of a released record
            if target:
                for rec in target:  # the Releases of one action list share a box
                    self.m._check_release(self.id, rec)
            return
        fn(*args)

    def _serve_fetch(self, sf: Any) -> None:
        """The control loop's home for ServeFetch (the callee's in the runtime): serialization
        is not modelled, the value's record travels as the answer."""
        self.m.net.append(Msg("fetch_ret", self.id, sf.src, {"msg_id": sf.msg_id, "rec": sf.record}))

    def drain(self) -> None:
        """Run every control item enqueued so far (the control thread, synchronously)."""
        q = self.control.queue
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            self.control._handlers[type(item)](item)


def _tracked(fn: Any) -> Any:
    """Remember that a step failed, so teardown does not pile a second error on top."""

    @functools.wraps(fn)
    def wrapper(self: "RRefProtocolMachine", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self.failed = True
            raise

    return wrapper


class RRefProtocolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctxs = [new_ctx(w) for w in WORKERS]
        self.net: list[Msg] = []  # in flight, delivered in any order
        self.fronts: list[Front] = []  # live Python RRef objects
        self.owner_of: dict[RRefId, int] = {}
        self.values: dict[RRefId, object] = {}
        #: the one OwnerRecord each RRef may ever have on its owner (a second one means the
        #: owner dropped the first while it was still referenced, then re-created it empty).
        #: Weak, like the runtime: a record lives only while the context or an RRef object
        #: holds it, so a record dropped too early really disappears here too.
        self.canonical: dict[RRefId, weakref.ref[OwnerRecord]] = {}
        #: forks whose holder has received the owner's confirmation (REMOTE_RET, the fork
        #: request's ack, or a fork sent by the owner itself)
        self.confirmed: set[ForkId] = set()
        #: child fork id -> (parent worker, parent fork id), from fork_user until the child's
        #: RREF_CHILD_ACCEPT reaches the parent (or the send is aborted)
        self.open_children: dict[ForkId, tuple[int, ForkId]] = {}
        self.deletes_sent: set[ForkId] = set()
        self.fetches: dict[int, Front] = {}
        self.msg_ids = itertools.count(1)
        self.failed = False
        #: rref id -> (value, fails): what the creating function of a remote() will do
        self.creations: dict[RRefId, tuple[object, bool]] = {}
        self.workers = [SimWorker(self, w) for w in WORKERS]

    # ------------------------------------------------------------------ ground truth
    def _refs(self, rid: RRefId) -> list[Any]:
        """What needs the owner's record of ``rid``: live UserRRefs and messages carrying
        one of its forks (G2)."""
        out: list[Any] = [f for f in self.fronts if f.kind == "user" and f.rid == rid]
        out += [m for m in self.net if m.kind is PythonCall and m.args["msg"].forks[0].rref_id == rid]
        return out

    def _undeleted_user_forks(self, rid: RRefId) -> list[UserRecord]:
        return [
            rec
            for c in self.ctxs
            for table in (c.pending_users, c.confirmed_users)
            for rec in table.values()
            if rec.rref_id == rid
        ]

    def _observe_owner(self, worker: int, rid: RRefId, rec: OwnerRecord) -> None:
        assert self.owner_of[rid] == worker, f"worker {worker} has an owner record of {rid} it does not own"
        known = self.canonical.setdefault(rid, weakref.ref(rec))()
        assert rec is known, (
            f"worker {worker} re-created the owner record of {rid}: the first one was dropped while "
            "still referenced (G2: an OwnerRRef died before its last user)"
        )

    @staticmethod
    def _usable(f: Front) -> bool:
        """RRef._check passes: an OwnerRRef, or a UserRRef whose record has no error."""
        return f.kind == "owner" or f.rec.error is None

    def _pick(self, idx: int, kind: str | None = None, usable: bool = False, unpinned: bool = False) -> Front:
        cands = [
            f
            for f in self.fronts
            if (kind is None or f.kind == kind) and not (usable and not self._usable(f)) and not (unpinned and f.pins)
        ]
        assert cands, "precondition let an impossible step through"
        return cands[idx % len(cands)]

    # ------------------------------------------------------------------ actions -> messages
    def _perform(self, worker: int, actions: list[Any]) -> None:
        """Actions returned by a context outside the control thread (the runtime's
        ``control.perform``), then the control thread runs."""
        w = self.workers[worker]
        w.control.perform(actions)
        w.drain()

    def sent(self, worker: int, msg: Any) -> None:
        """Checked as each message leaves (G1 for deletes)."""
        if isinstance(msg, ForkRequest):
            assert msg.dest == self.owner_of[msg.rref_id], "fork request sent to a non-owner"
        elif isinstance(msg, UserDelete):
            assert msg.dest == self.owner_of[msg.rref_id], "user delete sent to a non-owner"
            assert msg.fork_id in self.confirmed, f"G1: fork {msg.fork_id} deleted before the owner confirmed it"
            assert msg.fork_id not in self.deletes_sent, f"fork {msg.fork_id} deleted twice"
            kids = [c for c, p in self.open_children.items() if p == (worker, msg.fork_id)]
            assert not kids, f"G1: fork {msg.fork_id} deleted while its children {kids} are not accepted"
            self.deletes_sent.add(msg.fork_id)
        else:
            assert isinstance(msg, (ChildAccept, RemoteRequest, RemoteRet, Fetch)), f"unexpected {msg!r}"

    def _check_release(self, worker: int, rec: OwnerRecord) -> None:
        rid = rec.rref_id
        self._observe_owner(worker, rid, rec)
        assert rec.state != PENDING, f"released {rid} before its value was set"
        assert rid not in self.ctxs[worker].owners, f"Release of {rid} still in owners"
        refs = self._refs(rid)
        assert not refs, f"G2: owner {worker} released {rid} while still referenced by {refs}"

    # ------------------------------------------------------------------ rules: user code
    @initialize(pair=st.sampled_from(PAIRS))
    @_tracked
    def first_remote(self, pair: tuple[int, int]) -> None:
        self.remote(pair, False)

    @rule(pair=st.sampled_from(PAIRS), fails=st.sampled_from([False, False, False, True]))
    @_tracked
    def remote(self, pair: tuple[int, int], fails: bool) -> None:
        """runtime.remote() to another worker; the function may raise (``fails``)."""
        creator, owner = pair
        rec = self.ctxs[creator].new_remote_user(owner)
        rid = rec.rref_id
        assert rec.fork_id == rid and rid not in self.owner_of
        self.owner_of[rid] = owner
        self.values[rid] = value = object()
        self.fronts.append(Front(creator, "user", rid, rec))
        self.creations[rid] = (value, fails)
        # rrefrt.runtime.caller.Caller.remote: the creation goes through the creator's tracker
        self.workers[creator].creation.send(RemoteRequest(owner, rid, rec.fork_id, "object", ()), [])

    @rule(worker=st.sampled_from(WORKERS))
    @_tracked
    def local_rref(self, worker: int) -> None:
        """RRef(value) on ``worker``: an OwnerRRef, not in ``owners`` until forked."""
        value = object()
        rec = self.ctxs[worker].new_local_owner(value, "object")
        self.owner_of[rec.rref_id] = worker
        self.values[rec.rref_id] = value
        self._observe_owner(worker, rec.rref_id, rec)
        self.fronts.append(Front(worker, "owner", rec.rref_id, rec))

    def _fork(self, front: Front, dest: int) -> ForkData:
        """runtime._fork: the RRef is pickled into a message to ``dest``."""
        ctx = self.ctxs[front.worker]
        if front.kind == "owner":
            data = ctx.fork_owned(front.rec, dest)
            assert data.parent == front.worker == data.owner
        else:
            assert front.rec.alive and front.rec.error is None
            data = ctx.fork_user(front.rec, dest)
            assert data.parent == front.worker and data.owner == front.rec.owner
            self.open_children[data.fork_id] = (front.worker, front.rec.fork_id)
        assert data.rref_id == front.rid
        return data

    @precondition(lambda self: any(map(self._usable, self.fronts)))
    @rule(idx=st.integers(0, 1000), dest=st.sampled_from(WORKERS))
    @_tracked
    def send_rref(self, idx: int, dest: int) -> None:
        """rpc/remote to ``dest`` (itself included) with the RRef as an argument."""
        front = self._pick(idx, usable=True)
        data = self._fork(front, dest)
        self.net.append(Msg(PythonCall, front.worker, dest, {"msg": PythonCall(dest, (data,))}))

    @precondition(lambda self: any(map(self._usable, self.fronts)))
    @rule(idx=st.integers(0, 1000), dest=st.sampled_from(WORKERS))
    @_tracked
    def send_rref_fails(self, idx: int, dest: int) -> None:
        """The message carrying the fork could not be sent: runtime._abort_forks."""
        front = self._pick(idx, usable=True)
        data = self._fork(front, dest)
        self.open_children.pop(data.fork_id, None)
        self._perform(front.worker, self.ctxs[front.worker].abort_fork(data))

    @precondition(lambda self: any(f.pins == 0 for f in self.fronts))
    @rule(idx=st.integers(0, 1000))
    @_tracked
    def drop(self, idx: int) -> None:
        """The Python RRef object goes away (RRef.__del__ -> enqueue_drop)."""
        front = self._pick(idx, unpinned=True)
        self.fronts.remove(front)
        if front.kind == "user":  # RRef.__del__ -> runtime.enqueue_drop
            self.workers[front.worker].control.put(Dropped(front.rec.fork_id))
            self.workers[front.worker].drain()

    @precondition(lambda self: any(f.kind == "user" and self._usable(f) for f in self.fronts))
    @rule(idx=st.integers(0, 1000))
    @_tracked
    def to_here(self, idx: int) -> None:
        """A UserRRef fetches its value: RREF_FETCH, answered (maybe later) by ServeFetch.
        The object stays referenced until the answer arrives (to_here() is running)."""
        front = self._pick(idx, kind="user", usable=True)
        front.pins += 1
        msg = Fetch(front.rec.owner, front.rid, front.rec.fork_id)  # rrefrt.runtime.caller.Caller.fetch
        mid = self.workers[front.worker].request(msg.dest, msg.KIND, msg.meta(), [], 0.0, None, msg.NAME)
        self.fetches[mid] = front

    # ------------------------------------------------------------------ rules: the network
    def _deliver(self, idx: int) -> None:
        msg = self.net.pop(idx % len(self.net))
        self._handle(msg)

    @precondition(lambda self: self.net)
    @rule(idx=st.integers(0, 1000))
    @_tracked
    def deliver(self, idx: int) -> None:
        self._deliver(idx)

    @precondition(lambda self: self.net)
    @rule(idx=st.integers(0, 1000))
    @_tracked
    def deliver_more(self, idx: int) -> None:  # a second rule: delivery is chosen more often
        self._deliver(idx)

    @precondition(lambda self: self.net)
    @rule(idx=st.integers(0, 1000))
    @_tracked
    def deliver_even_more(self, idx: int) -> None:
        self._deliver(idx)

    def _handle(self, m: Msg) -> None:
        """Deliver ``m`` to its worker through the runtime's real handlers (the handler
        table of rrefrt/runtime/root.py: control messages to the control loop, creations and
        their results to the creation tracker)."""
        w, worker = m.dest, self.workers[m.dest]
        ctx, a = self.ctxs[w], m.args
        msg = a.get("msg")
        if m.kind is RemoteRequest:
            # Callee.on_remote_request: register the creator's fork; the function then runs
            # on the pool while other messages keep arriving ("run" below)
            rec = worker.creation.on_request(m.src, a["msg_id"], msg)
            assert rec is not None and rec.created, "a creation delivered once was taken for a duplicate"
            self._observe_owner(w, msg.rref_id, rec)
            self.net.append(Msg("run", w, w, {"msg": msg, "creator": m.src, "rec": rec}))
        elif m.kind == "run":
            # the pool finished the creating function: Callee.finish (set_value, REMOTE_RET)
            rec = a["rec"]
            value, fails = self.creations.pop(msg.rref_id)
            err = RuntimeError("user function failed") if fails else None
            worker.callee.finish(a["creator"], msg, 0, rec, value, err)
            assert rec.state == (FAILED if err else READY)
            assert rec.value is value if err is None else rec.error is err
        elif m.kind is RemoteRet:
            self.confirmed.add(msg.rref_id)
            worker.creation.on_remote_ret(m.src, a["msg_id"], msg, a["frames"])
        elif m.kind is PythonCall:
            # Caller.rrefs_from_forks: the fork data becomes an RRef object (model: a Front)
            (data,) = msg.forks
            rec, actions = ctx.on_fork_received(data, m.src)
            if data.owner == w:
                assert isinstance(rec, OwnerRecord)
                self._observe_owner(w, data.rref_id, rec)
                self.fronts.append(Front(w, "owner", data.rref_id, rec))
            else:
                assert isinstance(rec, UserRecord) and rec.alive and rec.error is None
                assert rec.fork_id == data.fork_id and rec.owner == data.owner
                if data.parent == data.owner:
                    self.confirmed.add(data.fork_id)  # early fork registration by the owner
                self.fronts.append(Front(w, "user", data.rref_id, rec))
            self._perform(w, actions)
            return
        elif m.kind in (Fetch, ForkRequest, ChildAccept, UserDelete):
            if m.kind is ChildAccept:
                parent = self.open_children.pop(msg.fork_id, None)
                assert parent is not None and parent[0] == w, f"unexpected child accept {m!r}"
            elif m.kind is UserDelete:
                assert msg.fork_id in ctx.forks.get(msg.rref_id, {}), f"G1: {m!r} arrived before the owner registered the fork"
            worker.control.put(Incoming(m.src, a["msg_id"], msg))  # through the control thread's queue
            if m.kind in (Fetch, ForkRequest):
                worker.drain()
                rec = ctx.owned_record(msg.rref_id)
                if rec is not None:
                    self._observe_owner(w, msg.rref_id, rec)
        elif m.kind == "reply":
            about, on_done = worker.pending.pop(a["msg_id"])
            if isinstance(about, ForkRequest):
                self.confirmed.add(about.fork_id)
            elif isinstance(about, UserDelete):
                assert about.fork_id in ctx.deleting_users
            if on_done is not None:
                on_done(a["meta"], a["frames"], None)
        elif m.kind == "fetch_ret":
            front = self.fetches.pop(a["msg_id"])
            self.workers[w].pending.pop(a["msg_id"])
            rec = a["rec"]
            assert rec is self.canonical[front.rid]() and rec.state in (READY, FAILED)
            if rec.state == READY:
                assert rec.value is self.values[front.rid], "fetch served the wrong value"
            front.pins -= 1
        else:  # pragma: no cover
            raise AssertionError(f"unknown message {m!r}")
        worker.drain()

    # ------------------------------------------------------------------ invariants
    @invariant()
    @_tracked
    def contexts_valid(self) -> None:
        for c in self.ctxs:
            c.validate()

    @invariant()
    @_tracked
    def owner_keeps_referenced_records(self) -> None:
        """G2, structurally: while an RRef is referenced (a live UserRRef, a message with one
        of its forks - to the owner itself included - or an undeleted user fork anywhere),
        its one record stays alive and in the owner's ``owners`` map (once it was there or
        its creation arrived)."""
        for rid, ref in self.canonical.items():
            rec = ref()
            owner = self.ctxs[self.owner_of[rid]]
            in_map = owner.owners.get(rid)
            assert in_map is None or in_map is rec, f"owner record of {rid} replaced"
            referenced = self._refs(rid) + self._undeleted_user_forks(rid)
            if not referenced:
                continue
            assert rec is not None, f"G2: the owner record of {rid} was lost while referenced by {referenced}"
            if rec.created or in_map is not None:
                assert in_map is rec, f"G2: {rid} dropped by its owner while referenced by {referenced}"

    # ------------------------------------------------------------------ teardown
    def _flush(self) -> None:
        for _ in range(10_000):
            if not self.net:
                return
            self._handle(self.net.pop(0))
        raise AssertionError("messages keep coming")

    def teardown(self) -> None:
        if self.failed:
            return
        # deliver everything, then the program lets go of every RRef, until quiet
        for _ in range(50):
            self._flush()
            for c in self.ctxs:
                c.validate()
            if not self.fronts:
                break
            for front in list(self.fronts):
                assert front.pins == 0
                self.fronts.remove(front)
                if front.kind == "user":
                    self.workers[front.worker].control.put(Dropped(front.rec.fork_id))
                    self.workers[front.worker].drain()
        self._flush()
        assert not self.open_children and not self.fetches
        for c in self.ctxs:
            c.validate()
            # no OwnerRRef outlived its last user, no user state left behind
            assert c.counts() == ZERO_COUNTS, f"worker {c.worker_id} leaked: {c.counts()} owners={c.owners} forks={c.forks}"
            assert c.leaks() == []


TestRRefProtocol = RRefProtocolMachine.TestCase
TestRRefProtocol.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRRefProtocol = pytest.mark.timeout(300)(TestRRefProtocol)


# ====================================================================== part 2: scenarios
def _make_confirmed_user(user: RRefContext, owner: RRefContext, value: Any = "v") -> tuple[UserRecord, OwnerRecord]:
    """remote() from ``user`` to ``owner``, every message delivered at once."""
    urec = user.new_remote_user(owner.worker_id)
    orec = owner.on_remote_request(urec.rref_id, urec.fork_id, user.worker_id, "object")
    assert owner.set_value(orec, value) == []
    assert user.on_remote_ret(urec.fork_id, None) == []
    assert urec.confirmed and urec.fork_id in user.confirmed_users
    return urec, orec


def _validate(*ctxs: RRefContext) -> None:
    for c in ctxs:
        c.validate()


def _drained(*ctxs: RRefContext) -> None:
    """Every context is consistent and holds nothing any more."""
    _validate(*ctxs)
    for c in ctxs:
        assert c.counts() == ZERO_COUNTS


def test_user_delete_does_not_overtake_fork_in_flight() -> None:
    """A (user of B's RRef) sends its fork to C and drops its own object at once. A's
    RREF_USER_DELETE must wait for C's RREF_CHILD_ACCEPT, and B keeps the value meanwhile."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id

    data = a.fork_user(urec, 2)  # the fork leaves in a message to C
    assert a.user_dropped(urec.fork_id) == []  # A's object goes away: no delete yet
    assert a.counts()["num_pending_children"] == 1
    _validate(a, b, c)

    crec, actions = c.on_fork_received(data, 0)
    assert isinstance(crec, UserRecord) and not crec.confirmed
    assert actions == [ForkRequest(1, rid, data.fork_id, 0)]
    assert b.owners[rid] is orec  # C's fork request pending: B keeps the value
    _validate(a, b, c)

    b.on_fork_request(rid, data.fork_id, 2)
    assert set(b.forks[rid]) == {urec.fork_id, data.fork_id}
    ack_actions = c.on_fork_request_ack(data.fork_id)
    assert ack_actions == [ChildAccept(0, data.fork_id)]
    assert crec.confirmed
    _validate(a, b, c)

    # the ChildAccept is delayed: A still must not delete; nothing else A does changes that
    assert a.user_dropped(urec.fork_id) == []
    assert a.on_child_accept(ForkId(2, 999)) == []  # an unrelated (stale) accept
    assert a.counts()["num_deleting_users"] == 0
    assert b.owners[rid] is orec and orec.state == READY
    _validate(a, b, c)

    # now the ChildAccept arrives: A deletes its fork, B keeps the value for C
    assert a.on_child_accept(data.fork_id) == [UserDelete(1, rid, urec.fork_id)]
    assert b.on_user_delete(rid, urec.fork_id) == []
    a.on_user_delete_ack(urec.fork_id)
    assert b.owners[rid] is orec
    _validate(a, b, c)

    # C lets go: only now B releases
    assert c.user_dropped(data.fork_id) == [UserDelete(1, rid, data.fork_id)]
    assert b.on_user_delete(rid, data.fork_id) == [Release(orec)]
    c.on_user_delete_ack(data.fork_id)
    _drained(a, b, c)


def test_fork_request_before_parent_registered_keeps_placeholder() -> None:
    """A's PYTHON_REMOTE is overtaken by C's fork request for the same RRef: B must keep
    the placeholder (and reuse it for the creation), not release anything early."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec = a.new_remote_user(1)
    rid = urec.rref_id
    data = a.fork_user(urec, 2)
    _, actions = c.on_fork_received(data, 0)
    assert actions == [ForkRequest(1, rid, data.fork_id, 0)]
    b.on_fork_request(rid, data.fork_id, 2)
    placeholder = b.owners[rid]
    assert placeholder.state == PENDING and not placeholder.created
    assert c.on_fork_request_ack(data.fork_id) == [ChildAccept(0, data.fork_id)]
    assert a.on_child_accept(data.fork_id) == []
    assert a.user_dropped(urec.fork_id) == []  # not confirmed yet (G1)
    assert c.user_dropped(data.fork_id) == [UserDelete(1, rid, data.fork_id)]
    assert b.on_user_delete(rid, data.fork_id) == []  # not created yet: kept
    assert b.owners[rid] is placeholder
    _validate(a, b, c)
    rec = b.on_remote_request(rid, urec.fork_id, 0, "object")
    assert rec is placeholder
    assert b.set_value(rec, "v") == []  # A's fork still registered
    assert a.on_remote_ret(urec.fork_id, None) == [UserDelete(1, rid, urec.fork_id)]
    assert b.on_user_delete(rid, urec.fork_id) == [Release(rec)]
    a.on_user_delete_ack(urec.fork_id)
    c.on_user_delete_ack(data.fork_id)
    for x in (a, b, c):
        x.validate()
        assert x.counts() == ZERO_COUNTS


def test_g1_user_dropped_before_remote_ret_deletes_only_after_it() -> None:
    a, b = new_ctx(0), new_ctx(1)
    urec = a.new_remote_user(1)
    rid = urec.rref_id
    assert a.user_dropped(urec.fork_id) == []  # REMOTE_RET not here yet: no delete (G1)
    assert a.user_dropped(urec.fork_id) == []  # a second drop is harmless
    assert a.counts()["num_pending_users"] == 1 and a.counts()["num_deleting_users"] == 0
    _validate(a, b)

    orec = b.on_remote_request(rid, urec.fork_id, 0, "object")
    assert b.set_value(orec, "v") == []  # the creator's fork keeps it
    _validate(a, b)

    assert a.on_remote_ret(urec.fork_id, None) == [UserDelete(1, rid, urec.fork_id)]
    assert a.counts()["num_deleting_users"] == 1
    assert b.on_user_delete(rid, urec.fork_id) == [Release(orec)]
    a.on_user_delete_ack(urec.fork_id)
    _validate(a, b)
    assert a.counts() == ZERO_COUNTS and b.counts() == ZERO_COUNTS


def test_a_delete_applied_again_changes_nothing() -> None:
    """NOTE [Piggybacked deletes]: the deletes a PYTHON_REMOTE carries come again with its
    retries, and those of a call that timed out are sent again on their own: applying a
    delete again (alone or in a batch, after the value was released) changes nothing."""
    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    keep, korec = _make_confirmed_user(a, b, "kept")
    assert a.user_dropped(urec.fork_id) == [UserDelete(1, urec.rref_id, urec.fork_id)]
    pair = (urec.rref_id, urec.fork_id)
    assert b.on_user_deletes((pair,)) == [Release(orec)]
    for _ in range(2):
        assert b.on_user_deletes((pair,)) == []
        assert b.on_user_delete(*pair) == []
    assert b.owners == {korec.rref_id: korec} and b.forks == {korec.rref_id: {keep.fork_id: 0}}
    a.on_user_deletes_ack([urec.fork_id])
    a.on_user_deletes_ack([urec.fork_id])  # the late ack of the copy sent on its own
    _validate(a, b)
    assert a.counts()["num_deleting_users"] == 0 and a.counts()["num_confirmed_users"] == 1


def test_g1_remote_ret_with_error_then_drop() -> None:
    a, b = new_ctx(0), new_ctx(1)
    urec = a.new_remote_user(1)
    orec = b.on_remote_request(urec.rref_id, urec.fork_id, 0, "object")
    err = ValueError("boom")
    assert b.set_value(orec, error=err) == []
    assert a.on_remote_ret(urec.fork_id, err) == []
    assert urec.error is err and urec.confirmed
    assert a.user_dropped(urec.fork_id) == [UserDelete(1, urec.rref_id, urec.fork_id)]
    assert b.on_user_delete(urec.rref_id, urec.fork_id) == [Release(orec)]


def test_peer_dead_owner_side_drops_forks_and_releases() -> None:
    """B owns an RRef; C (a user) dies: B drops C's forks and releases the value; A's fork
    (alive) keeps another RRef alive untouched."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    c_rec, orec_c = _make_confirmed_user(c, b, "held by C")
    a_rec, orec_a = _make_confirmed_user(a, b, "held by A")
    # C also holds a fork of A's RRef sent by the owner (early registration)
    data = b.fork_owned(orec_a, 2)
    c.on_fork_received(data, 1)
    assert set(b.forks[orec_a.rref_id].values()) == {0, 2}

    actions = b.on_peer_dead(2)
    assert actions == [Release(orec_c)]
    assert orec_c.rref_id not in b.owners and orec_c.rref_id not in b.forks
    assert b.forks[orec_a.rref_id] == {a_rec.fork_id: 0}
    assert b.owners[orec_a.rref_id] is orec_a
    assert b.leaks() == [f"RRef {orec_a.rref_id} fork {a_rec.fork_id} held by worker 0"]
    _validate(a, b)


def test_peer_dead_pending_child_counts_as_accepted() -> None:
    """A forked its RRef to C and dropped its object; C dies before accepting: A's pending
    child counts as accepted and A deletes its fork."""
    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    data = a.fork_user(urec, 2)
    assert a.user_dropped(urec.fork_id) == []
    assert a.on_peer_dead(2) == [UserDelete(1, urec.rref_id, urec.fork_id)]
    assert a.counts()["num_pending_children"] == 0
    assert b.on_user_delete(urec.rref_id, urec.fork_id) == [Release(orec)]
    a.on_user_delete_ack(urec.fork_id)
    # a late CHILD_ACCEPT from the dead child is ignored
    assert a.on_child_accept(data.fork_id) == []
    _validate(a, b)
    assert a.counts() == ZERO_COUNTS and b.counts() == ZERO_COUNTS


def test_peer_dead_users_of_dead_owner_get_owner_died_error() -> None:
    """B (owner) dies: every user record of B's RRefs on A gets OwnerDiedError and leaves
    the maps (pending, confirmed, deleting); pending children of them are settled without
    any message to the dead owner; later RRefs from B fail at once."""
    a, b = new_ctx(0), new_ctx(1)
    confirmed, _ = _make_confirmed_user(a, b)
    pending = a.new_remote_user(1)
    deleting, _ = _make_confirmed_user(a, b)
    assert a.user_dropped(deleting.fork_id) == [UserDelete(1, deleting.rref_id, deleting.fork_id)]
    parent, _ = _make_confirmed_user(a, b)
    child = a.fork_user(parent, 2)
    assert a.user_dropped(parent.fork_id) == []
    other_owner = new_ctx(2)
    survivor, _ = _make_confirmed_user(a, other_owner)

    actions = a.on_peer_dead(1)
    assert actions == []  # nothing is sent to a dead owner
    for rec in (confirmed, pending, deleting):
        assert isinstance(rec.error, OwnerDiedError), rec
    assert survivor.error is None and survivor.fork_id in a.confirmed_users
    assert a.counts() == {**ZERO_COUNTS, "num_confirmed_users": 1}
    a.validate()
    # messages still arriving for them are ignored
    assert a.on_remote_ret(pending.fork_id, None) == []
    assert a.on_child_accept(child.fork_id) == []
    a.on_user_delete_ack(deleting.fork_id)
    assert a.user_dropped(confirmed.fork_id) == []
    # new RRefs of the dead owner fail at once
    late = a.new_remote_user(1)
    assert isinstance(late.error, OwnerDiedError) and late.fork_id not in a.pending_users
    rec, acts = a.on_fork_received(ForkData(confirmed.rref_id, ForkId(2, 77), 1, 2, "object"), 2)
    assert isinstance(rec, UserRecord) and isinstance(rec.error, OwnerDiedError)
    assert acts == [ChildAccept(2, ForkId(2, 77))]  # the parent may let go
    a.validate()


def test_owner_sends_its_rref_to_itself() -> None:
    """An OwnerRRef passed in a call to its own worker (rpc/remote to self): the received
    RRef must refer to the same record (the value), and nothing may leak."""
    b = new_ctx(1)
    rec = b.new_local_owner("value", "str")
    data = b.fork_owned(rec, 1)
    assert data.fork_id != rec.rref_id and b.forks[rec.rref_id] == {data.fork_id: 1}
    got, actions = b.on_fork_received(data, 1)
    assert got is rec and got.value == "value"
    assert actions == [Release(rec)]  # it leaves ``owners``; the new RRef object holds it
    b.validate()
    assert b.counts() == ZERO_COUNTS

    # the same while another fork exists, and that fork is deleted while the message is in
    # flight: the record must still be found on arrival
    a = new_ctx(0)
    to_a = b.fork_owned(rec, 0)
    arec, _ = a.on_fork_received(to_a, 1)
    to_self = b.fork_owned(rec, 1)
    assert a.user_dropped(arec.fork_id) == [UserDelete(1, rec.rref_id, to_a.fork_id)]
    assert b.on_user_delete(rec.rref_id, to_a.fork_id) == []  # the self-fork is in flight
    got, actions = b.on_fork_received(to_self, 1)
    assert got is rec
    assert actions == [Release(rec)]
    b.validate()
    assert b.counts() == ZERO_COUNTS

    # a send to self that fails is undone
    data = b.fork_owned(rec, 1)
    assert b.abort_fork(data) == [Release(rec)]
    assert b.counts() == ZERO_COUNTS


def test_owner_self_send_survives_dropping_the_sender_object() -> None:
    """``rpc_async(self, f, args=(RRef(x),))``: the caller's RRef object may be collected
    before the I/O thread delivers the call to itself. The call must still see the value
    (not an empty placeholder that never gets one and stays in ``owners`` forever)."""
    b = new_ctx(1)
    rec = b.new_local_owner(["value"], "list")
    rid = rec.rref_id
    data = b.fork_owned(rec, 1)
    alive = weakref.ref(rec)
    del rec  # the caller's RRef object goes away; only the context can keep the record
    gc.collect()
    got, actions = b.on_fork_received(data, 1)
    assert alive() is got, "the call to self got a different record than the one sent"
    assert got.state == READY and got.value == ["value"]
    assert actions == [Release(got)]
    b.validate()
    assert b.counts() == ZERO_COUNTS
    assert rid not in b.owners


def test_owner_self_send_abort_keeps_creator_fork() -> None:
    """B owns an RRef created by A's remote() (A's fork id is the RRef id) and holds an
    OwnerRRef of it (A passed it back to B). B's call to itself with it fails to send:
    undoing that fork must not drop A's fork (which would release the value under A)."""
    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id
    back = a.fork_user(urec, 1)
    got, actions = b.on_fork_received(back, 0)
    assert got is orec and actions == [ChildAccept(0, back.fork_id)]
    assert a.on_child_accept(back.fork_id) == []

    data = b.fork_owned(orec, 1)  # B -> B, then the send fails
    assert b.abort_fork(data) == []
    assert b.forks[rid] == {urec.fork_id: 0}, "the creator's fork was dropped"
    assert b.owners[rid] is orec
    _validate(a, b)
    # A's delete still finds its fork; only then the value goes
    assert a.user_dropped(urec.fork_id) == [UserDelete(1, rid, urec.fork_id)]
    assert b.on_user_delete(rid, urec.fork_id) == [Release(orec)]


def test_abort_fork_of_user_releases_parent() -> None:
    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    data = a.fork_user(urec, 2)
    assert a.user_dropped(urec.fork_id) == []
    assert a.abort_fork(data) == [UserDelete(1, urec.rref_id, urec.fork_id)]
    a.validate()


def test_validate_catches_corrupted_state() -> None:
    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id
    _validate(a, b)

    # a fork without an owner record
    del b.owners[rid]
    with pytest.raises(AssertionError, match="without an owner record"):
        b.validate()
    b.owners[rid] = orec
    b.validate()

    # an empty fork set
    b.forks[RRefId(1, 999)] = {}
    with pytest.raises(AssertionError, match="empty fork set"):
        b.validate()
    del b.forks[RRefId(1, 999)]

    # an owner record with a value but no fork (should have been released)
    stray = OwnerRecord(RRefId(1, 998), state=READY, value=1, created=True)
    b.owners[stray.rref_id] = stray
    with pytest.raises(AssertionError, match="kept with no fork"):
        b.validate()
    del b.owners[stray.rref_id]
    b.validate()

    # a user fork in two maps
    a.pending_users[urec.fork_id] = urec
    with pytest.raises(AssertionError, match="two user maps"):
        a.validate()
    del a.pending_users[urec.fork_id]

    # a child count that does not match pending_children
    urec.children = 1
    with pytest.raises(AssertionError, match="child count"):
        a.validate()
    urec.children = 0

    # a delete sent while a child is pending (G1)
    a.deleting_users[urec.fork_id] = a.confirmed_users.pop(urec.fork_id)
    urec.alive = False
    urec.children = 1
    with pytest.raises(AssertionError, match="early delete"):
        a.validate()
    urec.children = 0
    a.validate()

    # a pending child whose parent fork is gone (G2)
    a.pending_children[ForkId(0, 500)] = (urec, 2)
    with pytest.raises(AssertionError, match="parent fork"):
        a.validate()


# ---------------------------------------------------------------- G3: forks in flight and deaths (issue 11, 5)
def test_no_fork_is_registered_for_a_dead_worker() -> None:
    """A fork sent to a worker already declared dead would never be dropped: refused."""
    from rrefrt.errors import WorkerUnavailableError

    a, b = new_ctx(0), new_ctx(1)
    urec, orec = _make_confirmed_user(a, b)
    b.on_fork_request(urec.rref_id, ForkId(9, 9), 2)  # a third worker's fork keeps it alive
    for c in (a, b):
        assert c.on_peer_dead(2) or True
    before = b.counts()
    with pytest.raises(WorkerUnavailableError, match="worker 2"):
        b.fork_owned(orec, 2)
    with pytest.raises(WorkerUnavailableError, match="worker 2"):
        a.fork_user(urec, 2)
    assert b.counts() == before and a.counts()["num_pending_children"] == 0
    _validate(a, b)


def test_late_messages_of_a_dead_worker_register_nothing() -> None:
    b = new_ctx(1)
    rid = RRefId(1, 77)
    owned = b.new_local_owner("v", "str")
    b.on_peer_dead(2)
    b.on_fork_request(owned.rref_id, ForkId(2, 5), 2)
    assert b.forks == {} and b.owners == {}
    assert b.on_remote_request(RRefId(2, 8), RRefId(2, 8), 2, "t") is None  # never runs
    assert b.owners == {} and b.leaks() == [] and rid not in b.owners
    _validate(b)


def test_fork_passed_on_by_a_dying_holder_does_not_pin_an_empty_placeholder() -> None:
    """A (user of B's value) passes its fork to C and dies. B drops A's fork and frees the
    value; C's fork request then arrives. Before: B re-created an empty placeholder that
    nothing ever freed (a value "pinned" after a kill) and C's to_here waited for its
    timeout. Now nothing is registered and the fetch fails at once."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id
    data = a.fork_user(urec, 2)
    actions = b.on_peer_dead(0)
    assert [type(x) for x in actions] == [Release] and rid not in b.owners
    del actions, orec
    gc.collect()
    crec, c_actions = c.on_fork_received(data, 0)
    assert c_actions == [ForkRequest(1, rid, data.fork_id, 0)]
    b.on_fork_request(rid, data.fork_id, 2)
    assert b.owners == {} and b.forks == {}
    sf = b.on_fetch(rid, 2, 11)
    assert sf is not None and sf.record.state == FAILED and "no longer exists" in str(sf.record.error)
    assert b.owners == {}
    assert b.on_user_delete(rid, data.fork_id) == []  # C lets go later: nothing to do
    assert b.counts() == ZERO_COUNTS and b.leaks() == []
    _validate(a, b, c)


def test_a_fork_request_for_a_freed_value_fails_the_fork_for_good() -> None:
    """B's own RRef (B created it: B is alive, so the id's creator is not dead) goes to A; A
    passes its fork to C and dies; B frees the value. The owner answers C's fork request
    with the loss, and C's RRef fails on every use from then on, however late: once
    ``released`` forgets the id (after its horizon), a fetch from C would make a placeholder
    that waits for a value that never comes, and stays (before: the ack said nothing, C's
    RRef looked alive, and a to_here after the horizon timed out and left the placeholder
    on the owner for good)."""
    now = [0.0]
    a, c = new_ctx(0), new_ctx(2)
    b = RRefContext(1, IdGenerator(1), horizon=60.0, clock=lambda: now[0])
    rec = b.new_local_owner("value", "str")
    rid = rec.rref_id
    arec, _ = a.on_fork_received(b.fork_owned(rec, 0), 1)
    del rec  # B's own RRef object is gone: A's fork alone keeps the value
    gc.collect()
    data = a.fork_user(arec, 2)
    assert [type(x) for x in b.on_peer_dead(0)] == [Release] and b.owners == {}
    crec, _ = c.on_fork_received(data, 0)
    lost = b.on_fork_request(rid, data.fork_id, 2)
    assert lost is not None and "no longer exists" in str(lost) and b.owners == {} and b.forks == {}
    actions = c.on_fork_request_ack(data.fork_id, RpcError("gone"))
    assert crec.confirmed and str(crec.error) == "gone", "C's RRef fails on every use, without asking B"
    assert [type(x) for x in actions] == [ChildAccept], "its parent may let its own fork go"
    for later in (RRefId(1, 901), RRefId(1, 902)):  # values freed two horizons later: B forgets this one
        now[0] += 61.0
        b.released.add(later)
    assert not b._lost(rid), "a fetch from C now would make a placeholder: C must never send one"
    assert b.on_user_delete(rid, data.fork_id) == [] and b.counts() == ZERO_COUNTS and b.leaks() == []


def test_the_control_loops_carry_the_loss_of_a_freed_value_to_the_fork_requester() -> None:
    """The same through the runtime's control loops: B answers the fork request with ERROR,
    and C's control loop fails C's RRef with an error that names the RRef and its owner."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)

    class Model:  # what SimWorker needs of the state machine
        ctxs = {1: b, 2: c}
        msg_ids = itertools.count(1)
        net: list = []

        def sent(self, worker: int, msg: Any) -> None:
            pass

        def _check_release(self, worker: int, rec: Any) -> None:
            pass

    m: Any = Model()
    wb, wc = SimWorker(m, 1), SimWorker(m, 2)
    rec = b.new_local_owner("value", "str")
    rid = rec.rref_id
    arec, _ = a.on_fork_received(b.fork_owned(rec, 0), 1)
    del rec
    gc.collect()
    data = a.fork_user(arec, 2)
    b.on_peer_dead(0)
    crec, actions = c.on_fork_received(data, 0)
    wc.control.perform(actions)  # C sends its fork request
    request = m.net.pop()
    assert request.kind is ForkRequest
    wb.control.on_incoming(2, request.args["msg_id"], request.args["msg"])
    reply = m.net.pop()
    assert reply.kind == "reply" and reply.args["meta"][0] == 1, reply  # ERROR
    wc.pending.pop(reply.args["msg_id"])[1](reply.args["meta"], reply.args["frames"], None)
    wc.drain()
    assert crec.confirmed and type(crec.error) is RpcError, crec.error  # the owner's error's type
    assert f"RRef {rid} no longer exists on its owner" in str(crec.error) and "(owner 'w1'" in str(crec.error)


def test_placeholder_of_a_dead_creator_fails_its_fetches_and_goes() -> None:
    b = new_ctx(1)
    rid = RRefId(0, 5)  # created by worker 0, whose PYTHON_REMOTE never arrived
    assert b.on_fetch(rid, 2, 7) is None  # a placeholder remembers the fetch
    b.on_fork_request(rid, ForkId(2, 1), 2)
    actions = b.on_peer_dead(0)
    assert len(actions) == 1 and isinstance(actions[0], ServeFetch) and actions[0].record.state == FAILED
    assert "creator (worker 0) died" in str(actions[0].record.error)
    _validate(b)
    assert [type(x) for x in b.on_user_delete(rid, ForkId(2, 1))] == [Release]
    assert b.counts() == ZERO_COUNTS and b.leaks() == []
    _validate(b)


def test_own_rref_arriving_after_its_creator_died_pins_nothing() -> None:
    """Chaos seed 21 (a fenced worker): C (worker 2) owns a value created by A's remote();
    A sends it back to C in a call, and C learns of A's death (the control thread) before
    its reading thread handles that call (NOTE [Inline protocol]). Before: the fork data
    re-created an empty placeholder in ``owners`` that nothing ever freed (1 OwnerRRef left
    with no fork). Whatever the order, an owner value whose creator is dead and that no
    live fork references goes, and the RRef that arrived late fails on use."""
    a, c = new_ctx(0), new_ctx(2)
    urec, orec = _make_confirmed_user(a, c)
    rid = urec.rref_id
    data = ForkData(rid, ForkId(0, 99), 2, 0, "object")  # A's fork of it, in a call to C
    assert [type(x) for x in c.on_peer_dead(0)] == [Release]
    del orec
    gc.collect()
    rec, actions = c.on_fork_received(data, 0)
    assert rec.state == FAILED and actions == [ChildAccept(0, data.fork_id)]
    assert c.counts() == ZERO_COUNTS and c.leaks() == []
    _validate(c)


def test_placeholder_made_after_its_creator_died_is_not_kept() -> None:
    """The creation by A (dead) never arrived; a fetch, a fork request from a live worker,
    or A's own RRef in a late message from A reaches the owner after A's death. Each used
    to register an empty placeholder (the creator's death, which frees placeholders, had
    already run); now none is kept and the fetch fails at once."""
    c = new_ctx(2)
    c.on_peer_dead(0)
    rid = RRefId(0, 5)
    sf = c.on_fetch(rid, 1, 7)
    assert sf is not None and sf.record.state == FAILED and "worker 0" in str(sf.record.error)
    c.on_fork_request(RRefId(0, 6), ForkId(1, 1), 1)
    rec, _ = c.on_fork_received(ForkData(RRefId(0, 7), ForkId(0, 8), 2, 0, "object"), 0)
    assert rec.state == FAILED
    rec, _ = c.on_fork_received(ForkData(RRefId(0, 9), ForkId(1, 8), 2, 1, "object"), 1)
    assert rec.state == FAILED
    assert c.on_remote_request(rid, rid, 0, "t") is None
    assert c.counts() == ZERO_COUNTS and c.leaks() == []
    _validate(c)


def test_placeholder_dropped_by_an_abandoned_creation_is_not_re_created() -> None:
    """The creator gave its creation up as lost (its UserDelete dropped the placeholder);
    a fetch that arrives later must not re-create a placeholder nothing would free."""
    c = new_ctx(2)
    rid = RRefId(0, 5)
    assert c.on_fetch(rid, 1, 7) is None
    assert [type(x) for x in c.on_user_delete(rid, rid)] == [ServeFetch]
    sf = c.on_fetch(rid, 1, 8)
    assert sf is not None and sf.record.state == FAILED
    c.on_fork_received(ForkData(rid, ForkId(1, 3), 2, 1, "object"), 1)
    assert c.on_remote_request(rid, rid, 0, "t") is None
    assert c.counts() == ZERO_COUNTS and c.leaks() == []
    _validate(c)


def test_placeholder_of_an_abandoned_creation_goes_with_its_last_fork() -> None:
    """The creator (alive) gave its creation up as lost while the placeholder had a fork
    (a fork request of a third worker): its delete found the fork and kept the placeholder,
    and when that fork went too nothing ever freed it (no death to clear it)."""
    c = new_ctx(2)
    rid = RRefId(0, 5)
    assert c.on_fetch(rid, 1, 7) is None
    c.on_fork_request(rid, ForkId(1, 1), 1)
    assert c.on_user_delete(rid, rid) == []  # the creator's give-up: the fork keeps it
    actions = c.on_user_delete(rid, ForkId(1, 1))
    assert [type(x) for x in actions] == [ServeFetch] and actions[0].record.state == FAILED
    assert c.counts() == ZERO_COUNTS and c.leaks() == []
    assert c.on_fetch(rid, 1, 8).record.state == FAILED  # type: ignore[union-attr]
    _validate(c)


def test_lazy_registration_of_a_fork_received_in_a_call() -> None:
    """NOTE [Lazy registration]: a user->user fork in a call's arguments sends nothing on
    arrival; dropped with no child it is accepted (no owner message); stored, it registers;
    forked onward and dropped it is accepted once its child is; its parent's death
    registers it, its owner's death fails it; validate() holds at every step."""
    c = new_ctx(2)  # owner 1, parent 0
    rid = RRefId(1, 5)

    def received(n: int, lazy: bool = True) -> tuple:
        rec, acts = c.on_fork_received(ForkData(rid, ForkId(0, n), 1, 0, "object"), 0, lazy)
        assert isinstance(rec, UserRecord)
        return rec, acts

    dropped, acts = received(1)
    assert acts == [] and not dropped.registered and c.counts()["num_unregistered_users"] == 1
    c.validate()
    assert c.user_dropped(dropped.fork_id) == [ChildAccept(0, dropped.fork_id)]
    assert c.counts() == ZERO_COUNTS
    stored, _ = received(2)
    assert c.register_users([stored]) == [ForkRequest(1, rid, stored.fork_id, 0)]
    assert c.register_users([stored]) == []  # once
    c.validate()
    assert c.on_fork_request_ack(stored.fork_id)[0] == ChildAccept(0, stored.fork_id)
    assert c.user_dropped(stored.fork_id) == [UserDelete(1, rid, stored.fork_id)]
    c.on_user_delete_ack(stored.fork_id)
    relayed, _ = received(3)
    child = c.fork_user(relayed, 3)
    assert c.user_dropped(relayed.fork_id) == []  # its child is covered by it
    c.validate()
    assert c.on_child_accept(child.fork_id) == [ChildAccept(0, relayed.fork_id)]
    assert c.counts() == ZERO_COUNTS
    eager, acts = received(4, lazy=False)
    assert eager.registered and acts == [ForkRequest(1, rid, eager.fork_id, 0)]
    c.on_fork_request_ack(eager.fork_id)
    orphan, _ = received(5)
    assert c.on_peer_dead(0) == [ForkRequest(1, rid, orphan.fork_id, 0)]  # the parent died
    c.validate()
    assert c.on_fork_request_ack(orphan.fork_id) == []  # no accept for a dead parent
    d = new_ctx(2)
    rec, _ = d.on_fork_received(ForkData(rid, ForkId(0, 6), 1, 0, "object"), 0, True)
    assert d.on_peer_dead(1) == [] and isinstance(rec.error, OwnerDiedError)  # the owner died
    assert d.counts() == ZERO_COUNTS and d.user_dropped(rec.fork_id) == []
    d.validate()


def test_a_fork_request_given_up_after_the_owner_registered_it_frees_the_value() -> None:
    """Issue 21, the chaos "large" leak, in its exact order: w0 (a user of w2's RRef) passes
    its RRef to itself (a call to self: the fork is registered eagerly), the owner registers
    the fork, the first ack is dropped and every retry's ack comes after its deadline (the
    200 MB result held w2 back), so w0 gives the fork request up. The owner kept two forks
    held by w0 for good: the given-up fork (only forgotten on w0) and w0's own fork, whose
    pending child was never accepted. Now the given-up fork is deleted and accepted."""
    w0, w2 = new_ctx(0), new_ctx(2)
    urec, orec = _make_confirmed_user(w0, w2)
    rid = urec.rref_id
    data = w0.fork_user(urec, 0)  # rpc_sync("w0", rref_pass_on, args=(rref, ...)) from w0
    child, acts = w0.on_fork_received(data, 0, lazy=True)  # parent is this worker: eager
    assert isinstance(child, UserRecord) and acts == [ForkRequest(2, rid, data.fork_id, 0)]
    for _ in range(15):  # every attempt arrives; every ack is lost or late
        w2.on_fork_request(rid, data.fork_id, 0)
    assert set(w2.forks[rid]) == {urec.fork_id, data.fork_id}
    assert w0.user_dropped(data.fork_id) == []  # the call ended: unconfirmed, no delete (G1)
    assert w0.user_dropped(urec.fork_id) == []  # the program dropped it: its child is pending
    _validate(w0, w2)

    acts = w0.give_up_user(data.fork_id, RpcError("never confirmed"))
    assert acts == [UserDelete(2, rid, data.fork_id), ChildAccept(0, data.fork_id)]
    assert child.error is not None and child.given_up
    _validate(w0, w2)
    assert w2.on_user_delete(rid, data.fork_id) == []  # w0's own fork still holds it
    w0.on_user_delete_ack(data.fork_id)
    assert w0.on_child_accept(data.fork_id) == [UserDelete(2, rid, urec.fork_id)]
    assert w2.on_user_delete(rid, urec.fork_id) == [Release(orec)]
    w0.on_user_delete_ack(urec.fork_id)
    _validate(w0, w2)
    for x in (w0, w2):
        assert x.counts() == ZERO_COUNTS
    w2.on_fork_request(rid, data.fork_id, 0)  # one more retry, late: the tombstone holds
    assert w2.counts() == ZERO_COUNTS


def test_a_fork_request_given_up_before_it_arrived_registers_nothing_later() -> None:
    """A (user) passes its RRef to C; every attempt of C's fork request is still on its way
    when C gives it up. C's delete reaches B first (or with a retried request after it,
    over another route): the fork request that arrives afterwards registers nothing, and
    A, accepted, frees the value. C's RRef fails on use, confirmed_by_owner() is False."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id
    data = a.fork_user(urec, 2)
    crec, acts = c.on_fork_received(data, 0)
    assert acts == [ForkRequest(1, rid, data.fork_id, 0)]
    assert c.give_up_user(data.fork_id, RpcError("never confirmed")) == [
        UserDelete(1, rid, data.fork_id), ChildAccept(0, data.fork_id)]
    assert c.user_dropped(data.fork_id) == []  # the RRef object goes later: nothing more
    with pytest.raises(RpcError):
        c.fork_user(crec, 0)  # a failed RRef is not passed on
    assert b.on_user_delete(rid, data.fork_id) == []
    b.on_fork_request(rid, data.fork_id, 2)  # late: a no-op (tombstone)
    assert set(b.forks[rid]) == {urec.fork_id}
    c.on_user_delete_ack(data.fork_id)
    assert a.on_child_accept(data.fork_id) == []  # A still holds its RRef
    assert a.user_dropped(urec.fork_id) == [UserDelete(1, rid, urec.fork_id)]
    assert b.on_user_delete(rid, urec.fork_id) == [Release(orec)]
    a.on_user_delete_ack(urec.fork_id)
    _drained(a, b, c)


def test_a_given_up_fork_with_a_child_pending_goes_once_the_child_accepts() -> None:
    """C gave its fork request up while a child it forked onward (to D) is unaccepted: the
    child is covered by C's fork, so C's delete and its accept to A wait for D's accept;
    a dead parent gets no accept."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec, orec = _make_confirmed_user(a, b)
    rid = urec.rref_id
    data = a.fork_user(urec, 2)
    crec, _ = c.on_fork_received(data, 0)
    b.on_fork_request(rid, data.fork_id, 2)
    grand = c.fork_user(crec, 3)
    assert c.give_up_user(data.fork_id, RpcError("never confirmed")) == []
    c.validate()
    assert c.counts()["num_pending_users"] == 0 and c.counts()["num_pending_children"] == 1
    assert c.on_child_accept(grand.fork_id) == [UserDelete(1, rid, data.fork_id), ChildAccept(0, data.fork_id)]
    c.validate()
    d = new_ctx(2)  # the same with the parent dead meanwhile
    drec, _ = d.on_fork_received(ForkData(rid, ForkId(0, 50), 1, 0, "object"), 0)
    d.on_peer_dead(0)
    assert d.give_up_user(drec.fork_id, RpcError("never confirmed")) == [UserDelete(1, rid, drec.fork_id)]
    d.validate()


def test_an_abandoned_creation_with_a_child_pending_is_deleted_once_the_child_accepts() -> None:
    """A remote() whose creation was never acknowledged, passed on meanwhile: the child is
    covered by the creator's fork, so the delete waits for its accept - and then goes
    (before, the creation stayed pending for good, its fork on the owner with it)."""
    a, b, c = new_ctx(0), new_ctx(1), new_ctx(2)
    urec = a.new_remote_user(1)
    rid = urec.rref_id
    data = a.fork_user(urec, 2)
    orec = b.on_remote_request(rid, urec.fork_id, 0, "object")  # it arrived; every ack is lost
    assert orec is not None and b.set_value(orec, "v") == []
    crec, acts = c.on_fork_received(data, 0)
    assert acts == [ForkRequest(1, rid, data.fork_id, 0)]
    assert a.abandon_user(urec.fork_id, RpcError("creation lost")) == []  # its child needs it
    a.validate()
    b.on_fork_request(rid, data.fork_id, 2)
    assert c.on_fork_request_ack(data.fork_id) == [ChildAccept(0, data.fork_id)]
    assert a.on_child_accept(data.fork_id) == [UserDelete(1, rid, urec.fork_id)]
    assert b.on_user_delete(rid, urec.fork_id) == []
    a.on_user_delete_ack(urec.fork_id)
    assert c.user_dropped(data.fork_id) == [UserDelete(1, rid, data.fork_id)]
    assert b.on_user_delete(rid, data.fork_id) == [Release(orec)]
    c.on_user_delete_ack(data.fork_id)
    _drained(a, b, c)


def test_child_accepts_to_one_parent_are_batched() -> None:
    """NOTE [Lazy registration]: the accepts of drops flushed together leave as one
    RREF_CHILD_ACCEPTS per parent (a lone one stays a RREF_CHILD_ACCEPT), in place."""
    from rrefrt.protocol.messages import batch_actions as _batch_deletes
    from rrefrt.protocol.messages import ChildAccepts

    f = [ForkId(0, i) for i in range(4)]
    got = _batch_deletes([ChildAccept(0, f[0]), UserDelete(1, RRefId(1, 1), f[3]), ChildAccept(2, f[1]),
                          ChildAccept(0, f[2])])
    assert got == [ChildAccepts(0, (f[0], f[2])), UserDelete(1, RRefId(1, 1), f[3]), ChildAccept(2, f[1])]
    a = new_ctx(0)
    parent, _ = _make_confirmed_user(a, new_ctx(1))
    kids = [a.fork_user(parent, 2) for _ in range(3)]
    assert a.on_child_accepts([k.fork_id for k in kids] + [kids[0].fork_id]) == []
    assert parent.children == 0 and a.counts()["num_pending_children"] == 0
    a.validate()


def test_a_batch_of_deletes_ends_as_the_same_deletes_one_by_one() -> None:
    """The owner's batch (``on_user_deletes``: the last fork of a ready value inlined, ids
    as the plain tuples the wire decodes to) leaves the context as the deletes applied one by
    one do, for every kind of record: ready values (freed together, one ``Releases``), a
    value with another fork, a creation still running, a placeholder whose creation may
    come, a creation given up as lost, a duplicate and an unknown fork."""

    def owner() -> tuple[RRefContext, list[tuple[Any, Any]]]:
        b = new_ctx(1)
        deletes = []
        for i in range(3):  # ready values with one fork each
            rid = RRefId(0, i + 1)
            b.set_value(b.on_remote_request(rid, rid, 0, "int"), i)
            deletes.append((rid, rid))
        two = RRefId(0, 10)  # a ready value with a second fork: stays
        b.set_value(b.on_remote_request(two, two, 0, "int"), 10)
        b.on_fork_request(two, ForkId(2, 1), 2)
        running = RRefId(0, 11)  # its creation still runs: released by set_value later
        b.on_remote_request(running, running, 0, "int")
        held = RRefId(0, 12)  # a placeholder made by a fork request; its creation may come
        b.on_fork_request(held, ForkId(2, 2), 2)
        b.on_fork_request(held, ForkId(2, 3), 2)
        lost = RRefId(0, 13)  # a fetch made a placeholder; its creator gives the creation up
        assert b.on_fetch(lost, 2, 7) is None
        deletes += [(two, two), (running, running), (held, ForkId(2, 2)), (lost, lost),
                    (RRefId(0, 1), RRefId(0, 1)), (RRefId(0, 99), ForkId(0, 99))]
        return b, deletes

    one, deletes = owner()
    singly = [a for rid, fid in deletes for a in one.on_user_delete(rid, fid)]
    batch, deletes = owner()
    got = batch.on_user_deletes(tuple((tuple(rid), tuple(fid)) for rid, fid in deletes))
    assert [type(a).__name__ for a in got] == ["ServeFetch", "Releases"]
    assert [r.rref_id for r in got[1].records] == [RRefId(0, i) for i in (1, 2, 3)]
    assert [type(a).__name__ for a in singly] == ["Release"] * 3 + ["ServeFetch"]
    assert got[0].record.state == singly[3].record.state == FAILED
    assert batch.owners.keys() == one.owners.keys() and batch.forks == one.forks
    assert batch.deleted_forks == one.deleted_forks and batch.released == one.released
    _validate(batch)
    _validate(one)


def test_tables_of_finished_things_stay_bounded() -> None:
    """Issue 21 item 8 (NOTE [Bounded memory of finished things] in rrefrt/protocol/recent.py): the
    owner's tombstones (``deleted_forks``) and ``released`` ids were kept for the group's
    life, about 100-150 bytes per RRef freed, for ever (the RSS growth of a long soak).
    Now each is remembered for ``horizon`` seconds at least and at most twice that: a late
    copy of a creation within the horizon is still refused, and after many RRefs created
    and dropped over a long time the tables hold only the last two horizons' ids."""
    now = [0.0]
    b = RRefContext(1, IdGenerator(1), horizon=60.0, clock=lambda: now[0])
    first = None
    for n in range(1, 3001):  # 3000 RRefs created by worker 0 on b and dropped, 10 per second
        rid = RRefId(0, n)
        rec = b.on_remote_request(rid, rid, 0, "int")
        assert rec is not None
        b.set_value(rec, n)
        assert b.on_user_delete(rid, rid) == [Release(rec)]
        del rec  # the value is gone (nothing references its record)
        assert b.on_remote_request(rid, rid, 0, "int") is None  # a late copy: refused
        b.on_fork_request(rid, ForkId(2, n), 2)  # a late fork request: registers nothing
        first = first or rid
        now[0] += 0.1
    assert b.owners == {} and b.forks == {}
    assert rid in b.deleted_forks and rid in b.released  # the last one: still remembered
    assert first not in b.deleted_forks and first not in b.released  # 300 s ago: forgotten
    assert 600 <= len(b.deleted_forks) <= 1200 and 600 <= len(b.released) <= 1200  # 1-2 horizons at 10/s
    _validate(b)
