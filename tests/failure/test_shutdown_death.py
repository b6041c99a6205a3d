"""Issue 11 item 4: a worker that dies while the others wait in shutdown()'s barriers stops
being waited for as soon as it is declared dead, instead of after the full
shutdown_timeout. Real processes and sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from rrefrt.group.store import StoreClient
from tests.support import Workers, free_port, poll_for

SHUTDOWN_TIMEOUT = 30.0


@pytest.mark.timeout(90)
def test_a_peer_dying_during_shutdown_is_not_waited_for(tmp_path):
    port, go = free_port(), str(tmp_path / "go")
    workers = Workers()
    try:
        procs = {}
        for r in range(3):
            spec = {"name": f"w{r}", "rank": r, "world_size": 3, "port": port,
                    "options": {"shutdown_timeout": SHUTDOWN_TIMEOUT, "init_timeout": 30}}
            if r == 2:
                spec |= {"scenario": "block_forever"}  # never reaches shutdown: killed meanwhile
            else:
                spec |= {"module": "tests.support.failure_scenarios", "scenario": "ready_then_shutdown_on_go", "go": go,
                         "shutdown_timeout": SHUTDOWN_TIMEOUT}
            procs[r] = workers.start(spec)
        for r in (0, 1):
            assert procs[r].stdout.readline().strip() == "READY", f"w{r} did not start"
        open(go, "w").close()
        # w0 and w1 enter shutdown and wait for w2 at the "enter" barrier: kill w2 once both
        # have arrived there (their arrival keys are in the rendezvous store, hosted by w0)
        store = StoreClient("127.0.0.1", port, connect_timeout=30)
        try:
            at_barrier = ["rpc/0/barrier/enter/0", "rpc/0/barrier/enter/1"]
            assert store.wait(at_barrier, 60), "w0 and w1 did not reach the shutdown barrier within 60 s"
            assert not store.check(["rpc/0/barrier/enter/2"])  # w2 blocks: never arrives
        finally:
            store.close()
        t0 = time.monotonic()
        os.kill(procs[2].pid, signal.SIGKILL)
        took = {}
        for r in (0, 1):
            poll_for(lambda r=r: procs[r].poll() is not None, SHUTDOWN_TIMEOUT + 10)
            took[r] = time.monotonic() - t0
        results = {}
        for r in (0, 1):
            text = procs[r].stdout.read()
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            assert procs[r].returncode == 0 and lines, text
            results[r] = json.loads(lines[-1][7:])
        print(f"\nw2 SIGKILLed during shutdown: w0 {results[0]}, w1 {results[1]}; exited "
              f"{took[0]:.2f} s / {took[1]:.2f} s after the kill (shutdown_timeout {SHUTDOWN_TIMEOUT:.0f} s)")
        for r in (0, 1):
            assert results[r]["error"] is None, results[r]
            assert took[r] < 10.0, f"w{r} waited {took[r]:.1f}s for a dead peer"
    finally:
        workers.kill_all()
