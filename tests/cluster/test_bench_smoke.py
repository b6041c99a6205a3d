"""The benchmark's --quick run as a smoke test: both backends run every workload of the main
group to the end. No ratio is asserted (CI machines are too noisy for that)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_bench_quick_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_rpc.py"), "--quick", "--timeout", "150", "--json", str(out)],
        capture_output=True, text=True, timeout=220, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rpc_sync no-op p50" in proc.stdout and out.exists()
