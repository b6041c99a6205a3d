"""The caller side: sending calls, remote() creations and fetches, and completing their
futures; the forks carried by messages in both directions.

Owns: ``rpc_async`` / ``rpc_sync`` / ``remote`` / ``fetch`` / ``owner_value``, the
serialization of outgoing payloads with their forks, the decoding of responses, and the
translation of transport errors into rrefrt's error tree (``translate``, the one place).
Imports from rrefrt: errors, futures, messages, rref, rref_context, serialization.

Threads: the public calls run on the user's thread; response callbacks run on the
transport thread, account for forks at once and decode the payload lazily (in the thread
that reads the future, never the transport thread).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Sequence

import transport

from . import serialization as ser
from .errors import (
    ArgumentError,
    OwnerDiedError,
    RpcError,
    RpcTimeoutError,
    SerializationError,
    ShutdownError,
    WorkerUnavailableError,
    fresh,
)
from .creation import UNKNOWN
from .futures import Future
from .messages import ForkData, Fetch, OK, PythonCall, RemoteRequest, Response
from .rref import RRef, _invoke_on_owner
from .rref_context import _NO_VALUE, FAILED, OwnerRecord, creation_site


def translate(err: BaseException, what: str, owner_of: str | None = None) -> BaseException:
    """Transport errors -> rrefrt's error tree (the one place this happens). ``owner_of``
    names the RRef when the destination is its owner (death -> OwnerDiedError)."""
    if isinstance(err, transport.RequestTimeout):
        return RpcTimeoutError(f"{what} timed out after {err.timeout:.3f}s (worker {err.peer!r} did not answer)")
    if isinstance(err, transport.PeerUnavailable) and owner_of is not None:
        return OwnerDiedError(f"{what} failed: the owner of {owner_of} is gone: {err}")
    if isinstance(err, transport.PeerUnavailable):
        return WorkerUnavailableError(f"{what} failed: {err}")
    if isinstance(err, transport.MessageTooLarge):
        return SerializationError(f"{what} failed: {err}")
    if isinstance(err, transport.AgentClosed):
        return ShutdownError(f"{what} failed: {err}")
    return err


class WaitedFuture(Future[Any]):
    """The future of a call whose caller only waits for it (``rpc_sync``, ``to_here``):
    never handed to user code, so it is never a torch future (NOTE [torch interop] in
    rrefrt/futures.py) and its completion costs no callback-pool task: the waiting thread
    decodes the answer itself and nothing else wakes."""


#: the meta of a plain successful answer (status OK, no forks): ``Response.decode`` skipped
_PLAIN_OK = [OK, []]
_NO_RREFS: Any = ()  #: the RRefs of an answer that carried none (read only)


class _Call:
    """One request in flight and its ``on_done`` (the transport calls the object itself, on
    its thread): one object per call where closures cost a cell per captured name.

    ``what`` / ``owner_of``: the texts of an error, built only if one happens (``what``
    defaults to "rpc to <dest> of <func>"). ``before``: run on the answer (or failure),
    before the future completes. ``deletes``: piggybacked deletes, acknowledged by the
    answer (NOTE [Piggybacked deletes])."""

    __slots__ = ("caller", "fut", "dest", "forks", "deletes", "before", "what", "owner_of", "func")

    def __init__(self, caller: "Caller", fut: Future[Any], dest: int, forks: list[Any]) -> None:
        self.caller, self.fut, self.dest, self.forks = caller, fut, dest, forks
        self.deletes: tuple = ()
        self.before: Callable[[], None] | None = None
        self.what: Callable[[], str] | None = None
        self.owner_of: Callable[[], str] | None = None
        self.func: Any = None

    def error(self, err: BaseException) -> BaseException:
        """rrefrt's error for transport error ``err`` (``translate``), with its text."""
        if self.what is not None:
            what = self.what()
        else:
            what = f"rpc to {self.caller.rt.worker_name(self.dest)!r} of {getattr(self.func, '__qualname__', self.func)!r}"
        return translate(err, what, self.owner_of() if self.owner_of is not None else None)

    def __call__(self, m: Any, fr: Sequence[Any], err: Any) -> None:  # transport thread
        caller = self.caller
        try:
            if self.deletes:  # NOTE [Piggybacked deletes]: the answer is their ack
                caller.rt.control.deletes_delivered(self.dest, self.deletes, err)
            if self.before is not None:
                self.before()
            if err is not None:
                if self.forks and isinstance(err, transport.Fenced):
                    # NOTE [Fenced forks]: once fenced, a request fails with Fenced, sent
                    # or not, and every peer is dead to this worker. A fork it registered
                    # for itself (a call to itself, unsent) would pin its value for good:
                    # no death ever drops it. Undoing a fork for a peer is what G3 does
                    # anyway, and undoing one already received here is a no-op. An
                    # answer that was not sent undoes its forks too (Callee.respond).
                    caller.abort_forks(self.forks)
                self.fut._fail(self.error(err))
                return
            caller._complete(self.fut, self.dest, m, fr)
        finally:
            caller.rt.lifecycle.track_outgoing(-1)


class Caller:
    def __init__(self, rt: Any) -> None:
        self.rt = rt

    # ------------------------------------------------------------------ calls (user thread)
    def rpc_async(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0,
                  waited: bool = False) -> Future[Any]:
        rt = self.rt
        rt.check_running()
        dest = rt.worker_info(to).id
        frames, forks = self.dumps_call(func, args, kwargs, dest)
        fut: Future[Any] = WaitedFuture() if waited else Future()
        fut._callback_pool = rt.callbacks
        call = _Call(self, fut, dest, forks)
        call.func = func  # the error's text names it (formatted only if the call fails)
        if func is _invoke_on_owner and args:  # a proxy call: the RRef (only it is kept)
            target = args[0]
            call.owner_of = lambda: repr(target)  # noqa: E731
        deletes = self.flush_drops(dest) if rt.control.drops else ()  # NOTE [Drops]
        call.deletes = deletes
        # the forks are in wire form already (dumps): PythonCall.meta without the round trip
        self._send(call, PythonCall.KIND, PythonCall.NAME, PythonCall.wire_meta(forks, deletes), frames,
                   rt.timeout(timeout))
        return fut

    def rpc_sync(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
        fut = self.rpc_async(to, func, args, kwargs, timeout, waited=True)
        t = self.rt.timeout(timeout)
        try:
            return fut.result(t + 5.0 if t > 0 else None)
        except BaseException:
            fut = None  # type: ignore[assignment]  # NOTE [No cycle through a raised error] (futures.py)
            raise

    def remote(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
        rt = self.rt
        rt.check_running()
        dest = rt.worker_info(to).id
        tname = func.__qualname__ if isinstance(func, type) else "object"
        frames, forks = self.dumps_call(func, args, kwargs, dest)
        fork_data = tuple(ForkData.from_wire(f) for f in forks)
        if dest == rt.info.id:
            rec = rt.ctx.new_local_owner(_NO_VALUE, tname)
            msg = RemoteRequest(dest, rec.rref_id, rec.rref_id, tname, fork_data)
            rrefs = self.rrefs_from_forks(fork_data, dest)
            rt.lifecycle.track_call(+1, dest)
            rt.pool.submit(rt.callee.run_call, dest, msg, 0, frames, rrefs, rec)
            return RRef._from_owner(rt, rec)
        urec = rt.ctx.new_remote_user(dest, tname, rt.timeout(timeout))
        if rt.options.strict_rref_leaks:
            urec.site = creation_site()
        # NOTE [Drops]; NOTE [Piggybacked deletes] in docs/protocol.md
        deletes = self.flush_drops(dest) if rt.control.drops else ()
        msg = RemoteRequest(dest, urec.rref_id, urec.fork_id, tname, fork_data, deletes)
        cell = rt.creation.new(urec.fork_id)
        try:
            rt.creation.send(msg, frames, cell)
        except transport.TransportError as e:
            rt.control.deletes_delivered(dest, deletes, e)
            self.abort_forks(forks)
            rt.control.perform(rt.ctx.on_remote_ret(urec.fork_id, translate(e, "remote()")))
            raise translate(e, "remote()") from None
        rref = RRef._from_user(rt, urec)
        rref._creation = cell  # NOTE [Inline creation values] in rrefrt/creation.py
        return rref

    def fetch(self, rref: RRef[Any], timeout: float, waited: bool = False) -> Future[Any]:
        """``waited``: the caller only waits for the value (``to_here``): a WaitedFuture.
        An RRef created here by remote() may need no fetch: its creation's answer carried
        the value, or will (NOTE [Inline creation values] in rrefrt/creation.py)."""
        rt = self.rt
        rec = rref._user_rec
        assert rec is not None
        t = rt.timeout(timeout)
        if not rec.confirmed and rec.creation_deadline is not None:
            left = rec.creation_deadline - time.monotonic()
            t = max(0.001, min(t, left)) if t > 0 else max(0.001, left)
        fut: Future[Any] = WaitedFuture() if waited else Future()
        fut._callback_pool = rt.callbacks
        cell = rref._creation
        if cell is not None:
            value = cell.value
            if value is not UNKNOWN:  # a plain value, carried by the creation's answer
                fut._finish(value, None)
                return fut
            if cell.waiters is not None and rt.creation.park(cell, rref, fut, t):
                return fut  # released by the creation's first answer
        self.send_fetch(rref, fut, t)
        return fut

    def send_fetch(self, rref: RRef[Any], fut: Future[Any], t: float, flush: bool = True) -> None:
        """Send a FETCH for ``rref`` that completes ``fut``. ``flush=False`` on the transport
        thread (a parked to_here() released by its creation's answer): no drops sent there."""
        rt = self.rt
        rec = rref._user_rec
        assert rec is not None
        forget = None
        if not rec.confirmed:  # fails at once if the creation turns out lost
            rt.creation.add_fetch(rec.fork_id, fut)
            forget = lambda: rt.creation.forget_fetch(rec.fork_id, fut)  # noqa: E731
        msg = Fetch(rec.owner, rec.rref_id, rec.fork_id)
        if flush and rt.control.drops:  # NOTE [Drops]: deletes of dropped RRefs leave first
            self.flush_drops()
        call = _Call(self, fut, msg.dest, [])
        call.what, call.owner_of, call.before = lambda: f"to_here() of {rref!r}", lambda: repr(rref), forget
        self._send(call, msg.KIND, msg.NAME, msg.meta(), [], t)

    def fetch_error(self, rref: RRef[Any], err: BaseException) -> BaseException:
        """The error of a to_here() of ``rref`` that failed with transport error ``err``."""
        return translate(err, f"to_here() of {rref!r}", repr(rref))

    def owner_value(self, rec: OwnerRecord, timeout: float) -> Any:
        rt = self.rt
        deadline = time.monotonic() + (timeout if timeout > 0 else 1e9)
        if not rt.ctx.wait_value(rec, deadline):
            raise RpcTimeoutError(f"the value of RRef {rec.rref_id} on worker {rt.info.name!r} was not created within {timeout:.3f}s")
        if rec.state == FAILED:
            raise fresh(rec.error)  # type: ignore[arg-type]
        return rec.value

    # ------------------------------------------------------------------ payloads
    def dumps_call(self, func: Any, args: Any, kwargs: Any, dest: int) -> tuple[list[Any], list[Any]]:
        if not callable(func):
            raise ArgumentError(f"func must be callable, got {type(func).__name__}")
        args = () if args is None else tuple(args)
        kwargs = {} if kwargs is None else dict(kwargs)
        return self.dumps((func, args, kwargs), dest)

    def dumps(self, obj: Any, dest: int, reply: bool = False) -> tuple[list[Any], list[Any]]:
        """Pickle ``obj`` for ``dest``, forking the RRefs inside; undo the forks on failure.
        Tensors take the device plan's request route (our map to ``dest``) or, for a reply
        (``reply=True``: a call's result, a fetched value), the inverse of ``dest``'s map to
        us (NOTE [Device maps] in rrefrt/devices.py)."""
        rt = self.rt
        plan = rt.devices
        route = None
        if plan is not None:
            peer = rt.worker_name(dest)  # a member may leave meanwhile (dynamic groups)
            route = plan.reply_route(peer) if reply else plan.request_route(peer)
        try:
            return ser.dumps(obj, lambda r: self.fork(r, dest), route=route)
        except Exception as e:
            self.abort_forks(getattr(e, "forks", []))
            raise

    def _send(self, call: "_Call", kind: int, name: str, meta: Any, frames: Any, timeout: float) -> None:
        """Send one request whose answer (or failure) ``call`` handles on the transport thread."""
        rt = self.rt
        rt.lifecycle.track_outgoing(+1)
        try:
            rt.transport.request(call.dest, kind, meta, frames, timeout, call, name)
        except transport.TransportError as e:
            rt.lifecycle.track_outgoing(-1)
            rt.control.deletes_delivered(call.dest, call.deletes, e)
            if call.before is not None:
                call.before()
            self.abort_forks(call.forks)
            raise call.error(e) from None

    def flush_drops(self, dest: int | None = None) -> tuple:
        """NOTE [Drops]: send the deletes of dropped RRefs before this call - unless the
        context's lock is held (a call made from a destructor that the garbage collector
        ran inside the context, on this very thread: the control thread sends them).
        ``dest``: the deletes to that worker are returned to ride in the call instead
        (NOTE [Piggybacked deletes] in docs/protocol.md)."""
        rt = self.rt
        if not rt.ctx._lock.locked():
            return rt.control.flush_drops(dest)
        return ()

    def _complete(self, fut: Future[Any], src: int, meta: Any, frames: Sequence[Any]) -> None:
        """Transport thread: decode the response meta once, account for the forks now,
        decode the payload lazily."""
        if type(meta) is list and meta == _PLAIN_OK and type(meta[0]) is int:  # no forks: the common case
            fut._complete_lazy(ser.loads, frames, _NO_RREFS)
            return
        try:
            resp = Response.decode(meta)
            rrefs = self.rrefs_from_forks(resp.forks, src) if resp.forks else []
        except Exception as e:
            fut._fail(SerializationError(f"malformed response from worker {self.rt.worker_name(src)!r}: {e}"))
            return
        if resp.status == OK:
            fut._complete_lazy(ser.loads, frames, rrefs)
        else:
            name = self.rt.worker_name(src)

            def raise_remote() -> Any:
                raise ser.loads_error(frames, name)

            fut._complete_lazy(raise_remote)

    # ------------------------------------------------------------------ forks
    def fork(self, rref: RRef[Any], dest: int) -> list[Any]:
        rt = self.rt
        if rref._rt is not rt:
            raise RpcError(f"{rref!r} belongs to another (shut down) RPC group")
        rref._check()
        if rref._owner_rec is not None:
            return rt.ctx.fork_owned(rref._owner_rec, dest).to_wire()
        return rt.ctx.fork_user(rref._user_rec, dest).to_wire()  # type: ignore[arg-type]

    def abort_forks(self, forks: list[Any]) -> None:
        """The message carrying these forks (wire form) was never sent."""
        for f in forks:
            self.rt.control.perform(self.rt.ctx.abort_fork(ForkData.from_wire(f)))

    def rrefs_from_forks(self, forks: Sequence[ForkData], src: int, lazy: bool = False) -> list[RRef[Any]]:
        """RRef objects for the forks a message from ``src`` carried (no user code); the
        protocol messages this implies are sent now. ``lazy``: the arguments of a call, whose
        forks from other users stay unregistered until ``register_survivors`` (NOTE [Lazy
        registration] in docs/protocol.md)."""
        rt = self.rt
        out = []
        strict = rt.options.strict_rref_leaks
        for data in forks:
            rec, actions = rt.ctx.on_fork_received(data, src, lazy)
            if isinstance(rec, OwnerRecord):
                out.append(RRef._from_owner(rt, rec))
            else:
                if strict:
                    rec.site = f"received from worker {rt.worker_name(src)!r}"
                out.append(RRef._from_user(rt, rec))
            rt.control.perform(actions)
        return out

    def register_survivors(self, refs: Sequence["weakref.ref[RRef[Any]]"]) -> None:
        """A call ended (NOTE [Lazy registration]): the unregistered forks of its arguments
        whose RRef object still exists (stored, returned, in a cycle) register with their
        owner now; those that died were dropped, and their drops send the child accepts
        (NOTE [Drops]: batched on the control thread's next flush, or this worker's next call;
        measured, flushing them here right after each answer cost ~7% of forks/s and did not
        shorten the owner's drain)."""
        recs = []
        for ref in refs:
            rref = ref()
            if rref is not None and rref._user_rec is not None:
                recs.append(rref._user_rec)
            del rref
        if recs:
            self.rt.control.perform(self.rt.ctx.register_users(recs))

    @staticmethod
    def unregistered(rrefs: Sequence[RRef[Any]]) -> list["weakref.ref[RRef[Any]]"]:
        """Weak references to the RRefs among ``rrefs`` whose fork is not registered yet."""
        return [weakref.ref(r) for r in rrefs if r._user_rec is not None and not r._user_rec.registered]
