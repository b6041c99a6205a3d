"""Words for what happened to a job: failure reports, stop reports, the success summary.

Owns: the text of the launcher's reports (their format is documented in docs/launcher.md;
tests match on it). Pure functions: they format, the supervisor prints.

A failure report names the worker as "rank N" with its node, local rank, pid and host, says
how it ended (exit code, or signal name and number), how long it ran, and quotes the last
lines of its output; then one line per other worker saying how it ended.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from rrefrt.run.workers import Worker, signal_name

__all__ = ["failure_report", "remote_failure_report", "outcome_lines", "summary_line"]

_INDENT = "  "


def _hint(sig: int | None) -> str:
    if sig == signal.SIGKILL:
        return (" (the launcher did not send it: SIGKILL usually comes from the kernel's "
                "out-of-memory killer or from a user; see `dmesg`)")
    if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT):
        return " (a crash in native code; run with PYTHONFAULTHANDLER=1 for a traceback)"
    return ""


def _tail_block(rank: int, tail: Sequence[str] | None, log_path: str | None) -> list[str]:
    lines: list[str] = []
    if tail is None:  # --tail-lines 0
        pass
    elif tail:
        lines.append(f"{_INDENT}last {len(tail)} line{'s' if len(tail) != 1 else ''} of "
                     f"rank {rank}'s output:")
        lines += [f"{_INDENT}  | {line}" for line in tail]
    else:
        lines.append(f"{_INDENT}rank {rank} wrote no output")
    if log_path:
        lines.append(f"{_INDENT}full output: {log_path}")
    return lines


def failure_report(failed: Worker, tail: Sequence[str] | None, host: str,
                   others: Sequence[Worker]) -> str:
    """The report for a worker of this node that exited non-zero or died by a signal."""
    st = failed.status
    assert st is not None
    spec = failed.spec
    ran = st.at - failed.started_at
    lines = [f"rrefrt-run: job failed: rank {spec.rank} (node {spec.node_rank}, local rank "
             f"{spec.local_rank}, pid {failed.pid}, host {host}) {st.describe()} after "
             f"{ran:.2f}s{_hint(st.signal)}"]
    lines += _tail_block(spec.rank, tail, spec.log_path)
    lines += outcome_lines(others)
    return "\n".join(lines)


def remote_failure_report(record: dict[str, object], workers: Sequence[Worker]) -> str:
    """Another node's failure, as published in the store, and what happened here."""
    raw_tail = record.get("tail")
    tail = [str(x) for x in raw_tail] if isinstance(raw_tail, list) else None
    rank = record.get("rank")
    lines = [f"rrefrt-run: job failed on node {record.get('node')} (host "
             f"{record.get('host')}): {record.get('what')}"]
    if isinstance(rank, int):
        lines += _tail_block(rank, tail, None)
    lines += outcome_lines(workers)
    return "\n".join(lines)


def outcome_lines(workers: Sequence[Worker]) -> list[str]:
    """One line per worker: how it ended, and whether the launcher stopped it."""
    if not workers:
        return []
    lines = [f"{_INDENT}workers of this node:"]
    for w in workers:
        st = w.status
        what = st.describe() if st is not None else "was still running"
        if w.stopped_with is not None:
            what = f"stopped by the launcher ({signal_name(w.stopped_with)}): {what}"
        lines.append(f"{_INDENT}  rank {w.rank} (pid {w.pid}) {what}")
    return lines


def summary_line(node_rank: int, workers: Sequence[Worker], elapsed: float) -> str:
    n = len(workers)
    return (f"rrefrt-run: node {node_rank}: all {n} worker{'s' if n != 1 else ''} finished "
            f"successfully in {elapsed:.2f}s")
