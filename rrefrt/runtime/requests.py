"""Requests sent from this worker and their answers: the one object per request in flight
(``_Call``), its sending, the completion of its future, and the translation of transport
errors into rrefrt's error tree (``translate``, the one place this happens).

Owns: ``send`` (a call, a creation's fetch or any request whose answer completes a future),
``send_fetch`` (a to_here()'s FETCH), ``complete`` (decoding an answer's meta once, its
forks accounted at once, its payload lazily) and ``flush_drops`` (NOTE [Drops]: the deletes
of dropped RRefs leave before the next request). Used by the caller and by remote()
creation.

Threads: ``send`` / ``send_fetch`` run on the user's thread (or the transport thread for a
parked to_here(), ``flush=False``); a request's answer is handled on the transport thread
(``_Call.__call__``), which never unpickles: the payload is decoded in the thread that
reads the future.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import rrefrt_transport as transport
from rrefrt.errors import OwnerDiedError, RpcTimeoutError, SerializationError, ShutdownError, WorkerUnavailableError
from rrefrt.futures import Future
from rrefrt.payload import serialization as ser
from rrefrt.protocol.messages import OK, Fetch, Response
from rrefrt.rref import RRef
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads

__all__ = ["Requests", "WaitedFuture", "translate"]


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


def fetch_error(rref: RRef[Any], err: BaseException) -> BaseException:
    """The error of a to_here() of ``rref`` that failed with transport error ``err``."""
    return translate(err, f"to_here() of {rref!r}", repr(rref))


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

    __slots__ = ("requests", "fut", "dest", "forks", "deletes", "before", "what", "owner_of", "func")

    def __init__(self, requests: "Requests", fut: Future[Any], dest: int, forks: list[Any]) -> None:
        self.requests, self.fut, self.dest, self.forks = requests, fut, dest, forks
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
            what = f"rpc to {self.requests.core.worker_name(self.dest)!r} of {getattr(self.func, '__qualname__', self.func)!r}"
        return translate(err, what, self.owner_of() if self.owner_of is not None else None)

    def __call__(self, m: Any, fr: Sequence[Any], err: Any) -> None:  # transport thread
        requests = self.requests
        try:
            if self.deletes:  # NOTE [Piggybacked deletes]: the answer is their ack
                requests.control.deletes_delivered(self.dest, self.deletes, err)
            if self.before is not None:
                self.before()
            if err is not None:
                if self.forks and isinstance(err, transport.Fenced):
                    # NOTE [Fenced forks]: once fenced, a request fails with Fenced, sent
                    # or not, and every peer is dead to this worker. A fork it registered
                    # for itself (a call to itself, unsent) would pin its value for good:
                    # no death ever drops it. Undoing a fork for a peer is what G3 does
                    # anyway, and undoing one already received here is a no-op. An
                    # answer that was not sent undoes its forks too (Callee.finish).
                    requests.payloads.abort_forks(self.forks)
                self.fut._fail(self.error(err))
                return
            requests.complete(self.fut, self.dest, m, fr)
        finally:
            requests.lifecycle.track_outgoing(-1)


class Requests:
    def __init__(self, core: WorkerCore, control: ControlLoop, lifecycle: Lifecycle, payloads: Payloads) -> None:
        self.core = core
        self.control = control
        self.lifecycle = lifecycle
        self.payloads = payloads

    def new_call(self, fut: Future[Any], dest: int, forks: list[Any]) -> _Call:
        return _Call(self, fut, dest, forks)

    def send(self, call: _Call, kind: int, name: str, meta: Any, frames: Any, timeout: float) -> None:
        """Send one request whose answer (or failure) ``call`` handles on the transport thread."""
        core = self.core
        self.lifecycle.track_outgoing(+1)
        try:
            core.transport.request(call.dest, kind, meta, frames, timeout, call, name)
        except transport.TransportError as e:
            self.lifecycle.track_outgoing(-1)
            self.control.deletes_delivered(call.dest, call.deletes, e)
            if call.before is not None:
                call.before()
            self.payloads.abort_forks(call.forks)
            raise call.error(e) from None

    def send_fetch(self, rref: RRef[Any], fut: Future[Any], t: float, flush: bool = True,
                   before: Callable[[], None] | None = None) -> None:
        """Send a FETCH for ``rref`` that completes ``fut``. ``flush=False`` on the transport
        thread (a parked to_here() released by its creation's answer): no drops sent there.
        ``before``: run on the answer (or failure), before ``fut`` completes."""
        rec = rref._user_rec
        assert rec is not None
        msg = Fetch(rec.owner, rec.rref_id, rec.fork_id)
        if flush and self.control.drops:  # NOTE [Drops]: deletes of dropped RRefs leave first
            self.flush_drops()
        call = _Call(self, fut, msg.dest, [])
        call.what, call.owner_of, call.before = lambda: f"to_here() of {rref!r}", lambda: repr(rref), before
        self.send(call, msg.KIND, msg.NAME, msg.meta(), [], t)

    def flush_drops(self, dest: int | None = None) -> tuple:
        """NOTE [Drops]: send the deletes of dropped RRefs before this call - unless the
        context's lock is held (a call made from a destructor that the garbage collector
        ran inside the context, on this very thread: the control thread sends them).
        ``dest``: the deletes to that worker are returned to ride in the call instead
        (NOTE [Piggybacked deletes] in docs/protocol.md)."""
        if not self.core.ctx._lock.locked():
            return self.control.flush_drops(dest)
        return ()

    def complete(self, fut: Future[Any], src: int, meta: Any, frames: Sequence[Any]) -> None:
        """Transport thread: decode the response meta once, account for the forks now,
        decode the payload lazily."""
        if type(meta) is list and meta == _PLAIN_OK and type(meta[0]) is int:  # no forks: the common case
            fut._complete_lazy(ser.loads, frames, _NO_RREFS)
            return
        try:
            resp = Response.decode(meta)
            rrefs = self.payloads.rrefs_from_forks(resp.forks, src) if resp.forks else []
        except Exception as e:
            fut._fail(SerializationError(f"malformed response from worker {self.core.worker_name(src)!r}: {e}"))
            return
        if resp.status == OK:
            fut._complete_lazy(ser.loads, frames, rrefs)
        else:
            name = self.core.worker_name(src)

            def raise_remote() -> Any:
                raise ser.loads_error(frames, name)

            fut._complete_lazy(raise_remote)
