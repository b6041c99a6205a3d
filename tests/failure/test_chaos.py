"""Seeded chaos runs in CI: drops, delays, duplicates, reordering, and in most runs a kill,
a SIGSTOP, a SIGSTOP near the heartbeat timeout, or a 200 MB result (tests/support/chaos.py).
Pass: 0 hangs, 0 orphans, 0 leaked OwnerRRefs (deaths and stops included), only documented
errors, consistent membership, large results delivered or failing typed within bounds.
Long campaigns: ``python scripts/chaos.py --runs 500``."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from tests.support.chaos import OPTIONS, check, run_one
from tests.support import Workers, free_port, poll_for

SEEDS = range(int(os.environ.get("RREFRT_CHAOS_RUNS", "16")))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_run(seed):
    result = run_one(seed)
    print(f"seed {seed}: {result['disruption']}, {result.get('took', 0):.1f}s, "
          f"errors {[w.get('errors') for w in result.get('workers', {}).values()]}")
    assert check(result) == [], result


@pytest.mark.timeout(90)
def test_a_fenced_worker_frees_the_values_it_owns(tmp_path):
    """Issue 11 item 5, found by the campaign: a worker stopped past the heartbeat timeout
    and resumed is fenced; over the zmq transport alone (no same-host path, whose closed
    connections hid it) it kept the values it owned for its former peers pinned for good
    (until a peer left, which looks like a death to it). Now it frees them when it learns it."""
    opts = OPTIONS
    port, workers = free_port(), Workers()
    try:
        for rank in range(2):
            workers.start({"name": f"w{rank}", "rank": rank, "world_size": 2, "port": port, "options": opts,
                           "scenario": "fenced_owner", "marks": str(tmp_path)}, {"RREFRT_SAME_HOST": "0"})
        poll_for(lambda: all((tmp_path / f"w{r}.ready").exists() for r in range(2)), 30, "both workers ready")
        os.kill(workers.procs[1].pid, signal.SIGSTOP)
        try:  # stopped well past the heartbeat timeout: w0 declares w1 dead meanwhile
            threading.Event().wait(3 * opts["heartbeat_timeout"] + 0.5)
        finally:
            os.kill(workers.procs[1].pid, signal.SIGCONT)
        (tmp_path / "resumed").touch()
        outs = workers.wait_all(40)
    finally:
        workers.kill_all()
    results = [json.loads([ln for ln in text.splitlines() if ln.startswith("RESULT ")][-1][7:]) for _, text in outs]
    assert results[0]["values"] == list(range(5)), outs
    w1 = results[1]
    print(f"\nfenced w1: learnt it {w1.get('fenced_after', -1):.2f}s after resuming, freed its values "
          f"{w1.get('freed_after', -1):.2f}s after resuming")
    assert w1["membership"]["fenced"], w1
    assert w1["counts"]["num_owner_rrefs"] == 0 and w1["counts"]["num_forks"] == 0, w1
