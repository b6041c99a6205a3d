"""The job-wide dump: SIGUSR1 to ``rrefrt-run`` prints every worker's thread stacks and
calls in flight, rank-prefixed, and the job goes on (docs/stuck.md).

Owns: the job's dump directory (0700, made at launch, removed at the end; named to the
workers as ``RREFRT_DEBUG_DIR``) and one round of a dump: signal the workers that said they
handle SIGUSR1, wait (bounded) for their dump files, print them. NOTE [Job dump] in
rrefrt/debug.py is the workers' side; this module does not import it (the launcher stays
standard library only and never imports the runtime), so the names of the files are
written in both places (a test checks they agree).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence

__all__ = ["DUMP_DIR_ENV", "DUMP_WAIT", "make_dump_dir", "remove_dump_dir", "dump_job"]

#: the variable naming the dump directory in a worker's environment (rrefrt/debug.py)
DUMP_DIR_ENV = "RREFRT_DEBUG_DIR"
#: how long a dump waits for the workers' files (a worker whose every thread is stuck in C
#: code holding the GIL never writes one: it is named instead)
DUMP_WAIT = 3.0


def make_dump_dir() -> str:
    """The job's dump directory (``mkdtemp``: 0700, this user's only)."""
    return tempfile.mkdtemp(prefix="rrefrt-dump-")


def remove_dump_dir(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _ready_pid(directory: str, rank: int) -> int | None:
    """The pid a worker wrote when it installed its SIGUSR1 handler (None: it did not)."""
    try:
        with open(os.path.join(directory, f"rank-{rank}.ready"), encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _in_group(pid: int, pgid: int) -> bool:
    """Whether ``pid`` is in process group ``pgid`` (a worker's session: its own process
    or one it started), so that a dump never signals a process outside the job."""
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def dump_job(directory: str, workers: Sequence[tuple[int, int]], emit: Callable[[str], None],
             wait: float = DUMP_WAIT) -> dict[int, str]:
    """One dump round. ``workers``: (rank, pid) of this node's running workers (each the
    leader of its process group). Signals those that are ready, waits ``wait`` at most for
    their files and calls ``emit`` with each line, "[rank N] "-prefixed. Returns rank ->
    what happened ("dumped", "no handler", "no answer")."""
    asked: dict[int, float] = {}
    outcome: dict[int, str] = {}
    for rank, pgid in workers:
        path = os.path.join(directory, f"rank-{rank}.dump")
        try:
            os.unlink(path)  # a dump of an earlier round
        except OSError:
            pass
        pid = _ready_pid(directory, rank)
        if pid is None or not _in_group(pid, pgid):
            outcome[rank] = "no handler"  # SIGUSR1 would kill it: never sent
            continue
        try:
            os.kill(pid, signal.SIGUSR1)
            asked[rank] = time.monotonic()
        except OSError:
            outcome[rank] = "no handler"
    deadline = time.monotonic() + wait
    pending = dict(asked)
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            path = os.path.join(directory, f"rank-{rank}.dump")
            if os.path.exists(path):
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                except OSError:
                    continue
                for line in text.rstrip("\n").split("\n"):
                    emit(f"[rank {rank}] {line}")
                outcome[rank] = "dumped"
                del pending[rank]
        if pending:
            time.sleep(0.02)  # files appear without any signal to wait on: a bounded re-check
    for rank in pending:
        outcome[rank] = "no answer"
        emit(f"[rank {rank}] no dump within {wait:.0f}s: every thread may be stuck in C code holding the GIL "
             "(try `py-spy dump --pid` on it)")
    for rank, what in sorted(outcome.items()):
        if what == "no handler":
            emit(f"[rank {rank}] no dump: it has not called init_rpc (or installed its own SIGUSR1 handler)")
    return outcome
