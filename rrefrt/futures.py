"""``rrefrt.Future``: the stdlib ``concurrent.futures.Future`` contract plus torch's
``wait/value/then`` and ``await``; ``wait_all`` and ``collect_all``.

Runtime-facing entry points are
``_complete_lazy`` and ``_fail`` which the I/O thread calls. Never imports torch.

NOTE [Lazy results]: the I/O thread completes an RPC future with an undecoded response
(``_Lazy``); the payload is unpickled by the first thread that asks for it (``result``,
``exception``, ``wait``), under the future's own decode lock. So the I/O thread never runs
user code (unpickling may), ``rpc_sync`` decodes on the caller's own thread, and callbacks of
futures completed by the I/O thread run on the runtime's callback pool, never on it.

NOTE [torch interop]: ``torch.futures.wait_all``/``collect_all`` and torch's own RPC code
accept only ``torch._C.Future`` instances. When torch is already imported, ``Future()``
builds an instance of ``_TorchFuture``, a subclass of both this class and
``torch.futures.Future`` created on first use (so ``import rrefrt`` never imports torch,
and a program without torch pays nothing). Python-level methods are ours (MRO: this class,
then ``concurrent.futures.Future``, then torch's: every public method of torch's Future is
overridden, so only torch's C++ functions read the C++ side). That side is completed by
``_mark_torch`` - with the decoded value, or with the error behind torch's unwrap hook (as
``torch.futures.Future.set_exception`` does) - and only once something on torch's side
needs it (*lazily*): a future completed by the runtime (one with a callback pool) that
torch never touches leaves its C++ side pending, so an ``rpc_async`` that is only read
through ``wait``/``result`` costs no callback-pool task. torch's functions that read the
C++ side - ``torch._C._collect_all`` (behind ``torch.futures.collect_all``/``wait_all``)
and ``torch._C.wait`` (``torch.jit.wait``) - are wrapped once, when the class is built, to
ask for it first (``_want_torch_side``): a future already done is marked there, on the
caller's thread; one not yet done is marked on completion, on the thread that runs the
callbacks - the callback pool for RPC futures, never the I/O thread, since torch runs the
callbacks of a ``collect_all`` on the thread that completes its last input (completions
with no Python callback are coalesced, ``WorkerPool.submit_batched``). A future with Python
callbacks, or none of a pool (a user's ``set_result``, ``then``), is marked when its
callbacks run, as before. Futures created before torch was imported stay plain (not
accepted by torch's functions).

NOTE [Lazy condition]: an ``rpc_async`` future is usually created, completed by the I/O
thread and read once it is done; ``concurrent.futures.Future.__init__`` built a Condition
(an RLock, a deque, four bound methods) for each, and every ``done``/``result`` took it.
So ``__init__`` sets the stdlib's fields itself, the state lives under a bare RLock
(``_lock``), and ``_condition`` - the name the stdlib's own methods and
``concurrent.futures.wait`` use - is a property that builds the Condition over that lock on
first use, under the lock (so two threads never build two). ``_finish``/``_settle`` change
the state under ``_lock`` and notify the Condition only if one exists: a waiter builds it
and checks the state under the same lock, so no wake-up is lost. ``done`` and the ``result``
of a finished future read the state without a lock (one attribute read is atomic); a lazy
result's decode writes ``_exception`` before ``_result`` and readers read ``_result``
first, so a racing reader never takes a failed decode for a ``None`` value.

NOTE [No cycle through a raised error]: a failed future stores its error, and ``result``/
``wait`` raise that object, so its traceback collects the frames it passes through. A
frame there that still holds the future (``self``, a local ``fut``) closes a cycle
future -> error -> traceback -> frame -> future, and everything those frames hold (the
proxy's RRef, the call's arguments) lives until a full gc pass, which in a large process
may not come for minutes: the owner keeps the remote value. So every library frame that
an error leaves through drops its reference to the future first (``self = None`` /
``fut = None`` in the ``except``), and ``exception()`` decodes a lazy error without
raising it (the callback pool calls it for the torch side; a raise there would add the
pool thread's frames, which hold the future, to the error). A user's own frame holding
the future is the same cycle as with ``concurrent.futures`` (see docs/futures.md).
NOTE [Callback chains]: completing a future runs its callbacks on the completing thread
(or its callback pool), and a ``then`` callback completes the derived future, which runs
its own callbacks: a chain of ``then`` on a pending future would nest one completion per
link, and a few hundred links would pass Python's recursion limit (the RecursionError
would be logged by the stdlib's callback loop and the rest of the chain never complete).
So ``_run_callbacks`` counts, per thread, how deeply completions nest: up to
``_INLINE_DEPTH`` they run inline, as in torch (a callback that completes another future
sees that future's callbacks done when ``set_result`` returns); deeper, the future goes on
a per-thread queue that the outermost completion drains once its own callbacks return,
each from a fresh depth. Any chain completes, each callback once, a linear chain in
order; only a completion nested that deep runs its callbacks after the callback that
completed it returns, not inside it.
See docs/futures.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures._base as _cf
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Generic, Iterable, TypeVar

from rrefrt.payload import torchimport
from rrefrt.errors import RpcError, SerializationError, fresh
from rrefrt.pool import WorkerPool, current_pool

__all__ = ["Future", "wait_all", "collect_all", "FutureAlreadyCompletedError", "FutureCallbackError"]

T = TypeVar("T")

_DONE = (_cf.CANCELLED, _cf.CANCELLED_AND_NOTIFIED, _cf.FINISHED)
_FINISHED = _cf.FINISHED
_RLock = threading.RLock
_Lock = threading.Lock
#: torch's phrase, which torch programs match on
_TWICE = "Attempting to mark a completed Future as complete again. Note that a Future can only be marked completed once."


class FutureAlreadyCompletedError(RpcError, concurrent.futures.InvalidStateError):
    """``set_result``/``set_exception`` on a Future that is already done (torch raises a
    RuntimeError, the stdlib an InvalidStateError: this is both)."""


class FutureCallbackError(RpcError):
    """A ``then`` callback raised an exception that is not a RuntimeError. torch fails the
    derived Future with a RuntimeError saying "Got the following error when running the
    callback: <type>: <text>"; rrefrt raises an instance of a subclass of both this class
    and the original type (``except ValueError`` and ``except RuntimeError`` both work),
    with the original as ``__cause__`` (plain FutureCallbackError where the two types
    cannot be combined, e.g. OSError). Sent to another worker it stays both."""

    __str__ = BaseException.__str__  # the message, whatever the original type prints

    def __reduce__(self) -> Any:  # the original exception stays behind (it may not pickle)
        if type(self) is FutureCallbackError:
            return (FutureCallbackError, self.args)
        return (_rebuild_callback_error, (_original_type(type(self)), self.args[0] if self.args else ""))


_dual_types: dict[type, type] = {}


def _original_type(dual: type) -> type:
    for base in dual.__bases__:
        if base is not FutureCallbackError:
            return base
    return FutureCallbackError


def _callback_error_type(orig: type) -> type:
    cls = _dual_types.get(orig)
    if cls is None:
        try:
            cls = type(orig.__name__, (FutureCallbackError, orig), {"__module__": orig.__module__})
        except TypeError:  # instance lay-out conflict (OSError, AttributeError, ...)
            cls = FutureCallbackError
        _dual_types[orig] = cls
    return cls


def _rebuild_callback_error(orig: type, message: str, cause: BaseException | None = None) -> BaseException:
    cls = _callback_error_type(orig) if isinstance(orig, type) and issubclass(orig, BaseException) else FutureCallbackError
    try:
        err = cls.__new__(cls, message)
        err.args = (message,)
    except Exception:
        err = FutureCallbackError(message)
    err.__cause__ = cause
    return err


class _NotAnException(TypeError, AssertionError):
    """``set_exception`` with something that is not an exception (torch: AssertionError)."""


class _Lazy:
    """An undecoded result: ``decode(*args)`` gives the value (NOTE [Lazy results])."""

    __slots__ = ("decode", "args")

    def __init__(self, decode: Callable[..., Any], args: tuple) -> None:
        self.decode, self.args = decode, args


def _not_callable(method: str, obj: Any) -> TypeError:
    return TypeError(
        f"{method}(): incompatible function arguments: the callback must be a callable taking the Future, "
        f"got {type(obj).__name__}"
    )


class Future(concurrent.futures.Future, Generic[T]):
    """A future usable from threads (``wait``/``result``) and from asyncio (``await``);
    an instance of ``torch.futures.Future`` too when torch is imported (NOTE [torch interop])."""

    _torch_side = False  #: the instance is also a torch._C.Future (class attribute)
    _torch_wanted = False  #: torch's side was asked for: complete it on completion (NOTE [torch interop])
    _torch_marked = False  #: torch's side is completed (or being completed)
    #: (read_until, peer): the waiting thread may read its answer itself (``_read_own``)
    _reader: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "Future[T]":
        if cls is Future:
            tcls = _torch_future_class()
            if tcls is not None:
                cls = tcls
        return super().__new__(cls)  # type: ignore[misc]

    def __init__(self, *, devices: Any = None) -> None:
        # NOTE [Lazy condition]: concurrent.futures.Future.__init__ is not called: the state
        # lock is a bare RLock, the Condition around it is built on first need
        self._state = _cf.PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []
        self._lock = _RLock()
        self._cond: threading.Condition | None = None
        self._decode_lock = _Lock()
        self._callback_pool: WorkerPool | None = None

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """The stdlib's Condition over this future's state lock, built on first use
        (NOTE [Lazy condition]): a thread that waits, or ``concurrent.futures.wait``."""
        cond = self._cond
        if cond is None:
            with self._lock:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition(self._lock)
        return cond

    def done(self) -> bool:
        return self._state in _DONE

    # -- torch's API
    def wait(self, timeout: float | None = None) -> T:
        """Block until done; return the value or raise its error (the same each time)."""
        try:
            return self.result(timeout)
        except BaseException:
            self = None  # type: ignore[assignment]  # noqa: F841  # NOTE [No cycle through a raised error]
            raise

    def value(self) -> T:
        """The value of a completed Future (raises its error); as in torch, only after
        ``wait()`` or inside a callback: on a Future not yet done it raises at once."""
        if not self.done():
            raise RpcError("value() was called on a Future that is not completed yet; call wait() first")
        try:
            return self.result(0)
        except BaseException:
            self = None  # type: ignore[assignment]  # noqa: F841  # NOTE [No cycle through a raised error]
            raise

    def then(self, callback: Callable[["Future[T]"], Any]) -> "Future[Any]":
        """A new Future completed with ``callback(self)``; a non-callable raises TypeError
        at once. If the callback raises, the new Future fails: with (a copy of) that error if
        it is a RuntimeError (rrefrt's typed errors are), else with a FutureCallbackError -
        a RuntimeError as in torch - that is also of the original type."""
        if not callable(callback):
            raise _not_callable("then", callback)
        out: Future[Any] = Future()

        def run(f: Future[T]) -> None:
            try:
                value = callback(f)
            except BaseException as e:
                out._finish(None, _callback_error(e))
                return
            out._finish(value, None)

        self.add_done_callback(run)
        return out

    def add_done_callback(self, fn: Callable[["Future[T]"], Any]) -> None:
        """Run ``fn(self)`` once done (at once, inline, if it is); errors it raises are logged."""
        if not callable(fn):
            raise _not_callable("add_done_callback", fn)
        with self._lock:
            if self._state not in _DONE:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:
            _cf.LOGGER.exception("exception calling callback for %r", self)

    def set_result(self, result: Any) -> None:
        if not self._settle(result, None):
            raise FutureAlreadyCompletedError(_TWICE)
        self._invoke_callbacks()

    def set_exception(self, exception: Any) -> None:
        if not isinstance(exception, BaseException):
            raise _NotAnException(f"{exception} is of type {type(exception)}, not an Exception.")
        if not self._settle(None, exception):
            raise FutureAlreadyCompletedError(_TWICE)
        self._invoke_callbacks()

    def _mark_done(self, result: Any, exc: BaseException | None) -> None:
        """Under ``_lock``: store the outcome and wake ``concurrent.futures.wait`` waiters
        and threads waiting on the condition (if one was built)."""
        self._result, self._exception, self._state = result, exc, _cf.FINISHED
        for waiter in self._waiters:
            if exc is None:
                waiter.add_result(self)
            else:
                waiter.add_exception(self)
        cond = self._cond
        if cond is not None:
            cond.notify_all()

    def _settle(self, result: Any, exc: BaseException | None) -> bool:
        """Complete the state under the lock and wake waiters; False if it was done (or
        cancelled) already. The callbacks are the caller's to run."""
        with self._lock:
            if self._state in _DONE:
                return False
            self._mark_done(result, exc)
        return True

    # -- stdlib contract, with lazy decoding and compensation of blocked pool threads
    # (result and exception repeat their wait on purpose: a shared helper would put a frame
    # holding this future into the stored error's traceback - a cycle that keeps RRefs alive)
    def result(self, timeout: float | None = None) -> T:
        try:
            if self._reader is not None and self._state is not _FINISHED:
                pool = current_pool()  # NOTE [Own reads]: read the answer here first
                if pool is not None:
                    with pool.blocking():
                        timeout = self._read_own(timeout)
                else:
                    timeout = self._read_own(timeout)
            if self._state is _FINISHED:  # fast path: no lock (NOTE [Lazy condition])
                r = self._result  # read before _exception: _decode writes them the other way round
                if type(r) is _Lazy:
                    return self._materialize(r)
                exc = self._exception
                if exc is None:
                    return r
                try:
                    raise exc
                finally:
                    exc = None
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

    def _read_own(self, timeout: float | None) -> float | None:
        """NOTE [Own reads] in transport/unix/receiver.py: a future whose answer comes from
        one peer (``_reader``: the transport's ``read_until`` and that peer, set by the
        runtime on futures only waited for) lets this thread read the answer itself before
        it waits. Once per future; never raises. Returns what is left of ``timeout``."""
        reader, self._reader = self._reader, None
        t0 = time.monotonic()
        try:
            reader[0](reader[1], self.done, timeout)
        except Exception:
            _cf.LOGGER.exception("reading the answer of %r failed; waiting for it instead", self)
        if timeout is None:
            return None
        return max(0.0, timeout - (time.monotonic() - t0))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state is _FINISHED:
            r = self._result
            if type(r) is _Lazy:
                self._decode(r)  # never raises: the error is not raised on this thread
            return self._exception
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
            self._decode(self._result)  # never raises: the error is not raised on this thread
            e = self._exception
        return e

    def _decode(self, lazy: _Lazy) -> None:
        """Decode a lazy result once; a failure becomes the stored error (no traceback)."""
        with self._decode_lock:
            if self._result is lazy:
                try:
                    self._result = lazy.decode(*lazy.args)
                except BaseException as e:
                    # _exception first: the lock-free readers (result) read _result first
                    self._exception = e.with_traceback(None)  # no cycle via this frame
                    self._result = None

    def _materialize(self, lazy: _Lazy) -> Any:
        self._decode(lazy)  # done on return, by this thread or another (under the decode lock)
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise SerializationError(
            "Can not pickle torch.futures.Future: an rrefrt.Future cannot be sent to another worker; "
            "send its value (fut.wait()) instead"
        )

    def _invoke_callbacks(self) -> None:
        _run_callbacks(self)  # NOTE [Callback chains]

    def _call_callbacks(self) -> None:
        """Run this future's callbacks on this thread, now (``_run_callbacks`` decides when)."""
        super()._invoke_callbacks()  # type: ignore[misc]
        # once run, callbacks are dropped (later ones run inline): a callback closing over a
        # derived future must not keep it alive through this one (NOTE [torch interop]: a
        # cycle through the C++ side is invisible to gc)
        self._done_callbacks = []

    # -- completion by the runtime
    def _complete_lazy(self, decode: Callable[..., Any], *args: Any) -> None:
        """Complete with the result ``decode(*args)``, computed by its first reader."""
        self._finish(_Lazy(decode, args), None)

    def _fail(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._state in _DONE:
                return
            self._mark_done(result, exc)
            has_callbacks = bool(self._done_callbacks)
            # NOTE [torch interop]: the C++ side is completed lazily, when torch asks for it
            torch_now = self._torch_side and (self._torch_wanted or self._callback_pool is None)
        if has_callbacks or torch_now:
            pool = self._callback_pool
            if pool is not None:
                try:
                    if has_callbacks:
                        pool.submit(self._invoke_callbacks)
                    else:  # only the torch side to complete: coalesced with others
                        pool.submit_batched(self, _invoke_all_callbacks)
                    return
                except RuntimeError:
                    pass
            self._invoke_callbacks()


#: NOTE [Callback chains]: how many completions may nest on one thread before the next is
#: deferred to the outermost one (about six Python frames each)
_INLINE_DEPTH = 16


class _ChainState(threading.local):
    """Per thread: how deep completions nest, and the futures whose callbacks wait for the
    outermost completion to run them (NOTE [Callback chains])."""

    def __init__(self) -> None:
        self.depth = 0  #: completions running their callbacks on this thread, nested
        self.deferred: deque[Future[Any]] = deque()  #: futures past the depth, oldest first


_chain = _ChainState()


def _run_callbacks(fut: Future[Any]) -> None:
    """Run the callbacks of ``fut`` (just completed) on this thread: inline, unless
    completions already nest ``_INLINE_DEPTH`` deep here; then the outermost runs them once
    the current ones return (NOTE [Callback chains])."""
    state = _chain
    depth = state.depth
    if depth >= _INLINE_DEPTH:
        state.deferred.append(fut)
        return
    state.depth = depth + 1
    try:
        fut._call_callbacks()
    finally:
        state.depth = depth
    if depth == 0:
        deferred = state.deferred
        while deferred:
            nxt = deferred.popleft()
            state.depth = 1
            try:
                nxt._call_callbacks()
            finally:
                state.depth = 0


def _invoke_all_callbacks(futures: list[Future[Any]]) -> None:
    for f in futures:
        try:
            f._invoke_callbacks()
        except Exception:
            _cf.LOGGER.exception("rrefrt: callbacks of %r failed", f)


def _callback_error(e: BaseException) -> BaseException:
    """What a Future derived with ``then`` fails with when its callback raised ``e``. The
    traceback becomes text: a stored traceback would hold the callback's frames, and through
    them the futures (a cycle keeping their values, RRefs included, alive)."""
    frames = e.__traceback__
    if frames is not None and frames.tb_next is not None:
        frames = frames.tb_next  # from the callback down (not then()'s own frame)
    tb = "".join(traceback.format_tb(frames))
    frames = None
    if isinstance(e, RuntimeError) or not isinstance(e, Exception):
        out = fresh(e)  # a copy: ``e`` may be the error stored on the source Future
        if tb:
            try:
                out.add_note(f"raised in a Future.then() callback:\n{tb}")
            except Exception:
                pass
        return out
    message = f"Got the following error when running the callback: {type(e).__name__}: {e}\n\nAt:\n{tb}"
    err = _rebuild_callback_error(type(e), message, e.with_traceback(None))
    try:
        err.__dict__.update({k: v for k, v in vars(e).items() if k != "__notes__"})
    except Exception:
        pass
    return err


def _raise_copy(exc: BaseException) -> Any:
    """torch's unwrap hook of a failed _TorchFuture: raise a copy (the stored error's own
    traceback must not grow with each reader)."""
    raise fresh(exc)


_torch_cls: Any = None
_NO_DEVICES: list[Any] = []
_torch_cls_lock = threading.Lock()


def _torch_future_class() -> Any:
    """``_TorchFuture`` once torch is imported (built on first use), else None - and None
    while another thread is still importing torch (NOTE [Importing torch from many threads])."""
    cls = _torch_cls
    if cls is not None:
        return cls
    tf = torchimport.loaded_module("torch.futures")
    base = getattr(tf, "Future", None) if tf is not None else None
    if base is None:
        return None
    return _build_torch_class(base)


def _build_torch_class(base: Any) -> Any:
    global _torch_cls
    with _torch_cls_lock:
        if _torch_cls is not None:
            return _torch_cls
        c_future = base.__mro__[1]  # torch._C.Future

        class _TorchFuture(Future, base):  # type: ignore[misc, valid-type]
            """An rrefrt.Future that is also a torch.futures.Future (NOTE [torch interop])."""

            _torch_side = True

            def __init__(self, *, devices: Any = None) -> None:
                Future.__init__(self)
                if devices is None:  # what torch.futures.Future.__init__ does, minus a frame
                    c_future.__init__(self, _NO_DEVICES)
                else:
                    base.__init__(self, devices=devices)

            def _invoke_callbacks(self) -> None:
                self._mark_torch()
                super()._invoke_callbacks()

            def _mark_torch(self) -> None:
                """Complete the C++ side, once (NOTE [torch interop])."""
                with self._lock:
                    if self._torch_marked:
                        return
                    self._torch_marked = True
                try:
                    if self.cancelled():
                        exc: BaseException | None = concurrent.futures.CancelledError("the Future was cancelled")
                    else:
                        exc = self.exception(0)  # decodes a lazy result
                    if exc is None:
                        c_future.set_result(self, self._result)
                    else:  # a copy without traceback: the C++ side holds it where gc cannot
                        # see, and the traceback's frames may hold this future (an
                        # uncollectable cycle, keeping RRefs alive)
                        c_future._set_unwrap_func(self, _raise_copy)
                        c_future.set_result(self, fresh(exc))
                except Exception:
                    _cf.LOGGER.exception("rrefrt: completing the torch side of %r failed", self)

        _TorchFuture.__module__ = __name__
        _TorchFuture.__qualname__ = "_TorchFuture"
        _hook_torch_readers(sys.modules.get("torch._C"))
        _torch_cls = _TorchFuture
        return _TorchFuture


def _want_torch_side(futures: Iterable[Any]) -> None:
    """torch is about to read the C++ side of these futures (NOTE [torch interop]): complete
    it now for those done, on completion for the others. Runs on the caller's thread."""
    for f in futures:
        if getattr(f, "_torch_side", False) is not True or not isinstance(f, Future):
            continue
        with f._lock:
            f._torch_wanted = True
            done = f._state in _DONE
        if done:
            f._mark_torch()  # type: ignore[attr-defined]


def _hook_torch_readers(torch_c: Any) -> None:
    """Wrap torch's C++ readers of a future's state so they ask for the C++ side first."""
    if torch_c is None:
        return
    collect = getattr(torch_c, "_collect_all", None)
    if collect is not None and not getattr(collect, "_rrefrt_wants", False):
        def _collect_all(futures: Any, _orig: Any = collect) -> Any:
            futures = list(futures)
            _want_torch_side(futures)
            return _orig(futures)

        _collect_all._rrefrt_wants = True  # type: ignore[attr-defined]
        torch_c._collect_all = _collect_all
    wait = getattr(torch_c, "wait", None)
    if wait is not None and not getattr(wait, "_rrefrt_wants", False):
        def _wait(future: Any, _orig: Any = wait) -> Any:
            _want_torch_side((future,))
            return _orig(future)

        _wait._rrefrt_wants = True  # type: ignore[attr-defined]
        torch_c.wait = _wait


def _wait_one(f: Any, timeout: float | None) -> Any:
    if isinstance(f, concurrent.futures.Future):
        return f.result(timeout)
    return f.wait()  # a torch future


def wait_all(futures: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Wait for every future (rrefrt's, stdlib or torch's); return their values, or raise
    the first error in list order."""
    futs = list(futures)
    return [_wait_one(f, timeout) for f in futs]


def collect_all(futures: Iterable[Any]) -> Future[list[Any]]:
    """A Future completed with the list of ``futures`` once all of them are done, failed
    ones included."""
    futs = list(futures)
    out: Future[list[Any]] = Future()
    if not futs:
        out.set_result([])
        return out
    remaining = [len(futs)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(futs)

    for f in futs:
        f.add_done_callback(one_done)
    return out
