"""The graceful shutdown of a static group's worker: its steps, their order and their
deadline (API.md "Shutdown and leaks"; NOTE [Bounded shutdown]).

Owns: the choreography - enter barrier, calls in flight, release of RRefs, drained barrier,
leak report, leave barrier - run on a thread of its own that the caller waits for
(bounded). The group's barriers are reached through ``Barriers`` (the rendezvous
implements it; this package never imports the group). Dynamic groups leave through
rrefrt/group/membership.py instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from rrefrt.errors import RpcError, RRefLeakError, ShutdownError
from rrefrt.runtime.root import Runtime

log = logging.getLogger("rrefrt")

__all__ = ["Barriers", "LiveDead", "SHUTDOWN_GRACE", "shutdown_graceful"]

#: how long past its deadline a graceful shutdown may run before it is abandoned
SHUTDOWN_GRACE = 1.0


class Barriers(Protocol):
    """What the shutdown needs of the group's rendezvous (rrefrt/group/rendezvous.py)."""

    #: the store this worker hosts (rank 0), else None
    server: Any
    #: the group's spec (``master_addr``, ``master_port``), named in errors
    spec: Any

    def barrier(self, name: str, me: int, world_size: int, deadline: float,
                dead: "Callable[[], set[int]]") -> list[int]:
        """Wait (bounded) until every live rank arrived at ``name``; the ranks missing."""
        ...

    def arrive(self, name: str, me: int) -> None:
        """Mark ``me`` as arrived at ``name`` without waiting."""
        ...


class LiveDead:
    """The transport's dead set, read afresh at every use, so that a barrier waiting in
    ``rendezvous`` stops waiting for a worker that dies while it waits (issue 11 item 4).
    Callable (``dead()`` -> the current set, the form rendezvous.barrier takes from now on)
    and set-like (``in``, ``bool``, ``iter``) for a barrier that still takes a set."""

    def __init__(self, dead_peers: Callable[[], set[int]]) -> None:
        self._dead_peers = dead_peers

    def __call__(self) -> set[int]:
        return set(self._dead_peers())

    def __contains__(self, peer: object) -> bool:
        return peer in self._dead_peers()

    def __bool__(self) -> bool:
        return bool(self._dead_peers())

    def __iter__(self) -> Any:
        return iter(set(self._dead_peers()))

    def __len__(self) -> int:
        return len(self._dead_peers())


def shutdown_graceful(rt: Runtime, rdzv: Barriers, world_size: int, limit: float) -> BaseException | None:
    """NOTE [Bounded shutdown]: every step of ``_graceful`` has the deadline, but a store
    request can still block in its socket beyond it (a stopped or partitioned store host
    accepts the bytes and never answers; the store client waits 10 s for an answer, the
    barriers up to their deadline, since a busy store host is not a dead one). So the
    steps run on a daemon thread and the caller waits for the deadline plus
    ``SHUTDOWN_GRACE`` at most; past that it gets a ShutdownError and the runtime is closed
    anyway (the abandoned thread cannot keep the process alive). Returns the error to
    raise, or None."""
    deadline = time.monotonic() + limit
    box: list[BaseException | None] = []
    phase = ["start"]
    t = threading.Thread(
        target=lambda: box.append(_graceful(rt, rdzv, world_size, deadline, phase)),
        name=f"rrefrt-{rt.info.name}-shutdown",
        daemon=True,
    )
    t.start()
    t.join(max(0.0, deadline - time.monotonic()) + SHUTDOWN_GRACE)
    if box:
        return box[0]
    rt.accepting = False
    spec = rdzv.spec
    host = rt.workers_by_id.get(0)
    return ShutdownError(
        f"shutdown of {rt.info.name!r} did not complete within {limit:.1f}s (+{SHUTDOWN_GRACE:.0f}s): stuck in "
        f"phase {phase[0]!r}; the rendezvous store at {spec.master_addr}:{spec.master_port} "
        f"(hosted by {repr(host.name) if host else 'rank 0'} or the launcher) did not answer - its host may be "
        "stopped or unreachable. The runtime was closed anyway."
    )


def _graceful(rt: Runtime, rdzv: Barriers, world_size: int, deadline: float, phase: list[str] | None = None) -> BaseException | None:
    me = rt.info.id
    phase = phase if phase is not None else [""]
    dead = LiveDead(rt.transport.dead_peers)

    def names(ranks: list[int]) -> str:
        return ", ".join(repr(rt.workers_by_id[r].name) if r in rt.workers_by_id else f"rank {r}" for r in ranks)

    try:
        error: BaseException | None = None
        phase[0] = "enter barrier"
        missing = rdzv.barrier("enter", me, world_size, deadline, dead)
        if missing:
            rt.accepting = False
            return ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never reached shutdown within the timeout"
            )
        phase[0] = "waiting for calls in flight"
        busy = not rt.lifecycle.wait_idle(deadline)
        phase[0] = "releasing RRefs"
        sites = rt.lifecycle.release_rrefs(deadline)
        phase[0] = "drained barrier"
        missing = rdzv.barrier("drained", me, world_size, deadline, dead)
        rt.accepting = False
        leaks = rt.ctx.leaks()
        for leak in leaks:
            log.error("RRef leak on worker %r: %s", rt.info.name, leak)
        if missing:
            error = ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never finished shutdown within the timeout"
            )
        elif rt.options.strict_rref_leaks and (leaks or sites):
            lines = [f"fork still registered: {x}" for x in leaks] + [f"still referenced at shutdown: {s}" for s in sites]
            error = RRefLeakError(f"RRef leaks on worker {rt.info.name!r}:\n  " + "\n  ".join(lines), lines)
        elif busy:
            error = ShutdownError(
                f"shutdown of {rt.info.name!r}: calls in flight (run here for live peers, or sent from here) "
                "had not finished at the timeout - a handler that never returns? They were abandoned"
            )
        phase[0] = "leave barrier"
        if rdzv.server is not None:  # rank 0 hosts the store: it leaves last
            rdzv.barrier("leave", me, world_size, deadline, dead)
        else:
            rdzv.arrive("leave", me)
        return error
    except RpcError as e:
        return e
    except Exception as e:  # the store died under us (its host left): still close
        return ShutdownError(f"shutdown of {rt.info.name!r} could not complete its barrier: {e}")
