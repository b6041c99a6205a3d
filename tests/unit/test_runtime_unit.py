"""The runtime without processes: two or three Runtimes in this process, joined by the
in-process fake transport (transport/inproc.py). Unit tests of logic only; features are
tested with real processes and sockets elsewhere.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Iterator

import pytest

import rrefrt
from rrefrt import state
from rrefrt.runtime.control import ControlLoop, Dropped, Incoming, Perform, Sync
from rrefrt.runtime.creation import ACCEPT_DELAY_S
from rrefrt.errors import OwnerDiedError, RRefCreationError, WorkerUnavailableError
from rrefrt.protocol.ids import ForkId, RRefId
from rrefrt.protocol.messages import Fetch, ForkRequest, RemoteRequest, Response, UserDelete
from rrefrt.options import RpcBackendOptions, WorkerInfo
from rrefrt.runtime.root import Runtime
from tests.support import poll_for
from rrefrt_transport.base import PeerAddress, PeerSpec
from rrefrt_transport.inproc import InprocHub

pytestmark = pytest.mark.timeout(60)


class Group:
    """n runtimes on one hub; ``as_worker(i)`` binds the test thread to runtime i."""

    def __init__(self, n: int, **options: Any) -> None:
        self.hub = InprocHub()
        infos = [WorkerInfo(f"w{i}", i) for i in range(n)]
        specs = [PeerSpec(i, f"w{i}", 0, PeerAddress("inproc")) for i in range(n)]
        self.rts: list[Runtime] = []
        for info in infos:
            opts = RpcBackendOptions(rpc_timeout=10.0, **options)
            rt = Runtime(info, opts, lambda on_msg, on_dead, i=info.id, name=info.name: self.hub.transport(i, name, on_msg, on_dead))
            rt.set_world(infos)
            rt.transport.connect_peers(specs, 1.0)
            rt.transport.start()
            self.rts.append(rt)

    def as_worker(self, i: int) -> Any:
        return state.bound(self.rts[i])

    def close(self) -> None:
        for rt in self.rts:
            rt.close()
        self.hub.close()


@pytest.fixture
def group() -> Iterator[Group]:
    g = Group(3)
    yield g
    g.close()


def add(a: int, b: int) -> int:
    return a + b


def whoami() -> str:
    return rrefrt.get_worker_info().name


class Box:
    def __init__(self, v: Any) -> None:
        self.v = v

    def get(self) -> Any:
        return self.v


def forward(rref: Any) -> Any:
    """On a user: passes the RRef on (user -> user fork) and reads it there."""
    return rref.to_here().v


def forward_confirmed(rref: Any) -> Any:
    """``forward``, after registering the fork with its owner (NOTE [Lazy registration])."""
    assert rref.confirmed_by_owner()
    return rref.to_here().v


def read_on(dest: str, rref: Any) -> Any:
    return rrefrt.rpc_sync(dest, forward, args=(rref,))


CALLS: list[int] = []
STARTED, RELEASE = threading.Event(), threading.Event()


def hang() -> None:
    STARTED.set()
    RELEASE.wait(10)


def record(x: int) -> None:
    CALLS.append(x)


def fail_holding(rref: Any) -> None:
    """Raises with the RRef argument in a frame that is part of a reference cycle (the
    error's traceback holds this frame, whose locals hold the error)."""
    err = ValueError("failed holding an RRef")
    holder = [err, rref]
    raise holder[0]


def boom() -> None:
    raise ValueError("boom from the callee")


# ------------------------------------------------------------------ rpc
def test_rpc_between_runtimes_in_one_process(group: Group) -> None:
    with group.as_worker(0):
        assert rrefrt.rpc_sync("w1", add, args=(1, 2)) == 3
        assert rrefrt.rpc_async("w2", whoami).wait() == "w2"  # user code on w2 sees w2
        with pytest.raises(ValueError, match="boom from the callee"):
            rrefrt.rpc_sync("w1", boom)
    with group.as_worker(1):
        assert rrefrt.rpc_sync("w1", whoami) == "w1"  # a call to itself


def test_remote_and_to_here_answer_once(group: Group) -> None:
    """NOTE [Creation acks]: a quick creation is answered once, accept and result together
    (no REMOTE_RET), and a slow one gets an accept, then REMOTE_RET."""
    w0, w1 = group.rts[0], group.rts[1]
    sent0 = w1.transport.stats["messages_sent"]
    with group.as_worker(0):
        rref = rrefrt.remote("w1", Box, args=(7,))
        assert rref.to_here().v == 7
        poll_for(lambda: rref.confirmed_by_owner(), 5)
        assert rref.rpc_sync().get() == 7
    # w1 sent: the creation's single answer (no REMOTE_RET), the fetch's answer, and for
    # the proxy call (the RRef travels back to its owner) a ChildAccept and the answer
    assert w1.transport.stats["messages_sent"] - sent0 == 4
    assert not w1.creation.accepts and not w0.creation.fetches
    del rref
    gc.collect()
    poll_for(lambda: w1.ctx.counts()["num_owner_rrefs"] == 0, 5, "the owner released the value")


def test_remote_error_is_raised_by_to_here(group: Group) -> None:
    with group.as_worker(0):
        rref = rrefrt.remote("w2", boom)
        with pytest.raises(ValueError, match="boom from the callee"):
            rref.to_here()


def test_forks_user_to_user(group: Group) -> None:
    """w0 holds a user of an RRef owned by w1 and sends it to w2, which reads it: the fork
    request / child accept dance, then everything is released."""
    w0, w1, w2 = group.rts
    with group.as_worker(0):
        rref = rrefrt.remote("w1", Box, args=("shared",))
        assert rrefrt.rpc_sync("w2", forward, args=(rref,)) == "shared"
        assert rrefrt.rpc_sync("w2", read_on, args=("w0", rref)) == "shared"  # w0 -> w2 -> w0
        del rref
    gc.collect()
    for rt in group.rts:
        rt.sync_control(time.monotonic() + 5)

    def clean() -> bool:
        gc.collect()
        return all(
            rt.ctx.counts() == dict.fromkeys(rt.ctx.counts(), 0) for rt in (w0, w1, w2)
        )

    poll_for(clean, 10, lambda: f"left over: {[rt.ctx.counts() for rt in group.rts]}")
    for rt in group.rts:
        rt.ctx.validate()


def test_owner_sends_its_rref_to_itself_registers_a_fork(group: Group) -> None:
    w1 = group.rts[1]
    with group.as_worker(1):
        rref = rrefrt.RRef(Box(3))
        assert rrefrt.rpc_sync("w1", forward, args=(rref,)) == 3
    poll_for(lambda: w1.ctx.counts()["num_forks"] == 0, 5, "the self-fork was dropped on arrival")


def test_peer_death_fails_calls_and_rrefs(group: Group) -> None:
    w0 = group.rts[0]
    started, release = STARTED, RELEASE
    started.clear()
    release.clear()
    with group.as_worker(0):
        rref = rrefrt.remote("w2", Box, args=(1,))
        rref.to_here()
        fut = rrefrt.rpc_async("w2", hang)
        poll_for(started.is_set, 5)
        group.hub.kill(2)
        with pytest.raises(WorkerUnavailableError, match="w2"):
            fut.wait()
        poll_for(lambda: 2 in w0.transport.dead_peers(), 5)
        w0.sync_control(time.monotonic() + 5)
        with pytest.raises(OwnerDiedError):
            rref.to_here()
        with pytest.raises(WorkerUnavailableError):
            rrefrt.rpc_sync("w2", add, args=(1, 1))
        assert rrefrt.rpc_sync("w1", add, args=(2, 2)) == 4  # the others go on
    release.set()
    assert w0.debug_info()["agent.dead_peers"] == 1


def test_an_error_does_not_pin_the_rrefs_in_its_frames(group: Group) -> None:
    """NOTE [Error frames]: the callee clears the frames of a user function's error once it
    is answered. Before, the RRef argument stayed alive in a reference cycle until the
    garbage collector ran (on an idle worker: never), pinning the value on its owner."""
    w0 = group.rts[0]
    gc.disable()  # the workers share this process: no collection may hide the cycle
    try:
        with group.as_worker(0):
            rref = rrefrt.RRef(Box(1))
            with pytest.raises(ValueError, match="failed holding"):
                rrefrt.rpc_sync("w1", fail_holding, args=(rref,))
            del rref
        poll_for(lambda: w0.ctx.counts()["num_forks"] == 0, 5,
                 lambda: f"the fork held by w1 was never deleted: {w0.ctx.counts()}")
    finally:
        gc.enable()


# ------------------------------------------------------------------ malformed input
@pytest.mark.parametrize("kind, meta", [
    (16, 5), (16, []), (16, [["not fork data"]]), (17, [1]), (17, [[0, 1], [0, 1], 3, []]),
    (18, ["x"]), (19, [[1]]), (19, [[0, 1], [0, 1], "p"]), (20, "x"), (21, [None, None]),
    (22, [["a", "b"], 9]), (22, [[0, 1], 7]), (99, []), ("x", []),
])
def test_malformed_messages_are_counted_and_dropped(group: Group, kind: Any, meta: Any) -> None:
    w1 = group.rts[1]
    before = w1.debug_info()["agent.bad_frames_dropped"]
    w1.on_message(0, kind, 1, meta, [b"never unpickled"])
    assert w1.debug_info()["agent.bad_frames_dropped"] == before + 1
    assert w1.ctx.counts() == dict.fromkeys(w1.ctx.counts(), 0)


# ------------------------------------------------------------------ creation tracker
def test_duplicate_creation_runs_once_and_is_answered_at_once(group: Group) -> None:
    w0, w1 = group.rts[0], group.rts[1]
    CALLS.clear()
    rid = RRefId(0, 999)
    answers: list[Any] = []

    def on_done(meta: Any, frames: Any, err: Any) -> None:
        answers.append(Response.decode(meta) if err is None else err)

    with group.as_worker(0):
        frames, forks = w0.payloads.dumps_call(record, (1,), None, 1)
    msg = RemoteRequest(1, rid, rid, "object", ())
    for n in (1, 2):  # the original, then a retry (as if the first answer was lost)
        w0.transport.request(1, msg.KIND, msg.meta(), frames, 5.0, on_done, msg.NAME)
        poll_for(lambda: len(answers) == n, 5, lambda: f"answers {answers}")
    assert CALLS == [1]
    assert w1.stats["duplicate_calls_dropped"] == 1
    # the quick creation: accepted and done in one answer; the retry: done, from the record;
    # both carry the plain value (None) itself (NOTE [Inline creation values])
    assert answers == [Response(0, (), True, (None,)), Response(0, (), True, (None,))], answers
    assert not w1.creation.accepts


def test_lost_creation_fails_waiting_fetches(group: Group) -> None:
    w0 = group.rts[0]
    w0.control_retry_interval, w0.control_attempts = 0.05, 2
    group.rts[0].transport.fault_hook = lambda dest, label: [] if label == "PYTHON_REMOTE" else [0.0]
    with group.as_worker(0):
        rref = rrefrt.remote("w1", Box, args=(1,))
        fut = rref.to_here_async(timeout=5)
        with pytest.raises(RRefCreationError, match="never acknowledged"):
            fut.wait()
    assert not w0.creation.fetches


def test_slow_creation_is_accepted_then_settled_by_remote_ret(group: Group) -> None:
    w1 = group.rts[1]
    with group.as_worker(0):
        rref = rrefrt.remote("w1", time.sleep, args=(ACCEPT_DELAY_S * 4,))
        poll_for(rref.confirmed_by_owner, 5, "REMOTE_RET confirmed the creation")
        assert rref.to_here() is None
    assert not w1.creation.accepts


# ------------------------------------------------------------------ control items
def test_control_items_have_one_home_thread(group: Group) -> None:
    """Perform from another thread is enqueued; Sync is answered after what came before;
    Release never drops a value on the control thread."""
    w0 = group.rts[0]
    control: ControlLoop = w0.control
    threads: list[str] = []

    class Value:
        def __del__(self) -> None:
            threads.append(threading.current_thread().name)

    rec = w0.ctx.new_local_owner(Value(), "Value")
    from rrefrt.protocol.messages import Release

    actions = [Release(rec)]
    del rec
    control.perform(actions)
    del actions
    assert control.sync(time.monotonic() + 5)
    gc.collect()
    poll_for(lambda: threads, 5, "the value was dropped")
    assert "control" not in threads[0], threads
    assert isinstance(Dropped(ForkId(0, 1)), Dropped) and Perform([]).actions == []
    ev = threading.Event()
    control.put(Incoming(1, 7, Fetch(0, RRefId(0, 5), ForkId(0, 5))))
    control.put(Sync(ev))
    assert ev.wait(5)
    assert w0.ctx.counts()["num_owner_rrefs"] == 1  # a placeholder waits for the creation


def test_fork_request_is_acked_and_registered(group: Group) -> None:
    w1 = group.rts[1]
    rid, fid = RRefId(1, 50), ForkId(2, 3)
    acked: list[Any] = []
    msg = ForkRequest(1, rid, fid, 0)
    group.rts[2].transport.request(1, msg.KIND, msg.meta(), [], 5.0, lambda m, f, e: acked.append((m, e)), msg.NAME)
    poll_for(lambda: acked, 5)
    assert acked[0][1] is None and w1.ctx.forks[rid] == {fid: 2}
    d = UserDelete(1, rid, fid)
    group.rts[2].transport.request(1, d.KIND, d.meta(), [], 5.0, lambda m, f, e: acked.append((m, e)), d.NAME)
    poll_for(lambda: len(acked) == 2, 5)
    assert rid not in w1.ctx.forks and fid in w1.ctx.deleted_forks


def owned_here() -> int:
    return int(rrefrt.get_debug_info()["num_owner_rrefs"])


def new_owned() -> Any:
    return rrefrt.RRef(Box(4))


def holds(rref: Any) -> str:
    """On the owner: the RRef came back; what does using it give?"""
    try:
        return repr(rref.to_here(timeout=5))
    except rrefrt.RpcError as e:
        return type(e).__name__


def test_a_fenced_worker_undoes_the_forks_of_its_unsent_calls(group: Group, monkeypatch: Any) -> None:
    """Chaos seed 165: a fenced worker's call to itself (rref_pass_on to itself, with an RRef
    it owns) failed unsent with Fenced; the fork it had registered for itself - never dead -
    pinned the value for good (1 OwnerRRef, 1 fork held by itself). NOTE [Fenced forks]."""
    import rrefrt_transport as transport
    w1 = group.rts[1]
    real = w1.transport.request

    def fenced(dest: int, kind: int, meta: Any, frames: Any, timeout: float, on_done: Any, label: str = "") -> int:
        if label == "PYTHON_CALL":  # what the zmq transport's _issue does once fenced
            on_done(None, (), transport.Fenced("w1", "w0", "test"))
            return 0
        return real(dest, kind, meta, frames, timeout, on_done, label)

    with group.as_worker(1):
        rref = rrefrt.RRef(Box(3))
        monkeypatch.setattr(w1.transport, "request", fenced)
        for to in ("w1", "w0"):
            with pytest.raises(rrefrt.ShutdownError):
                rrefrt.rpc_sync(to, forward, args=(rref,))
        assert rrefrt.get_debug_info()["num_forks"] == 0
        del rref
        gc.collect()
        assert w1.sync_control(time.monotonic() + 5)
        assert owned_here() == 0

    def closed(*args: Any, **kwargs: Any) -> None:
        raise transport.Fenced("w1", "w0", "test")

    monkeypatch.setattr(w1.transport, "respond", closed)  # an answer that carries an RRef, unsent
    with group.as_worker(0):
        with pytest.raises(rrefrt.RpcTimeoutError):
            rrefrt.rpc_sync("w1", new_owned, timeout=1)
    assert w1.sync_control(time.monotonic() + 5)
    with group.as_worker(1):
        gc.collect()
        assert rrefrt.get_debug_info()["num_forks"] == 0 and owned_here() == 0


def test_a_fenced_owner_keeps_nothing_for_a_late_call_of_a_dead_creator(group: Group) -> None:
    """Chaos seed 21: a fenced worker reports every peer dead (its control thread frees
    what they held) but goes on reading their messages (NOTE [Late events] in
    docs/protocol.md). A call from the dead creator carrying the RRef back to its owner
    re-created an empty placeholder there that nothing freed (1 OwnerRRef left, no fork),
    and the call's to_here() waited for its timeout. Now nothing is kept and it fails."""
    w1 = group.rts[1]
    with group.as_worker(0):
        rref = rrefrt.remote("w1", Box, args=(5,))
        assert rref.to_here().v == 5
    with group.as_worker(1):
        assert owned_here() == 1
    w1.on_peer_dead(0, "this worker was expelled (test)")  # what a fenced w1's transport does
    assert w1.sync_control(time.monotonic() + 5)
    with group.as_worker(1):
        poll_for(lambda: owned_here() == 0, 5, "w1 freed what w0 held")
    # the pool thread that created the value may still be unwinding (its frame holds the
    # record, which a late event then finds, rightly, alive): wait until nothing holds it
    poll_for(lambda: len(w1.ctx.known_owned) == 0, 5, "w1's pool thread let go of the record")
    with group.as_worker(0):
        t0 = time.monotonic()
        assert rrefrt.rpc_sync("w1", holds, args=(rref,)) == "RpcError"
        assert time.monotonic() - t0 < 4
    assert w1.sync_control(time.monotonic() + 5)
    with group.as_worker(1):
        assert owned_here() == 0 and rrefrt.get_debug_info()["num_forks"] == 0


def test_the_rref_protocol_runs_off_the_control_thread(group: Group) -> None:
    """NOTE [Inline protocol] and NOTE [Drops]: with every control thread stopped, a
    remote() settles, to_here() is answered (a plain value inline, on the thread that read
    the fetch), a user->user fork is requested, confirmed and accepted, and the deletes of
    dropped RRefs reach their owner with the next call to it, inside that call (NOTE
    [Piggybacked deletes] in docs/protocol.md: no delete message of their own); an
    rpc_sync costs no callback-pool task even where torch is imported (WaitedFuture)."""
    pytest.importorskip("torch")  # rrefrt's futures are torch futures once torch is imported
    w0, w1, w2 = group.rts
    for rt in group.rts:
        rt.control.stop(5.0)
        assert not rt.control._thread.is_alive()
    labels: list[str] = []
    w0.transport.fault_hook = lambda dest, label: (labels.append(label), [0.0])[1]
    submitted: list[str] = []
    for rt in (w0, w1):
        for name in ("submit", "submit_batched"):
            real = getattr(rt.callbacks, name)
            setattr(rt.callbacks, name, lambda *a, _real=real, _rt=rt.info.name, **k: (
                submitted.append(f"{_rt}: {getattr(a[0], '__qualname__', a[0])}"), _real(*a, **k))[1])
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        assert rrefrt.rpc_sync("w1", add, args=(1, 2)) == 3
        rref = rrefrt.remote("w1", add, args=(2, 3))
        assert rref.to_here() == 5
        poll_for(rref.confirmed_by_owner, 5, "the creation settled without the control thread")
        assert rref.to_here() == 5  # a ready plain value: answered by the reader of the fetch
        assert submitted == [], submitted
        box = rrefrt.remote("w1", Box, args=("forked",))
        assert rrefrt.rpc_sync("w2", forward_confirmed, args=(box,)) == "forked"  # fork request, confirm, accept
        poll_for(lambda: w0.ctx.counts()["num_pending_children"] == 0, 5, "the child's accept arrived")
        # NOTE [Lazy registration]: a fork dropped in its call is accepted by its drop, which
        # the flush of the drops sends (the control thread's, or the next caller's)
        assert rrefrt.rpc_sync("w2", forward, args=(box,)) == "forked"
        poll_for(lambda: (w2.control.flush_drops(), w0.ctx.counts()["num_pending_children"] == 0)[1], 5,
                 "the unregistered child's accept arrived")
        more = [rrefrt.remote("w1", add, args=(i, i)) for i in range(5)]
        for r in more:
            poll_for(r.confirmed_by_owner, 5)
        del rref, box, more, r
        gc.collect()
        w2.control.flush_drops()  # w2's copy of the box went away on w2; nothing else sends from w2
        assert rrefrt.rpc_sync("w1", owned_here) == base  # the deletes left before this call
        last = rrefrt.remote("w1", add, args=(1, 1))
        poll_for(last.confirmed_by_owner, 5)
        del last
        gc.collect()
        with w0.ctx._lock:  # a call from a destructor run inside the context: no deadlock
            assert rrefrt.rpc_sync("w1", add, args=(1, 2)) == 3
        assert w0.control.drops  # left for the control thread (or the next call)
        assert rrefrt.rpc_sync("w1", owned_here) == base
    assert "RREF_USER_DELETES" not in labels and "RREF_USER_DELETE" not in labels, labels
    poll_for(lambda: w0.ctx.counts() == dict.fromkeys(w0.ctx.counts(), 0), 5, lambda: w0.ctx.counts())


def test_a_burst_of_drops_wakes_the_control_thread_once_and_a_call_waits_for_a_flush(group: Group) -> None:
    """NOTE [Drops]: RRefs dropped together queue one FlushDrops, not one per RRef (each
    item is a wake-up of the control thread), and a call made while another thread is
    sending a batch of deletes it took waits for it: the owner has applied every delete
    by the time it answers that call."""
    w0 = group.rts[0]
    w0.control.stop(5.0)  # its queue is only looked at here
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        refs = [rrefrt.remote("w1", add, args=(i, i)) for i in range(200)]
        for r in refs:
            poll_for(r.confirmed_by_owner, 5)
        queued = w0.control.queue.qsize()
        del refs, r
        # applied in the destructors already (the context's lock was free), one marker
        # queued: only the sends of their deletes wait (NOTE [Drops])
        assert w0.ctx.counts()["num_deleting_users"] == 200 and len(w0.control.drops) == 1
        assert w0.control.queue.qsize() - queued == 1
        real = w0.control._perform

        def slow(actions: Any) -> None:  # the flushing thread is slow to send what it took
            if threading.current_thread().name == "flusher":
                time.sleep(0.5)
            real(actions)

        w0.control._perform = slow  # type: ignore[method-assign]
        flusher = threading.Thread(target=w0.control.flush_drops, name="flusher")
        flusher.start()
        poll_for(lambda: not len(w0.control.drops), 5, "the flusher took every drop")
        assert rrefrt.rpc_sync("w1", owned_here) == base  # sent after the flusher's deletes
        flusher.join(5)
    poll_for(lambda: w0.ctx.counts() == dict.fromkeys(w0.ctx.counts(), 0), 5, lambda: w0.ctx.counts())


def test_drops_are_applied_in_the_destructor_and_their_deletes_ride_in_one_call(group: Group) -> None:
    """NOTE [Drops]: an RRef's __del__ applies its drop to the context when the context's
    lock is free (one held by this very thread - the garbage collector inside the context -
    queues the fork id instead); the next call to the owner takes every delete to it (over
    the old 512 cap) and carries them: the owner applies them as one batch before the
    call, and no RREF_USER_DELETES of their own is sent."""
    w0, w1 = group.rts[0], group.rts[1]
    w0.control.stop(5.0)  # nothing flushes behind the test's back
    batches: list[int] = []
    real = w1.ctx.on_user_deletes
    w1.ctx.on_user_deletes = lambda deletes: batches.append(len(deletes)) or real(deletes)  # type: ignore[method-assign]
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        refs = [rrefrt.remote("w1", add, args=(i, i)) for i in range(600)]
        for r in refs:
            poll_for(r.confirmed_by_owner, 5)
        held = refs.pop()
        fid = held._user_rec.fork_id
        with w0.ctx._lock:  # as if the collector ran the destructor inside the context
            del held, r
            assert list(w0.control.drops) == [fid]
        assert w0.ctx.counts()["num_confirmed_users"] == 600
        del refs
        assert w0.ctx.counts()["num_deleting_users"] == 599  # applied, not sent
        assert rrefrt.rpc_sync("w1", owned_here) == base
        assert batches == [600]
    poll_for(lambda: w0.ctx.counts() == dict.fromkeys(w0.ctx.counts(), 0), 5, lambda: w0.ctx.counts())


def test_the_first_drops_of_a_burst_leave_when_they_wake_the_control_thread(group: Group, monkeypatch: Any) -> None:
    """NOTE [Drops]: a burst of drops (``FIRST_BATCH`` or more) that wakes the control
    thread is sent at once (the owner starts on it while the program may still be dropping
    or collecting); only the drops that come while it batches wait for ``DROP_DELAY``."""
    import rrefrt.runtime.control as control

    monkeypatch.setattr(control, "DROP_DELAY", 60.0)  # a tick would come too late for the test
    w0 = group.rts[0]
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        refs = [rrefrt.remote("w1", add, args=(i, i)) for i in range(control.FIRST_BATCH)]
        for r in refs:
            poll_for(r.confirmed_by_owner, 5)
        del refs, r
    poll_for(lambda: group.rts[1].ctx.counts()["num_owner_rrefs"] == base, 10, lambda: group.rts[1].ctx.counts())
    poll_for(lambda: w0.ctx.counts() == dict.fromkeys(w0.ctx.counts(), 0), 5, lambda: w0.ctx.counts())


def test_a_full_collection_waits_for_the_flush_only_when_deletes_wait(group: Group, monkeypatch: Any) -> None:
    """NOTE [Drops before a collection]: a generation-2 collection that starts with deletes
    decided and unsent hands them to the control thread first; with nothing to send, or
    with the context's lock held (the flush would wait for it), it does not wait; a stopped
    control loop leaves the hook's registry, and the hook is installed once."""
    import rrefrt.runtime.collection as collection
    import rrefrt.runtime.control as control

    monkeypatch.setattr(control, "DROP_DELAY", 60.0)  # only the collection flushes, not a tick
    monkeypatch.setattr(control, "FIRST_BATCH", 10_000)  # nor the drops' own wake-up
    monkeypatch.setattr(collection, "COLLECT_WAIT", 5.0)  # a busy machine may be slow to run the flush
    w0, w1 = group.rts[0], group.rts[1]
    assert collection._gc_hook in gc.callbacks and w0.control in collection._LOOPS
    syncs: list[int] = []
    on_sync = w0.control._handlers[control.Sync]
    monkeypatch.setitem(w0.control._handlers, control.Sync, lambda item: (syncs.append(1), on_sync(item)))
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        gc.collect()
        assert syncs == []  # nothing to send: no wait
        refs = [rrefrt.remote("w1", add, args=(i, i)) for i in range(50)]
        for r in refs:
            poll_for(r.confirmed_by_owner, 5)
        del refs, r
        with w0.ctx._lock:
            gc.collect()  # the context's lock is held: the flush would wait for this thread
        assert syncs == [] and w0.ctx.unsent_count == 50
        gc.collect()
        assert syncs == [1]
        assert w0.ctx.unsent_count == 0  # sent before the collection
        poll_for(lambda: w1.ctx.counts()["num_owner_rrefs"] == base, 5, lambda: w1.ctx.counts())
    w0.control.stop(5.0)
    assert w0.control not in collection._LOOPS and gc.callbacks.count(collection._gc_hook) == 1


def test_collect_fully_collects_again_after_another_threads_collection(monkeypatch: Any) -> None:
    """While a collection of another thread is in progress (its "start" callbacks ran - our
    hook may wait there - and its "stop" ones have not), ``gc.collect()`` returns at once
    having collected nothing; ``collect_fully`` (the strict leak report's) waits for that
    collection to end and collects again."""
    import rrefrt.runtime.collection as collection

    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    collection.collect_fully(time.monotonic() + 5)
    assert calls == [1]
    monkeypatch.setattr(collection, "_collecting", True)  # another thread's collection started
    ender = threading.Timer(0.05, lambda: collection._gc_hook("stop", {"generation": 0}))  # ... and ends
    ender.start()
    collection.collect_fully(time.monotonic() + 5)
    ender.join(5)
    assert calls == [1, 1, 1]


def test_release_rrefs_collects_garbage_only_for_strict_leak_checks(group: Group, monkeypatch: Any) -> None:
    """Shutdown deletes every user fork, referenced or not: a full gc.collect() (~95 ms per
    rank with torch loaded) is needed only to tell live RRefs from garbage in strict mode."""
    w0 = group.rts[0]
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    with group.as_worker(0):
        rref = rrefrt.remote("w1", add, args=(1, 1))
        poll_for(rref.confirmed_by_owner, 5)
    assert w0.lifecycle.release_rrefs(time.monotonic() + 5) == []
    assert collected == []
    assert w0.ctx.counts()["num_confirmed_users"] == 0  # deleted although still referenced
    w0.options.strict_rref_leaks = True
    w0.lifecycle.release_rrefs(time.monotonic() + 5)
    assert collected == [1]
    del rref


# ------------------------------------------------------------------ the inproc transport itself
def test_inproc_transport_is_a_transport_and_calls_back_on_the_hub_thread() -> None:
    from rrefrt_transport import base

    hub = InprocHub()
    try:
        seen: list[tuple[str, Any]] = []
        a = base.create(base.TransportConfig(0, "a", 0, kind="inproc", extra={"hub": hub}),
                        lambda *m: None, lambda p, c: seen.append(("dead", p)))
        b = hub.transport(1, "b", lambda src, kind, mid, meta, frames: (
            seen.append(("msg", (threading.current_thread().name, meta, frames))), b.respond(src, mid, ["ok"])),
            lambda p, c: None)
        assert isinstance(a, base.Transport) and isinstance(b, base.Transport)
        a.connect_peers([PeerSpec(1, "b", 0, PeerAddress("inproc"))], 1.0)
        done: list[Any] = []
        a.request(1, 16, (1, (2, 3)), [memoryview(b"xy")], 5.0, lambda m, f, e: done.append((m, f, e)), "PYTHON_CALL")
        poll_for(lambda: done, 5)
        assert done == [(["ok"], [], None)]
        name, meta, frames = seen[0][1]
        assert "hub" in name and meta == [1, [2, 3]] and frames == [b"xy"]  # msgpack-like copies
        a.fault_hook = lambda dest, label: []  # drop everything
        a.request(1, 16, [], [], 0.2, lambda m, f, e: done.append(e), "PYTHON_CALL")
        poll_for(lambda: len(done) == 2, 5)
        assert "no response" in str(done[1])
        a.fault_hook = None
        a.request(1, 16, [], [], 0, lambda m, f, e: done.append(e), "PYTHON_CALL")  # no deadline
        hub.kill(1)
        poll_for(lambda: ("dead", 1) in seen, 5)
        assert a.dead_peers() == {1} and not a.is_alive(1)
    finally:
        hub.close()


def make_list(n: int) -> list[int]:
    return list(range(n))


def test_drops_spread_over_time_share_wake_ups_and_all_leave(group: Group) -> None:
    """NOTE [Drops]: a program that drops one RRef now and then (a loop of
    ``remote().to_here()``) woke the control thread once per drop. Now the first drop wakes
    it and it flushes every ``DROP_DELAY`` while drops keep coming; the deletes still all
    reach the owner with no further call from the dropping worker."""
    from rrefrt.runtime.control import FlushDrops

    w0, w1 = group.rts[0], group.rts[1]
    wakes: list[int] = []
    on_flush = w0.control._handlers[FlushDrops]
    w0.control._handlers[FlushDrops] = lambda item: (wakes.append(1), on_flush(item))
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        refs = [rrefrt.remote("w1", add, args=(i, i)) for i in range(100)]
        for r in refs:
            poll_for(r.confirmed_by_owner, 5)
        del r
        for _ in range(100):
            refs.pop()  # one drop ...
            time.sleep(0.001)  # ... now and then (shapes the load; nothing waits on it)
    poll_for(lambda: len(w1.ctx.owners) == base, 5, lambda: f"w1 owns {len(w1.ctx.owners)}, base {base}")
    print(f"\n100 drops 1 ms apart woke w0's control thread {len(wakes)} time(s)")
    assert len(wakes) < 50  # one per drop before


def test_values_with_no_destructor_are_freed_without_a_pool_task(group: Group, monkeypatch: Any) -> None:
    """NOTE [Release home]: freeing an int or a short str runs no user code, so the owner
    frees it on the thread that handled the delete; a value that may run user code (a list
    of objects, anything else) still goes to the callback pool."""
    w1 = group.rts[1]
    tasks: list[str] = []
    submit = w1.callbacks.submit
    monkeypatch.setattr(w1.callbacks, "submit", lambda fn, *a, **k: (tasks.append(getattr(fn, "__name__", "")), submit(fn, *a, **k))[1])
    with group.as_worker(0):
        base = rrefrt.rpc_sync("w1", owned_here)
        ints = [rrefrt.remote("w1", add, args=(i, 1)) for i in range(20)]
        assert [r.to_here() for r in ints] == [i + 1 for i in range(20)]
        tasks.clear()
        del ints
        rrefrt.rpc_sync("w1", owned_here)  # the deletes leave before this call
    poll_for(lambda: len(w1.ctx.owners) == base, 5)
    assert "clear" not in tasks, tasks
    with group.as_worker(0):
        lst = rrefrt.remote("w1", make_list, args=(3,))
        assert lst.to_here() == [0, 1, 2]
        tasks.clear()
        del lst
        rrefrt.rpc_sync("w1", owned_here)
    poll_for(lambda: len(w1.ctx.owners) == base, 5)
    poll_for(lambda: "clear" in tasks, 5, lambda: f"pool tasks: {tasks}")


def test_call_tracking_notifies_only_a_waiting_shutdown(monkeypatch: Any) -> None:
    """The per-call counters (two updates per call on each side) wake the condition only
    when shutdown's ``wait_idle`` waits on it; that wait still ends once the last call does."""
    from types import SimpleNamespace

    from rrefrt.runtime.lifecycle import Lifecycle

    rt = SimpleNamespace(info=SimpleNamespace(id=0), transport=SimpleNamespace(is_alive=lambda src: True))
    life = Lifecycle(rt, SimpleNamespace())  # type: ignore[arg-type]
    notified: list[int] = []
    real = life._active.notify_all
    monkeypatch.setattr(life._active, "notify_all", lambda: (notified.append(1), real()))
    for _ in range(3):
        life.track_call(+1, 1)
        life.track_outgoing(+1)
        life.track_outgoing(-1)
        life.track_call(-1, 1)
    assert notified == []  # nobody waited
    life.track_call(+1, 1)
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(life.wait_idle(time.monotonic() + 10)))
    waiter.start()
    poll_for(lambda: life._active._waiters, 5, "wait_idle waiting")  # type: ignore[attr-defined]
    life.track_call(-1, 1)
    waiter.join(5)
    assert done == [True] and notified == [1]
