"""Fork safety (issue 4, item 6): a worker that calls os.fork().

Bound (shared/DESIGN.md): a forked child that touches the runtime gets a clear error within
0.1 s and sends nothing. The parent keeps working and its fork() never blocks, also while
the I/O thread holds the runtime's locks; the child can call init_rpc afresh.

Everything runs in worker processes (tests/support/failure_scenarios.py ``fork_checks``), not in
pytest's own process: w0 forks, w1 is its peer, n1 waits for the child's fresh group.
"""

from __future__ import annotations

import json

import pytest

from tests.support import Workers, free_port

CHILD_BOUND = 0.1


@pytest.fixture
def workers():
    w = Workers()
    yield w
    w.kill_all()


def _result(code: int, out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert code == 0 and lines, out
    return json.loads(lines[-1][7:])


@pytest.mark.timeout(90)
def test_fork_in_a_worker_is_safe_for_parent_and_child(workers):
    port, fresh_port = free_port(), free_port()
    w0 = workers.start({"name": "w0", "rank": 0, "world_size": 2, "port": port, "module": "tests.support.failure_scenarios",
                        "scenario": "fork_checks", "peer": "w1", "fresh_port": fresh_port, "forks": 30,
                        "options": {"rpc_timeout": 20, "shutdown_timeout": 20}})
    workers.start({"name": "w1", "rank": 1, "world_size": 2, "port": port, "options": {"shutdown_timeout": 20}})
    workers.start({"name": "n1", "rank": 1, "world_size": 2, "port": fresh_port,
                   "options": {"init_timeout": 60, "shutdown_timeout": 20}})
    text, _ = w0.communicate(timeout=80)
    res = _result(w0.returncode, text)

    # 1. forked while the I/O thread held the RRef context lock and the outbox lock
    first = res["locked_fork"]
    assert first["exit"] == 0 and "checks" in first, first
    print(f"\nfork() while the I/O thread holds the context and outbox locks and a thread holds the API lock: fork took "
          f"{1000 * first['fork_took']:.1f} ms; child exit {first['exit']}")
    for name, check in first["checks"].items():
        print(f"  child: {name:38s} {1000 * check['took']:6.2f} ms  {check['result'][:110]}")
    print(f"  child: dropping inherited RRefs + gc took {1000 * first['gc_took']:.2f} ms, sent {first['sent']}")
    print(f"  child: fresh group {first['fresh_group']}")
    assert first["exit"] == 0, first
    assert first["fork_took"] < 0.5, "fork() blocked"
    for name, check in first["checks"].items():
        assert check["result"].startswith("ShutdownError"), (name, check)
        assert "fork" in check["result"], (name, check)  # the error says why
        assert check["took"] <= CHILD_BOUND, (name, check)
    assert first["sent"] == [] and first["gc_took"] <= CHILD_BOUND
    fresh = first["fresh_group"]
    assert fresh.get("value") == 42 and fresh.get("tag") == "fresh", fresh

    # 2. thirty forks while two threads keep RPC and RRef traffic flowing
    forks = res["forks"]
    worst_fork = max(f["fork_took"] for f in forks)
    worst_check = max(c["took"] for f in forks for c in f["checks"].values())
    worst_exit = max(f["exit_within"] for f in forks)
    print(f"{len(forks)} forks during traffic ({res['traffic']['rounds']} traffic rounds): worst fork() "
          f"{1000 * worst_fork:.1f} ms, worst child error {1000 * worst_check:.2f} ms (bound "
          f"{1000 * CHILD_BOUND:.0f} ms), every child reported and exited within {worst_exit:.2f} s "
          f"(half by os._exit, half by a normal interpreter exit)")
    for f in forks:
        assert f["exit"] == 0, f
        assert f["sent"] == [], f
        for name, check in f["checks"].items():
            assert check["result"].startswith("ShutdownError") and check["took"] <= CHILD_BOUND, (name, check)
    assert worst_fork < 0.5, "fork() blocked"
    assert res["traffic"]["errors"] == [] and res["traffic"]["rounds"] > 0, res["traffic"]

    # 3. the parent is intact: calls work, its RRefs work, and it shuts down cleanly
    after = res["after"]
    print(f"parent after the forks: {after}; shutdown {res['shutdown']}")
    assert after["add"] == 3 and after["user_rref"] == "user" and after["owned"] == "owned"
    assert res["shutdown"]["error"] is None, res["shutdown"]
    for code, out in workers.wait_all(20)[1:]:
        assert code == 0, out
