"""One I/O loop: a thread that owns some sockets, an outbox of closures and one timer heap.

Owns: the thread, the doorbell (an eventfd), the outbox, the timer heap and the guard every
callback runs under. The zmq transport runs two
loops: the data loop (``rrefrt_transport.zmq.agent``) and the heartbeat loop
(``rrefrt_transport.zmq.heartbeat``).

Rule 1: only the loop's thread touches the sockets registered with it. Other threads hand it
    work with ``call_soon(fn)``: the closure is appended to the outbox under a lock and the
    doorbell rung. Once the loop stopped, ``call_soon`` raises ``LoopClosed`` and the last
    drain has run every closure that was accepted (none is ever left behind).
Rule 2: one timer heap of (due, seq, fn) serves every delay: ``call_later``, the fault
    hook's delayed messages, periodic work (``every``).
Rule 3: every callback the loop runs - outbox closures, timers, socket handlers, and through
    them the runtime's on_message / on_done / on_peer_dead - runs under ``guard``: an
    exception is logged and counted in ``stats["callback_errors"]``, never takes the thread
    down.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import zmq

log = logging.getLogger("rrefrt.transport")


class LoopClosed(RuntimeError):
    """The loop stopped; nothing more can be scheduled on it."""


class IOLoop:
    def __init__(self, name: str, stats: collections.Counter, on_exit: Callable[[], None]) -> None:
        self.name = name
        self.stats = stats
        self._outbox: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False  #: set under the lock by the final drain (Rule 1)
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rung = False
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  #: (due, seq, fn): loop thread only
        self._seq = itertools.count()
        self._poller = zmq.Poller()
        self._poller.register(self._bell, zmq.POLLIN)
        self._handlers: dict[Any, Callable[[], None]] = {}
        self._stopping = False
        #: extra wake-up hint (clock), asked before each poll: e.g. a backlog to retry
        self.wake_hint: Callable[[float], float | None] = lambda now: None
        #: run (guarded) after every pass of the loop: e.g. retry a backlog
        self.each_pass: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._on_exit = on_exit  #: runs last on the loop thread (or in finish()): closes its sockets

    # ------------------------------------------------------------------ setup
    def register(self, sock: Any, handler: Callable[[], None]) -> None:
        """Call ``handler`` (on the loop thread) whenever ``sock`` is readable."""
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def in_loop(self) -> bool:
        return threading.get_ident() == self._thread.ident

    # ------------------------------------------------------------------ any thread
    def call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise LoopClosed(self.name)
            self._outbox.append(fn)
            if not self._rung:
                self._rung = True
                try:
                    os.eventfd_write(self._bell, 1)
                except OSError:
                    pass

    def stop(self) -> None:
        """Ask the loop to stop after the closures already queued; no-op once stopped."""
        try:
            self.call_soon(self._request_stop)
        except LoopClosed:
            pass

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ loop thread only
    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))

    def every(self, interval: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` now and every ``interval`` seconds until the loop stops."""

        def tick() -> None:
            try:
                self.guard(fn, "periodic task")
            finally:
                self.call_later(interval, tick)

        self.call_later(0, tick)

    def guard(self, fn: Callable[..., Any], what: str, *args: Any) -> None:
        """Rule 3."""
        try:
            fn(*args)
        except Exception:
            self.stats["callback_errors"] += 1
            log.exception("%s raised on %s; the I/O thread carries on", what, self.name)

    def _request_stop(self) -> None:
        self._stopping = True

    def _drain(self) -> None:
        box = self._outbox
        while box and not self._stopping:
            self.guard(box.popleft(), "scheduled call")

    def _final_drain(self) -> list[Callable[[], None]]:
        with self._lock:
            self._closed = True
            items = list(self._outbox)
            self._outbox.clear()
        return items

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        wake = now + 1.0
        if self._timers:
            wake = min(wake, self._timers[0][0])
        hint = self.wake_hint(now)
        if hint is not None:
            wake = min(wake, hint)
        return max(0, int((wake - now) * 1000) + 1)

    def _run(self) -> None:
        try:
            while not self._stopping:
                events = dict(self._poller.poll(self._timeout_ms()))
                if self._bell in events:
                    try:
                        os.eventfd_read(self._bell)
                    except OSError:
                        pass
                with self._lock:
                    self._rung = False
                self._drain()
                for sock, handler in self._handlers.items():
                    if sock in events and not self._stopping:
                        self.guard(handler, "socket handler")
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now and not self._stopping:
                    _, _, fn = heapq.heappop(self._timers)
                    self.guard(fn, "timer callback")
                if self.each_pass is not None and not self._stopping:
                    self.guard(self.each_pass, "loop pass")
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("I/O loop %s crashed", self.name)
        finally:
            self.finish()

    def finish(self) -> None:
        """Run the closures accepted before the stop, then on_exit; close the bell."""
        self._stopping = True
        for fn in self._final_drain():
            self.guard(fn, "scheduled call at close")
        self.guard(self._on_exit, "close")
        try:
            os.close(self._bell)
        except OSError:
            pass
