"""Where a worker is stuck: the dump of a whole process (every thread's stack plus the
calls in flight) that the job-wide dump collects, and the ``python -m rrefrt.debug dump``
tool (docs/stuck.md).

Owns: the per-process dump written on SIGUSR1 (``install_dump_signal``), where a worker
publishes its dump directory in the store, and the tool (``main``). Stacks themselves are
rrefrt/runtime/stacks.py's.

Cost: nothing on the path of a call; a process's stacks are read only on a dump.

``python -m rrefrt.debug dump`` asks for the same dump from any process that can reach the
job's store with its secret (MASTER_ADDR, MASTER_PORT, RREFRT_SECRET): each worker with a
handler published ``DUMP_KEY`` (host, pid, directory) there; the tool signals those on its
own host whose ready file names that pid, and prints their dumps (a worker on another host
is named, with the host to run the tool on).

The job-wide dump (NOTE [Job dump]): a worker started by ``rrefrt-run`` (or any worker
whose environment names ``RREFRT_DEBUG_DIR``) installs a SIGUSR1 handler at ``init_rpc``
and writes ``rank-<R>.ready`` (its pid) in that directory; on SIGUSR1 a short-lived thread
writes ``rank-<R>.dump`` there (atomically: a temporary name, then a rename). The launcher
signals only the workers that wrote a ready file (SIGUSR1 kills a process that has no
handler), waits ``DUMP_WAIT`` at most for their dumps and prints them rank-prefixed. The
directory is the job's own (0700, the launcher's), so only processes of the job's user can
read a dump; only they can signal the workers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from rrefrt.runtime.stacks import all_threads_text

log = logging.getLogger("rrefrt")

#: the environment variable naming the directory of the job-wide dump (NOTE [Job dump])
DUMP_DIR_ENV = "RREFRT_DEBUG_DIR"
#: how long the launcher (or ``python -m rrefrt.debug dump``) waits for the workers' dumps
DUMP_WAIT = 3.0

#: the store key where a worker says where its dumps go (json: host, pid, dir)
DUMP_KEY = "rrefrt/debug/dump/{rank}"


# ---------------------------------------------------------------------------- the job dump
def dump_text(header: str, calls: Callable[[], str] | None) -> str:
    """This process's dump: ``header``, the calls in flight (``calls()``), every thread."""
    out = [header]
    if calls is not None:
        try:
            out.append(calls())
        except Exception as e:  # a dump must never fail for the runtime's state
            out.append(f"calls in flight: could not be read ({type(e).__name__}: {e})")
    out.append(all_threads_text())
    return "\n".join(out) + "\n"


def write_dump(directory: str, rank: int, header: str, calls: Callable[[], str] | None) -> str:
    """Write this process's dump to ``<directory>/rank-<rank>.dump`` (atomically)."""
    path = os.path.join(directory, f"rank-{rank}.dump")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dump_text(header, calls))
    os.replace(tmp, path)
    return path


def install_dump_signal(directory: str, rank: int, header: Callable[[], str], calls: Callable[[], str]) -> bool:
    """NOTE [Job dump]: on SIGUSR1, write this process's dump in ``directory``. Only from the
    main thread, and only where SIGUSR1 has no handler yet (a program's own stays). Writes
    ``rank-<rank>.ready`` (this pid) so that the launcher knows it may signal us. False if
    not installed."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None, _on_sigusr1):
            return False
        _state.update(directory=directory, rank=rank, header=header, calls=calls)
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        ready = os.path.join(directory, f"rank-{rank}.ready")
        with open(ready + ".tmp", "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
        os.replace(ready + ".tmp", ready)
        return True
    except (OSError, ValueError) as e:
        log.warning("the job dump (SIGUSR1) is not available on rank %d: %s", rank, e)
        return False


def publish_dump_target(store: Any, rank: int, directory: str) -> None:
    """Tell the job's store where this worker's dumps go (for ``python -m rrefrt.debug``);
    nothing if there is no store (a file rendezvous) or it does not answer."""
    if store is None:
        return
    target = {"host": socket.gethostname(), "pid": os.getpid(), "dir": directory}
    try:
        store.set(DUMP_KEY.format(rank=rank), json.dumps(target).encode())
    except Exception as e:  # the dump is a convenience: never a reason for init to fail
        log.debug("rank %d could not publish its dump target: %s", rank, e)


def collect_dumps(targets: list[tuple[int, int, str]], emit: Callable[[str], None], wait: float = DUMP_WAIT) -> int:
    """Signal each (rank, pid, directory) whose ready file names ``pid`` and print its dump,
    "[rank N] "-prefixed, within ``wait``. Returns how many dumped."""
    asked = {}
    for rank, pid, directory in targets:
        path = os.path.join(directory, f"rank-{rank}.dump")
        try:
            with open(os.path.join(directory, f"rank-{rank}.ready"), encoding="ascii") as f:
                ready = int(f.read().strip())
        except (OSError, ValueError):
            ready = -1
        if ready != pid:
            emit(f"[rank {rank}] no dump: no handler installed by pid {pid} in {directory}")
            continue
        try:
            os.unlink(path)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGUSR1)
            asked[rank] = path
        except OSError as e:
            emit(f"[rank {rank}] no dump: could not signal pid {pid}: {e}")
    deadline = time.monotonic() + wait
    done = 0
    while asked and time.monotonic() < deadline:
        for rank, path in sorted(asked.items()):
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f.read().rstrip("\n").split("\n"):
                        emit(f"[rank {rank}] {line}")
                del asked[rank]
                done += 1
        if asked:
            time.sleep(0.02)  # files appear without a signal to wait on: a bounded re-check
    for rank in sorted(asked):
        emit(f"[rank {rank}] no dump within {wait:.0f}s: every thread may be stuck in C code holding the GIL")
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m rrefrt.debug dump``: the dump of every worker of the job on this host."""
    import argparse

    from rrefrt.group.store import StoreClient, StoreError

    parser = argparse.ArgumentParser(prog="python -m rrefrt.debug", description=main.__doc__)
    parser.add_argument("command", choices=["dump"])
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "0") or 0))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "0") or 0),
                        help="ranks to ask (default: WORLD_SIZE, else every rank found in the store)")
    parser.add_argument("--wait", type=float, default=DUMP_WAIT)
    args = parser.parse_args(argv)
    if not args.master_port:
        parser.error("the job's store is unknown: set MASTER_ADDR and MASTER_PORT (and RREFRT_SECRET)")
    try:
        store = StoreClient(args.master_addr, args.master_port, connect_timeout=10.0,
                            secret=os.environ.get("RREFRT_SECRET") or None, identity="python -m rrefrt.debug")
    except StoreError as e:
        print(f"cannot reach the job's store at {args.master_addr}:{args.master_port}: {e}", file=sys.stderr)
        return 2
    here, targets = socket.gethostname(), []
    try:
        rank = 0
        while args.world_size == 0 or rank < args.world_size:
            key = DUMP_KEY.format(rank=rank)
            if not store.check([key]):
                if args.world_size == 0:
                    break
                print(f"[rank {rank}] no dump: it published no dump target (not started by rrefrt-run?)")
            else:
                t = json.loads(store.get(key, 5.0))
                if t.get("host") != here:
                    print(f"[rank {rank}] runs on host {t.get('host')!r}: run this tool there for its dump")
                else:
                    targets.append((rank, int(t["pid"]), str(t["dir"])))
            rank += 1
    finally:
        store.close()
    if not targets:
        print("no worker of this job on this host published a dump target", file=sys.stderr)
        return 1
    collect_dumps(targets, lambda line: print(line, flush=True), args.wait)
    return 0


def uninstall_dump_signal() -> None:
    """At shutdown: SIGUSR1 goes back to its default, the ready file goes."""
    if not _state or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) is _on_sigusr1:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        os.unlink(os.path.join(_state["directory"], f"rank-{_state['rank']}.ready"))
    except (OSError, ValueError):
        pass
    _state.clear()


#: what the SIGUSR1 handler writes: directory, rank, header(), calls() (one per process:
#: a process has one signal table)
_state: dict[str, Any] = {}


def _on_sigusr1(signum: int, frame: Any) -> None:
    """On the main thread, between two bytecodes: hand the dump to a thread of its own, so
    that the main thread (which may hold the runtime's locks) goes on at once."""
    st = dict(_state)
    if not st:
        return
    threading.Thread(target=_dump_now, args=(st,), name="rrefrt-dump", daemon=True).start()


def _dump_now(st: dict[str, Any]) -> None:
    try:
        header = f"rank {st['rank']} (pid {os.getpid()}) at {time.strftime('%H:%M:%S')}: {st['header']()}"
        write_dump(st["directory"], st["rank"], header, st["calls"])
    except Exception:
        log.exception("the job dump could not be written on rank %s", st.get("rank"))


__all__ = [
    "DUMP_DIR_ENV", "DUMP_WAIT", "dump_text", "write_dump", "install_dump_signal",
    "uninstall_dump_signal", "publish_dump_target", "collect_dumps", "main", "DUMP_KEY",
]


if __name__ == "__main__":
    sys.exit(main())
