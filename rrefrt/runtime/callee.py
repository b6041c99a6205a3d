"""The callee side: running peers' calls (user functions) and answering them.

Owns: the arrival of PYTHON_CALL and PYTHON_REMOTE (deduplication, hand-off to the user
pool), the execution of user functions (plain, ``@async_execution``, ``async def`` on the
event loop thread), their answers, and serving fetches (pickling a value). Answers leave
through the replies (rrefrt/runtime/replies.py); payloads and forks are the payloads'.
The calls running here are in ``core.inflight`` (rrefrt/runtime/inflight.py): arrival,
start, answer; a CALL_STACK_QUERY about one is answered on the transport thread
(``on_stack_query``).

Threads: ``on_python_call`` / ``on_remote_request`` / ``on_fetch`` run on the transport
thread and never unpickle; ``run_call`` runs on the user pool; ``serve_fetch`` on the
callback pool, on the pool thread that set the value, or on the transport thread (a plain
value, no user code) (see the home-thread table in rrefrt/runtime/control.py); ``async def``
functions on the event loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import traceback
from typing import Any, Callable, Sequence

import rrefrt_transport as transport
from rrefrt.payload import serialization as ser
from rrefrt import state, userlog
from rrefrt.payload.devices import NO_SCOPE
from rrefrt.errors import OperatorSchemaError, RemoteSerializationError, SerializationError, ShutdownError
from rrefrt.functions import is_async_execution, when_future_done
from rrefrt.pool import PoolExhaustedError
from rrefrt.protocol.messages import ERROR, OK, Fetch, PythonCall, RemoteRequest, ServeFetch, StackQuery
from rrefrt.protocol.context import FAILED, READY, OwnerRecord
from rrefrt.protocol.recent import RecentIds
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.creation import CreationTracker
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads
from rrefrt.runtime.replies import Replies
from rrefrt.runtime.inflight import TAG_MASK, WAITING, creation_key

log = logging.getLogger("rrefrt")
#: a user function's exception, reported on the worker that ran it (rrefrt/userlog.py);
#: ``logging.getLogger("rrefrt.callee").setLevel(logging.ERROR)`` silences it
_user_log = logging.getLogger("rrefrt.callee")

#: the longest text of a user function's error that this worker's log shows (its caller gets it whole)
LOG_TEXT_MAX = 8192


def _cut(text: str) -> str:
    if len(text) <= LOG_TEXT_MAX:
        return text
    half = LOG_TEXT_MAX // 2
    return f"{text[:half]} ... [{len(text) - 2 * half} characters left out] ... {text[-half:]}"


#: at most this many PYTHON_CALL ids per peer are remembered to drop duplicates, each for
#: ``recent.HORIZON_S`` at least or half this many later calls (NOTE [Bounded memory of
#: finished things] in rrefrt/protocol/recent.py)
SEEN_CALLS = 65536

#: a fetched str/bytes value up to this size is pickled on the thread that read the fetch
INLINE_FETCH_BYTES = 64 * 1024
#: types whose pickling runs no user code (their subclasses may: ``type(v) in`` only)
_PLAIN = frozenset({type(None), bool, int, float, complex})
_PLAIN_SIZED = frozenset({str, bytes})

Done = Callable[[Any, "BaseException | None"], None]


class Callee:
    def __init__(self, core: WorkerCore, control: ControlLoop, lifecycle: Lifecycle, payloads: Payloads,
                 replies: Replies, creation: CreationTracker) -> None:
        self.core = core
        self.control = control
        self.lifecycle = lifecycle
        self.payloads = payloads
        self.replies = replies
        self.creation = creation
        #: src -> recent PYTHON_CALL ids of that peer, to drop duplicates (transport thread)
        self._seen_calls: dict[int, RecentIds] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    # ------------------------------------------------------------------ arrival (transport thread)
    def on_python_call(self, src: int, msg_id: int, msg: PythonCall, frames: Sequence[Any]) -> None:
        if msg.deletes:  # NOTE [Piggybacked deletes] in docs/protocol.md: before the call
            self.control.perform(self.core.ctx.on_user_deletes(msg.deletes))
        if self._seen_before(src, msg_id):
            self.core.stats["duplicate_calls_dropped"] += 1
            return
        self._start(src, msg, msg_id, frames, None)

    def on_remote_request(self, src: int, msg_id: int, msg: RemoteRequest, frames: Sequence[Any]) -> None:
        if msg.deletes:  # NOTE [Piggybacked deletes]: before the creation; idempotent (retries)
            self.control.perform(self.core.ctx.on_user_deletes(msg.deletes))
        rec = self.creation.on_request(src, msg_id, msg)
        if rec is not None:  # not a duplicate; the answer goes through the creation tracker
            self._start(src, msg, 0, frames, rec)

    def _start(self, src: int, msg: PythonCall | RemoteRequest, msg_id: int, frames: Sequence[Any],
               rec: OwnerRecord | None) -> None:
        core = self.core
        rrefs = self.payloads.rrefs_from_forks(msg.forks, src, lazy=isinstance(msg, PythonCall))
        if not core.accepting:
            err = ShutdownError(f"worker {core.info.name!r} is shutting down and accepts no new calls")
            self.finish(src, msg, msg_id, rec, None, err)
            return
        self.lifecycle.track_call(+1, src)
        core.inflight.arrived((src, msg_id) if rec is None else creation_key(rec.rref_id), src)
        call = (src, msg, msg_id, frames, rrefs, rec)
        self._submit(call)

    def _submit(self, call: tuple) -> None:
        core = self.core
        try:
            core.pool.submit(self.run_call, *call, reject_when_exhausted=True)
        except PoolExhaustedError as e:  # the hard cap of the compensating pool: fail this call, typed
            src, msg, msg_id, _frames, _rrefs, rec = call
            self.lifecycle.track_call(-1, src)
            core.inflight.finished((src, msg_id) if rec is None else creation_key(rec.rref_id))
            self.finish(src, msg, msg_id, rec, None, e)
        except RuntimeError as e:  # a stopped pool (at close)
            src, msg, msg_id, _frames, _rrefs, rec = call
            self.lifecycle.track_call(-1, src)
            core.inflight.finished((src, msg_id) if rec is None else creation_key(rec.rref_id))
            self.finish(src, msg, msg_id, rec, None, ShutdownError(f"worker {core.info.name!r} is shutting down ({e})"))

    def _seen_before(self, src: int, msg_id: int) -> bool:
        """A PYTHON_CALL delivered twice must not run twice."""
        seen = self._seen_calls.get(src)
        if seen is None:
            seen = self._seen_calls[src] = RecentIds(limit=SEEN_CALLS // 2)
        if msg_id in seen:
            return True
        seen.add(msg_id)
        return False

    # ------------------------------------------------------------------ execution (user pool)
    def run_call(self, src: int, msg: Any, msg_id: int, frames: Sequence[Any], rrefs: list[Any],
                 rec: OwnerRecord | None) -> None:
        core = self.core
        #: NOTE [Device maps] in rrefrt/payload/devices.py: the function runs with this worker's device
        #: current, on a pooled stream that waits for the arriving tensors; its result's
        #: tensors are recorded so the caller never sees unfinished values (NO_SCOPE without CUDA)
        scope = core.devices.scope() if core.devices is not None else NO_SCOPE
        lazy = self.payloads.unregistered(rrefs) if isinstance(msg, PythonCall) else []
        # handed over, emptied: neither this frame nor the pool's task keeps the RRefs alive
        call = [frames, list(rrefs)]
        rrefs.clear()
        del frames, rrefs
        try:
            self._run_call(src, msg, msg_id, call, rec, scope)
        finally:
            # NOTE [Lazy registration] in docs/protocol.md: the call's frames have returned;
            # a received fork whose RRef object survives them registers now
            if lazy:
                self.payloads.register_survivors(lazy)

    def _run_call(self, src: int, msg: Any, msg_id: int, call: list[Any], rec: OwnerRecord | None,
                  scope: Any) -> None:
        core = self.core
        frames, rrefs = call
        call.clear()
        key = (src, msg_id) if rec is None else creation_key(rec.rref_id)
        entry = core.inflight.started(key, src)  # its stack can be asked for from now on

        def done(value: Any, exc: BaseException | None) -> None:
            try:
                if exc is None:
                    value = scope.finish(value)
                self.finish(src, msg, msg_id, rec, value, exc)
            finally:
                core.inflight.finished(key)
                self.lifecycle.track_call(-1, src)

        with scope:
            try:
                func, args, kwargs = ser.loads(frames, rrefs)
            except BaseException as e:
                if isinstance(e, SerializationError):  # we lack (or refuse) a class: say so, typed
                    cause = e.__cause__ or e
                    err = RemoteSerializationError(str(e), f"{type(cause).__module__}.{type(cause).__qualname__}", core.info.name)
                    err.__cause__ = e
                    e = err
                done(None, e)
                return
            # a received fork may still await the owner's ack: the function runs now, and
            # confirmed_by_owner() waits for it (NOTE [Early run] in docs/protocol.md)
            del rrefs, frames
            scope.use(args)
            entry[1] = func
            self.invoke(func, args, kwargs, done)
            if key in core.inflight.incoming:  # it returned a future: no thread runs it now
                entry[3] = WAITING

    def invoke(self, func: Any, args: tuple, kwargs: dict, done: Done) -> None:
        try:
            result = func(*args, **kwargs)
        except BaseException as e:
            if isinstance(e, Exception):  # the caller gets it; this worker's log says so too (torch does)
                # texts only: a log record that held ``e`` would keep its frames, and the RRef
                # arguments in them, alive for as long as a handler keeps records (NOTE [Error frames])
                userlog.warn(_user_log, "On worker %r: %s raised %s\n%s", self.core.info.name,
                             getattr(func, "__qualname__", type(func).__name__), _cut(repr(e)),
                             _cut("".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()))
                if type(e) is TypeError and _is_torch_operator(func):
                    e = _schema_error(func, e, self.core.info.name)
            done(None, e)
            return
        if is_async_execution(func):
            when_future_done(result, func, done)
        elif inspect.iscoroutine(result):
            cf = asyncio.run_coroutine_threadsafe(result, self._event_loop())
            cf.add_done_callback(lambda f: self.core.pool.submit(_settle, f, done))
        else:
            done(result, None)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=_run_loop, args=(self.core, loop), name=f"rrefrt-{self.core.info.name}-asyncio", daemon=True)
                t.start()
                self._loop, self._loop_thread = loop, t
            return self._loop

    def stop(self, timeout: float = 2.0) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout)

    # ------------------------------------------------------------------ replies
    def finish(self, src: int, msg: Any, msg_id: int, rec: OwnerRecord | None, value: Any, exc: BaseException | None) -> None:
        try:
            self._finish(src, msg, msg_id, rec, value, exc)
        finally:
            if exc is not None:
                release_frames(exc)

    def _finish(self, src: int, msg: Any, msg_id: int, rec: OwnerRecord | None, value: Any, exc: BaseException | None) -> None:
        core = self.core
        if isinstance(msg, RemoteRequest):
            assert rec is not None
            self.control.perform(core.ctx.set_value(rec, value, exc))
            if src != core.info.id:  # not a remote() to self
                self.creation.finished(rec, src, exc)
            return
        if exc is None:
            try:
                frames, forks = self.payloads.dumps(value, src, reply=True)
                if not self.replies.respond(src, msg_id, [OK, forks], frames, msg):
                    self.payloads.abort_forks(forks)  # never sent (NOTE [Fenced forks] in caller.py)
                return
            except Exception as e:
                exc = e
        self.replies.respond(src, msg_id, [ERROR, []], ser.dumps_error(exc, core.info.name), msg)

    def on_stack_query(self, src: int, msg_id: int, msg: StackQuery, frames: Sequence[Any]) -> None:
        """Transport thread (never the user pool: a full pool still answers): where is the
        call ``msg`` names now (docs/stuck.md)? Reads one thread's stack, no user code."""
        key = (src, msg.call_id | (msg_id & TAG_MASK)) if msg.rref_id is None else creation_key(msg.rref_id)
        try:
            self.core.transport.respond(src, msg_id, self.core.inflight.describe(key), [], "RESPONSE:" + msg.NAME)
        except transport.TransportError:
            log.debug("answer to worker %d's stack query dropped", src)

    def on_fetch(self, src: int, msg_id: int, msg: Fetch, frames: Sequence[Any]) -> None:
        """Transport thread: a fetch. A ready plain value is answered here, another ready one
        on the callback pool; a pending one waits for the value (served by whoever sets it)."""
        sf = self.core.ctx.on_fetch(msg.rref_id, src, msg_id)
        if sf is None or self.serve_fetch_inline(sf):
            return
        # a ready value whose pickling may run user code: on the callback pool
        self.core.callbacks.submit(self.serve_fetch, sf)

    def serve_fetch_inline(self, sf: ServeFetch) -> bool:
        """Answer a fetch on this thread if pickling the value runs no user code (a plain
        value: None, bool, int, float, complex, or str/bytes below ``INLINE_FETCH_BYTES``).
        False: not done, the caller hands it to the callback pool."""
        rec = sf.record
        if rec.state != READY:
            return False
        v = rec.value
        t = type(v)
        if t not in _PLAIN and not (t in _PLAIN_SIZED and len(v) <= INLINE_FETCH_BYTES):
            return False
        self.serve_fetch(sf)
        return True

    def serve_fetch(self, sf: ServeFetch) -> None:
        """Callback pool: answer a fetch with the value (pickling it may run user code)."""
        core, rec = self.core, sf.record
        if rec.state == FAILED:
            self.replies.respond(sf.src, sf.msg_id, [ERROR, []], ser.dumps_error(rec.error, core.info.name), Fetch)
            return
        try:
            frames, forks = self.payloads.dumps(rec.value, sf.src, reply=True)
        except Exception as e:
            self.replies.respond(sf.src, sf.msg_id, [ERROR, []], ser.dumps_error(e, core.info.name), Fetch)
            return
        if not self.replies.respond(sf.src, sf.msg_id, [OK, forks], frames, Fetch):
            self.payloads.abort_forks(forks)  # never sent (NOTE [Fenced forks] in caller.py)


def release_frames(exc: BaseException) -> None:
    """NOTE [Error frames]: once a user function's error is answered (and, for remote(),
    stored), the locals of its finished frames are cleared. A traceback usually sits in a
    reference cycle (a future holds the error, the error's traceback holds the frame of the
    future's ``result``), so without this the RRef arguments in those frames stay alive
    until the garbage collector happens to run - on an idle worker, never - and pin their
    values on the owner (the leaks after a kill: every call to the dead worker failed).
    The traceback text was formatted before; line numbers survive the clearing."""
    seen = 0
    while exc is not None and seen < 16:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1


def _is_torch_operator(func: Any) -> bool:
    """A torch operator bound in C (``torch.add``, ``torch.mm``; not a Python function of torch's)."""
    return type(func).__name__ == "builtin_function_or_method" and getattr(func, "__module__", None) == "torch"


def _schema_error(func: Any, e: TypeError, worker: str) -> OperatorSchemaError:
    """What a torch operator's TypeError for arguments matching none of its schemas becomes
    (``OperatorSchemaError``: torch's RuntimeError phrase and the operator's own text)."""
    err = OperatorSchemaError(f"{OperatorSchemaError.PHRASE}: {e}", "builtins.TypeError", worker)
    err.__cause__ = e
    return err


def _run_loop(core: WorkerCore, loop: asyncio.AbstractEventLoop) -> None:
    with state.bound(core):
        loop.run_forever()



def _settle(f: concurrent.futures.Future, done: Done) -> None:
    try:
        value = f.result()
    except BaseException as e:
        f = None  # type: ignore[assignment]  # NOTE [No cycle through a raised error] (futures.py)
        done(None, e)
        return
    done(value, None)
