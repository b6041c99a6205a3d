"""``RRef``: the Python object users hold, on the owner (an OwnerRRef) or elsewhere (a
UserRRef), and its proxies ``rref.rpc_sync().method(...)`` etc.

Owns: the user-facing behaviour of a reference. The protocol state lives in the RRef
context; an RRef object only points at its record. Imports from rrefrt: errors, state,
rref_context, futures. The runtime is reached through ``state.current()``.

``__del__`` never sends and never blocks: it enqueues the drop for the runtime's control
thread (a SimpleQueue put is safe from any thread and from inside the garbage collector),
and in a forked child it does nothing at all.
"""

from __future__ import annotations

import os
import time
from typing import Any, Generic, TypeVar

from . import state
from .autograd import _hooks as _autograd
from .errors import OwnerDiedError, RpcError, RpcTimeoutError, ShutdownError, fresh
from .futures import Future
from .rref_context import OwnerRecord, UserRecord

__all__ = ["RRef"]

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value that lives on one worker (its owner)."""

    _rrefrt_is_rref = True
    __slots__ = ("_rt", "_owner_rec", "_user_rec", "_pid", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        rt = state.current()
        self._rt = rt
        self._pid = rt.pid
        self._user_rec: UserRecord | None = None
        self._owner_rec: OwnerRecord | None = rt.ctx.new_local_owner(value, type(value).__qualname__)

    @classmethod
    def _from_owner(cls, rt: Any, rec: OwnerRecord) -> "RRef[Any]":
        self = cls.__new__(cls)
        self._rt, self._pid, self._owner_rec, self._user_rec = rt, rt.pid, rec, None
        return self

    @classmethod
    def _from_user(cls, rt: Any, rec: UserRecord) -> "RRef[Any]":
        self = cls.__new__(cls)
        self._rt, self._pid, self._owner_rec, self._user_rec = rt, rt.pid, None, rec
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
        return self._owner_rec is not None or bool(self._user_rec and self._user_rec.confirmed)

    def __repr__(self) -> str:
        rid, fid = self._ids()
        kind = "OwnerRRef" if self._owner_rec is not None else "UserRRef"
        try:
            owner = self.owner_name()
        except Exception:
            owner = f"worker {self._owner_id()}"
        return f"{kind}(owner={owner}, rref_id={rid}, fork_id={fid})"

    def __class_getitem__(cls, item: Any) -> Any:  # RRef[int] in annotations
        return cls

    def __reduce__(self) -> Any:
        raise RpcError(
            f"{self!r} can only be sent as an argument or result of an rrefrt call "
            "(rpc_sync/rpc_async/remote), not pickled directly"
        )

    # ------------------------------------------------------------------ values
    def _check(self) -> None:
        if self._pid != os.getpid():
            raise ShutdownError("this RRef was inherited through fork(); it cannot be used in the child")
        rec = self._user_rec
        if rec is not None:
            if rec.closed_by_shutdown:
                raise ShutdownError(f"{self!r} was deleted by rrefrt.shutdown()")
            if rec.error is not None:
                if isinstance(rec.error, OwnerDiedError):  # name the RRef and its owner
                    raise OwnerDiedError(f"{self!r} cannot be used: {rec.error}")
                raise fresh(rec.error)
            if not rec.confirmed and rec.creation_deadline is not None and time.monotonic() > rec.creation_deadline:
                raise RpcTimeoutError(f"the creation of {self!r} on its owner did not finish within its timeout")
        if self._rt is not state.current_or_none():
            raise ShutdownError(f"{self!r} belongs to an RPC group that was shut down")

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        self._check()
        if self._owner_rec is None:
            raise RpcError(
                f"local_value() can only be called on the owner of the RRef: {self!r} is owned by "
                f"{self.owner_name()!r}; use to_here() for a copy"
            )
        return self._rt.owner_value(self._owner_rec, self._rt.options.rpc_timeout)

    def to_here(self, timeout: float = -1.0) -> T:
        """A copy of the value (on the owner: the value object itself)."""
        self._check()
        if self._owner_rec is not None:
            t = self._rt.options.rpc_timeout if timeout is None or timeout < 0 else timeout
            return self._rt.owner_value(self._owner_rec, t)
        if _autograd.active():  # inside a distributed autograd context: record the transfer
            return _autograd.traced_call("rpc_sync", self._rt.rpc_sync, self._owner_id(), _autograd.fetch_value, (self,), None, timeout)
        return self._rt.fetch(self, timeout).result()

    def to_here_async(self, timeout: float = -1.0) -> Future[T]:
        """A Future of the value; ``await rref.to_here_async()`` in asyncio."""
        self._check()
        if self._owner_rec is not None:
            fut: Future[T] = Future()
            t = self._rt.options.rpc_timeout if timeout < 0 else timeout
            rt, rec = self._rt, self._owner_rec
            rt.callbacks.submit(_complete_with, fut, lambda: rt.owner_value(rec, t))
            return fut
        return self._rt.fetch(self, timeout)

    # ------------------------------------------------------------------ proxies
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "remote", timeout)

    def __del__(self) -> None:
        rec = getattr(self, "_user_rec", None)
        if rec is None or self._pid != os.getpid():
            return
        try:
            self._rt.enqueue_drop(rec.fork_id)
        except Exception:
            pass


def _complete_with(fut: Future[Any], fn: Any) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:
        fut.set_exception(e)


def _invoke_on_owner(rref: RRef[Any], name: str, args: tuple, kwargs: dict) -> Any:
    """Runs on the owner: a method of the referenced object."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


class _Proxy:
    __slots__ = ("_rref", "_how", "_timeout")

    def __init__(self, rref: RRef[Any], how: str, timeout: float) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Any:
        rref, how, timeout = self._rref, self._how, self._timeout
        rref._check()

        def call(*args: Any, **kwargs: Any) -> Any:
            fn = getattr(rref._rt, how)
            if _autograd.active():  # inside a distributed autograd context: record the call
                return _autograd.traced_call(how, fn, rref._owner_id(), _invoke_on_owner, (rref, name, args, kwargs), None, timeout)
            return fn(rref._owner_id(), _invoke_on_owner, (rref, name, args, kwargs), None, timeout)

        return call
