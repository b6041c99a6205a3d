"""A network partition (issue 4, item 1): two workers in two network namespaces joined by
a veth pair; the test sets the link down while each has a call and a to_here() pending on
the other.

Bound (shared/DESIGN.md): a partition is detected within heartbeat timeout + interval +
1 s; every future bound to the unreachable worker fails with WorkerUnavailableError (or
OwnerDiedError for its RRefs). Shutdown afterwards raises a typed error within
shutdown_timeout + 2 s on the side cut off from the store, and both processes exit.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; skips and says so otherwise. The
namespaces are deleted in a finally, which also removes the veth pair.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from tests.support import ROOT, env_for, free_port, ip, veth_namespaces

ADDR = ("10.214.0.1", "10.214.0.2")
HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 0.6}
SILENT_BOUND = HB["heartbeat_timeout"] + HB["heartbeat_interval"] + 1.0
SHUTDOWN_TIMEOUT = 2.0


@pytest.fixture
def two_hosts():
    """Yields ((namespace, veth device) x 2); skips where namespaces cannot be made."""
    with veth_namespaces("rrp", ADDR) as hosts:
        yield hosts


class _Proc:
    """A worker in a namespace (``ip netns exec`` execs in place: the pid is the worker's);
    its output is read by a thread so the test can wait for a line with a deadline."""

    def __init__(self, ns: str, spec: dict) -> None:
        self.p = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(ROOT / "tests" / "support" / "worker_main.py"), json.dumps(spec)],
            env=env_for({"RREFRT_NO_IPC": "1"}),  # same host id in both namespaces: force TCP
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.text: list[str] = []
        self.exited_at: float | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.text.append(line)
            self.lines.put(line.strip())
        self.p.wait()
        self.exited_at = time.monotonic()
        self.lines.put("<exit>")

    def expect(self, what: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what!r} within {timeout}s; output:\n{''.join(self.text)}") from None
            if line.startswith(what):
                return line
            if line == "<exit>":
                raise AssertionError(f"exited before {what!r}; output:\n{''.join(self.text)}")

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, 9)
            except ProcessLookupError:
                pass
        self.p.wait(5)


@pytest.mark.timeout(60)
def test_partition_is_detected_within_the_heartbeat_bound(two_hosts):
    (ns_a, dev_a), (ns_b, _) = two_hosts
    port = free_port()
    procs: list[_Proc] = []
    try:
        for rank, ns in ((0, ns_a), (1, ns_b)):
            spec = {"name": f"w{rank}", "rank": rank, "world_size": 2, "port": port, "addr": ADDR[0],
                    "module": "tests.support.failure_scenarios", "scenario": "partition_observer", "peer": f"w{1 - rank}",
                    "shutdown_timeout": SHUTDOWN_TIMEOUT, "wait": 20,
                    "options": HB | {"init_timeout": 30, "shutdown_timeout": SHUTDOWN_TIMEOUT}}
            procs.append(_Proc(ns, spec))
        for p in procs:
            p.expect("READY", 30)
        t0 = time.monotonic()
        res = ip("-n", ns_a, "link", "set", dev_a, "down")
        assert res.returncode == 0, res.stderr
        results = [json.loads(p.expect("RESULT ", 30)[7:]) for p in procs]
        for p in procs:
            p.p.wait(10)
            p.reader.join(10)  # it notes when the process exited
        print(f"\nnetwork partition between two namespaces (heartbeat interval {HB['heartbeat_interval']} s, "
              f"timeout {HB['heartbeat_timeout']} s):")
        for rank, r in enumerate(results):
            print(f"  w{rank}: pending call failed after {r['call']['at'] - t0:.3f} s ({r['call']['error']}), pending "
                  f"to_here after {r['to_here']['at'] - t0:.3f} s ({r['to_here']['error']}) (bound {SILENT_BOUND:.1f} s); "
                  f"next call {r['next_call']['error']} in {1000 * r['next_call']['took']:.2f} ms; shutdown: "
                  f"{r['shutdown'].get('message', r['shutdown']['error'])} after {r['shutdown']['took']:.3f} s (bound {SHUTDOWN_TIMEOUT + 2} s); "
                  f"process exited {procs[rank].exited_at - t0:.3f} s after the cut")
        for rank, r in enumerate(results):
            peer = f"w{1 - rank}"
            assert r["call"]["error"] == "WorkerUnavailableError" and peer in r["call"]["message"], r
            assert r["to_here"]["error"] == "OwnerDiedError", r
            assert r["call"]["at"] - t0 <= SILENT_BOUND and r["to_here"]["at"] - t0 <= SILENT_BOUND, r
            assert r["next_call"]["error"] == "WorkerUnavailableError" and r["next_call"]["took"] < 0.1, r
            assert r["dead"] == [peer], r
            assert r["shutdown"]["took"] <= SHUTDOWN_TIMEOUT + 2.0, r
            assert procs[rank].p.returncode == 0
        # w0 does not wait for the dead w1 (nor for w1's calls still running on it); w1 is cut
        # off from the store that w0 hosts: a typed error, not a hang
        assert results[0]["shutdown"]["error"] is None, results[0]
        assert results[1]["shutdown"]["error"] == "ShutdownError", results[1]
    finally:
        for p in procs:
            p.kill()
