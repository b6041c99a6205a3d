"""Test support: free ports, bounded polling, and worker processes that are always reaped.

Worker processes are started with subprocess (never fork()) in a session of their own, and
every one of them is killed by pid when its group is torn down.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_LOW = 20000
_PORT_HIGH = max(_PORT_LOW + 1000, min(_ephemeral_low(), 32768))
_given: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, for a test's rendezvous or worker. Picked at random
    *below* the kernel's ephemeral range: a port from ``bind(0)`` is an ephemeral one, and
    any outgoing connection of the suite's hundreds of processes could take it before the
    worker binds it (a rendezvous test once failed with "already in use" that way). Never
    the same port twice in one test process."""
    import random

    for _ in range(2000):
        port = random.randrange(_PORT_LOW, _PORT_HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # the range is crowded: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_for(
    predicate: Callable[[], Any], timeout: float, what: "str | Callable[[], str]" = "", interval: float = 0.02
) -> Any:
    """Return the first truthy value of ``predicate()`` or raise AssertionError after
    ``timeout`` seconds, naming ``what``. The interval only paces re-checks of a condition."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {timeout}s: {(what() if callable(what) else what) or predicate}")
        time.sleep(interval)


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Workers:
    """Subprocess workers running ``tests/support/worker_main.py`` with a JSON spec each."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, spec: dict[str, Any], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "worker_main.py"), json.dumps(spec)],
            env=env_for(extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def wait_all(self, timeout: float) -> list[tuple[int, str]]:
        """Wait for every worker (bounded); return (returncode, output) per worker."""
        deadline = time.monotonic() + timeout
        out = []
        for p in self.procs:
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(p)
                text, _ = p.communicate(timeout=5)
                text = (text or "") + "\n<killed: did not exit in time>"
            out.append((p.returncode, text or ""))
        return out

    @staticmethod
    def kill(p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()

    def kill_all(self) -> None:
        for p in self.procs:
            self.kill(p)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def veth_namespaces(prefix: str, addrs: tuple[str, str]) -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair, ``addrs[i]/24`` on side i; yields
    [(namespace, veth device)] x 2 and deletes the namespaces afterwards. Skips the test
    (with the reason) where the tool or the privilege is missing."""
    import pytest

    if shutil.which("ip") is None:
        pytest.skip("the 'ip' tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN)")
    tag = f"{os.getpid() % 100000}"
    names, veth = (f"{prefix}A{tag}", f"{prefix}B{tag}"), (f"{prefix}a{tag}", f"{prefix}b{tag}")
    created: list[str] = []
    try:
        for ns in names:
            res = ip("netns", "add", ns)
            if res.returncode != 0:
                if "Operation not permitted" in res.stderr or "Permission denied" in res.stderr:
                    pytest.skip(f"not permitted to create network namespaces: {res.stderr.strip()}")
                raise RuntimeError(f"ip netns add {ns} failed: {res.stderr.strip()}")
            created.append(ns)
        steps = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
                 ("link", "set", veth[0], "netns", names[0]), ("link", "set", veth[1], "netns", names[1])]
        for ns, dev, addr in zip(names, veth, addrs, strict=True):
            steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            res = ip(*step)
            if res.returncode != 0:
                if "Operation not permitted" in res.stderr:
                    pytest.skip(f"not permitted to set up a veth pair: {res.stderr.strip()}")
                raise RuntimeError(f"ip {' '.join(step)} failed: {res.stderr.strip()}")
        yield list(zip(names, veth, strict=True))
    finally:
        for ns in created:
            ip("netns", "del", ns)


def zmq_transport(transport: Any) -> Any:
    """The ZeroMQ transport of a runtime's transport: the "auto" transport's inner one (the
    path to every peer on another host), or the transport itself when it is the zmq one.
    For tests that read the zmq transport's own state (endpoints, its loop, its security)."""
    return getattr(transport, "inner", transport)


def finish_processes(ps: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, dict | None, str]]:
    """Wait (bounded by ``timeout`` for all of them) for processes started in sessions of
    their own that print ``RESULT <json>`` lines; a process past the deadline is killed with
    its process group. Returns (exit code, the last RESULT's value or None, output) each."""
    deadline = time.monotonic() + timeout
    out = []
    for p in ps:
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            text, _ = p.communicate(timeout=10)
            text += "\n<killed: did not exit in time>"
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        out.append((p.returncode, json.loads(lines[-1][7:]) if lines else None, text))
    return out
