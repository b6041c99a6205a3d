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
from rrefrt.runtime import stacks
from rrefrt.runtime.root import Runtime

log = logging.getLogger("rrefrt")

__all__ = ["Barriers", "LiveDead", "SHUTDOWN_GRACE", "shutdown_graceful", "stuck_calls", "format_calls"]

#: how long past its deadline a graceful shutdown may run before it is abandoned
SHUTDOWN_GRACE = 1.0

#: how long a shutdown that gave up waits for its callees to say where its calls are
STUCK_WAIT = 0.25


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
    clock = [time.monotonic() + limit]  #: the deadline; NOTE [Shutdown while in use] moves it later
    box: list[BaseException | None] = []
    phase = ["start"]
    t = threading.Thread(
        target=lambda: box.append(_graceful(rt, rdzv, world_size, clock, limit, phase)),
        name=f"rrefrt-{rt.info.name}-shutdown",
        daemon=True,
    )
    t.start()
    while not box and t.is_alive():
        left = clock[0] + SHUTDOWN_GRACE - time.monotonic()
        if left <= 0:
            break
        t.join(left)
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


def _graceful(rt: Runtime, rdzv: Barriers, world_size: int, clock: list[float], limit: float,
              phase: list[str] | None = None) -> BaseException | None:
    """The steps; a shutdown that gives up while calls are still in flight here (either
    way: for live or dead callers, or awaiting an answer) names them, with where they are
    (``format_stuck``; the list in the error's ``stuck_calls``; docs/stuck.md). ``clock[0]``
    is the deadline, ``limit`` the timeout it was set from."""
    phase = phase if phase is not None else [""]
    error = _graceful_steps(rt, rdzv, world_size, clock, limit, phase)
    if isinstance(error, ShutdownError) and (rt.inflight.incoming or rt.inflight.outgoing):
        phase[0] = "describing the calls still in flight"
        stuck = stuck_calls(rt, STUCK_WAIT)
        if stuck:
            out = ShutdownError(f"{error}\n{format_stuck(rt.info.name, stuck)}")
            out.stuck_calls = stuck  # type: ignore[attr-defined]
            return out
    return error


def _graceful_steps(rt: Runtime, rdzv: Barriers, world_size: int, clock: list[float], limit: float,
                    phase: list[str]) -> BaseException | None:
    me = rt.info.id
    dead = LiveDead(rt.transport.dead_peers)

    def names(ranks: list[int]) -> str:
        return ", ".join(repr(rt.workers_by_id[r].name) if r in rt.workers_by_id else f"rank {r}" for r in ranks)

    try:
        error: BaseException | None = None
        phase[0] = "enter barrier"
        missing, extended = _enter(rt, rdzv, world_size, clock, limit, dead)
        if missing:
            rt.accepting = False
            try:  # NOTE in Rendezvous.barrier: the others must not take this exit for a death
                rdzv.arrive("failed", me)
            except Exception:
                pass
            return ShutdownError(
                f"shutdown of {rt.info.name!r}: worker(s) {names(missing)} never reached shutdown within the timeout "
                f"({limit:.1f}s{' since the last call from or to this worker' if extended else ''}; they are alive: "
                "raise shutdown_timeout, or the timeout argument, if they work that long without calling this worker)"
            )
        deadline = clock[0]
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


#: NOTE [Shutdown while in use]: how often the enter barrier looks whether the group still
#: uses this worker
IN_USE_POLL = 0.5


def _enter(rt: Runtime, rdzv: Barriers, world_size: int, clock: list[float], limit: float,
           dead: LiveDead) -> tuple[list[int], bool]:
    """The enter barrier: (the ranks that never arrived, whether the deadline was moved).

    NOTE [Shutdown while in use]: torch programs often call ``shutdown()`` on every worker
    but one as soon as ``init_rpc`` returns; the workers then serve the one that drives the
    job (an agent, a master) from inside their shutdown until it finishes and shuts down
    too (pytorch/examples' rl, parameter servers). torch waits for it without a bound. Here
    the wait for the others to arrive is bounded by ``limit`` counted from the last sign
    that the group still uses this worker:

    1. a call between this worker and another began or ended since the last look (polled
       every ``IN_USE_POLL``);
    2. a call is in flight between this worker and a live peer (running here, or sent from
       here and awaiting its answer): it counts for at most ``rpc_timeout`` from its start
       (``limit`` when calls have no timeout), so a handler stuck for good, or a call to
       one, holds the shutdown back for a bounded time only.

    So a worker served for an hour waits for an hour; one that nobody calls gives up
    ``limit`` after its last call; a silent, stuck or deadlocked group still ends the wait
    in bounded time, and a dead worker at once (``dead``). When the deadline moved, the
    steps after the barrier get ``limit`` from the moment everyone arrived."""
    events, _young = rt.lifecycle.in_use()
    hold = rt.options.rpc_timeout or limit  #: how long a call in flight counts as use (2.)
    extended = False
    me = rt.info.id
    while True:
        missing = rdzv.barrier("enter", me, world_size, min(clock[0], time.monotonic() + IN_USE_POLL), dead)
        now = time.monotonic()
        if not missing:
            if extended:
                clock[0] = max(clock[0], now + limit)
            return [], extended
        seen, young = rt.lifecycle.in_use()
        used = now if seen != events else None  # (1.)
        if young is not None:  # (2.)
            used = max(used or 0.0, min(now, young + hold))
        events = seen
        if used is not None and used + limit > clock[0]:
            clock[0] = used + limit
            extended = True
        elif now >= clock[0]:
            return missing, extended


# ---------------------------------------------------------------------------- calls still in flight
def stuck_calls(rt: Runtime, wait: float) -> list[dict[str, Any]]:
    """A shutdown gave up (docs/stuck.md): the calls in flight, a running one with its
    stack, an outgoing one with where its callee has it (asked, ``wait`` at most)."""
    calls = rt.lifecycle.calls_in_flight(stacks=True)
    answers: dict[int, Any] = {}
    asked = threading.Condition()
    sent = []
    for call in list(rt.inflight.outgoing.values()):
        query = rt.requests.stack_query(call)
        if query is None:
            continue

        def got(answer: Any, key: int = id(call)) -> None:
            with asked:
                answers[key] = answer
                asked.notify_all()

        if rt.requests.ask_where(call.dest, query, got):
            sent.append((id(call), call.msg_id))
    deadline = time.monotonic() + wait
    with asked:
        while len(answers) < len(sent) and time.monotonic() < deadline:
            asked.wait(max(0.0, deadline - time.monotonic()))
        got_answers = dict(answers)
    by_msg = {str(msg_id): got_answers.get(key) for key, msg_id in sent}
    for item in calls:
        answer = by_msg.get(item["id"]) if item["direction"] == "outgoing" else None
        if type(answer) is list and len(answer) == 4 and answer[0] in ("running", "queued", "waiting"):
            item["state"] = f"{answer[0]} on {item['peer']}"
            frames = stacks.decode_frames(answer[3])
            if frames:
                item["stack"] = frames
    return calls


def format_stuck(worker: str, calls: list[dict[str, Any]]) -> str:
    """The calls a shutdown gave up on, readable: one line each with where it is and its
    innermost frames (the full stacks are in the error's ``stuck_calls``)."""
    return format_calls(f"calls still in flight on {worker!r} (full stacks in the error's stuck_calls):", calls)


def format_calls(title: str, calls: list[dict[str, Any]]) -> str:
    """``title``, then one line per call (``Lifecycle.calls_in_flight``) with where it is
    and its three innermost frames."""
    lines = [title] if calls else [f"{title} none"]
    for c in calls:
        if c["direction"] == "incoming":
            line = f"  {c['function']!r} from {c['peer']!r}, {c['state']} for {c['age']:.1f}s"
        else:
            line = f"  {c['function']} to {c['peer']!r}, sent {c['age']:.1f}s ago, {c['state']}"
        frames = c.get("stack")
        if frames:
            text = stacks.format_frames(frames, 3).rstrip("\n")
            line += f", at {stacks.summary(frames)}:\n" + "\n".join("    " + x for x in text.split("\n"))
        lines.append(line)
    return "\n".join(lines)
