"""Bounded spins before a sleep, for the transports' loops and waiting callers.

On this kind of VM a ``sendmsg`` (or an eventfd write) that wakes a thread asleep in
``epoll_wait``, ``poll`` or ``select`` costs the sender about 14 us of CPU, and the message
reaches the woken thread about 40 us later than one that polls (docs/performance.md,
"Known limits"). A thread about to sleep that expects a message soon therefore polls for
it first, for a bounded time, and stops spinning where spins do not pay. The rules:
NOTE [Receiver spin] in ``rrefrt_transport.unix.receiver`` (a loop), NOTE [Own reads] (7)
there (a caller waiting for its answer).

The zmq transport does not spin: its messages pass libzmq's I/O threads, which sleep
whatever our threads do, so a spinning data loop bought tcp latency only for more CPU per
call than TensorPipe's (docs/performance.md, "Known limits").
"""

from __future__ import annotations

import os
from time import monotonic as _now
from typing import Any, Callable

#: the default bound of a loop's spin before it sleeps, seconds (NOTE [Receiver spin];
#: ``extra["rx_spin_us"]`` or ``RREFRT_RX_SPIN_US``, 0: off)
RX_SPIN = 150e-6
#: NOTE [Receiver spin] (4), NOTE [Own reads] (7): where the last gap between messages (a
#: loop) or the last wait for an answer (a caller) was at most ``STRETCH_MAX``, a spin
#: stretches to ``STRETCH`` x it (the next one is due about as long after)
STRETCH_MAX = 1000e-6
STRETCH = 1.5
#: this many spins in a row that end without a message ...
SPIN_MISSES = 4
#: ... stop the spinning for this many waits
SPIN_PAUSE = 64


def spin(holder: Any, poll_once: Callable[[], Any], seconds: float, stats: Any, name: str) -> Any:
    """Call ``poll_once`` without sleeping for up to ``seconds``, yielding the core between
    polls; its first truthy result, or a falsy one (a miss). ``holder`` (a channel for a
    caller's spin, a ``LoopSpin`` for a loop's) keeps ``spin_misses`` and ``spin_skip``:
    SPIN_MISSES misses in a row set ``spin_skip`` to SPIN_PAUSE, which its user counts down
    instead of spinning. Counted in ``stats`` as ``<name>_hits`` and ``<name>_pauses``."""
    end = _now() + seconds
    while True:
        ready = poll_once()
        if ready:
            holder.spin_misses = 0
            stats[name + "_hits"] += 1
            return ready
        if _now() >= end:
            break
        # whatever else this core should run goes first: a loop's pool thread that runs the
        # call it just handed on (NOTE [Receiver spin] (2)), a worker that shares the core
        # and must run before the answer can come (NOTE [Own reads] (7))
        os.sched_yield()
    holder.spin_misses += 1
    if holder.spin_misses >= SPIN_MISSES:
        holder.spin_misses = 0
        holder.spin_skip = SPIN_PAUSE
        stats[name + "_pauses"] += 1
    return ready


def configured(extra: dict, key: str, env: str, default: float) -> float:
    """A spin's bound in seconds: ``extra[key]`` (microseconds), else the environment
    variable ``env``, else ``default``; 0 (or less) turns it off."""
    us = extra.get(key, os.environ.get(env))
    return default if us is None else max(0.0, float(us)) * 1e-6


class LoopSpin:
    """When a loop spins before it sleeps (NOTE [Receiver spin] (1) and (4) in
    ``rrefrt_transport.unix.receiver``): while the messages that count come often (the last
    two at most 2 x ``seconds`` apart) and one came just now (at most ``seconds`` ago), for
    up to ``seconds``; or while the last gap was at most ``STRETCH_MAX``, until ``STRETCH``
    x that gap after the last message. Loop thread only."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  #: the spin's bound (0: never)
        self.last = 0.0  #: when the loop last read a message that counts
        self.gap = 1.0  #: ... and the time since the one before
        self.spin_misses = 0
        self.spin_skip = 0

    def note(self, now: float) -> None:
        """The loop read a message that counts, at ``now``."""
        self.gap, self.last = now - self.last, now

    def before_sleep(self, poll_once: Callable[[], Any], timeout: float, stats: Any, name: str) -> Any:
        """Before a sleep of ``timeout`` seconds: spin when due (and not paused), never longer
        than ``timeout`` (the class docstring says for how long). None: no spin; else what
        ``poll_once`` last returned
        (falsy: a miss, which took some of the sleep's time). Counted in ``stats`` as
        ``<name>s``, ``<name>_hits`` and ``<name>_pauses``."""
        s = self.seconds
        if timeout <= 0.0 or not s:
            return None
        gap, since = self.gap, _now() - self.last
        if gap <= 2.0 * s and since <= s:  # (1): often, and one just now
            length = s
        elif gap <= STRETCH_MAX and since < STRETCH * gap:  # (4): the next is due soon
            length = STRETCH * gap - since
        else:
            return None
        if self.spin_skip:
            self.spin_skip -= 1
            return None
        stats[name + "s"] += 1
        return spin(self, poll_once, min(length, timeout), stats, name)
