"""A bounded thread pool for user functions and user callbacks.

Owns: worker threads and their task queue.

NOTE [Blocked pool threads]: a user function may block in a nested wait (``rpc_sync`` back
to a caller that is itself waiting on us). If every pool thread blocks that way, the call
it waits for could never run: torch's recurring pool-exhaustion deadlock. A pool thread
that enters a blocking wait (``rrefrt.Future.result``) tells its pool through
``blocking()``; while tasks are queued and no thread is free, the pool starts an extra
thread. Extra threads leave once idle.

NOTE [Pool cap]: the compensation has a hard bound, ``max_threads`` (threads alive, blocked
ones included), so a deep chain of nested calls cannot grow the process without limit. At
the bound, ``submit`` queues the task (a running thread will take it), and
``submit(..., reject_when_exhausted=True)`` - the path for calls from peers - raises
``PoolExhaustedError`` instead when every thread is blocked in a nested wait, so the new
call fails at once with a typed error rather than waiting behind waits that wait for it.

NOTE [One runner under load]: waking a thread per task makes a burst of quick calls wake
many threads that then queue for the GIL (the transport reads a burst and submits each).
So ``submit`` wakes a thread only when no thread is running tasks (``_active == 0``: a
running thread takes the next task itself when it finishes, with no wake-up), and a burst
costs one wake-up, not one per task. A long or blocking task must not hold the queue:
``max_queue_wait`` bounds it. (1) A thread that enters a nested wait stops counting as
running (``blocking()``) and a runner is woken at once if tasks wait. (2) While tasks wait
behind a running thread, one idle thread is the *watcher*: it sleeps ``max_queue_wait`` at
a time and, if no task was started meanwhile, becomes a runner itself; it goes back to
the idle threads once the queue is empty, so an idle pool never polls. (3) ``submit``
wakes a runner at once when no task was started for ``max_queue_wait`` (a long task is
running). So a queued task starts within about ``max_queue_wait`` of the last progress
whatever the running tasks do, up to the caps above; tasks quicker than that run one
after another on one thread (under the GIL they could not run side by side anyway).
Idle threads are woken one by one, the most recently idle first (each waits on a lock of
its own, not on a shared condition).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

from rrefrt.errors import RpcError

log = logging.getLogger("rrefrt.pool")

__all__ = ["WorkerPool", "PoolExhaustedError", "current_pool", "DEFAULT_MAX_THREADS"]

_tls = threading.local()

#: the least cap of a pool (threads alive, blocked ones included): enough for a chain of
#: about 2000 nested calls between two workers, far below what exhausts a process
DEFAULT_MAX_THREADS = 1024


class PoolExhaustedError(RpcError):
    """Every thread of a worker's pool is blocked in a nested wait and the pool is at its
    cap: the new call was refused instead of queued behind waits that may wait for it."""


def current_pool() -> "WorkerPool | None":
    return getattr(_tls, "pool", None)


_RUN, _WATCH = 1, 2  #: what a woken thread is asked to do (a _Slot's role)
_IDLE_WAIT = 1.0  #: an idle thread re-checks whether it should leave this often


class _Slot:
    """One thread's wake-up lock and the role it is woken for. The lock is held except
    between a wake-up (``pending``: released, under the pool's ``_cond``) and the moment
    its thread takes it back; so a thread woken twice before it runs is released once."""

    __slots__ = ("lock", "role", "pending")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.role = 0
        self.pending = False

    def give(self, role: int) -> None:
        """Under the pool's ``_cond``."""
        self.role = role
        if not self.pending:
            self.pending = True
            self.lock.release()


class WorkerPool:
    def __init__(self, name: str, num_threads: int, max_threads: int | None = None,
                 max_queue_wait: float = 0.002) -> None:
        if num_threads < 1:
            raise ValueError(f"pool {name}: num_threads must be >= 1, got {num_threads}")
        self.name = name
        self.num_threads = num_threads
        #: NOTE [Pool cap]: threads alive (blocked included) never exceed this
        self.max_threads = max(num_threads, max_threads or max(num_threads * 8, DEFAULT_MAX_THREADS))
        #: NOTE [One runner under load]: how long queued tasks wait without any task starting
        self.max_queue_wait = max_queue_wait
        self._cond = threading.Condition()  #: guards the state below (its lock; no waits on it)
        self._tasks: collections.deque = collections.deque()  #: callables waiting for a thread
        self._threads = 0  #: threads alive
        self._idle: list[_Slot] = []  #: sleeping threads, most recently idle last
        self._watcher: _Slot | None = None  #: the thread watching the queue, if any
        self._active = 0  #: threads running (or woken to run) tasks, blocked ones not included
        self._blocked = 0  #: threads inside blocking()
        self._started = 0  #: tasks taken from the queue so far
        self._last_start = 0.0  #: monotonic time a task was last taken
        self._wakes = 0  #: threads woken or started to run or watch
        self._peak = 0  #: most threads alive at once
        self._rejected = 0  #: tasks refused with PoolExhaustedError
        self._batch: list[Any] = []  #: items for the scheduled drain (submit_batched)
        self._batch_scheduled = False  #: a drain task is queued or running
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any, reject_when_exhausted: bool = False) -> None:
        """Queue ``fn(*args)``. With ``reject_when_exhausted``, raise PoolExhaustedError
        when the pool is at its cap and every thread is blocked (NOTE [Pool cap])."""
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"pool {self.name} is stopped")
            if (
                reject_when_exhausted
                and self._threads >= self.max_threads
                and not self._idle
                and self._threads - self._blocked <= 0
            ):
                self._rejected += 1
                raise PoolExhaustedError(
                    f"pool {self.name!r} is exhausted: all {self._threads} threads (its cap) are blocked in "
                    f"nested waits; the call was refused. Reduce the nesting depth of calls between workers "
                    f"(a chain of rpc_sync calls back and forth holds one thread per level)"
                )
            self._tasks.append((fn, args))
            if self._active == 0 or time.monotonic() - self._last_start > self.max_queue_wait:
                self._wake(_RUN)  # NOTE [One runner under load]: none running, or one is stuck
            elif self._watcher is None:
                self._wake(_WATCH)

    def submit_batched(self, item: Any, drain: Callable[[list[Any]], None]) -> None:
        """Queue ``item`` for ``drain(items)``: one task drains every item queued until it
        finds none left, so a burst costs one thread wake-up, not one per item. ``drain``
        must be the same function on every call (one batch per pool)."""
        with self._cond:
            self._batch.append(item)
            if self._batch_scheduled:
                return
            self._batch_scheduled = True
        try:
            self.submit(self._drain_batch, drain)
        except RuntimeError:
            with self._cond:
                self._batch_scheduled = False
                self._batch.clear()
            raise

    def _drain_batch(self, drain: Callable[[list[Any]], None]) -> None:
        while True:
            with self._cond:
                items, self._batch = self._batch, []
                if not items:
                    self._batch_scheduled = False
                    return
            drain(items)

    # ------------------------------------------------------------------ waking (under _cond)
    def _wake(self, role: int) -> None:
        """Give ``role`` to a thread: the most recently idle one, else (to run) the watcher,
        else a new thread if the pool may grow (NOTE [Pool cap]). Under ``_cond``."""
        if self._idle:
            slot, sleeping = self._idle.pop(), True
        elif role == _RUN and self._watcher is not None:
            slot, sleeping, self._watcher = self._watcher, True, None
        elif self._threads < self.max_threads and (
            self._threads - self._blocked < self.num_threads or self._blocked > 0
        ):
            slot, sleeping = _Slot(), False
            if not self._spawn(slot):
                return
        else:
            return  # at its size: a running thread takes the task when it is done
        self._wakes += 1
        slot.role = role
        if role == _RUN:
            self._active += 1
            self._last_start = time.monotonic()  # it starts a task now: not a stuck runner
        else:
            self._watcher = slot
        if sleeping:
            slot.give(role)

    def _spawn(self, slot: _Slot) -> bool:
        """Under ``_cond``, below the cap: a thread that starts with ``slot``'s role."""
        self._threads += 1
        self._peak = max(self._peak, self._threads)
        try:
            threading.Thread(target=self._work, args=(slot,), name=f"{self.name}-{self._threads}", daemon=True).start()
            return True
        except RuntimeError:  # the OS refused a thread: run with what exists
            self._threads -= 1
            log.warning("pool %s could not start a thread (%d alive)", self.name, self._threads)
            return False

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        with self._cond:
            self._blocked += 1
            self._active -= 1
            if self._tasks and self._active == 0:
                self._wake(_RUN)  # NOTE [Blocked pool threads]
        try:
            yield
        finally:
            with self._cond:
                self._blocked -= 1
                self._active += 1

    # ------------------------------------------------------------------ threads
    def _sleep(self, slot: _Slot, timeout: float) -> int:
        """Under ``_cond`` (released meanwhile): wait for a role; 0 if none came in time."""
        slot.role = 0
        if slot is not self._watcher:
            self._idle.append(slot)
        self._cond.release()
        try:
            woken = slot.lock.acquire(True, timeout)
        finally:
            self._cond.acquire()
        if slot.pending:  # woken (maybe just as the wait timed out: then the lock is free)
            if not woken:
                slot.lock.acquire()
            slot.pending = False
            return slot.role
        if slot is not self._watcher:  # a timeout (the watcher's: _watch decides)
            self._idle.remove(slot)
        return 0

    def _work(self, slot: _Slot) -> None:
        _tls.pool = self
        with self._cond:
            if slot.pending:  # a watcher made a runner before it started: take the wake-up
                slot.lock.acquire()
                slot.pending = False
            role = slot.role  # given by _wake before it released _cond
            while True:
                if role == _WATCH:
                    role = self._watch(slot)
                    continue
                if role == _RUN:
                    if self._tasks:
                        fn, args = self._tasks.popleft()
                        self._started += 1
                        self._last_start = time.monotonic()
                        if self._tasks and self._watcher is None:
                            self._wake(_WATCH)  # the rest must not wait behind this task unwatched
                        self._cond.release()
                        try:
                            fn(*args)
                        except BaseException:  # tasks report their own errors; this is a last resort
                            log.exception("task in pool %s raised", self.name)
                        finally:
                            del fn, args
                            self._cond.acquire()
                        continue
                    self._active -= 1
                    role = 0
                if self._stopped or self._threads - self._blocked > self.num_threads:
                    self._threads -= 1
                    return
                role = self._sleep(slot, _IDLE_WAIT)

    def _watch(self, slot: _Slot) -> int:
        """Under ``_cond``: NOTE [One runner under load] (2). Returns the next role."""
        mark = self._started
        while True:
            role = self._sleep(slot, self.max_queue_wait)
            if role:  # woken to run (by _wake, which took it off the watch)
                return role
            if self._watcher is not slot:
                return 0
            if self._stopped or not self._tasks:
                self._watcher = None
                return 0
            if self._started == mark or self._active == 0:  # nothing started for a while: run
                self._watcher = None
                self._active += 1
                self._wakes += 1
                return _RUN
            mark = self._started

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "threads": self._threads, "idle": len(self._idle), "blocked": self._blocked, "queued": len(self._tasks),
                "active": self._active, "watching": int(self._watcher is not None), "wakes": self._wakes,
                "peak_threads": self._peak, "max_threads": self.max_threads, "rejected": self._rejected,
            }

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._tasks.clear()
            self._batch.clear()
            sleepers, self._idle = self._idle, []
            if self._watcher is not None:
                sleepers.append(self._watcher)
                self._watcher = None
            for slot in sleepers:
                slot.give(0)
