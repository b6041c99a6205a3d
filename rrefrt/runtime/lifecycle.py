"""The life cycle of a runtime: accounting of calls in flight, ``wait_idle``, the release
of RRefs at shutdown, and debug info.

Owns: the counts of calls running here for peers and of calls sent from here. The order of
the graceful shutdown's steps is rrefrt/runtime/shutdown.py's; closing the parts is the
composition root's (``Runtime.close``).

Threads: the counters are touched from every thread under ``_active``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from rrefrt.runtime.collection import collect_fully
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore

log = logging.getLogger("rrefrt")

#: the runtime counters merged into get_debug_info's ``agent.*`` keys (same keys as before
#: the runtime kept its own: the transport's and the runtime's counts are summed)
AGENT_KEYS = ("messages_sent", "messages_received", "bytes_sent", "bytes_received", "bad_frames_dropped",
              "unknown_peer_dropped", "fenced_dropped", "late_responses_dropped", "requests_timed_out",
              "peers_declared_dead", "control_retries", "duplicate_calls_dropped",
              # NOTE [Protocol errors] in rrefrt_transport.unix.transport: same-host connections
              # closed on a protocol error, read here / by the peer (no death: the inner transport judges)
              "protocol_errors", "connections_closed_by_peer",
              # NOTE [Tcp stream plane]: tcp stream connections ended by an EOF or a reset
              # without BYE (the peer then goes through zmq, whose liveness judges it)
              "connections_lost",
              # NOTE [Accept failures] in rrefrt_transport.unix.transport: accepts that failed
              # with connections waiting (out of file descriptors), each followed by a pause
              "accept_failures",
              # NOTE [Own reads] in transport/unix/receiver.py: waits that read their own
              # answer, and those that handed a message for the loop on
              "own_reads", "own_reads_handed",
              # NOTE [Receiver spin]: the receiver loop's spins before it sleeps, those that
              # caught a message, and the pauses after misses in a row
              "rx_spins", "rx_spin_hits", "rx_spin_pauses")


class Lifecycle:
    def __init__(self, core: WorkerCore, control: ControlLoop) -> None:
        self.core = core
        self.control = control
        self._lock = threading.RLock()  #: ``_active``'s lock, taken bare on the per-call paths
        self._active = threading.Condition(self._lock)
        self.active_calls = 0  #: user functions running or queued on behalf of peers
        #: caller id -> its calls counted in active_calls (shutdown waits for live callers only)
        self.active_from: collections.Counter = collections.Counter()
        self.outgoing_calls = 0  #: calls and fetches sent from here still awaiting an answer
        #: calls begun or ended here, either way (it only grows): a graceful shutdown that
        #: waits for the group reads it to see whether the group still uses this worker
        #: (NOTE [Shutdown while in use] in rrefrt/runtime/shutdown.py)
        self.call_events = 0

    def in_use(self) -> tuple[int, float | None]:
        """(``call_events``, the start (monotonic) of the youngest call in flight between
        this worker and a live peer, either way, or None): what a shutdown waiting for the
        group looks at between polls (NOTE [Shutdown while in use])."""
        core = self.core
        me, alive = core.info.id, core.transport.is_alive
        starts = [t0 for peer, _f, t0, _t in list(core.inflight.incoming.values()) if peer != me and alive(peer)]
        starts += [c.t0 for c in list(core.inflight.outgoing.values()) if c.dest != me and alive(c.dest)]
        return self.call_events, max(starts) if starts else None

    def track_call(self, delta: int, src: int) -> None:
        with self._lock:  # twice per call: the bare lock (Condition.__enter__ is Python code)
            self.call_events += 1
            self.active_calls += delta
            self.active_from[src] += delta
            if self.active_calls == 0 and self._active._waiters:  # type: ignore[attr-defined]
                self._active.notify_all()  # only shutdown's wait_idle waits here

    def track_outgoing(self, delta: int) -> None:
        with self._lock:
            self.call_events += 1
            self.outgoing_calls += delta
            if self.outgoing_calls == 0 and self._active._waiters:  # type: ignore[attr-defined]
                self._active.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """Until no call from a peer is running or queued here and no call or fetch made
        here is still waiting for its answer (in-flight calls complete before shutdown)."""
        core = self.core
        with self._active:
            while self.outgoing_calls or any(
                n and (src == core.info.id or core.transport.is_alive(src)) for src, n in self.active_from.items()
            ):  # calls on behalf of a dead worker are not waited for: their answers go nowhere
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._active.wait(min(left, 0.1))
            return True

    def release_rrefs(self, deadline: float) -> list[str]:
        """Graceful shutdown, RRef part: returns the live-user sites found (strict mode)."""
        core = self.core
        strict = core.options.strict_rref_leaks
        if strict:
            # only the leak report needs unreachable RRef objects collected (until then they
            # count as live); every user fork is deleted below, referenced or not, so a
            # non-strict shutdown skips the full collection (~95 ms per rank with torch loaded)
            collect_fully(deadline)  # NOTE [Drops before a collection] in rrefrt/runtime/collection.py
            self.control.sync(deadline)
        self.control.flush_drops()  # NOTE [Drops] in rrefrt/runtime/control.py
        sites = core.ctx.live_user_sites() if strict else []
        self.control.perform(core.ctx.delete_all_users())
        core.ctx.wait_users_settled(deadline)
        core.ctx.wait_owners_drained(deadline)
        return sites

    def stats(self) -> dict[str, int]:
        """The transport's counters plus the runtime's own (same keys)."""
        core = self.core
        merged: collections.Counter = collections.Counter()
        merged.update({k: int(v) for k, v in dict(core.transport.stats).items()})
        merged.update({k: int(v) for k, v in dict(core.stats).items()})
        return dict(merged)

    def debug_info(self) -> dict[str, Any]:
        core = self.core
        info: dict[str, Any] = dict(core.ctx.counts())
        stats = self.stats()
        for key in AGENT_KEYS:
            info[f"agent.{key}"] = int(stats.get(key, 0))
        for name, n in core.transport.pending_per_peer().items():
            info[f"agent.pending_futures.{name}"] = n
        for key, n in core.pool.stats().items():
            info[f"pool.{key}"] = n
        info["agent.dead_peers"] = len(core.transport.dead_peers())
        #: the calls in flight, both directions (rrefrt/runtime/inflight.py; docs/stuck.md)
        info["calls_in_flight"] = self.calls_in_flight(stacks=False)
        return info

    def calls_in_flight(self, stacks: bool) -> list[dict[str, Any]]:
        """The calls running (or queued) here for peers, then those sent from here still
        awaiting their answer; ``stacks``: each running one with its thread's stack."""
        inflight, name = self.core.inflight, self.core.worker_name
        return inflight.running_here(name, stacks) + inflight.sent_from_here(name)

