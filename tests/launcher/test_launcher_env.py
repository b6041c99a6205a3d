"""rrefrt.run.env: reading the job layout from torchrun, rrefrt-run, SLURM and MPI variables.

Unit tests of ``resolve_env`` and ``expand_hostlist`` (with hypothesis), then the same rrefrt
program (tests/launcher_scripts/rpc_ring.py) run for real under torchrun, and under plain
processes that carry only SLURM or only Open MPI variables.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrefrt.run.env import EnvError, detect_engine, expand_hostlist, hosted_store, resolve_env
from tests.launcher_scripts.harness import REPO, SCRIPTS, free_port, launcher_env

RING = os.path.join(SCRIPTS, "rpc_ring.py")

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "node[01-03,7],other",
         "SLURM_JOB_ID": "123456"}
OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}


@pytest.mark.timeout(10)
def test_slurm_variables():
    assert resolve_env(SLURM) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": str(20000 + 123456 % 10000)}
    assert detect_engine(SLURM) == "slurm"


@pytest.mark.timeout(10)
def test_step_nodelist_wins_over_job_nodelist():
    env = {**SLURM, "SLURM_STEP_NODELIST": "gpu[5-6]"}
    assert resolve_env(env)["MASTER_ADDR"] == "gpu5"


@pytest.mark.timeout(10)
def test_torch_variables_win_over_slurm():
    env = {**SLURM, "RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.9",
           "MASTER_PORT": "29400", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    out = resolve_env(env)
    assert (out["RANK"], out["WORLD_SIZE"], out["MASTER_ADDR"], out["MASTER_PORT"]) == \
        ("0", "8", "10.0.0.9", "29400")
    assert out["LOCAL_RANK"] == "1"  # absent from torch's set, taken from SLURM
    assert out["NODE_RANK"] == "0"  # torchrun's GROUP_RANK
    assert detect_engine(env) == "torchrun"


@pytest.mark.timeout(10)
def test_open_mpi_variables_single_node():
    assert resolve_env(OMPI) == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2",
                                 "LOCAL_WORLD_SIZE": "3", "NODE_RANK": "0",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert detect_engine(OMPI) == "mpi"


@pytest.mark.timeout(10)
def test_open_mpi_on_several_nodes_leaves_master_addr_to_the_user():
    env = {**OMPI, "OMPI_COMM_WORLD_SIZE": "6"}
    out = resolve_env(env)
    assert "MASTER_ADDR" not in out and "MASTER_PORT" not in out
    out = resolve_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("head", "1234")


@pytest.mark.timeout(10)
def test_pmi_variables():
    out = resolve_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (out["RANK"], out["WORLD_SIZE"]) == ("1", "2") and "MASTER_ADDR" not in out


@pytest.mark.timeout(10)
def test_nothing_set():
    assert resolve_env({}) == {} and detect_engine({}) == "none"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env, message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a non-negative integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "the world size must be at least 1"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n[1-"}, "SLURM_NODELIST"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(EnvError, match=message.replace("[", r"\[")):
        resolve_env(env)


@pytest.mark.timeout(10)
def test_environment_and_init_method_errors_are_rpc_errors(monkeypatch):
    """Issue 11 item 8: every error a user sees derives from RpcError (EnvError stays a
    ValueError too, so existing ``except ValueError`` keeps working)."""
    import rrefrt
    from rrefrt.group.rendezvous import resolve

    with pytest.raises(rrefrt.RpcError, match="RANK='x'") as info:
        resolve_env({"RANK": "x", "WORLD_SIZE": "2"})
    assert isinstance(info.value, ValueError)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    for init_method, rank, world_size, message in [
        ("env://", 0, 2, "needs MASTER_ADDR and MASTER_PORT"),
        ("tcp://nohost", 0, 2, "must be tcp://host:port"),
        ("tcp://127.0.0.1:1234", -1, 2, "no rank given"),
        ("tcp://127.0.0.1:1234", 0, 0, "rank must be in"),
    ]:
        with pytest.raises(EnvError, match=message) as info:
            resolve(init_method, rank, world_size)
        assert isinstance(info.value, rrefrt.RpcError) and isinstance(info.value, ValueError)
    # no world size anywhere: a dynamic group (docs/dynamic-groups.md), not an error
    assert resolve("tcp://127.0.0.1:1234", 0, None).world_size == 0


@pytest.mark.timeout(10)
def test_hosted_store():
    assert hosted_store({"RREFRT_STORE_HOSTED": "1"}) == "rrefrt"
    assert hosted_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}) == "torch"
    assert hosted_store({}) is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,7],other", ["node01", "node02", "node03", "node7", "other"]),
    ("a", ["a"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("gpu-[9-11]-ib", ["gpu-9-ib", "gpu-10-ib", "gpu-11-ib"]),
    ("x[001-002], y", ["x001", "x002", "y"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text", ["", "n[1-", "n]1", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_expand_hostlist_rejects_garbage(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


_names = st.from_regex(r"[a-z][a-z0-9-]{0,6}[a-z]", fullmatch=True)


@pytest.mark.timeout(30)
@settings(max_examples=200, deadline=None)
@given(prefix=_names, width=st.integers(1, 4),
       numbers=st.lists(st.integers(0, 999), min_size=1, max_size=8, unique=True))
def test_expand_hostlist_inverts_compression(prefix, width, numbers):
    """Compress sorted numbers into SLURM ranges the way SLURM prints them, then expand."""
    numbers = sorted(n for n in numbers if len(str(n)) <= width) or [0]
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    ranges = [f"{r[0]:0{width}d}" + (f"-{r[-1]:0{width}d}" if len(r) > 1 else "") for r in runs]
    hosts = expand_hostlist(f"{prefix}[{','.join(ranges)}],login")
    assert hosts == [f"{prefix}{n:0{width}d}" for n in numbers] + ["login"]


# ---- the same program under other engines -------------------------------------------------

def _run_ranks(envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, RING], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for env in envs]
    try:
        return [(p.wait(timeout=timeout), p.communicate()[0].decode()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)


def _free_port_in(low: int, high: int) -> int:
    start = random.randrange(low, high)  # concurrent runs rarely try the same port first
    for port in [*range(start, high), *range(low, start)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip(f"no free port in {low}-{high}")


def _base_env() -> dict[str, str]:
    return {k: v for k, v in launcher_env().items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}


@pytest.mark.timeout(40)
def test_same_program_under_slurm_variables():
    port = _free_port_in(24000, 26000)
    job_id = str(port - 20000)
    envs = [{**_base_env(), "SLURM_PROCID": str(r), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(r),
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": job_id}
            for r in range(3)]
    for code, out in _run_ranks(envs, 30):
        assert code == 0, out
        assert "add -> 10" in out


@pytest.mark.timeout(40)
def test_same_program_under_open_mpi_variables():
    port = free_port()
    envs = [{**_base_env(), "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "3",
             "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
             "MASTER_PORT": str(port)} for r in range(3)]
    for code, out in _run_ranks(envs, 30):
        assert code == 0, out
        assert "add -> 10" in out


@pytest.mark.timeout(60)
def test_same_program_under_torchrun():
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed (it ships with torch)")
    p = subprocess.run([torchrun, "--nproc-per-node", "3", "--standalone", RING], cwd=REPO,
                       env=_base_env(), capture_output=True, timeout=50)
    out = p.stdout.decode() + p.stderr.decode()
    assert p.returncode == 0, out
    for r in range(3):
        assert f"worker{r}: add -> {100 + r}" in out
