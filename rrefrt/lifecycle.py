"""The life cycle of a runtime: accounting of calls in flight, wait_idle, the release of
RRefs, debug info, close, and the graceful-shutdown choreography.

Owns: the counts of calls running here for peers and of calls sent from here, the order of
the shutdown steps (barriers, drain, release, leak check) and their deadline (NOTE [Bounded
shutdown]). Imports from rrefrt: errors. The rendezvous object is passed in (duck-typed:
``barrier``, ``arrive``, ``server``, ``spec``), so this module does not import it.

Threads: the counters are touched from every thread under ``_active``; the shutdown steps
run on a daemon thread of their own, which the caller waits for (bounded).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from .collection import collect_fully
from .errors import RpcError, RRefLeakError, ShutdownError

log = logging.getLogger("rrefrt")

#: how long past its deadline a graceful shutdown may run before it is abandoned
SHUTDOWN_GRACE = 1.0

#: the runtime counters merged into get_debug_info's ``agent.*`` keys (same keys as before
#: the runtime kept its own: the transport's and the runtime's counts are summed)
AGENT_KEYS = ("messages_sent", "messages_received", "bytes_sent", "bytes_received", "bad_frames_dropped",
              "unknown_peer_dropped", "fenced_dropped", "late_responses_dropped", "requests_timed_out",
              "peers_declared_dead", "control_retries", "duplicate_calls_dropped")


class Lifecycle:
    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._lock = threading.RLock()  #: ``_active``'s lock, taken bare on the per-call paths
        self._active = threading.Condition(self._lock)
        self.active_calls = 0  #: user functions running or queued on behalf of peers
        #: caller id -> its calls counted in active_calls (shutdown waits for live callers only)
        self.active_from: collections.Counter = collections.Counter()
        self.outgoing_calls = 0  #: calls and fetches sent from here still awaiting an answer

    def track_call(self, delta: int, src: int) -> None:
        with self._lock:  # twice per call: the bare lock (Condition.__enter__ is Python code)
            self.active_calls += delta
            self.active_from[src] += delta
            if self.active_calls == 0 and self._active._waiters:  # type: ignore[attr-defined]
                self._active.notify_all()  # only shutdown's wait_idle waits here

    def track_outgoing(self, delta: int) -> None:
        with self._lock:
            self.outgoing_calls += delta
            if self.outgoing_calls == 0 and self._active._waiters:  # type: ignore[attr-defined]
                self._active.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """Until no call from a peer is running or queued here and no call or fetch made
        here is still waiting for its answer (in-flight calls complete before shutdown)."""
        rt = self.rt
        with self._active:
            while self.outgoing_calls or any(
                n and (src == rt.info.id or rt.transport.is_alive(src)) for src, n in self.active_from.items()
            ):  # calls on behalf of a dead worker are not waited for: their answers go nowhere
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._active.wait(min(left, 0.1))
            return True

    def release_rrefs(self, deadline: float) -> list[str]:
        """Graceful shutdown, RRef part: returns the live-user sites found (strict mode)."""
        rt = self.rt
        strict = rt.options.strict_rref_leaks
        if strict:
            # only the leak report needs unreachable RRef objects collected (until then they
            # count as live); every user fork is deleted below, referenced or not, so a
            # non-strict shutdown skips the full collection (~95 ms per rank with torch loaded)
            collect_fully(deadline)  # NOTE [Drops before a collection] in rrefrt/collection.py
            rt.control.sync(deadline)
        rt.control.flush_drops()  # NOTE [Drops] in rrefrt/control.py
        sites = rt.ctx.live_user_sites() if strict else []
        rt.control.perform(rt.ctx.delete_all_users())
        rt.ctx.wait_users_settled(deadline)
        rt.ctx.wait_owners_drained(deadline)
        return sites

    def stats(self) -> dict[str, int]:
        """The transport's counters plus the runtime's own (same keys)."""
        rt = self.rt
        merged: collections.Counter = collections.Counter()
        merged.update({k: int(v) for k, v in dict(rt.transport.stats).items()})
        merged.update({k: int(v) for k, v in dict(rt.stats).items()})
        return dict(merged)

    def debug_info(self) -> dict[str, Any]:
        rt = self.rt
        info: dict[str, Any] = dict(rt.ctx.counts())
        stats = self.stats()
        for key in AGENT_KEYS:
            info[f"agent.{key}"] = int(stats.get(key, 0))
        for name, n in rt.transport.pending_per_peer().items():
            info[f"agent.pending_futures.{name}"] = n
        for key, n in rt.pool.stats().items():
            info[f"pool.{key}"] = n
        info["agent.dead_peers"] = len(rt.transport.dead_peers())
        return info

    def close(self) -> None:
        """Stop everything; bounded; safe to call twice."""
        rt = self.rt
        if rt.closed:
            return
        rt.closed = True
        rt.accepting = False
        rt.transport.close()
        rt.control.stop(2.0)
        rt.pool.stop()
        rt.callbacks.stop()
        rt.callee.stop(2.0)


# ---------------------------------------------------------------------------- graceful shutdown
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


def shutdown_graceful(rt: Any, rdzv: Any, world_size: int, limit: float) -> BaseException | None:
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


def _graceful(rt: Any, rdzv: Any, world_size: int, deadline: float, phase: list[str] | None = None) -> BaseException | None:
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
            try:  # NOTE in Rendezvous.barrier: the others must not take this exit for a death
                rdzv.arrive("failed", me)
            except Exception:
                pass
            return ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never reached shutdown within the timeout"
            )
        phase[0] = "waiting for calls in flight"
        busy = not rt.wait_idle(deadline)
        phase[0] = "releasing RRefs"
        sites = rt.release_rrefs(deadline)
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
        elif time.monotonic() > deadline:  # every step found its condition met, but too late
            error = ShutdownError(
                f"shutdown of {rt.info.name!r} did not complete within its timeout: its steps ended "
                f"{time.monotonic() - deadline:.3f}s past the deadline (raise the timeout, or shutdown_timeout)"
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
