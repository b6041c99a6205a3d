"""Seeded chaos runs in CI: drops, delays, duplicates, reordering, and in most runs a kill,
a SIGSTOP, a SIGSTOP near the heartbeat timeout, or a 200 MB result (tests/chaos.py).
Pass: 0 hangs, 0 orphans, 0 leaked OwnerRRefs (deaths and stops included), only documented
errors, consistent membership, large results delivered or failing typed within bounds.
Long campaigns: ``python scripts/chaos.py --runs 500``."""

from __future__ import annotations

import os

import pytest

from tests.chaos import check, run_one

SEEDS = range(int(os.environ.get("RREFRT_CHAOS_RUNS", "24")))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_run(seed):
    result = run_one(seed)
    print(f"seed {seed}: {result['disruption']}, {result.get('took', 0):.1f}s, "
          f"errors {[w.get('errors') for w in result.get('workers', {}).values()]}")
    assert check(result) == [], result
