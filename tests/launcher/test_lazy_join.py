"""Joins that scale (issue 22; NOTE [Lazy connections] in transport/zmq/agent.py): a worker
connects to a peer on first use, so a job whose workers call only their neighbour holds
connections to its neighbours only, whatever the size of the group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.launcher_scripts.harness import REPO, SCRIPTS

JOB = os.path.join(SCRIPTS, "neighbour_job.py")


def run_job(n: int, env: dict[str, str], timeout: float) -> tuple[list[dict], float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rrefrt.run", "--nproc-per-node", str(n), JOB],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **env},
    )
    took = time.monotonic() - t0
    rows = [json.loads(line.split("NEIGHBOUR ", 1)[1]) for line in proc.stdout.splitlines() if "NEIGHBOUR " in line]
    assert proc.returncode == 0 and len(rows) == n, f"exit {proc.returncode}, {len(rows)}/{n} reported\n{proc.stderr[-3000:]}"
    return rows, took


def neighbours(r: dict) -> set[int]:
    return {(r["rank"] + 1) % r["size"], (r["rank"] - 1) % r["size"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("same_host", ["1", "0"], ids=["auto", "tcp-only"])
def test_workers_that_call_their_neighbour_connect_to_their_neighbours_only(same_host: str) -> None:
    """16 workers, each calling rank + 1: after init a worker has a data pipe with at most
    its two ring neighbours (the join's fan-out of one), and after its calls still; its
    liveness watches those only, and its same-host connections too (none made by init_rpc). Its
    descriptors do not grow with the group: at most those of its two neighbours'
    connections over a 2-worker job's. (rrefrt-run gives a one-node job a secret, so the tcp
    stream plane, off with a secret, makes no connection here: tests/cluster/test_stream_plane.py.)"""
    rows, took = run_job(16, {"RREFRT_SAME_HOST": same_host}, 150)
    for r in rows:
        for when in ("init", "calls"):
            assert set(r[when]["pipes"]) <= neighbours(r), r
            assert set(r[when]["unix"]) <= neighbours(r), r  # NOTE [Lazy same-host connections]
            assert set(r[when]["stream"]) <= neighbours(r), r
            assert not (r[when]["unix"] if same_host == "0" else r[when]["stream"]), r  # one plane per pair
            assert r[when]["watched"] <= 2, r
        # init_rpc made no same-host connection: at most the one its caller (rank - 1) made since
        assert set(r["init"]["unix"]) <= {(r["rank"] - 1) % r["size"]}, r
        assert set(r["init"]["stream"]) <= {(r["rank"] - 1) % r["size"]}, r
    small, _ = run_job(2, {"RREFRT_SAME_HOST": same_host}, 60)
    base = max(r["calls"]["fds"] for r in small)
    # per peer talked to: data, heartbeat and echo connections each way (<= 8 descriptors),
    # and a same-host (or stream) connection
    assert max(r["calls"]["fds"] for r in rows) <= base + 18, (base, [r["calls"]["fds"] for r in rows])
    print(f"\n16 workers ({'auto' if same_host == '1' else 'tcp only'}): job {took:.1f}s, init median "
          f"{sorted(r['init_s'] for r in rows)[8]:.2f}s, fds after calls {sorted(r['calls']['fds'] for r in rows)}")


@pytest.mark.timeout(120)
def test_a_32_worker_job_joins_and_finishes_quickly() -> None:
    """The scale test CI runs (issue 22): 32 workers with the default options, each calling
    its neighbour, start, join and finish within 60 s even on 2 cores."""
    rows, took = run_job(32, {}, 100)
    assert took < 60, took
    print(f"\n32 workers: job {took:.1f}s, init max {max(r['init_s'] for r in rows):.2f}s")
