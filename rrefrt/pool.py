"""A bounded thread pool for user functions and user callbacks.

Owns: worker threads and their task queue. Leaf module (standard library only).

NOTE [Blocked pool threads]: a user function may block in a nested wait (``rpc_sync`` back
to a caller that is itself waiting on us). If every pool thread blocks that way, the call
it waits for could never run: torch's recurring pool-exhaustion deadlock. A pool thread
that enters a blocking wait (``rrefrt.Future.result``) tells its pool through
``blocking()``; while tasks are queued and no thread is free, the pool starts an extra
thread, up to ``max_threads``. Extra threads leave once idle.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger("rrefrt.pool")

_tls = threading.local()


def current_pool() -> "WorkerPool | None":
    return getattr(_tls, "pool", None)


class WorkerPool:
    def __init__(self, name: str, num_threads: int, max_threads: int | None = None) -> None:
        self.name = name
        self.num_threads = num_threads
        self.max_threads = max_threads or max(num_threads * 8, num_threads + 64)
        self._cond = threading.Condition()
        self._tasks: collections.deque = collections.deque()  #: callables waiting for a thread
        self._threads = 0  #: threads alive
        self._idle = 0  #: threads waiting for a task
        self._blocked = 0  #: threads inside blocking()
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"pool {self.name} is stopped")
            self._tasks.append((fn, args))
            if self._idle > len(self._tasks) - 1:
                self._cond.notify()
            elif self._threads - self._blocked < self.num_threads or (
                self._threads < self.max_threads and self._idle == 0 and self._blocked > 0
            ):
                self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()

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
            return {"threads": self._threads, "idle": self._idle, "blocked": self._blocked, "queued": len(self._tasks)}

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._tasks.clear()
            self._cond.notify_all()
