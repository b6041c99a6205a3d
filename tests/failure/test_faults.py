"""Fault injection: lost, delayed, duplicated and reordered messages between real workers.

Control messages are retried and deduplicated (final counts equal a clean run), user
functions never run twice, and a lost creation fails clearly.
"""

from __future__ import annotations

import gc
import json
import time

import pytest

import rrefrt
from rrefrt import faults
from tests.support import lazy_fns as lf
from tests.support import workerfns as fns
from tests.support import free_port, poll_for

pytestmark = pytest.mark.timeout(120)

WORKERS = ("w0", "w1", "w2")


@pytest.fixture
def plans(cluster):
    """Install plans per worker; removed after the test."""

    def install(worker: str, *rules: faults.Rule, retry: float | None = 0.2, seed: int = 0) -> None:
        plan = faults.FaultPlan(list(rules), seed=seed, control_retry_interval=retry)
        rrefrt.rpc_sync(worker, faults.install, args=(plan,))

    yield install
    for w in WORKERS:
        rrefrt.rpc_sync(w, faults.clear)


def drained(worker: str, timeout: float = 10.0) -> None:
    gc.collect()
    poll_for(lambda: rrefrt.rpc_sync(worker, fns.owner_counts)["num_owner_rrefs"] == 0, timeout)
    counts = rrefrt.rpc_sync(worker, fns.owner_counts)
    assert counts["num_forks"] == 0, counts


def retries(worker: str) -> int:
    return rrefrt.rpc_sync(worker, fns.debug_info)["agent.control_retries"]


def test_lost_control_messages_are_retried(plans):
    before = {w: retries(w) for w in ("w0", "w2")}
    plans("w2", faults.Rule("RREF_FORK_REQUEST", "drop", first=2), faults.Rule("RREF_CHILD_ACCEPT", "drop", first=1))
    plans("w0", faults.Rule("RREF_USER_DELETE", "drop", first=1))
    rref = rrefrt.remote("w1", fns.identity, args=(5,))
    # confirmed_by_owner() registers the received fork (NOTE [Lazy registration]): w2 sends
    # its fork request (lost twice) and, once acknowledged, its child accept (lost once)
    confirmed, value, _ = rrefrt.rpc_sync("w2", fns.confirmed_then_value, args=(rref,))
    assert confirmed is True and value == 5
    # w2's child accept (lost once) has come back: w0's delete can leave as soon as it drops
    poll_for(lambda: rrefrt.get_debug_info()["num_pending_children"] == 0, 10, "w2's child accept retried")
    del rref
    gc.collect()
    # no call to w1 until w0's delete is acknowledged: a call would carry it (NOTE
    # [Piggybacked deletes]); alone, the control thread's flush sends it (lost once)
    poll_for(lambda: (lambda c: c["num_confirmed_users"] + c["num_pending_users"] + c["num_deleting_users"] == 0)(
        rrefrt.get_debug_info()), 10, lambda: str(rrefrt.get_debug_info()))
    drained("w1")
    hits = rrefrt.rpc_sync("w2", faults.stats)
    assert hits == {"drop:RREF_FORK_REQUEST": 2, "drop:RREF_CHILD_ACCEPT": 1}
    assert retries("w2") - before["w2"] >= 3 and retries("w0") - before["w0"] >= 1
    for w in WORKERS:
        assert rrefrt.rpc_sync(w, fns.owner_counts)["num_pending_children"] == 0


def test_duplicated_and_reordered_messages_change_nothing(plans):
    rrefrt.rpc_sync("w1", fns.calls_made, args=(True,))
    for i, w in enumerate(WORKERS):
        plans(
            w,
            faults.Rule("*", "duplicate", probability=0.5),
            faults.Rule("*", "reorder", probability=0.3, delay=0.02),
            seed=i,
        )
    counter = rrefrt.remote("w1", fns.Counter)
    for _ in range(20):
        counter.rpc_sync().increment()
    refs = [rrefrt.remote("w1", fns.identity, args=(i,)) for i in range(30)]
    assert rrefrt.rpc_sync("w2", fns.keep, args=(refs,)) >= 30
    assert sum(r.to_here() for r in refs) == sum(range(30))
    assert [rrefrt.rpc_sync("w1", fns.count_call) for _ in range(10)] == list(range(1, 11))
    assert counter.rpc_sync().get() == 20  # every increment ran exactly once
    assert rrefrt.rpc_sync("w1", fns.calls_made) == 10
    assert rrefrt.rpc_sync("w1", fns.debug_info)["agent.duplicate_calls_dropped"] > 0
    rrefrt.rpc_sync("w2", fns.drop_kept)
    del counter, refs
    drained("w1")


def test_dropped_response_after_the_function_ran(plans):
    rrefrt.rpc_sync("w1", fns.calls_made, args=(True,))
    # after=1: the response to faults.install itself goes through
    plans("w1", faults.Rule("RESPONSE:PYTHON_CALL", "drop", first=1, after=1))
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError):
        rrefrt.rpc_sync("w1", fns.count_call, timeout=0.5)
    assert time.monotonic() - t0 <= 1.0
    assert rrefrt.rpc_sync("w1", fns.calls_made) == 1  # ran once, not retried


def test_lost_remote_creation_fails_clearly(plans):
    rrefrt.rpc_sync("w1", fns.calls_made, args=(True,))
    plans("w0", faults.Rule("PYTHON_REMOTE", "drop", dest=1), retry=0.05)
    t0 = time.monotonic()
    rref = rrefrt.remote("w1", fns.count_call)
    with pytest.raises(rrefrt.RRefCreationError, match="RRef creation failed"):
        rref.to_here(timeout=20)
    took = time.monotonic() - t0
    print(f"lost creation reported after {took:.2f}s (15 attempts x 0.05 s)")
    with pytest.raises(rrefrt.RRefCreationError, match="RRef creation failed"):
        rrefrt.rpc_sync("w2", fns.rref_value, args=(rref,))
    with pytest.raises(rrefrt.RRefCreationError):
        rref.rpc_sync().get()
    assert rrefrt.rpc_sync("w1", fns.calls_made) == 0
    rrefrt.rpc_sync("w0", faults.clear)
    del rref
    drained("w1")


def test_delayed_creation_that_arrives_after_it_was_given_up_never_runs(plans):
    rrefrt.rpc_sync("w1", fns.calls_made, args=(True,))
    base = rrefrt.rpc_sync("w1", fns.debug_info)["agent.duplicate_calls_dropped"]
    plans("w0", faults.Rule("PYTHON_REMOTE", "delay", delay=1.5, dest=1), retry=0.05)
    rref = rrefrt.remote("w1", fns.count_call)
    with pytest.raises(rrefrt.RRefCreationError):
        rref.to_here(timeout=20)
    del rref
    sent = rrefrt.rpc_sync("w0", faults.stats)["delay:PYTHON_REMOTE"]
    # every delayed copy arrives after the delete's tombstone and is dropped: never runs
    poll_for(lambda: rrefrt.rpc_sync("w1", fns.debug_info)["agent.duplicate_calls_dropped"] >= base + sent, 10)
    drained("w1")
    assert rrefrt.rpc_sync("w1", fns.calls_made) == 0


def test_a_fork_request_never_acknowledged_leaves_nothing_behind(plans):
    """Issue 21: the owner registers a fork whose every ack is lost (or comes after its
    deadline), so the child gives the fork request up. The child's RRef fails; its delete
    frees the fork on the owner and its accept lets the parent's fork go: the value is
    freed once the parent drops it (before, the owner kept both forks for good)."""
    plans("w1", faults.Rule("RESPONSE:RREF_FORK_REQUEST", "drop"))
    plans("w2", retry=0.05)  # gives up after 15 attempts x 0.05 s
    rref = rrefrt.remote("w1", fns.identity, args=(5,))
    assert rref.to_here() == 5
    # confirmed_by_owner() registers the received fork (NOTE [Lazy registration])
    confirmed, value, took = rrefrt.rpc_sync("w2", fns.confirmed_then_value, args=(rref,))
    print(f"fork request given up after {took:.2f}s (15 attempts x 0.05 s)")
    assert confirmed is False and value == "RpcError"
    assert rrefrt.rpc_sync("w1", faults.stats)["drop:RESPONSE:RREF_FORK_REQUEST"] >= 15
    # w2's accept reaches w0: its pending child goes, and its own fork may be deleted
    poll_for(lambda: rrefrt.get_debug_info()["num_pending_children"] == 0, 10, lambda: str(rrefrt.get_debug_info()))
    del rref
    drained("w1")
    for w in ("w0", "w2"):
        assert rrefrt.rpc_sync(w, fns.owner_counts)["num_confirmed_users"] == 0


def test_leak_from_dropped_user_deletes_is_reported(workers):
    port = free_port()
    for r in range(2):
        workers.start({
            "name": f"w{r}", "rank": r, "world_size": 2, "port": port, "scenario": "leak_by_dropped_delete",
            "options": {"strict_rref_leaks": True, "shutdown_timeout": 2},  # the owner waits this long for the leaked fork
        })
    outs = workers.wait_all(60)
    results = []
    for code, text in outs:
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert code == 0 and lines, text
        results.append((json.loads(lines[-1][7:]), text))
    (user, _), (owner, owner_log) = results
    assert owner["error"] == "RRefLeakError", owner
    assert any("held by worker 0" in leak for leak in owner["leaks"]), owner
    assert "RRef leak on worker 'w1'" in owner_log


def test_a_call_runs_before_the_owner_confirms_the_fork_it_received(plans):
    """NOTE [Early run] in docs/protocol.md: the callee runs a function at once, while a fork
    it received from another user still waits for the owner's ack (the parent's fork keeps
    the value alive meanwhile); confirmed_by_owner() waits for the ack instead, so it is True
    inside the function, as in torch. A fork dropped while pending is deleted once the ack
    comes (G1), and nothing leaks."""
    before = retries("w2")
    # the owner's first two acks of a fork request are lost: w2 sends each again after 4 s
    plans("w1", faults.Rule("RESPONSE:RREF_FORK_REQUEST", "drop", first=2))
    plans("w2", retry=4.0)
    rref = rrefrt.remote("w1", fns.identity, args=(5,))
    assert rref.to_here() == 5
    # 1. the function ran before the owner confirmed the fork, and read the value meanwhile
    #    (a fetch of a fork the owner does not know yet: w0's fork keeps the value)
    assert rrefrt.rpc_sync("w2", fns.fork_state_at_start, args=(rref,)) == (False, 5)
    # that fork died with its call: accepted, never registered (NOTE [Lazy registration]);
    # one the function keeps registers when the call ends, and waits for the ack after the
    # call is over, while w0 keeps its own fork for it (G2)
    assert rrefrt.rpc_sync("w2", lf.keep, args=(rref,)) is False
    poll_for(lambda: rrefrt.rpc_sync("w2", lf.state)["num_pending_users"] == 1
             and rrefrt.rpc_sync("w2", lf.state)["num_unregistered_users"] == 0, 10)
    assert fns.owner_counts()["num_pending_children"] >= 1
    # 2. torch's rule: an RRef received as an argument is confirmed inside the function
    confirmed, value, waited = rrefrt.rpc_sync("w2", fns.confirmed_then_value, args=(rref,))
    assert (confirmed, value) == (True, 5)
    assert rrefrt.rpc_sync("w1", faults.stats) == {"drop:RESPONSE:RREF_FORK_REQUEST": 2}
    assert retries("w2") - before >= 2
    # 3. both registered forks, dropped by w2 (one while pending), were deleted after their
    #    acks: the owner frees the value once w0 drops its RRef too, and no fork or child is
    #    left anywhere
    assert rrefrt.rpc_sync("w2", lf.drop_kept) == 1
    del rref
    drained("w1")
    poll_for(lambda: all(rrefrt.rpc_sync(w, fns.owner_counts) == dict.fromkeys(fns.owner_counts(), 0)
                         for w in ("w0", "w2")), 10, lambda: [rrefrt.rpc_sync(w, fns.owner_counts) for w in WORKERS])
