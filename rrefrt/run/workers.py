"""Worker processes: the environment contract, spawning, exit status, process groups.

Owns: one ``Worker`` per process this launcher starts, and the environment each one gets.
Does not decide when to stop anyone (that is the supervisor) and writes no output.

NOTE [Process groups and reaping]
  Every worker is started with ``subprocess.Popen(start_new_session=True)`` from the
  launcher's main thread (a fork+exec done in C, so no Python runs in a half-copied threaded
  process; and PR_SET_PDEATHSIG follows the thread that spawned the worker, which must live
  as long as the launcher). The worker leads its own session and process group, so its
  pgid is its pid and ``killpg(pid, sig)`` reaches the worker and every descendant that
  stayed in the group (DataLoader workers, shells it runs).
  The launcher learns that a worker exited with ``waitid(WEXITED | WNOHANG | WNOWAIT)`` and
  reaps it only at the very end (``reap()``): while the leader is an unreaped zombie its pid,
  and so its pgid, cannot be reused, so signalling the group of a finished worker can never
  hit an unrelated process.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO

__all__ = ["ExitStatus", "WorkerSpec", "Worker", "group_members", "signal_name",
           "BOOTSTRAP_PATH", "worker_environ"]

log = logging.getLogger("rrefrt.run.workers")

BOOTSTRAP_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
WATCHDOG_ENV = "RREFRT_RUN_WATCHDOG"  # read (and removed) by _bootstrap.py


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class ExitStatus:
    """How a worker ended: an exit code, or the signal that killed it."""

    code: int | None  #: exit code; None when killed by a signal
    signal: int | None  #: the killing signal; None on a normal exit
    at: float  #: time.monotonic() when the launcher saw it

    @property
    def ok(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.signal is not None:
            return f"was killed by {signal_name(self.signal)} (signal {self.signal})"
        return f"exited with code {self.code}"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker."""

    rank: int
    local_rank: int
    node_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: str | None  #: its output goes here; None: pipes read by the output pump


class Worker:
    """One worker process. Only the launcher's main thread calls these methods."""

    def __init__(self, spec: WorkerSpec, popen: subprocess.Popen[bytes], started_at: float):
        self.spec = spec
        self.popen = popen
        self.started_at = started_at  #: time.monotonic() at spawn
        self.status: ExitStatus | None = None  #: set once, when the exit is first seen
        self.stopped_with: int | None = None  #: first signal the launcher sent it, if any
        self._reaped = False

    @classmethod
    def spawn(cls, spec: WorkerSpec, watchdog_fd: int) -> Worker:
        log_file: IO[bytes] | None = None
        if spec.log_path is not None:
            log_file = open(spec.log_path, "wb")  # noqa: SIM115 - handed to the child below
        try:
            popen = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL,
                stdout=log_file if log_file is not None else subprocess.PIPE,
                stderr=log_file if log_file is not None else subprocess.PIPE,
                start_new_session=True, pass_fds=(watchdog_fd,), close_fds=True)
        finally:
            if log_file is not None:
                log_file.close()  # the worker holds its own copy
        return cls(spec, popen, time.monotonic())

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def running(self) -> bool:
        return self.status is None

    def poll(self) -> ExitStatus | None:
        """The exit status once the worker has exited (without reaping it), else None."""
        if self.status is not None:
            return self.status
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere: fall back on Popen's record
            rc = self.popen.poll()
            if rc is None:
                return None
            self._reaped = True
            self.status = ExitStatus(rc if rc >= 0 else None, -rc if rc < 0 else None,
                                     time.monotonic())
            return self.status
        if info is None or info.si_pid == 0:
            return None
        if info.si_code == os.CLD_EXITED:
            self.status = ExitStatus(info.si_status, None, time.monotonic())
        else:  # CLD_KILLED or CLD_DUMPED
            self.status = ExitStatus(None, info.si_status, time.monotonic())
        return self.status

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (see NOTE [Process groups and reaping])."""
        if self._reaped:
            return
        if self.stopped_with is None and self.status is None:
            self.stopped_with = sig
        try:
            os.killpg(self.pid, sig)
        except OSError as e:
            if e.errno not in (errno.ESRCH, errno.EPERM):
                raise

    def reap(self, timeout: float) -> None:
        if self._reaped:
            return
        try:
            self.popen.wait(timeout=timeout)
            self._reaped = True
        except subprocess.TimeoutExpired:
            log.warning("rank %d (pid %d) did not exit within %.1fs of SIGKILL",
                        self.rank, self.pid, timeout)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``, read from /proc."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        # fields: state ppid pgrp ...
        if len(fields) >= 3 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def build_argv(script: str, script_args: tuple[str, ...], module: bool) -> tuple[str, ...]:
    target = ("-m", script) if module else (script,)
    return (sys.executable, BOOTSTRAP_PATH, *target, *script_args)


def worker_environ(base: Mapping[str, str], *, rank: int, local_rank: int, world_size: int,
                   local_world_size: int, node_rank: int, master_addr: str, master_port: int,
                   secret: str | None, device_env: Mapping[str, str],
                   watchdog: str) -> dict[str, str]:
    """The environment contract of docs/launcher.md, on top of the launcher's own."""
    env = {k: v for k, v in base.items() if k != WATCHDOG_ENV}
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size), "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "RREFRT_STORE_HOSTED": "1", "PYTHONUNBUFFERED": "1", WATCHDOG_ENV: watchdog,
    })
    if secret is not None:
        env["RREFRT_SECRET"] = secret
    else:
        env.pop("RREFRT_SECRET", None)
    env.update(device_env)
    return env
