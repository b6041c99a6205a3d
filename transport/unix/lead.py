"""Leader/follower for the same-host transport's receiver role (``rrefrt_transport.unix.transport``): which
thread runs the receiver loop now, the standby thread that takes the loop over, and the
calls run inline on the loop's thread. Owns no loop state: only who may touch it. Imports
only the standard library (never zmq, torch, rrefrt).

NOTE [Inline calls]: handing every incoming call from the receiver thread to a pool thread
costs one thread wake-up per call (40-80 us on a 2-core machine: the woken thread then
waits for the GIL), the largest part of the callee's cost of a no-op ``rpc_sync``. So the
runtime may ask (``run_inline(task, fallback)``, from a message callback on the loop's
thread) that the thread that read a call runs it and sends the answer itself. Safety
("never hang": a function may block - a nested ``rpc_sync`` whose answer this very thread
must read, a lock, a sleep, a long computation - and reading, timers and liveness must not
stall behind it):

1. Only at a consistent point. Callbacks only queue the task; the leader runs queued tasks
   at the end of a loop iteration (every buffer parsed, calls, timers done), one at a time.
2. A standby thread watches. Before a task starts, a sleeping standby is woken to watch
   (once per burst, not per call: it keeps watching in ``TAKEOVER_AFTER`` slices while
   tasks keep starting, and sleeps again after a slice in which none ran - no polling
   while idle). If a task has run for ``TAKEOVER_AFTER`` (2 ms), the standby becomes the
   leader and runs the loop from where the old leader left it; the old leader finishes
   its task (it sends its own answer, as any thread may) and then becomes the standby.
3. rrefrt's own blocking points (``Future.result``, ``to_here``, ``confirmed_by_owner``:
   NOTE [Blocked pool threads] in rrefrt/pool.py) call ``hand_off()``: the standby takes
   over at once, without waiting for the 2 ms.
4. At most one displaced leader at a time: while one is still in its task there is no
   standby, ``run_inline`` says no and the runtime hands calls to its pool as before
   (tasks already queued go to their ``fallback`` then). So the process never has more
   than two threads for this, and a function that blocks for long costs what it cost
   before this: a pool hand-off per call while it blocks.
5. Leadership changes only under ``_cv``: the old leader checks after its task whether it
   still leads, the standby takes over only while a task runs. Loop state (the selector,
   peers, timers) is touched by the leader alone; ``leader`` says who that is (a write on
   the leader's thread never blocks: Rule 1 of rrefrt_transport.unix.transport).
6. Off by default for now: ``RREFRT_INLINE=1`` (or ``TransportConfig.extra["inline"]=True``)
   turns it on; off, every call goes to the pool as before. On the loaded 2-core machine
   it cut the callee's context switches per call from 2.0 to 1.2, but the latency gain
   (rpc_sync p50 0.92x over 26 paired rounds, 0.54-1.41) was within the noise
   (docs/performance.md, "Inline calls on the callee"): turn it on by default once a
   quiet machine shows the gain.
7. A burst goes to the pool. A loop iteration that queued ``BURST`` (4) tasks or more
   (calls that arrived together: ``rpc_async`` in flight by the hundred; a call and the
   next one a program sends stay inline) hands them all to their
   ``fallback`` (the pool, whose one running thread takes them one after another: NOTE
   [One runner under load] in rrefrt/pool.py): one wake-up for the burst, and the reading
   thread goes back to reading instead of running the burst ahead of it. Counted as
   ``inline_bursts``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("rrefrt.transport")

#: NOTE [Inline calls] (2): a task running this long loses the loop to the standby
TAKEOVER_AFTER = 0.002
#: NOTE [Inline calls] (7): this many tasks queued in one loop iteration go to the pool
BURST = 4
_IDLE_CHECK = 1.0  #: a sleeping standby re-checks whether the transport closed this often
_ASLEEP, _WATCHING = 0, 1


def inline_enabled(extra: dict[str, Any]) -> bool:
    """Off unless ``extra["inline"]`` or ``RREFRT_INLINE=1`` (NOTE [Inline calls] (6))."""
    if extra.get("inline") is not None:
        return bool(extra["inline"])
    return os.environ.get("RREFRT_INLINE", "0").strip().lower() in ("1", "true", "yes", "on")


class Leadership:
    """Who runs the receiver loop (NOTE [Inline calls]). The loop (``serve``, given to
    ``main``) runs until the transport closes (then returns True) or this thread lost the
    lead (then False)."""

    def __init__(self, name: str, enabled: bool, stats: collections.Counter) -> None:
        self.name = name
        self.enabled = enabled
        self.leader = 0  #: ident of the thread that runs the loop now
        self.queue: collections.deque = collections.deque()  #: (task, fallback) to run inline
        self.stats = stats  #: the transport's: inline_calls, inline_takeovers (handoffs among them), inline_fallbacks, inline_bursts
        self._serve: Callable[[], bool] = lambda: True
        self._cv = threading.Condition(threading.Lock())
        self._standby = False  #: a standby thread exists (waiting, or watching)
        self._state = _ASLEEP  #: the standby's
        self._running = False  #: the leader runs an inline task now
        self._started = 0  #: inline tasks started so far
        self._since = 0.0  #: when the running one started
        self._handoff = False  #: the running task blocks in rrefrt (hand_off)
        self._closing = False

    def main(self, serve: Callable[[], bool]) -> None:
        """The loop's first thread: lead from now on, running ``serve``; the standby starts
        beside it."""
        self._serve = serve
        self.leader = threading.get_ident()
        if self.enabled:
            with self._cv:
                self._standby = self._spawn()
        self._body(True)

    def _spawn(self) -> bool:
        try:
            t = threading.Thread(target=self._body, args=(False,), name=f"rrefrt-unix-{self.name}-standby", daemon=True)
            t.start()
            return True
        except RuntimeError:  # the OS refused a thread: calls go to the pool
            log.warning("transport %r could not start its standby thread; calls go to the pool", self.name)
            return False

    def _body(self, lead: bool) -> None:
        """A thread's turns: lead until displaced, then stand by until it takes over."""
        while True:
            if lead:
                try:
                    if self._serve():
                        return  # closed
                except Exception:  # _serve reports its own crash
                    return
                with self._cv:  # displaced, its task done: it becomes the standby
                    if self._closing or self._standby:
                        return
                    self._standby = True
                    self._state = _ASLEEP
            lead = self._watch()
            if not lead:
                return

    # ------------------------------------------------------------------ the leader
    def run_inline(self, task: Callable[[], None], fallback: Callable[[], None]) -> bool:
        """From a message callback on the loop's thread: queue ``task`` to run on this thread
        at the end of the loop's iteration; ``fallback`` runs instead (on the loop's
        thread) if the lead passed meanwhile. False: not accepted, hand it on yourself."""
        if not self._standby or self._closing or threading.get_ident() != self.leader:
            return False
        self.queue.append((task, fallback))
        return True

    def run_queued(self) -> bool:
        """The leader, at the end of a loop iteration: run the queued tasks. False: the lead
        passed to the standby while a task ran; this thread must leave the loop."""
        me = threading.get_ident()
        q, cv = self.queue, self._cv
        burst = len(q) >= BURST  # NOTE [Inline calls] (7): a burst goes to the pool, one wake-up for all
        while q:
            task, fallback = q.popleft()
            if burst or not self._standby or self._closing:
                del task
                self.stats["inline_bursts" if burst else "inline_fallbacks"] += 1
                self._guard(fallback)
                del fallback
                continue
            del fallback
            with cv:
                self._running = True
                self._handoff = False
                self._started += 1
                self._since = time.monotonic()
                if self._state == _ASLEEP:
                    self._state = _WATCHING
                    cv.notify()
            self.stats["inline_calls"] += 1
            self._guard(task)
            del task
            with cv:
                self._running = False
                if self.leader == me:
                    continue
            return False
        return True

    def hand_off(self) -> None:
        """The leader's inline task is about to block in rrefrt: let the standby take the loop
        over now (NOTE [Inline calls] (3)). A no-op on any other thread."""
        if not self._running or threading.get_ident() != self.leader:
            return
        with self._cv:
            if self._running and self.leader == threading.get_ident() and not self._handoff:
                self._handoff = True
                self.stats["inline_handoffs"] += 1
                self._state = _WATCHING
                self._cv.notify()

    # ------------------------------------------------------------------ the standby
    def _watch(self) -> bool:
        """Stand by (NOTE [Inline calls] (2)). True: this thread leads now; False: closed."""
        cv = self._cv
        with cv:
            mark = -1
            while not self._closing:
                if self._state == _ASLEEP:
                    cv.wait(_IDLE_CHECK)
                    mark = -1
                    continue
                now = time.monotonic()
                if self._running and (self._handoff or now - self._since >= TAKEOVER_AFTER):
                    self._standby = False
                    self.leader = threading.get_ident()
                    self.stats["inline_takeovers"] += 1
                    return True
                if not self._running and self._started == mark:
                    self._state = _ASLEEP  # a whole slice without a task: stop watching
                    continue
                mark = self._started
                left = self._since + TAKEOVER_AFTER - now if self._running else TAKEOVER_AFTER
                cv.wait(max(left, 0.0002))
            self._standby = False
            return False

    def close(self) -> None:
        """The transport closed: the standby leaves (a displaced leader too, once back)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("inline call failed")
