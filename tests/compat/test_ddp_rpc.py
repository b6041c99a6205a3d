"""torch programs that mix DistributedDataParallel and RPC (pytorch/examples ddp_rpc's
pattern): the trainers' process group has a port of its own, RPC an explicit tcp://
init_method; and a rendezvous that cannot form says so within seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support import ROOT, env_for, free_port, finish_processes

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.timeout(240)


def _start(rank: int, pg_port: int, rpc_port: int, **extra: str) -> subprocess.Popen:
    env = env_for({"RANK": str(rank), "PG_PORT": str(pg_port), "RPC_PORT": str(rpc_port), **extra})
    for var in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "tests.support.ddp_rpc_worker"], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)




@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        p.wait(10)


def test_ddp_trainers_with_their_own_process_group_join_rpc_at_its_init_method(procs):
    """Without the fix the trainers rendezvous in their process group's store (PG_PORT)
    and the master and parameter server wait at RPC_PORT until init_timeout."""
    pg_port, rpc_port = free_port(), free_port()
    procs += [_start(r, pg_port, rpc_port) for r in range(4)]
    results = finish_processes(procs, 180)
    for code, res, text in results:
        assert code == 0 and res is not None, text[-4000:]
        # polling a shared torch store must not flood the log with c10d's wait warnings
        assert text.count("waitForInput") == 0, text[-4000:]
    losses = results[2][1]["losses"]
    assert len(losses) == 2 and all(x == x for x in losses), results[2][2]


def test_a_rendezvous_that_cannot_form_says_who_is_awaited_where_within_seconds(procs):
    """Rank 3 alone (the parameter server): nobody hosts RPC_PORT. It warns within seconds
    naming the address, and fails at its init_timeout."""
    rpc_port = free_port()
    t0 = time.monotonic()
    procs.append(_start(3, free_port(), rpc_port, INIT_TIMEOUT="7"))
    [(code, res, text)] = finish_processes(procs, 120)
    assert code != 0 and res is None, text[-3000:]
    assert f"localhost:{rpc_port}" in text and "has waited" in text, text[-3000:]
    assert "init_timeout" in text, text[-3000:]
    assert time.monotonic() - t0 < 100
