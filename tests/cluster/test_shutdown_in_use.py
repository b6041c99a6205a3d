"""NOTE [Shutdown while in use] (rrefrt/runtime/shutdown.py): a worker that calls
``shutdown()`` right after ``init_rpc`` and is then served from (torch's usual pattern:
observers, parameter servers) waits for as long as the group keeps calling it, and gives
up ``shutdown_timeout`` after the last call when nobody calls it any more.

Real processes and sockets: this test process is w0, w1 a serving subprocess waiting in
its own graceful shutdown (the ``group`` fixture)."""

from __future__ import annotations

import time

import pytest

import rrefrt
from tests.support import poll_for
from tests.support import workerfns as fns

T = 1.5  #: w1's shutdown_timeout
#: how late past T (after the last call) w1 may give up: one poll of the enter barrier
#: (IN_USE_POLL, 0.5 s) and this loaded machine's scheduling
SLACK = 1.5


@pytest.mark.timeout(90)
def test_a_worker_in_shutdown_waits_while_the_group_calls_it(group):
    procs = group(2, peer_options={"shutdown_timeout": T})
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < 3 * T:  # twice its timeout and more, calling it all along
        assert rrefrt.rpc_sync("w1", fns.add, args=(calls, 1), timeout=10) == calls + 1
        calls += 1
        assert procs["w1"].poll() is None, "w1's shutdown gave up while it was being called"
    rref = rrefrt.remote("w1", fns.add, args=(2, 3))  # an RRef it owns, still usable
    assert rref.to_here(timeout=10) == 5
    del rref
    rrefrt.shutdown(timeout=30)
    [(code, out)] = group.workers.wait_all(30)
    assert code == 0, out
    print(f"\nw1 (shutdown_timeout {T}s) stayed in its shutdown, serving {calls} calls over {3 * T:.1f}s, "
          "and finished with w0's")


@pytest.mark.timeout(90)
def test_a_worker_in_shutdown_that_nobody_calls_gives_up_after_its_timeout(group):
    procs = group(2, peer_options={"shutdown_timeout": T})
    time.sleep(T / 2)  # (the thing under test: w1 waits in shutdown, half its timeout has passed)
    assert rrefrt.rpc_sync("w1", fns.add, args=(1, 1), timeout=10) == 2  # the last call: it moves the deadline
    last = time.monotonic()
    poll_for(lambda: procs["w1"].poll() is not None, T + SLACK + 10, "w1's shutdown gives up")
    took = time.monotonic() - last
    [(code, out)] = group.workers.wait_all(10)
    assert code != 0 and "ShutdownError" in out, out
    assert "worker(s) 'w0' never reached shutdown within the timeout" in out, out
    assert f"({T:.1f}s since the last call from or to this worker; they are alive" in out, out
    assert T <= took <= T + SLACK, took
    with pytest.raises(rrefrt.ShutdownError):  # w1 gave up: w0's barrier reports it missing
        rrefrt.shutdown(timeout=2)
    print(f"\nw1 gave up its shutdown {took:.2f}s after the last call to it (shutdown_timeout {T}s)")
