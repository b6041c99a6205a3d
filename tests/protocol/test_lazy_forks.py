"""NOTE [Lazy registration] in docs/protocol.md: a fork received in a call's arguments
from another user registers with the owner only if it outlives the call (or its user asks
``confirmed_by_owner()``, or its parent dies); one dropped within the call is accepted by
its parent and never reaches the owner. Real processes on 127.0.0.1; this process is w0."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

import rrefrt
from tests.support import lazy_fns as lf
from tests.support import workerfns as fns
from tests.support import poll_for

pytestmark = pytest.mark.timeout(120)

HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 0.6}


def state(worker: str) -> dict:
    return lf.state() if worker == "w0" else rrefrt.rpc_sync(worker, lf.state)


def settled(worker: str) -> bool:
    s = state(worker)
    return s["num_pending_users"] == 0 and s["num_pending_children"] == 0 and s["num_deleting_users"] == 0


def test_forks_dropped_in_their_call_never_reach_the_owner_and_stored_ones_register(group):
    group(3, HB, HB)
    rref = rrefrt.remote("w1", fns.identity, args=(7,))
    assert rref.to_here() == 7
    poll_for(lambda: settled("w0"), 10)
    assert state("w1")["num_forks"] == 1  # w0's own fork
    lf.count_protocol()
    for w in ("w1", "w2"):
        rrefrt.rpc_sync(w, lf.count_protocol)
    try:
        # 1. dropped inside the call: no fork request, no delete; the parent's child clears
        n = 20
        for _ in range(n):
            rrefrt.rpc_sync("w2", lf.registered_at_start, args=(rref,))
        # forked onward within the call (to w0, its own parent's worker), then dropped
        rrefrt.rpc_sync("w2", lf.relay, args=(rref, "w0"))
        poll_for(lambda: settled("w0") and settled("w2"), 10, "pending children accepted")
        sent_w2, sent_w0 = rrefrt.rpc_sync("w2", lf.sent), lf.sent()
        # w2 sent its parent one child accept per fork and nothing to the owner w1
        # (batched: RREF_CHILD_ACCEPTS carries the accepts of drops flushed together)
        assert set(sent_w2) <= {"RREF_CHILD_ACCEPT", "RREF_CHILD_ACCEPTS"} and sent_w2, sent_w2
        assert sent_w0 == {"RREF_CHILD_ACCEPT": 1}, sent_w0  # the relayed fork, to w2
        assert rrefrt.rpc_sync("w1", lf.sent) == {}
        assert state("w1")["num_forks"] == 1 and state("w2")["num_confirmed_users"] == 0

        # 2. stored by the function: registers at the call's end, deleted when dropped
        assert rrefrt.rpc_sync("w2", lf.keep, args=(rref,)) is False
        poll_for(lambda: state("w1")["num_forks"] == 2 and settled("w0") and settled("w2"), 10, "stored fork registered")
        assert state("w2")["num_confirmed_users"] == 1
        # confirmed_by_owner() inside a call registers the fork and waits for the ack
        assert rrefrt.rpc_sync("w2", lf.confirmed, args=(rref,)) == (False, True, 7)
        assert rrefrt.rpc_sync("w2", lf.drop_kept) == 1
        poll_for(lambda: state("w1")["num_forks"] == 1 and settled("w0") and settled("w2")
                 and state("w2")["num_confirmed_users"] == 0, 10, "owner count back to its base")
        sent_w2 = rrefrt.rpc_sync("w2", lf.sent)
        # both registered forks were deleted (in one RREF_USER_DELETES, or two messages)
        assert sent_w2["RREF_FORK_REQUEST"] == 2 and 1 <= sum(v for k, v in sent_w2.items() if "DELETE" in k) <= 2, sent_w2
        del rref
        gc.collect()
        poll_for(lambda: state("w1")["num_owner_rrefs"] == 0 and state("w1")["num_forks"] == 0, 10, "w1 drained")
    finally:
        rrefrt.faults.clear()
    rrefrt.shutdown()
    for code, out in group.workers.wait_all(15):
        assert code == 0, out


def test_owner_killed_while_a_fork_is_unregistered(group):
    """G3: the unregistered fork fails typed (no hang), the parent's pending child goes."""
    procs = group(3, HB, HB)
    rref = rrefrt.remote("w1", fns.identity, args=(5,))
    assert rref.to_here() == 5
    fut = rrefrt.rpc_async("w2", lf.wait_for_death_then_fetch, args=(rref, "w1"))
    poll_for(lambda: state("w2")["num_unregistered_users"] == 1, 10)
    os.kill(procs["w1"].pid, signal.SIGKILL)
    at_start, _, value, took = fut.wait(30)
    assert at_start is False and value == "OwnerDiedError" and took < 10
    poll_for(lambda: settled("w0") and settled("w2"), 10)
    assert state("w2")["num_unregistered_users"] == 0
    del rref, fut
    t0 = time.monotonic()
    rrefrt.shutdown()
    assert time.monotonic() - t0 < 5.0
    (code, out), = group.workers.wait_all(15)[1:]
    assert code == 0, out


def test_parent_killed_mid_call_registers_the_fork_and_leaks_nothing(group):
    """w0 owns the value, w1 (the parent) holds the only other fork and passes it on to w2,
    then is SIGKILLed while w2's call runs: w2 registers at once; its fetch gets the value
    or, if the owner freed it first, a typed error; the owner ends with nothing."""
    procs = group(3, HB, HB)
    rref = rrefrt.RRef(41)
    assert rrefrt.rpc_sync("w1", lf.keep, args=(rref,)) is True  # parent is the owner: registered
    del rref
    gc.collect()
    assert rrefrt.rpc_sync("w1", lf.hand_kept_on, args=("w2", "w1")) is True
    poll_for(lambda: state("w2")["num_unregistered_users"] == 1, 10)
    os.kill(procs["w1"].pid, signal.SIGKILL)
    outcome = poll_for(lambda: rrefrt.rpc_sync("w2", lf.outcomes), 30, "w2's call finished")
    at_start, after, value, took = outcome[0]
    assert at_start is False and after is True and took < 10
    assert value == 41 or value == "RpcError", value
    poll_for(lambda: settled("w2") and state("w2")["num_confirmed_users"] == 0, 10)
    poll_for(lambda: state("w0")["num_owner_rrefs"] == 0 and state("w0")["num_forks"] == 0, 10, "owner drained")
    t0 = time.monotonic()
    rrefrt.shutdown()
    assert time.monotonic() - t0 < 5.0
    (code, out), = group.workers.wait_all(15)[1:]
    assert code == 0, out
