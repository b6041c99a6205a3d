"""The benchmark's --quick run as a smoke test: torch and rrefrt run every workload of the
2-worker (point-to-point) group to the end, after the bytecode precompile and a warm-up group
each (the 3- and 4-worker groups would double its time in CI: each worker imports torch). No ratio is asserted (CI machines
are too noisy for that). The table's arithmetic (paired ratios over interleaved rounds, rate
rows, targets, the variants' rows, CPU per call) is checked on made-up rounds, without
starting any process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_rpc():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_rpc
        yield bench_rpc
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.timeout(300)
def test_bench_quick_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_rpc.py"), "--quick", "--groups", "p2p", "--timeout", "150",
         "--json", str(out), "--pycache", str(tmp_path / "pycache")],
        capture_output=True, text=True, timeout=280, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for row in ("rpc_sync no-op p50", "rpc_sync no-op p99", "tensor round trip 4 KB (rate)",
                "remote() + to_here() p99", "owner drain after a drop"):
        assert row in text, row
    assert "bench_rpc.py --quick" in text  # the command line that produced the table
    assert "p2p: 2 workers on" in text
    assert "modules compiled during a measured init" not in text, text[-3000:]
    assert list((tmp_path / "pycache").rglob("rrefrt/runtime/*.pyc")), "rrefrt's bytecode was not precompiled"
    report = json.loads(out.read_text())
    res = {b: report["runs"][b][0]["results"] for b in ("torch", "rrefrt")}
    for b, r in res.items():
        for key in ("sync_cpu_us", "tensor_4kb_cpu_us", "remote_cpu_us", "async_cpu_us"):
            assert r.get(key, 0) > 0, (b, key)


def _round(**results):
    return {"results": results, "errors": {}}


def test_bench_table_pairs_rounds(bench_rpc, capsys):
    # three interleaved rounds; rrefrt twice as fast as torch in each, whatever the drift
    runs = {
        "torch": [_round(sync_p50_us=200.0 * k, sync_cpu_us=100.0, tensor_1mb_p50_ms=2.0 * k,
                         tensor_1mb_cpu_us=400.0) for k in (1, 2, 3)],
        "rrefrt": [_round(sync_p50_us=100.0 * k, sync_cpu_us=50.0, tensor_1mb_p50_ms=1.0 * k,
                          tensor_1mb_cpu_us=100.0) for k in (1, 2, 3)],
        "torch-tcp": [_round(sync_p50_us=400.0)] * 3,
        "rrefrt-tcp": [_round(sync_p50_us=500.0)] * 2 + [None],  # one failed round: left out of the pairs
    }
    medians, ratios = bench_rpc.summary_table(runs, list(runs))
    text = capsys.readouterr().out
    assert ratios["rrefrt/torch:sync_p50_us"] == pytest.approx(0.5)
    assert ratios["rrefrt/torch:tensor_1mb_p50_ms"] == pytest.approx(2.0)  # a rate: torch's time / rrefrt's
    assert ratios["rrefrt/torch:tensor_1mb_cpu_us"] == pytest.approx(0.25)
    assert ratios["rrefrt-tcp/torch-tcp:sync_p50_us"] == pytest.approx(1.25)
    assert medians["torch"]["sync_p50_us"] == 400.0
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
             if line.startswith("| ")}
    assert lines["rpc_sync no-op p50"] == ["0.50x (0.50-0.50)", "<= 0.8", "yes", "400 us", "50 vs 100 us (0.50x)"]
    assert lines["tensor round trip 1 MB (rate)"][:3] == ["2.00x (2.00-2.00)", ">= 1.5", "yes"]
    assert lines["tcp only: rpc_sync p50"][:3] == ["1.25x (1.25-1.25)", "<= 0.8", "no"]
    assert "with a job secret: 1 MB (rate)" not in lines  # the variant did not run


def test_bench_plan_and_placement(bench_rpc):
    todo = bench_rpc.plan(["torch", "rrefrt-secret", "torch-tcp"], ["p2p", "forks", "life4"], None, False)
    assert todo["torch"] == [("p2p", None), ("forks", None), ("life4", None)]
    assert todo["rrefrt-secret"] == todo["torch-tcp"] == [("p2p", "sync,tensors")]
    assert bench_rpc.plan(["torch"], ["p2p", "forks", "life4"], "forks", False)["torch"] == [("forks", "forks"),
                                                                                             ("life4", None)]
    assert bench_rpc.placement("p2p", 2) == "p2p: 2 workers on 2 cores, one core each"
    assert "w2 shares core 0 with w0" in bench_rpc.placement("forks", 2)
    assert bench_rpc.placement("forks", 4).endswith("one core each")


def test_netns_runs_the_point_to_point_group_only():
    """``--netns`` puts one worker in each of two namespaces: any other group is refused
    before anything is started (no namespace is made)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_rpc.py"), "--netns", "--groups", "forks"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "--netns runs the p2p group only" in proc.stderr, proc.stderr[-2000:]
