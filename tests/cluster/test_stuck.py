"""Issue 23: a call that does not finish says where it is stuck (docs/stuck.md).

Real processes and sockets on 127.0.0.1: this test process is w0, w1 a subprocess whose
handlers block in a known function (tests/support/stuck_fns.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import rrefrt
from tests.support import stuck_fns as fns
from tests.support import free_port, poll_for

T = 1.5  #: the calls' timeout
STACK_WAIT = 0.25  #: rrefrt.runtime.caller.STACK_WAIT: how long a timed-out caller waits for the stack
#: how late past T + STACK_WAIT an error may come on this loaded machine (timers, GIL)
SLACK = 0.75


def _released(w: str = "w1") -> None:
    rrefrt.rpc_sync(w, fns.release, timeout=10)
    rrefrt.rpc_sync(w, fns.rearm, timeout=10)


def _assert_names_stuck(err: rrefrt.RpcTimeoutError, took: float) -> None:
    text = str(err)
    assert "w1 was at stuck_fns.py:" in text and "in stuck (time.sleep)" in text, text
    assert err.remote_stack is not None and "stuck_fns.py" in err.remote_stack, err.remote_stack
    assert err.remote_stack.rstrip().endswith("time.sleep(0.01)"), err.remote_stack  # innermost last
    assert isinstance(err, TimeoutError)
    assert T <= took <= T + STACK_WAIT + SLACK, took


@pytest.mark.timeout(90)
def test_timeouts_say_where_the_handler_is(group):
    group(2)
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        rrefrt.rpc_sync("w1", fns.stuck, timeout=T)
    took_sync = time.monotonic() - t0
    _assert_names_stuck(e.value, took_sync)
    _released()

    t0 = time.monotonic()
    fut = rrefrt.rpc_async("w1", fns.stuck, timeout=T)
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        fut.wait()
    took_async = time.monotonic() - t0
    _assert_names_stuck(e.value, took_async)
    _released()

    rref = rrefrt.remote("w1", fns.stuck)
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        rref.to_here(timeout=T)
    took_to_here = time.monotonic() - t0
    assert "to_here()" in str(e.value)
    _assert_names_stuck(e.value, took_to_here)
    _released()

    box = rrefrt.remote("w1", fns.StuckBox)
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        box.rpc_sync(timeout=T).stuck()
    _assert_names_stuck(e.value, time.monotonic() - t0)
    _released()
    print(f"\ntimeouts of {T}s name the stuck handler after: rpc_sync {took_sync:.3f}s, rpc_async "
          f"{took_async:.3f}s, to_here {took_to_here:.3f}s (bound T + {STACK_WAIT}s + {SLACK}s)")


@pytest.mark.timeout(90)
def test_a_queued_call_says_so(group, tmp_path):
    group(2, peer_options={"num_worker_threads": 1})
    flag = tmp_path / "entered"
    blocker = rrefrt.rpc_async("w1", fns.stuck, args=(4, str(flag)), timeout=30)  # returns after 4 s
    poll_for(flag.exists, 10, "the stuck handler started")  # w1's only pool thread is taken
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        rrefrt.rpc_sync("w1", fns.quick, timeout=1.0)
    took = time.monotonic() - t0
    assert "w1 had not started it yet: it was queued" in str(e.value), str(e.value)
    assert e.value.remote_stack is None and took <= 1.0 + STACK_WAIT + SLACK, took
    assert blocker.wait() == "released"  # (a release() would queue behind it)


@pytest.mark.timeout(90)
def test_a_callee_holding_the_gil_gives_the_plain_timeout(group):
    group(2)
    fut = rrefrt.rpc_async("w1", fns.hold_the_gil, args=(10 ** 12,), timeout=0)  # never returns in the test
    del fut
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        rrefrt.rpc_sync("w1", fns.quick, timeout=1.0)
    took = time.monotonic() - t0
    assert e.value.remote_stack is None and "was at" not in str(e.value), str(e.value)
    assert took <= 1.0 + STACK_WAIT + SLACK, took
    print(f"\na callee holding the GIL: plain timeout after {took:.3f}s")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("gives_up", ["caller", "callee"])
def test_a_shutdown_that_gives_up_names_the_running_handler_and_where(workers, tmp_path, gives_up):
    """w0 calls a handler on w1 that never returns, then both shut down. The side that gives
    up first (shutdown_timeout 2 s; the other waits 10 s, alive meanwhile) names the call:
    the callee its running handler (function, caller, age, stack), the caller its call
    still outstanding and where w1 has it."""
    short, long_ = 2.0, 10.0
    mine_limit, theirs_limit = (short, long_) if gives_up == "caller" else (long_, short)
    port, go = free_port(), str(tmp_path / "go")
    w1 = workers.start({"name": "w1", "rank": 1, "world_size": 2, "port": port, "options": {"init_timeout": 30},
                        "module": "tests.support.failure_scenarios", "scenario": "ready_then_shutdown_on_go", "go": go,
                        "shutdown_timeout": theirs_limit})
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", init_timeout=30,
                                    shutdown_timeout=mine_limit)
    rrefrt.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=opts)
    error = None
    try:
        assert w1.stdout.readline().strip() == "READY"
        rrefrt.rpc_async("w1", fns.stuck, args=(30,), timeout=0)
        poll_for(lambda: rrefrt.rpc_sync("w1", fns.entered, timeout=10), 10, "the stuck handler started")
        # a monitoring thread's view, no timeout needed: both directions, with their state
        mine = rrefrt.get_debug_info()["calls_in_flight"]
        assert [(c["direction"], c["function"], c["peer"], c["state"]) for c in mine] == [
            ("outgoing", "rpc of 'stuck'", "w1", "awaiting answer")], mine
        theirs = rrefrt.rpc_sync("w1", rrefrt.get_debug_info, timeout=10)["calls_in_flight"]
        running = [c for c in theirs if c["direction"] == "incoming" and c["state"] == "running"]
        # oldest first: the stuck handler, then this very get_debug_info call
        assert [(c["function"], c["peer"]) for c in running] == [("stuck", "w0"), ("get_debug_info", "w0")], theirs
        assert running[0]["age"] > 0 and running[0]["id"] == mine[0]["id"]
        open(go, "w").close()
        t0 = time.monotonic()
        try:
            rrefrt.shutdown()
        except rrefrt.ShutdownError as e:
            error = e
        took = time.monotonic() - t0
    finally:
        if rrefrt.state.current_or_none() is not None:
            rrefrt.shutdown(graceful=False)
    out, _ = w1.communicate(timeout=30)
    if gives_up == "caller":  # its call still outstanding, and where its callee has it
        assert error is not None, "w0's shutdown did not give up"
        text = str(error)
        assert "calls still in flight on 'w0'" in text and "rpc of 'stuck' to 'w1'" in text, text
        assert "running on w1, at stuck_fns.py:" in text and "in stuck (time.sleep)" in text, text
        assert [c["function"] for c in error.stuck_calls] == ["rpc of 'stuck'"]
        assert "stuck_fns.py" in error.stuck_calls[0]["stack"][-1][0]
    else:  # the handler still running there: its function, its caller, its age and its stack
        result = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:])
        assert result["error"] == "ShutdownError", out
        text = result["message"]
        assert "calls still in flight on 'w1'" in text and "'stuck' from 'w0', running for" in text, out
        assert "stuck_fns.py\", line" in text and "in stuck (time.sleep)" in text, out
        took = result["took"]
    print(f"\nthe {gives_up}'s shutdown gave up after {took:.2f}s (timeout {short:.0f} s):\n{text}")


# ---------------------------------------------------------------------------- the job dump
@pytest.mark.timeout(90)
def test_sigusr1_to_rrefrt_run_dumps_every_worker_and_the_job_goes_on(tmp_path):
    import signal
    import threading

    from rrefrt import debug
    from rrefrt.run import dump
    from tests.launcher_scripts.harness import REPO, SCRIPTS, Procs, finish

    assert dump.DUMP_DIR_ENV == debug.DUMP_DIR_ENV  # the launcher names it without importing the runtime
    procs = Procs()
    try:
        p = procs.launch(["--nproc-per-node", "2", f"{SCRIPTS}/stuck_job.py", str(tmp_path)])
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(x.decode(errors="replace") for x in p.stderr), daemon=True)
        reader.start()
        poll_for((tmp_path / "ready").exists, 60, "worker0's call to worker1 is stuck")
        t0 = time.monotonic()
        p.send_signal(signal.SIGUSR1)

        def dumped(rank: int) -> list[str]:
            return [x for x in list(lines) if x.startswith(f"[rank {rank}] ")]

        poll_for(lambda: any("calls in flight on 'worker0'" in x for x in dumped(0))
                 and any("threading.py" in x for x in dumped(1)) and any("Thread " in x for x in dumped(1)), 20,
                 lambda: "".join(lines))
        took = time.monotonic() - t0
        assert p.poll() is None  # the job goes on
        assert any(x.startswith("rrefrt-run: SIGUSR1: node 0 running after") and "rank 1 pid" in x
                   for x in list(lines)), "".join(lines)  # the launcher says where it is too
        one, zero = "".join(dumped(1)), "".join(dumped(0))
        # worker1: the handler running for worker0, where it is, and every thread's stack
        assert "'stuck' from 'worker0', running for" in one and "stuck_fns.py" in one and "in stuck" in one, one
        assert "time.sleep(0.01)" in one
        # worker0: its call still awaiting worker1's answer, and its main thread's stack
        assert "rpc of 'stuck' to 'worker1'" in zero and "stuck_job.py" in zero, zero
        # the same from a script that has the job's store and secret, and from one without
        job = json.loads((tmp_path / "job.env").read_text())
        env = dict(os.environ, PYTHONPATH=REPO, **job)
        env.pop("WORLD_SIZE", None)
        t0 = time.monotonic()
        cli = subprocess.run([sys.executable, "-m", "rrefrt.debug", "dump"], env=env, capture_output=True,
                             text=True, timeout=60)
        took_cli = time.monotonic() - t0
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "[rank 1]   'stuck' from 'worker0', running for" in cli.stdout, cli.stdout + cli.stderr
        assert "[rank 0]   rpc of 'stuck' to 'worker1'" in cli.stdout, cli.stdout
        env["RREFRT_SECRET"] = "not the job's secret"
        refused = subprocess.run([sys.executable, "-m", "rrefrt.debug", "dump"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0 and "[rank" not in refused.stdout, refused.stdout + refused.stderr
        assert p.poll() is None  # the job still goes on
        (tmp_path / "go").touch()
        rc, out, _ = finish(p, 60)
        reader.join(5)
        assert rc == 0 and "worker0: released" in out, (out, "".join(lines))
        print(f"\nSIGUSR1 to rrefrt-run: both workers' dumps printed in {took:.2f}s; `python -m rrefrt.debug dump` "
              f"took {took_cli:.2f}s; the job then finished (rc 0)")
    finally:
        procs.close()


@pytest.mark.timeout(90)
def test_owner_died_names_where_the_rref_was_created(group):
    procs = group(2)
    rref = rrefrt.remote("w1", fns.StuckBox)  # the creation site the error must name
    line = __import__("inspect").currentframe().f_lineno - 1
    assert type(rref.to_here(timeout=10)).__name__ == "StuckBox"
    group.workers.kill(procs["w1"])

    def died() -> str:
        try:
            rref.to_here(timeout=2)
        except rrefrt.OwnerDiedError as e:
            return str(e)
        except rrefrt.RpcError:
            return ""
        return ""

    text = poll_for(died, 20, "to_here() raises OwnerDiedError")
    assert f"test_stuck.py:{line} in test_owner_died_names_where_the_rref_was_created" in text, text
