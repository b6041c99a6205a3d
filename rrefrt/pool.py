"""A bounded thread pool for user functions and user callbacks.

Owns: worker threads and their task queue. Imports from rrefrt: errors (leaf) only.

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
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

from .errors import RpcError

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


class WorkerPool:
    def __init__(self, name: str, num_threads: int, max_threads: int | None = None) -> None:
        if num_threads < 1:
            raise ValueError(f"pool {name}: num_threads must be >= 1, got {num_threads}")
        self.name = name
        self.num_threads = num_threads
        #: NOTE [Pool cap]: threads alive (blocked included) never exceed this
        self.max_threads = max(num_threads, max_threads or max(num_threads * 8, DEFAULT_MAX_THREADS))
        self._cond = threading.Condition()
        self._tasks: collections.deque = collections.deque()  #: callables waiting for a thread
        self._threads = 0  #: threads alive
        self._idle = 0  #: threads waiting for a task
        self._blocked = 0  #: threads inside blocking()
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
                and self._idle == 0
                and self._threads - self._blocked <= 0
            ):
                self._rejected += 1
                raise PoolExhaustedError(
                    f"pool {self.name!r} is exhausted: all {self._threads} threads (its cap) are blocked in "
                    f"nested waits; the call was refused. Reduce the nesting depth of calls between workers "
                    f"(a chain of rpc_sync calls back and forth holds one thread per level)"
                )
            self._tasks.append((fn, args))
            if self._idle > len(self._tasks) - 1:
                self._cond.notify()
            elif self._threads < self.max_threads and (
                self._threads - self._blocked < self.num_threads or (self._idle == 0 and self._blocked > 0)
            ):
                self._spawn()

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

    def _spawn(self) -> None:
        """Under ``_cond``, below the cap."""
        self._threads += 1
        self._peak = max(self._peak, self._threads)
        try:
            threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        except RuntimeError:  # the OS refused a thread: run with what exists
            self._threads -= 1
            log.warning("pool %s could not start a thread (%d alive)", self.name, self._threads)

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        with self._cond:
            self._blocked += 1
            if self._tasks and self._idle == 0 and self._threads < self.max_threads:
                self._spawn()
        try:
            yield
        finally:
            with self._cond:
                self._blocked -= 1

    def _work(self) -> None:
        _tls.pool = self
        while True:
            with self._cond:
                while not self._tasks:
                    if self._stopped or self._threads - self._blocked > self.num_threads:
                        self._threads -= 1
                        return
                    self._idle += 1
                    self._cond.wait(1.0)
                    self._idle -= 1
                fn, args = self._tasks.popleft()
            try:
                fn(*args)
            except BaseException:  # tasks report their own errors; this is a last resort
                log.exception("task in pool %s raised", self.name)
            del fn, args

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "threads": self._threads, "idle": self._idle, "blocked": self._blocked, "queued": len(self._tasks),
                "peak_threads": self._peak, "max_threads": self.max_threads, "rejected": self._rejected,
            }

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._tasks.clear()
            self._batch.clear()
            self._cond.notify_all()
