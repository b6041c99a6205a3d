"""Functions the failure tests call remotely (importable on every worker).

Kept apart from tests/support/workerfns.py, which other tests own.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from tests.support import zmq_transport
import rrefrt

# ---------------------------------------------------------------------------- introspection


def agent_info() -> dict:
    """What the transport of this worker knows: endpoints, dead peers, counters."""
    rt = rrefrt.state.current()
    return {
        "endpoints": list(zmq_transport(rt.transport).endpoints),
        "dead": sorted(rt.transport.peer_name(p) for p in rt.transport.dead_peers()),
        # the transport's counters and the runtime's own, merged as get_debug_info shows them
        "stats": rt.lifecycle.stats(),
        "pid": os.getpid(),
    }


def counts() -> dict:
    info = rrefrt.get_debug_info()
    return {k: info[k] for k in ("num_owner_rrefs", "num_forks", "num_pending_users", "num_pending_children",
                                 "num_confirmed_users")}


# ---------------------------------------------------------------------------- side effects

_records: list[str] = []


def record(token: str) -> int:
    """A side effect the tests can count: it must run exactly as often as expected."""
    _records.append(token)
    return len(_records)


def records() -> list[str]:
    return list(_records)


def append_line(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def mark_then_wait(path: str, token: str, seconds: float) -> str:
    """Record that it ran (once per run), then wait: the caller stops or kills us meanwhile."""
    append_line(path, f"run {token}")
    threading.Event().wait(seconds)  # the wait is the thing under test (a long call)
    return token


def mark_wait_then_call_back(path: str, token: str, seconds: float, targets: list[str]) -> str:
    """Runs on a worker that the test SIGSTOPs during the wait. After SIGCONT it answers its
    caller and calls ``record`` on every target: all of that must be dropped by the peers
    that declared it dead. The outcome of each call is written to ``path``."""
    append_line(path, f"run {token}")
    threading.Event().wait(seconds)  # stopped in here
    append_line(path, "resumed")
    futs = {t: rrefrt.rpc_async(t, record, args=(f"late call from a fenced worker ({token})",), timeout=1.0)
            for t in targets}
    for t, fut in futs.items():
        try:
            fut.wait()
            outcome = "ran"
        except rrefrt.RpcError as e:
            outcome = type(e).__name__
        append_line(path, f"call to {t}: {outcome}")
    append_line(path, "done")
    return token


def call_and_time(to: str, seconds: float) -> dict:
    """On a bystander: call ``to`` (a long call, no timeout) and report when and how it
    failed, as time.monotonic() (one clock for every process of this host)."""
    try:
        rrefrt.rpc_sync(to, mark_then_wait, args=(os.devnull, "bystander", seconds), timeout=0)
        return {"error": None, "at": time.monotonic()}
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "at": time.monotonic()}


def big_result_from(to: str, size: int) -> dict:
    """Ask ``to`` for a result of ``size`` bytes; report how the call ended and how long it
    took (issue 21 item 5: a result over this worker's max_message_size)."""
    from tests.support.workerfns import big_result

    t0 = time.monotonic()
    try:
        return {"error": None, "size": len(rrefrt.rpc_sync(to, big_result, args=(size,)))}
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "took": time.monotonic() - t0}


def raise_big(delay: float, size: int) -> None:
    """Fail after ``delay`` s with an error whose pickle takes about ``size`` bytes: a
    remote() of it that fails at once answers its creator in the creation's answer, one
    that fails later in a REMOTE_RET."""
    time.sleep(delay)  # (the slow function under test)
    raise ValueError("x" * size)


# ---------------------------------------------------------------------------- stuck handlers

_never_released = threading.Lock()
_never_released.acquire()


def deadlock() -> None:
    """A handler that deadlocks: it waits for a lock nobody will ever release. Only the
    death of the process (test teardown) ends it."""
    _never_released.acquire()


def hold_gil(seconds: float, started: str = "") -> float:
    """A handler that holds the GIL for ``seconds`` in one C call (poll(2) through
    ctypes.PyDLL, which keeps the GIL): no Python thread of this process - the I/O thread
    included - runs meanwhile; only libzmq's own threads do. ``started``, if given, is a file
    created just before the call, so a caller can wait until the stall has begun. It is
    created and closed through PyDLL too: ``open(...).close()`` released the GIL in its
    syscalls after the file existed, and in that window another thread of this process could
    take the GIL and answer a call or two that the caller had sent on seeing the file."""
    import ctypes

    libc = ctypes.PyDLL(None)
    if started:
        libc.close(libc.creat(started.encode(), 0o600))  # the GIL is kept from here on
    t0 = time.monotonic()
    libc.poll(None, 0, int(seconds * 1000))
    return time.monotonic() - t0


# ---------------------------------------------------------------------------- RRef values

_freed: list[str] = []  #: tags of the Tracked values destroyed in this process


class Tracked:
    """A value whose destruction the owner counts."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def get(self) -> str:
        return self.tag

    def wait(self, seconds: float) -> str:
        threading.Event().wait(seconds)  # a long method call (the owner dies meanwhile)
        return self.tag

    def __del__(self) -> None:
        _freed.append(self.tag)


def freed(tag: str) -> int:
    """How many Tracked values tagged ``tag`` were destroyed here (copies included)."""
    return _freed.count(tag)


def make_tracked_rref(tag: str) -> rrefrt.RRef:
    return rrefrt.RRef(Tracked(tag))


_kept: list = []


def keep(obj: Any) -> int:
    _kept.append(obj)
    return len(_kept)


def drop_kept() -> int:
    n = len(_kept)
    _kept.clear()
    return n


def use_kept_rrefs() -> list[str]:
    """Use every kept RRef; report the error type of each use (the owner may be dead)."""
    out = []
    for r in _kept:
        try:
            r.to_here(timeout=5)
            out.append("ok")
        except rrefrt.RpcError as e:
            out.append(type(e).__name__)
    return out
