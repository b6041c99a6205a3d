"""``rrefrt.Future``: the stdlib ``concurrent.futures.Future`` contract plus torch's
``wait/value/then`` and ``await``; ``wait_all`` and ``collect_all``.

Imports from rrefrt: pool (leaf). Runtime-facing entry points are ``_complete_lazy`` and
``_fail`` which the I/O thread calls.

NOTE [Lazy results]: the I/O thread completes an RPC future with an undecoded response
(``_Lazy``); the payload is unpickled by the first thread that asks for it (``result``,
``exception``, ``wait``), under the future's own decode lock. So the I/O thread never runs
user code (unpickling may), ``rpc_sync`` decodes on the caller's own thread, and callbacks of
futures completed by the I/O thread run on the runtime's callback pool, never on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures._base as _cf
import threading
from typing import Any, Callable, Generic, Iterable, TypeVar

from .pool import WorkerPool, current_pool

__all__ = ["Future", "wait_all", "collect_all"]

T = TypeVar("T")


class _Lazy:
    __slots__ = ("decode",)

    def __init__(self, decode: Callable[[], Any]) -> None:
        self.decode = decode


class Future(concurrent.futures.Future, Generic[T]):
    """A future usable from threads (``wait``/``result``) and from asyncio (``await``)."""

    def __init__(self) -> None:
        super().__init__()
        self._decode_lock = threading.Lock()
        self._callback_pool: WorkerPool | None = None

    # -- torch's API
    def wait(self, timeout: float | None = None) -> T:
        """Block until done; return the value or raise its error."""
        return self.result(timeout)

    def value(self) -> T:
        return self.result()

    def then(self, callback: Callable[["Future[T]"], Any]) -> "Future[Any]":
        """A new Future completed with ``callback(self)``; if the callback raises, the new
        Future fails with that exception."""
        out: Future[Any] = Future()

        def run(f: Future[T]) -> None:
            try:
                out.set_result(callback(f))
            except BaseException as e:
                out.set_exception(e)

        self.add_done_callback(run)
        return out

    # -- stdlib contract, with lazy decoding and compensation of blocked pool threads
    # (result and exception repeat their wait on purpose: a shared helper would put a frame
    # holding this future into the stored error's traceback - a cycle that keeps RRefs alive)
    def result(self, timeout: float | None = None) -> T:
        try:
            if not self.done():
                pool = current_pool()
                if pool is not None:
                    with pool.blocking():
                        r = super().result(timeout)
                else:
                    r = super().result(timeout)
            else:
                r = super().result(timeout)
            if type(r) is _Lazy:
                return self._materialize(r)
            return r
        except BaseException:
            # the error is stored on this future: a traceback that kept this frame (and so
            # the future) would be a cycle holding every object in it, RRefs included
            self = None  # type: ignore[assignment]  # noqa: F841
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            pool = current_pool()
            if pool is not None:
                with pool.blocking():
                    e = super().exception(timeout)
            else:
                e = super().exception(timeout)
        else:
            e = super().exception(timeout)
        if e is None and type(self._result) is _Lazy:
            try:
                self._materialize(self._result)
            except BaseException as err:
                return err
        return e

    def _materialize(self, lazy: _Lazy) -> Any:
        with self._decode_lock:
            if self._result is lazy:
                try:
                    self._result = lazy.decode()
                except BaseException as e:
                    self._result, self._exception = None, e.with_traceback(None)  # no cycle via this frame
            exc = self._exception
            if exc is not None:
                try:
                    raise exc
                finally:  # no cycle future -> error -> traceback -> this frame -> future
                    self = None  # type: ignore[assignment]  # noqa: F841
                    exc = None
            return self._result

    def __await__(self):  # type: ignore[override]
        return asyncio.wrap_future(self).__await__()

    # -- completion by the runtime
    def _complete_lazy(self, decode: Callable[[], Any]) -> None:
        self._finish(_Lazy(decode), None)

    def _fail(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        with self._condition:
            if self._state in (_cf.CANCELLED, _cf.CANCELLED_AND_NOTIFIED, _cf.FINISHED):
                return
            self._result, self._exception, self._state = result, exc, _cf.FINISHED
            for waiter in self._waiters:
                if exc is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
            self._condition.notify_all()
            has_callbacks = bool(self._done_callbacks)
        if has_callbacks:
            pool = self._callback_pool
            if pool is not None:
                try:
                    pool.submit(self._invoke_callbacks)
                    return
                except RuntimeError:
                    pass
            self._invoke_callbacks()


def wait_all(futures: Iterable[concurrent.futures.Future], timeout: float | None = None) -> list[Any]:
    """Wait for every future; return their values, or raise the first error."""
    futs = list(futures)
    return [f.result(timeout) for f in futs]


def collect_all(futures: Iterable[concurrent.futures.Future]) -> Future[list[Any]]:
    """A Future completed with the list of ``futures`` once all of them are done, failed
    ones included."""
    futs = list(futures)
    out: Future[list[Any]] = Future()
    if not futs:
        out.set_result([])
        return out
    remaining = [len(futs)]
    lock = threading.Lock()

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(futs)

    for f in futs:
        f.add_done_callback(one_done)
    return out
