"""``RRef``: the Python object users hold, on the owner (an OwnerRRef) or elsewhere (a
UserRRef), and its proxies ``rref.rpc_sync().method(...)`` etc.

Owns: the user-facing behaviour of a reference. The protocol state lives in the RRef
context; an RRef object only points at its record. The runtime is reached through
``state.current()`` and, for an object, through the ``RRefHost`` that made it.

NOTE [Proxies]: ``rref.rpc_sync().m(...)`` runs ``_invoke_on_owner`` on the owner. It is
itself an ``@async_execution`` function: an ``@async_execution`` method's Future is handed
to the runtime as is (the reply goes when it completes; nothing pickles it), and a plain
method's result is wrapped in a completed Future. A method that does not exist raises
AttributeError (``remote()`` checks the type first, as torch does, since it returns an
RRef at once: the type is fetched from the owner once per RRef object and cached).

``__del__`` never sends and never blocks: it enqueues the drop for the runtime's control
thread (a SimpleQueue put is safe from any thread and from inside the garbage collector),
and in a forked child it does nothing at all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
import weakref
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from rrefrt import arguments, state
from rrefrt.payload import torchimport
from rrefrt import hooks as _autograd
from rrefrt.errors import OwnerDiedError, RpcError, RpcTimeoutError, SerializationError, ShutdownError, fresh
from rrefrt.functions import is_async_execution, is_future, wrong_return_type
from rrefrt.profiling import active as profiling_active, profiled_call, profiling_future
from rrefrt.futures import Future
from rrefrt.pool import current_pool
from rrefrt.options import RpcBackendOptions, WorkerInfo
from rrefrt.pool import WorkerPool
from rrefrt.protocol.audit import site_text
from rrefrt.protocol.context import READY, OwnerRecord, RRefContext, UserRecord
from rrefrt.protocol.ids import ForkId, GloballyUniqueId

__all__ = ["RRef", "RRefHost"]

T = TypeVar("T")


class RRefHost(Protocol):
    """The runtime an RRef object belongs to, as the object uses it (implemented by
    rrefrt/runtime/root.py's ``Runtime``, which creates the objects; this module never
    imports the runtime)."""

    pid: int
    info: WorkerInfo
    options: RpcBackendOptions
    ctx: RRefContext
    closed: bool
    callbacks: WorkerPool

    def worker_info(self, to: Any = None) -> WorkerInfo: ...
    def rpc_sync(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any: ...
    def rpc_async(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]: ...
    def remote(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> "RRef[Any]": ...
    def fetch(self, rref: "RRef[Any]", timeout: float, waited: bool = False) -> Future[Any]: ...
    def owner_value(self, rec: OwnerRecord, timeout: float) -> Any: ...
    def enqueue_drop(self, fork_id: ForkId) -> None: ...
    def register_users(self, recs: list[Any]) -> None: ...


def _torch_fork_str(rid: GloballyUniqueId, fid: GloballyUniqueId) -> str:
    """torch's text for a user's fork id. remote()'s user keeps the RRef id as its fork id
    in rrefrt; torch gives it the next id, which rrefrt leaves unused for this
    (RRefContext.new_remote_user)."""
    return (GloballyUniqueId(rid.worker, rid.local + 1) if fid == rid else fid).torch_str()

class RRef(Generic[T]):
    """A reference to a value that lives on one worker (its owner)."""

    _rrefrt_is_rref = True
    __slots__ = ("_rt", "_owner_rec", "_user_rec", "_pid", "_type_fut", "_creation_fut", "_creation", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        rt: RRefHost = state.current()
        self._rt = rt
        self._pid = rt.pid
        self._user_rec: UserRecord | None = None
        self._owner_rec: OwnerRecord | None = rt.ctx.new_local_owner(value, type(value).__qualname__)
        self._type_fut: Future[type] | None = None  #: _get_type(), cached once it succeeded
        self._creation_fut: Future[None] | None = None  #: _get_future(), cached

    @classmethod
    def _from_owner(cls, rt: RRefHost, rec: OwnerRecord) -> "RRef[Any]":
        self = cls.__new__(cls)
        self._rt, self._pid, self._owner_rec, self._user_rec = rt, rt.pid, rec, None
        self._type_fut = self._creation_fut = None
        return self

    @classmethod
    def _from_user(cls, rt: RRefHost, rec: UserRecord) -> "RRef[Any]":
        self = cls.__new__(cls)
        self._rt, self._pid, self._owner_rec, self._user_rec = rt, rt.pid, None, rec
        self._type_fut = self._creation_fut = None
        #: creation.Creation of a remote() made here (its answer, a plain value), else None
        self._creation = None
        return self

    # ------------------------------------------------------------------ identity
    def is_owner(self) -> bool:
        return self._owner_rec is not None

    def owner(self) -> Any:
        return self._rt.worker_info(self._owner_id())

    def owner_name(self) -> str:
        return self.owner().name

    def _owner_id(self) -> int:
        return self._rt.info.id if self._owner_rec is not None else self._user_rec.owner  # type: ignore[union-attr]

    def _ids(self) -> tuple[Any, Any]:
        if self._owner_rec is not None:
            return self._owner_rec.rref_id, self._owner_rec.rref_id
        return self._user_rec.rref_id, self._user_rec.fork_id  # type: ignore[union-attr]

    def confirmed_by_owner(self) -> bool:
        """True on the owner; on a user once the owner has registered this fork. A fork
        received from another user (an argument, say) may still be pending when the
        function starts (NOTE [Early run] in docs/protocol.md): then this waits for the
        owner's ack, bounded by ``rpc_timeout`` (a waiting pool thread counts as blocked), so
        inside the function it is True, as in torch, whose callee waits before running. A
        remote() creation is not waited for (False until the owner answers, as in torch)."""
        if self._owner_rec is not None:
            return True
        rec = self._user_rec
        if rec is None:
            return False
        if not rec.confirmed and rec.fork_id != rec.rref_id and rec.error is None and self._pid == state.pid:
            rt = self._rt
            if not rt.closed:
                wait_received_confirmed([self], time.monotonic() + rt.options.rpc_timeout)
        return rec.confirmed and not rec.given_up

    def __repr__(self) -> str:
        rid, fid = self._ids()
        kind = "OwnerRRef" if self._owner_rec is not None else "UserRRef"
        try:
            owner = self.owner_name()
        except Exception:
            owner = f"worker {self._owner_id()}"
        return f"{kind}(owner={owner}, rref_id={rid}, fork_id={fid})"

    def __str__(self) -> str:
        """torch's text (``OwnerRRef(GloballyUniqueId(...))``, ``UserRRef(RRefId = ..., ForkId = ...)``);
        ``repr`` gives rrefrt's, with the owner's name."""
        rid, fid = self._ids()
        if self._owner_rec is not None:
            return f"OwnerRRef({rid.torch_str()})"
        return f"UserRRef(RRefId = {rid.torch_str()}, ForkId = {_torch_fork_str(rid, fid)})"

    def __class_getitem__(cls, item: Any) -> Any:
        """``RRef[T]`` in annotations. Python does not check annotations: it is the class
        itself, except where torch is loaded, where it is torch's ``RRef[T]``, the one RRef
        type TorchScript knows. A module that compiles a TorchScript function annotated
        ``RRef[T]`` (torch's own test files do, at import) must still import; TorchScript
        would otherwise try to compile this class. rrefrt does not run TorchScript calls: such
        a function sent over RPC fails at the call site with ``SerializationError``."""
        api = torchimport.loaded_module("torch.distributed.rpc.api")
        torch_rref = getattr(api, "RRef", None) if api is not None else None
        return cls if torch_rref is None else torch_rref[item]

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass with this RRef's value (a scalar tensor) as its root. With
        ``dist_autograd_ctx_id``, a distributed backward of that context (rrefrt.autograd),
        run from the owner: read the gradients with ``rrefrt.autograd.get_gradients``. With
        -1 (the default), a local ``value.backward(retain_graph)``; only the owner may do that."""
        _autograd.rref_backward(self, dist_autograd_ctx_id, retain_graph)

    def __reduce__(self) -> Any:
        raise RpcError(
            f"Can not pickle rref in python pickler, rref can only be pickled when using RPC: {self!r} can only "
            "be sent as an argument or result of an rrefrt call (rpc_sync/rpc_async/remote), not pickled directly"
        )

    # ------------------------------------------------------------------ values
    def _check(self) -> None:
        if self._pid != state.pid:
            raise ShutdownError("this RRef was inherited through fork(); it cannot be used in the child")
        rec = self._user_rec
        if rec is not None:
            if rec.closed_by_shutdown:
                # torch's phrase (its programs match on it), then ours
                raise ShutdownError(
                    f"User RRef was deleted. Cannot call to_here() on it after deletion. {self!r} was "
                    "deleted by rrefrt.shutdown(): an RRef cannot be used once its worker has left"
                )
            if rec.error is not None:
                if isinstance(rec.error, OwnerDiedError):  # name the RRef and its owner
                    site = f" (created at {site_text(rec.site)})" if rec.site else ""
                    raise OwnerDiedError(f"{self!r}{site} cannot be used: {rec.error}")
                raise fresh(rec.error)
            if not rec.confirmed and rec.creation_deadline is not None and time.monotonic() > rec.creation_deadline:
                _creation_timed_out(self, rec)
                raise fresh(rec.error)  # type: ignore[arg-type]
        if self._rt is not state.current_or_none():
            raise ShutdownError(f"{self!r} belongs to an RPC group that was shut down")

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        self._check()
        if self._owner_rec is None:
            rid, fid = self._ids()
            raise RpcError(
                f"For UserRRef(rref_id={rid.torch_str()}, fork_id={_torch_fork_str(rid, fid)}), can't call localValue() on user "
                f"{self._rt.info!r}. Call it on owner {self.owner()!r}: local_value() can only be called on "
                f"the owner of the RRef ({self!r}); use to_here() for a copy"
            )
        return self._rt.owner_value(self._owner_rec, self._rt.options.rpc_timeout)

    def to_here(self, timeout: float = -1.0) -> T:
        """A copy of the value (on the owner: the value object itself)."""
        self._check()
        if self._owner_rec is not None:
            return self._rt.owner_value(self._owner_rec, self._rt.timeout(timeout))
        if _autograd.active():  # inside a distributed autograd context: record the transfer
            return _autograd.traced_call("rpc_sync", self._rt.rpc_sync, self._owner_id(), _autograd.fetch_value, (self,), None, timeout)
        return self._rt.fetch(self, timeout, waited=True).result()

    def to_here_async(self, timeout: float = -1.0) -> Future[T]:
        """A Future of the value; ``await rref.to_here_async()`` in asyncio."""
        self._check()
        if self._owner_rec is not None:
            t = self._rt.timeout(timeout)
            fut: Future[T] = Future()
            rt, rec = self._rt, self._owner_rec
            rt.callbacks.submit(_complete_with, fut, lambda: rt.owner_value(rec, t))
            return fut
        return self._rt.fetch(self, timeout)

    # ------------------------------------------------------------------ torch's helpers
    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The type of the value (fetched from the owner once, then cached), or with
        ``blocking=False`` a Future of it (the same Future on every call once cached)."""
        fut = self._type_fut
        if fut is None or (fut.done() and fut.exception() is not None):
            try:
                self._check()
                if self._owner_rec is not None:
                    fut = self._owner_future(timeout, lambda v: type(v))
                else:
                    call = self._rt.rpc_async
                    if profiling_active():  # torch shows this call in its profiler
                        call = functools.partial(profiled_call, "async", call)
                    fut = call(self._owner_id(), _rref_typeof_on_owner, (self,), None, timeout)
            except Exception as e:
                if blocking:
                    raise
                fut = Future()
                fut.set_exception(e)
                return fut
            self._type_fut = fut
            fut.add_done_callback(functools.partial(_forget_failed_type, weakref.ref(self)))
        if not blocking:
            return fut
        try:
            return fut.wait()
        except BaseException:  # NOTE [No cycle through a raised error] (futures.py)
            if self._type_fut is fut:
                self._type_fut = None  # a failure is not cached (the next call fetches again)
            fut = self = None  # type: ignore[assignment]
            raise

    def _get_future(self) -> Future[None]:
        """A Future completed (with None) when the owner has created the value - or failed
        with the creation's error or timeout. The same Future on every call."""
        fut = self._creation_fut
        if fut is not None:
            return fut
        rec = self._user_rec
        try:
            self._check()
            if self._owner_rec is not None:
                fut = self._owner_future(-1.0, lambda v: None)
            elif rec is not None and rec.confirmed:
                fut = Future()
                fut.set_result(None)
            else:
                t = -1.0
                if rec is not None and rec.creation_deadline is not None:
                    t = max(0.001, rec.creation_deadline - time.monotonic())
                fut = self._rt.rpc_async(self._owner_id(), _rref_created_on_owner, (self,), None, t)
                if rec is not None and rec.creation_deadline is not None:
                    fut.add_done_callback(lambda f, r=rec, me=self: _late_creation(f, me, r))
        except Exception as e:
            fut = Future()
            fut.set_exception(e)
        self._creation_fut = fut
        return fut

    def _get_profiling_future(self) -> Future[None]:
        """torch's profiling hook: for an RRef made by ``remote()`` inside torch's legacy
        profiler, a Future completed once the owner's profiling events are in the caller's
        profile (NOTE [RPC profiling]); otherwise ``_get_future()``."""
        fut = profiling_future(self)
        return fut if fut is not None else self._get_future()

    def _owner_future(self, timeout: float, convert: Any) -> Future[Any]:
        rt, rec = self._rt, self._owner_rec
        assert rec is not None
        fut: Future[Any] = Future()
        if rec.state == READY:
            fut.set_result(convert(rec.value))
            return fut
        t = rt.timeout(timeout)
        rt.callbacks.submit(_complete_with, fut, lambda: convert(rt.owner_value(rec, t)))
        return fut

    # ------------------------------------------------------------------ proxies
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        arguments.call_timeout(timeout)  # a bad timeout fails here, not at the method call
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        arguments.call_timeout(timeout)
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        arguments.call_timeout(timeout)
        return _Proxy(self, "remote", timeout)

    def __del__(self) -> None:
        rec = getattr(self, "_user_rec", None)
        if rec is None or self._pid != state.pid:
            return
        try:
            self._rt.enqueue_drop(rec.fork_id)
        except Exception:
            pass


def _forget_failed_type(me: "weakref.ref[RRef[Any]]", fut: Future[Any]) -> None:
    """A failed type fetch leaves the RRef's cache: its error's traceback may hold frames
    that hold the RRef (``_check_method``'s), a cycle through ``_type_fut`` that only gc
    would free (NOTE [No cycle through a raised error], futures.py)."""
    rref = me()
    if rref is not None and rref._type_fut is fut and (fut.cancelled() or fut.exception() is not None):
        rref._type_fut = None


def _creation_timed_out(rref: RRef[Any], rec: UserRecord) -> None:
    """remote(timeout=...) ran late: the RRef fails on every later use, also once the value
    exists (torch's rule; API.md). Kept on the record like a creation error."""
    if rec.error is None:
        rec.error = RpcTimeoutError(
            f"RRef creation timed out: the creation of {rref!r} on its owner did not finish within the "
            "timeout given to remote(); the RRef cannot be used"
        )


def _late_creation(fut: Future[None], rref: RRef[Any], rec: UserRecord) -> None:
    """_get_future()'s call timed out while the creation was unconfirmed: that is a late
    creation."""
    if isinstance(fut.exception(), RpcTimeoutError) and not rec.confirmed:
        _creation_timed_out(rref, rec)


def _complete_with(fut: Future[Any], fn: Any) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:
        fut.set_exception(e)


def _invoke_on_owner(rref: RRef[Any], name: str, args: tuple, kwargs: dict) -> Any:
    """Runs on the owner: a method of the referenced object (NOTE [Proxies]). Returns a
    Future: the method's own if it is ``@async_execution``, else one holding its result."""
    method = getattr(rref.local_value(), name)
    if is_async_execution(method):
        result = method(*args, **kwargs)
        if not is_future(result):  # rrefrt's decorator checked already; torch's does not
            raise wrong_return_type(method, result)
        return result
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result(method(*args, **kwargs))
    return done


_invoke_on_owner._rrefrt_async_execution = True  # type: ignore[attr-defined]


def _rref_typeof_on_owner(rref: RRef[Any]) -> type:
    """Runs on the owner: ``RRef._get_type`` (torch's name, which its profiler shows)."""
    return type(rref.local_value())


def _rref_created_on_owner(rref: RRef[Any]) -> None:
    """Runs on the owner: returns once the value exists (``RRef._get_future``)."""
    rref.local_value()


def wait_received_confirmed(rrefs: Sequence[RRef[Any]], deadline: float) -> bool:
    """Wait until every UserRRef in ``rrefs`` is confirmed by its owner (a fork from another
    user is confirmed one round trip to the owner after it arrived): what
    ``confirmed_by_owner()`` does for a received fork (NOTE [Early run] in docs/protocol.md;
    the callee no longer waits before running a function). A fork not yet registered with
    its owner (NOTE [Lazy registration] in docs/protocol.md) is registered first: nothing
    else would confirm it. Bounded by ``deadline``; a fork that fails (owner death, retries
    exhausted) ends the wait too. A pool thread waiting here counts as blocked (NOTE
    [Blocked pool threads]). Returns False at the deadline."""
    recs = [r._user_rec for r in rrefs if r._user_rec is not None and not r._user_rec.confirmed]
    if not recs:
        return True
    rt = rrefs[0]._rt
    ctx = rt.ctx
    lazy = [r for r in recs if not r.registered and r.fork_id != r.rref_id and r.error is None]
    if lazy and not rt.closed:
        rt.register_users(lazy)
    pool = current_pool()
    with pool.blocking() if pool is not None else contextlib.nullcontext():
        with ctx._changed:  # notified on every confirmation and failure
            while any(not r.confirmed and r.error is None for r in recs):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ctx._changed.wait(left)
    return True


class _Proxy:
    __slots__ = ("_rref", "_how", "_timeout")

    def __init__(self, rref: RRef[Any], how: str, timeout: float) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # copy/pickle probes, not methods
            raise AttributeError(name)
        rref, how, timeout = self._rref, self._how, self._timeout
        rref._check()

        def call(*args: Any, **kwargs: Any) -> Any:
            if how == "remote":  # an RRef comes back at once: check the method exists first
                _check_method(rref, name, timeout)
            fn = getattr(rref._rt, how)
            if _autograd.active():  # inside a distributed autograd context: record the call
                return _autograd.traced_call(how, fn, rref._owner_id(), _invoke_on_owner, (rref, name, args, kwargs), None, timeout)
            if profiling_active():  # inside torch's legacy profiler: recorded as torch records proxy calls
                mode = {"rpc_sync": "sync", "rpc_async": "async", "remote": "remote"}[how]
                return profiled_call(mode, fn, rref._owner_id(), _invoke_on_owner, (rref, name, args, kwargs), None, timeout)
            return fn(rref._owner_id(), _invoke_on_owner, (rref, name, args, kwargs), None, timeout)

        return call


def _check_method(rref: RRef[Any], name: str, timeout: float) -> None:
    try:
        rtype = rref._get_type(timeout)
    except SerializationError:  # the type cannot be rebuilt here: the owner will tell
        return
    if not hasattr(rtype, name):
        raise AttributeError(f"type object {rtype.__name__!r} has no attribute {name!r} (the value of {rref!r})")
