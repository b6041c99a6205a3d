"""Two nodes of two workers each, in two network namespaces joined by a veth pair.

Each "node" is a network namespace with its own address (10.213.0.1 and 10.213.0.2, which
exist only inside the namespaces); a launcher runs in each through ``ip netns exec``. This
needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root); without them the tests skip and say so.
The namespaces are deleted in a finally, which also removes the veth pair.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support import veth_namespaces
from tests.launcher_scripts.harness import (SCRIPTS, WORKER, Procs, finish_all, launcher_env,
                                            read_json)

ADDR = ("10.213.0.1", "10.213.0.2")
PORT = 29513


@pytest.fixture
def two_hosts():
    """Yields the two namespace names; skips where namespaces cannot be made."""
    with veth_namespaces("rr", ADDR) as hosts:
        yield [ns for ns, _ in hosts]


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def _launch_both(procs, names, script_args, env=None):
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", ADDR[0],
              "--master-port", str(PORT), "--rdzv-timeout", "20"]
    env = env or launcher_env(RREFRT_SECRET="netns-test-secret")
    started = [procs.launch([*common, "--node-rank", str(n), *script_args], env=env,
                            prefix=["ip", "netns", "exec", names[n]]) for n in (0, 1)]
    t0 = time.monotonic()
    results = finish_all(started, 45)
    return results, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_two_nodes_in_two_network_namespaces(two_hosts, procs, tmp_path):
    (r0, r1), took = _launch_both(procs, two_hosts, [WORKER, str(tmp_path), "--connect-store"])
    for rc, _, err in (r0, r1):
        assert rc == 0, err
    recs = {r: read_json(tmp_path / f"rank{r}.json")["env"] for r in range(4)}
    assert [recs[r]["NODE_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert all(recs[r]["MASTER_ADDR"] == ADDR[0] and recs[r]["WORLD_SIZE"] == "4"
               for r in range(4))
    assert "store 10.213.0.1:29513 (hosted here)" in r0[2]
    print(f"\n2 nodes x 2 workers across namespaces: {took:.2f}s\n--- node 0 ---\n{r0[2]}"
          f"--- node 1 ---\n{r1[2]}")


@pytest.mark.timeout(60)
def test_rrefrt_program_across_two_network_namespaces(two_hosts, procs):
    (r0, r1), took = _launch_both(procs, two_hosts, [os.path.join(SCRIPTS, "rpc_ring.py")])
    for rc, _, err in (r0, r1):
        assert rc == 0, err
    out = r0[1] + r1[1]
    for r in range(4):
        assert (f"worker{r}: add -> {100 + r}; call from worker{r} handled by rank "
                f"{(r + 1) % 4}") in out
    print(f"\nrpc ring over 2 namespaces in {took:.2f}s:\n{r0[1]}{r1[1]}{r0[2]}{r1[2]}")


@pytest.mark.timeout(60)
def test_failure_on_one_namespace_node_stops_the_other(two_hosts, procs, tmp_path):
    (r0, r1), _ = _launch_both(procs, two_hosts, [WORKER, str(tmp_path), "--exit-rank", "2",
                                                  "--hold", "60", "--wait-peers"])
    assert r1[0] == 1 and "job failed: rank 2 (node 1, local rank 0" in r1[2]
    assert r0[0] == 1 and "job failed on node 1" in r0[2] and "rank 2 exited with code 3" in r0[2]
    print(f"\n--- node 0 ---\n{r0[2]}--- node 1 ---\n{r1[2]}")
