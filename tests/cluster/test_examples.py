"""The examples run as users run them: through the launcher, and the migration example
also under torch.distributed.rpc itself with only its import changed back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT, Workers, env_for, free_port

pytestmark = pytest.mark.timeout(180)


def _launch(script: str, nproc: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rrefrt.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), script],
        cwd=ROOT, env=env_for(), capture_output=True, text=True, timeout=150,
    )


def test_demo_runs_through_the_launcher():
    proc = _launch("examples/demo.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo: OK" in proc.stdout


def test_migration_example_runs_on_rrefrt():
    proc = _launch("examples/torch_rpc_migration.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "migration example: OK" in proc.stdout


def test_migration_example_is_a_torch_rpc_program(tmp_path):
    source = (ROOT / "examples" / "torch_rpc_migration.py").read_text()
    assert source.count("import rrefrt as rpc") == 1
    torch_version = tmp_path / "torch_rpc_original.py"
    torch_version.write_text(source.replace("import rrefrt as rpc", "import torch.distributed.rpc as rpc"))
    port = free_port()
    procs = Workers()
    try:
        for rank in range(3):
            procs.procs.append(subprocess.Popen(
                [sys.executable, str(torch_version)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=env_for({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "3"}),
                start_new_session=True,
            ))
        outs = procs.wait_all(120)
    finally:
        procs.kill_all()
    assert all(code == 0 for code, _ in outs), outs
    assert "migration example: OK" in outs[0][1]
