"""The classic torch RPC programs in examples/ run on rrefrt, and unchanged on torch.distributed.rpc.

Each example picks its backend from ``--backend`` (``import rrefrt as rpc`` or
``import torch.distributed.rpc as rpc``; nothing else differs) and starts its own worker
processes with torch.multiprocessing.spawn. Small sizes, random data, no downloads.
The torch runs are marked slow (torch's TensorPipe start-up and shutdown take longer) and
run only with RREFRT_TEST_TORCH_EXAMPLES=1: they check the examples, not rrefrt.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.support import ROOT, env_for, free_port

pytestmark = pytest.mark.timeout(150)

SMALL = {
    "parameter_server.py": ["--world-size", "3", "--steps", "20"],
    "batch_parameter_server.py": ["--world-size", "3", "--steps", "20"],
    "rl_agent_observers.py": ["--world-size", "3", "--episodes", "4", "--steps", "10"],
}

def _run(script: str, backend: str, *, launcher: bool = False) -> subprocess.CompletedProcess:
    args = SMALL[script]
    if launcher:
        cmd = [sys.executable, "-m", "rrefrt.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
               f"examples/{script}", "--backend", backend, *args]
    else:
        cmd = [sys.executable, f"examples/{script}", "--backend", backend, *args]
    env = env_for({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RPC_BACKEND"):
        env.pop(var, None)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the example's spawned workers share its session
        out, _ = p.communicate(timeout=10)
        out += "\n<killed: did not finish in 120 s>"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def _check(proc: subprocess.CompletedProcess, script: str, backend: str) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"[{backend}]" in proc.stdout, proc.stdout[-3000:]
    assert f"{script.removesuffix('.py')}: OK" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize(
    "script",
    [
        "parameter_server.py",
        "batch_parameter_server.py",  # torch.futures.wait_all over rrefrt futures
        "rl_agent_observers.py",
    ],
)
def test_example_on_rrefrt(script: str) -> None:
    _check(_run(script, "rrefrt"), script, "rrefrt")


def test_parameter_server_through_the_launcher() -> None:
    _check(_run("parameter_server.py", "rrefrt", launcher=True), "parameter_server.py", "rrefrt")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RREFRT_TEST_TORCH_EXAMPLES") != "1",
                    reason="checks the examples on torch itself, not rrefrt (about 25 s): RREFRT_TEST_TORCH_EXAMPLES=1")
@pytest.mark.parametrize("script", list(SMALL))
def test_example_on_torch_rpc(script: str) -> None:
    _check(_run(script, "torch"), script, "torch")


@pytest.mark.parametrize("script", list(SMALL))
def test_example_differs_from_torch_only_in_the_import(script: str) -> None:
    """The backend switch is the only place the two programs differ."""
    source = (ROOT / "examples" / script).read_text()
    assert source.count("import torch.distributed.rpc as rpc") == 1
    assert source.count("import rrefrt as rpc") == 1
    assert not re.search(r"\brrefrt\.[A-Za-z_]", source), "uses rrefrt-only names"
