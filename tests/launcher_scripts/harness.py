"""Helpers for the launcher tests: start rrefrt-run, wait on conditions, find live processes.

Every process a test starts is registered in a ``Procs`` and killed by pid in its
``close()``; waits go through ``poll_for`` with a deadline, never a bare sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.support import free_port  # noqa: F401  (re-exported for the launcher tests)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "launcher_scripts")
WORKER = os.path.join(SCRIPTS, "worker.py")


def poll_for(predicate: Callable[[], Any], deadline: float, what: str = "condition",
             interval: float = 0.01) -> Any:
    """Wait until ``predicate()`` is truthy (returning it) or raise at ``deadline``."""
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        pause.wait(min(interval, max(0.0, deadline - time.monotonic())))


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def group_alive(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "RREFRT_SECRET", "OMP_NUM_THREADS",
                        "RREFRT_FAKE_GPU_COUNT")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Procs:
    """The processes one test started; ``close()`` kills every one of them by pid."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.pids: set[int] = set()  #: other pids to kill (workers, descendants)

    def launch(self, args: Sequence[str], *, env: dict[str, str] | None = None,
               prefix: Sequence[str] = (), **kw: Any) -> subprocess.Popen[bytes]:
        cmd = [*prefix, sys.executable, "-m", "rrefrt.run", *args]
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(cmd, cwd=kw.pop("cwd", REPO), env=env or launcher_env(), **kw)
        self.popens.append(p)
        return p

    def track(self, pids: Sequence[int]) -> None:
        self.pids.update(pids)

    def close(self) -> None:
        for p in self.popens:
            if p.poll() is None:
                p.kill()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.popens:
            try:
                p.communicate(timeout=5)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def wait_ranks(outdir: str, ranks: Sequence[int], deadline: float) -> dict[int, dict[str, Any]]:
    """Wait for every rank's start record (see worker.py) and return them."""
    paths = {r: os.path.join(outdir, f"rank{r}.json") for r in ranks}
    poll_for(lambda: all(os.path.exists(p) for p in paths.values()), deadline,
             f"ranks {list(ranks)} to start")
    return {r: read_json(p) for r, p in paths.items()}


def finish(p: subprocess.Popen[bytes], timeout: float) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def finish_all(popens: Sequence[subprocess.Popen[bytes]],
               timeout: float) -> list[tuple[int, str, str]]:
    """``finish`` for several launchers at once; on timeout, kill them all and fail with
    everything each one printed (so a hang on one node shows what the others said)."""
    results: dict[int, tuple[int, str, str]] = {}

    def wait(i: int, p: subprocess.Popen[bytes]) -> None:
        out, err = p.communicate()
        results[i] = (p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    threads = [threading.Thread(target=wait, args=(i, p), daemon=True)
               for i, p in enumerate(popens)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if len(results) < len(popens):
        tree = _process_tree([p.pid for p in popens if p.poll() is None])
        for p in popens:  # each launcher prints where it is (its SIGUSR1 status line)
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        for t in threads:
            t.join(1.0)
        for p in popens:
            if p.poll() is None:
                p.kill()
        for t in threads:
            t.join(5)
        dump = "\n".join(f"--- launcher {i}: rc {rc}\n{out}{err}"
                          for i, (rc, out, err) in sorted(results.items()))
        raise AssertionError(f"launchers still running after {timeout}s:\n{dump}\n"
                             f"--- their processes then:\n{tree}")
    return [results[i] for i in range(len(popens))]


def _process_tree(roots: Sequence[int]) -> str:
    """``ps`` lines (pid, parent, state, kernel wait channel, age, command) of ``roots`` and
    every descendant: what a hung launcher test was waiting on."""
    res = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,wchan:24=,etime=,args="], capture_output=True,
                         text=True, timeout=10)
    rows = [line.split(None, 5) for line in res.stdout.splitlines() if line.strip()]
    keep, grew = set(roots), True
    while grew:
        grew = False
        for row in rows:
            if int(row[0]) not in keep and int(row[1]) in keep:
                keep.add(int(row[0]))
                grew = True
    return "\n".join(" ".join(row) for row in rows if int(row[0]) in keep) or "(none left)"
