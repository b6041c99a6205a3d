"""RPC profiling: calls made under torch's legacy autograd profiler are recorded as torch's
RPC records them.

Owns: the call-site hook (``active``/``profiled_call``, called by the public API), the
callee-side trampoline (``_Profiled``) that runs the function under a profiler and sends
its events back, and the merge of those events into the caller's profile.
torch is imported
inside functions only, through rrefrt/payload/torchimport.py, never at import (``import rrefrt``
stays free of torch); ``active()`` costs a ``sys.modules`` lookup when torch is absent.

NOTE [RPC profiling]: torch records an RPC made inside
``torch.autograd.profiler_legacy.profile()`` (what ``torch.autograd.profiler.profile``
was before kineto; torch does not profile RPC under kineto, neither does rrefrt) as an event
named ``rpc_<sync|async|remote>#<function>(<caller> -> <callee>)`` whose node_id is the
caller's rank, plus the callee's own events (``aten::add``, record_function blocks, nested
RPCs...) named ``<that key>#remote_op: <event>``, with ``is_remote`` set and the callee's rank
as node_id. rrefrt does the same in Python:

- the caller wraps the function in ``_Profiled`` (picklable; it keeps the
  ``@async_execution`` marker), which runs it on the callee under a legacy profiler with the
  caller's ``record_shapes``/``profile_memory`` and returns (value, events, duration) -
  inline for rpc_sync/rpc_async (the caller unwraps it before the user sees the value), by a
  separate call back to the caller for ``remote`` (the value stays on the owner;
  ``RRef._get_profiling_future()`` completes when the events are in).
- at the call, an empty ``record_function`` marker (``rrefrt::profiled_rpc#<n>``) goes into
  the caller's profile: it places the call in that profile's clock and says which profile
  the call belongs to (whatever thread completes it).
- torch's legacy profiler has no Python API to add events, so ``install()`` wraps two
  functions of ``torch.autograd.profiler_legacy`` (``profile._start_trace``, to read the
  profile's options, and ``_parse_legacy_records``, to replace each marker with the call's
  ``FunctionEvent``s before the event tree is built). Both are looked up at call time by
  torch's ``profile.__exit__``. ``install()`` runs at ``init_rpc`` when torch is imported, and
  at the first profiled call; a profile started before it records the calls without shapes
  and memory. If torch moves these functions, ``install()`` logs once and calls are not
  profiled (they still work).
- remote events are placed in the middle of the caller's event (their clocks are the
  callee's); a call not finished when its profile ends is left out. An ``@async_execution``
  function's nested calls finish after the function has returned its Future: the callee
  waits (bounded) for them before it sends its events.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable

from rrefrt import state

from rrefrt.payload import torchimport
from rrefrt.functions import is_async_execution, is_future, when_future_done
from rrefrt.futures import Future

log = logging.getLogger("rrefrt.profiling")

__all__ = ["active", "install", "profiled_call", "profiling_future", "REMOTE_OP"]

#: torch's separator between an RPC's key and the name of a remote event
REMOTE_OP = "#remote_op: "
_MARKER = "rrefrt::profiled_rpc#"
_SPAN = "/span"
#: calls whose events never reached a profile are dropped beyond this many
_MAX_CALLS = 10_000
#: how long a callee waits for the nested calls of an @async_execution function
_NESTED_WAIT = 30.0


class _Local(threading.local):
    suspended = False  #: inside profiled_call: the wrapped call itself is not profiled again
    config: tuple[bool, bool] | None = None  #: (record_shapes, profile_memory) of this thread's profile
    pending: list | None = None  #: unfinished calls of the profile that just ended on this thread


_tls = _Local()
_torch: Any = None  #: torch, once ``torchimport.loaded()`` returned it
_install_lock = threading.Lock()
_installed = False
_ids = itertools.count(1)
_event_ids = itertools.count(1 << 40)
_calls: dict[int, "_Call"] = {}
_calls_lock = threading.Lock()
_rref_futures: "weakref.WeakKeyDictionary[Any, Future[None]]" = weakref.WeakKeyDictionary()


def active() -> bool:
    """True when a call made now on this thread must be profiled: torch's legacy profiler
    is on for this thread (cheap when torch is not imported)."""
    if _tls.suspended:
        return False
    global _torch
    torch = _torch
    if torch is None:  # kept once fully imported (it stays so): one lookup less per call
        torch = _torch = torchimport.loaded()
        if torch is None:
            return False
    try:
        if not torch.autograd._profiler_enabled():
            return False
        return torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY
    except AttributeError:  # torch half-imported, or a torch without these
        return False


def install() -> bool:
    """Hook torch's legacy profiler (see NOTE [RPC profiling]) once; False without torch.
    torch imported by another thread right now: waits for that import to finish, then hooks
    (NOTE [Importing torch from many threads]: never a torch submodule beside it)."""
    global _installed
    if _installed:
        return True
    if not torchimport.started():  # neither imported nor being imported: nothing to hook
        return False
    try:
        pl: Any = torchimport.import_module("torch.autograd.profiler_legacy")
    except ImportError as e:
        pl = e
    with _install_lock:
        if _installed:
            return True
        _installed = True
        try:
            if isinstance(pl, ImportError):
                raise pl
            orig_start = pl.profile._start_trace
            orig_parse = pl._parse_legacy_records
        except (ImportError, AttributeError) as e:
            log.debug("rrefrt cannot record RPC calls in torch's profiler (this torch lacks %s)", e)
            return False

        def _start_trace(prof: Any) -> Any:  # becomes torch's profile._start_trace
            _tls.config = (bool(getattr(prof, "record_shapes", False)), bool(getattr(prof, "profile_memory", False)))
            return orig_start(prof)

        def _parse_legacy_records(thread_records: Any) -> Any:
            return _merge(orig_parse(thread_records))

        pl.profile._start_trace = _start_trace
        pl._parse_legacy_records = _parse_legacy_records
        return True


class _Call:
    """One profiled call, on its caller: filled in when the reply (or the events) arrive."""

    __slots__ = ("id", "key", "node", "t0", "t1", "events", "callee_us", "done", "future", "end")

    def __init__(self, key: str, node: int) -> None:
        self.id = next(_ids)
        self.key = key
        self.node = node
        self.t0 = time.perf_counter_ns()
        self.t1: int | None = None
        self.events: list[tuple] = []
        self.callee_us = 0.0
        self.done = threading.Event()
        self.future: Future[None] | None = None
        self.end: Any = None  #: a torch Future whose completion ends the call's span

    def finish(self, events: list[tuple] | None, callee_us: float, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.t1 = time.perf_counter_ns()
        self.events = list(events or ())
        self.callee_us = callee_us
        end, self.end = self.end, None
        if end is not None:
            end.set_result(None)
        self.done.set()
        fut = self.future
        if fut is not None and not fut.done():
            try:
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)
            except Exception:  # completed meanwhile by another path
                pass


class _Reply:
    """What ``_Profiled`` returns for rpc_sync/rpc_async: the value and the callee's events."""

    __slots__ = ("value", "events", "us")

    def __init__(self, value: Any, events: list[tuple], us: float) -> None:
        self.value, self.events, self.us = value, events, us

    def __reduce__(self) -> Any:
        return (_Reply, (self.value, self.events, self.us))


def _register(key: str, node: int) -> _Call:
    call = _Call(key, node)
    with _calls_lock:
        _calls[call.id] = call
        while len(_calls) > _MAX_CALLS:
            _calls.pop(next(iter(_calls)))
    return call


def _func_name(func: Any) -> str:
    torch = torchimport.loaded()
    if torch is not None:
        try:
            builtin = torch.jit._builtins._find_builtin(func)
        except Exception:
            builtin = None
        if builtin is not None:
            return str(builtin)
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__qualname__)


def profiled_call(mode: str, api: Callable[..., Any], to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float) -> Any:
    """Make ``api(to, func, args, kwargs, timeout)`` (the public rpc_sync, rpc_async or
    remote: ``mode`` is "sync", "async" or "remote") as a profiled call. The hook at a call
    site is::

        if _profiling.active():
            return _profiling.profiled_call("sync", rpc_sync, to, func, args, kwargs, timeout)
    """
    torch = torchimport.torch_module()
    install()
    rt = state.current()
    me = rt.worker_info(None)
    dst = rt.worker_info(to)
    if not callable(func):
        return _unprofiled(api, to, func, args, kwargs, timeout)
    call = _register(f"rpc_{mode}#{_func_name(func)}({me.name} -> {dst.name})", me.id)
    with torch.autograd.profiler.record_function(f"{_MARKER}{call.id}"):
        pass
    # the call's span in the profile's own clock: ended by torch (with this thread's
    # profiler state) when call.finish() completes call.end
    call.end = torch.futures.Future()
    span = torch.autograd.profiler.record_function(f"{_MARKER}{call.id}{_SPAN}")
    with span:
        span._call_end_callbacks_on_future(call.end)
    shapes, memory = _tls.config or (False, False)
    wrapped = _Profiled(func, shapes, memory, me.name if mode == "remote" else None, call.id)
    if mode == "remote":
        call.future = Future()
    try:
        result = _unprofiled(api, to, wrapped, args, kwargs, timeout)
    except BaseException as e:
        call.finish(None, 0.0, e)
        raise
    if mode == "sync":
        if isinstance(result, _Reply):
            call.finish(result.events, result.us)
            return result.value
        call.finish(None, 0.0)
        return result
    if mode == "async":
        out: Future[Any] = Future()
        result.add_done_callback(lambda f: _settle_async(f, call, out))
        return out
    _rref_futures[result] = call.future
    result._get_future().add_done_callback(lambda f: _creation_done(f, call, rt.timeout(timeout)))
    return result


def _unprofiled(api: Callable[..., Any], to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> Any:
    prev = _tls.suspended
    _tls.suspended = True
    try:
        return api(to, func, args, kwargs, timeout)
    finally:
        _tls.suspended = prev


def _settle_async(f: Any, call: _Call, out: Future[Any]) -> None:
    try:
        reply = f.result()
    except BaseException as e:
        call.finish(None, 0.0, e)
        out.set_exception(e)
        return
    if isinstance(reply, _Reply):
        call.finish(reply.events, reply.us)
        out.set_result(reply.value)
    else:
        call.finish(None, 0.0)
        out.set_result(reply)


def _creation_done(f: Any, call: _Call, timeout: float) -> None:
    """remote(): the owner created the value (or failed). The events come by a separate
    call, normally first; if they are lost, the profiling future completes anyway."""
    try:
        err = f.exception()
    except BaseException as e:
        err = e
    if err is not None:
        call.finish(None, 0.0, err)
        return
    if not call.done.is_set():
        timer = threading.Timer(max(1.0, timeout) if timeout > 0 else 60.0, call.finish, (None, 0.0))
        timer.daemon = True
        timer.start()


def profiling_future(rref: Any) -> Future[None] | None:
    """The Future that completes when a profiled ``remote()``'s events are in, or None."""
    try:
        return _rref_futures.get(rref)
    except TypeError:
        return None


def _deliver(call_id: int, events: list[tuple], us: float) -> None:
    """Runs on the caller of a profiled ``remote()``: the owner's events arrived."""
    with _calls_lock:
        call = _calls.get(call_id)
    if call is not None:
        call.finish(events, us)


# ---------------------------------------------------------------------------- callee side
class _Profiled:
    """The function of a profiled call, as sent: runs it under torch's legacy profiler."""

    def __init__(self, func: Any, shapes: bool, memory: bool, deliver_to: str | None, call_id: int) -> None:
        self.func, self.shapes, self.memory, self.deliver_to, self.call_id = func, shapes, memory, deliver_to, call_id
        if is_async_execution(func):
            self._rrefrt_async_execution = True
        # errors name the user's function, not this wrapper (serialization._describe)
        self.__qualname__ = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        if getattr(func, "qualified_name", None):  # a TorchScript function
            self.qualified_name = func.qualified_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        profile = torchimport.import_module("torch.autograd.profiler_legacy").profile
        install()
        me = state.current().worker_info(None).id
        t0 = time.perf_counter_ns()
        prof = profile(record_shapes=self.shapes, profile_memory=self.memory)
        with prof:
            value = self.func(*args, **kwargs)
        pending = _tls.pending or []
        _tls.pending = None
        events = _export(prof.function_events, me)
        if getattr(self, "_rrefrt_async_execution", False) and is_future(value):
            out: Future[Any] = Future()

            def done(v: Any, e: BaseException | None) -> None:
                if e is not None:
                    out.set_exception(e)
                    return
                for call, start, thread in pending:
                    call.done.wait(_NESTED_WAIT)
                    events.extend(_export(_events_of(call, start, thread), me))
                out.set_result(self._reply(v, events, (time.perf_counter_ns() - t0) / 1000))

            when_future_done(value, self.func, done)
            return out
        return self._reply(value, events, (time.perf_counter_ns() - t0) / 1000)

    def _reply(self, value: Any, events: list[tuple], us: float) -> Any:
        if self.deliver_to is None:
            return _Reply(value, events, us)
        try:
            fut = state.current().rpc_async(self.deliver_to, _deliver, (self.call_id, events, us), None, -1.0)
            fut.add_done_callback(_log_delivery)
        except Exception as e:
            log.warning("could not send profiling events of a remote() call to %s: %s", self.deliver_to, e)
        return value


def _log_delivery(f: Any) -> None:
    try:
        err = f.exception()
    except BaseException as e:
        err = e
    if err is not None:
        log.warning("could not send profiling events of a remote() call: %s", err)


def _export(function_events: Any, me: int) -> list[tuple]:
    """A profile's events as plain tuples for the caller (names unprefixed, times relative
    to the profile's start, node ids: this worker's unless the event came from further on)."""
    out = []
    for fe in function_events:
        if fe.name == "[memory]":
            continue
        node = fe.node_id if fe.is_remote else me
        shapes = [list(s) if isinstance(s, (list, tuple)) else s for s in (fe.input_shapes or [])]
        out.append((fe.name, float(fe.time_range.start), float(fe.time_range.end), int(fe.thread), int(node),
                    shapes, int(fe.cpu_memory_usage or 0), bool(fe.is_async)))
    return out


def _events_of(call: _Call, start: float, thread: int, end: float | None = None) -> list[Any]:
    """The FunctionEvents of a finished call whose marker began at ``start`` (microseconds
    in the profile's clock) on ``thread`` and whose span ended at ``end`` (None: measured
    here): the call's own event and the callee's."""
    FunctionEvent = torchimport.import_module("torch.autograd.profiler_util").FunctionEvent

    dur = ((call.t1 or call.t0) - call.t0) / 1000 if end is None else max(0.0, end - start)
    events = [FunctionEvent(id=next(_event_ids), name=call.key, trace_name=call.key, thread=thread, start_us=start,
                            end_us=start + dur, stack=[], node_id=call.node, is_async=True, is_legacy=True)]
    base = start + max(0.0, (dur - call.callee_us) / 2)
    for name, s, e, th, node, shapes, mem, is_async in call.events:
        full = f"{call.key}{REMOTE_OP}{name}"
        events.append(FunctionEvent(id=next(_event_ids), name=full, trace_name=full, thread=th, start_us=base + s,
                                    end_us=base + e, input_shapes=shapes, stack=[], cpu_memory_usage=mem,
                                    node_id=node, is_async=is_async, is_remote=True, is_legacy=True))
    return events


def _merge(functions: list[Any]) -> list[Any]:
    """torch's parsed events of a profile that just ended, each marker replaced by its
    call's events (unfinished calls go to ``_tls.pending`` for a callee still waiting)."""
    if not any(fe.name.startswith(_MARKER) for fe in functions):
        _tls.pending = None
        return functions
    out, pending = [], []
    ends = {fe.name[: -len(_SPAN)]: float(fe.time_range.end) for fe in functions
            if fe.name.startswith(_MARKER) and fe.name.endswith(_SPAN)}
    for fe in functions:
        if not fe.name.startswith(_MARKER):
            out.append(fe)
            continue
        if fe.name.endswith(_SPAN):
            continue
        with _calls_lock:
            call = _calls.pop(int(fe.name[len(_MARKER):]), None)
        if call is None:
            continue
        if call.done.is_set():
            out.extend(_events_of(call, float(fe.time_range.start), int(fe.thread), ends.get(fe.name)))
        else:
            pending.append((call, float(fe.time_range.start), int(fe.thread)))
    _tls.pending = pending
    out.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    return out
