"""Requests sent from this worker and their answers: the one object per request in flight
(``_Call``), its sending, the completion of its future, the translation of transport
errors into rrefrt's error tree (``translate``, the one place this happens), and, when a
call times out while its callee is alive, asking the callee where the call is (a
CALL_STACK_QUERY answered within ``STACK_WAIT``; ``explain_timeout``, docs/stuck.md).

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

import threading
import time
from typing import Any, Callable, Sequence

import rrefrt_transport as transport
from rrefrt.errors import OwnerDiedError, RpcTimeoutError, SerializationError, ShutdownError, WorkerUnavailableError
from rrefrt.futures import Future
from rrefrt.payload import serialization as ser
from rrefrt.protocol.audit import site_text
from rrefrt.protocol.messages import OK, Fetch, Response, StackQuery
from rrefrt.rref import RRef
from rrefrt.runtime import stacks
from rrefrt.runtime.inflight import func_name
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads

__all__ = ["Requests", "WaitedFuture", "translate", "STACK_WAIT"]

#: how long past a call's timeout its caller waits for the callee to say where the call is
#: (a CALL_STACK_QUERY); without an answer by then it raises the plain timeout
STACK_WAIT = 0.25
#: NOTE [Stack queries are bounded]: at most this many queries in flight per callee; the
#: timeouts beyond them fail plainly at once
STACK_QUERIES_PER_PEER = 4
#: NOTE [Stack queries are bounded]: a callee that left a query unanswered (its GIL held, a
#: stopped process) is not asked again for this long: its timeouts fail plainly at once
STACK_MUTE = 5.0


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


def rref_text(rref: Any) -> str:
    """An RRef as errors about its owner name it: its repr and, where known, the place
    that created it (the remote() call; ``UserRecord.site``)."""
    rec = getattr(rref, "_user_rec", None)
    site = site_text(rec.site) if rec is not None and rec.site else ""
    return f"{rref!r} (created at {site})" if site else repr(rref)


def fetch_error(rref: RRef[Any], err: BaseException) -> BaseException:
    """The error of a to_here() of ``rref`` that failed with transport error ``err``."""
    return translate(err, f"to_here() of {rref!r}", rref_text(rref))


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

    __slots__ = ("requests", "fut", "dest", "forks", "deletes", "before", "what", "owner_of", "func", "t0", "msg_id",
                 "creation")

    def __init__(self, requests: "Requests", fut: Future[Any], dest: int, forks: list[Any]) -> None:
        self.requests, self.fut, self.dest, self.forks = requests, fut, dest, forks
        self.deletes: tuple = ()
        self.before: Callable[[], None] | None = None
        self.what: Callable[[], str] | None = None
        self.owner_of: Callable[[], str] | None = None
        self.func: Any = None
        self.t0 = 0.0  #: when it was sent (monotonic), for debug info
        self.msg_id = 0  #: its request's id (0: not sent yet)
        #: the RRef id whose remote() creation a timeout asks about (a fetch), else None
        self.creation: Any = None

    def label(self) -> str:
        """What the call is, for debug info and errors."""
        if self.what is not None:
            return self.what()
        return f"rpc of {func_name(self.func)!r}"

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
                if isinstance(err, transport.RequestTimeout) and requests.explain_timeout(self, err):
                    return  # fails once the callee said where the call is (or did not, in time)
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
            requests.core.inflight.outgoing.pop(id(self), None)
            requests.lifecycle.track_outgoing(-1)


class Requests:
    def __init__(self, core: WorkerCore, control: ControlLoop, lifecycle: Lifecycle, payloads: Payloads) -> None:
        self.core = core
        self.control = control
        self.lifecycle = lifecycle
        self.payloads = payloads
        self._asking_lock = threading.Lock()
        #: callee -> its stack queries in flight (NOTE [Stack queries are bounded])
        self._asking: dict[int, int] = {}
        #: callee -> until when it is not asked (it left a query unanswered)
        self._mute_until: dict[int, float] = {}

    def new_call(self, fut: Future[Any], dest: int, forks: list[Any]) -> _Call:
        return _Call(self, fut, dest, forks)

    def send(self, call: _Call, kind: int, name: str, meta: Any, frames: Any, timeout: float) -> None:
        """Send one request whose answer (or failure) ``call`` handles on the transport thread."""
        core = self.core
        self.lifecycle.track_outgoing(+1)
        call.t0 = time.monotonic()
        outgoing = core.inflight.outgoing
        outgoing[id(call)] = call
        try:
            call.msg_id = core.transport.request(call.dest, kind, meta, frames, timeout, call, name)
        except transport.TransportError as e:
            outgoing.pop(id(call), None)
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
        call.what, call.owner_of, call.before = lambda: f"to_here() of {rref!r}", lambda: rref_text(rref), before
        call.creation = rec.rref_id  # a fetch waits for the creation: a timeout asks about it
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

    # ------------------------------------------------------------------ where is my call?
    def explain_timeout(self, call: _Call, err: BaseException) -> bool:
        """Transport thread: ``call`` timed out; ask its callee where it is and fail its
        future with the answer (``where_error``) within ``STACK_WAIT``. False: not asked
        (the callee is dead, or the call was never numbered): the caller fails it plainly."""
        dest = call.dest
        # cheap first: in a burst of timeouts most calls find the callee muted or already
        # asked about as often as allowed (NOTE [Stack queries are bounded])
        if self._mute_until.get(dest, 0.0) > time.monotonic() or self._asking.get(dest, 0) >= STACK_QUERIES_PER_PEER:
            return False
        query = self.stack_query(call)
        if query is None:
            return False
        plain, fut = call.error(err), call.fut
        return self.ask_where(dest, query, lambda answer: fut._fail(self.where_error(plain, dest, answer)))

    @staticmethod
    def stack_query(call: _Call) -> StackQuery | None:
        """The CALL_STACK_QUERY about ``call`` (None: not sent yet, so not numbered)."""
        if call.creation is not None:
            return StackQuery(call.dest, 0, call.creation)
        return StackQuery(call.dest, call.msg_id) if call.msg_id else None

    def ask_where(self, dest: int, query: StackQuery, on_answer: Callable[[Any], None]) -> bool:
        """Send ``query`` to ``dest``; ``on_answer(answer meta or None)`` runs once, on the
        transport thread, within ``STACK_WAIT``. False (nothing sent, ``on_answer`` never
        runs): ``dest`` is dead or unreachable."""
        core = self.core
        if dest != core.info.id and not core.transport.is_alive(dest):
            return False
        # NOTE [Stack queries are bounded]: a burst of timeouts to one callee (thousands of
        # calls queued behind a stopped peer) must not become a burst of queries, each
        # holding its call's failure for STACK_WAIT: a few are asked, a callee that did not
        # answer is not asked again for STACK_MUTE, and the rest fail plainly, at once
        with self._asking_lock:
            now = time.monotonic()
            if self._mute_until.get(dest, 0.0) > now or self._asking.get(dest, 0) >= STACK_QUERIES_PER_PEER:
                return False
            self._asking[dest] = self._asking.get(dest, 0) + 1

        def done(meta: Any, frames: Sequence[Any], err: Any) -> None:
            with self._asking_lock:
                self._asking[dest] -= 1
                if err is not None:
                    self._mute_until[dest] = time.monotonic() + STACK_MUTE
            on_answer(meta if err is None else None)

        try:
            core.transport.request(dest, query.KIND, query.meta(), [], STACK_WAIT, done, query.NAME)
        except transport.TransportError:
            with self._asking_lock:
                self._asking[dest] -= 1
            return False
        return True

    def where_error(self, plain: BaseException, dest: int, answer: Any) -> BaseException:
        """The timeout ``plain`` with what ``dest`` answered about the call (``InFlight.
        describe``): where its handler is (``remote_stack``), or that it is still queued,
        or waiting on the future it returned. No (or a malformed) answer: ``plain``."""
        if not isinstance(plain, RpcTimeoutError) or type(answer) is not list or len(answer) != 4:
            return plain
        state, function, age, raw = answer
        name = self.core.worker_name(dest)
        if type(age) not in (int, float) or type(function) is not str:
            return plain
        if state == "running":
            frames = stacks.decode_frames(raw)
            if not frames:
                return plain
            text = (f"{plain}; {name} was at {stacks.summary(frames)}, running {function!r} for {age:.1f}s. "
                    f"Its stack (innermost last; all of it in the error's remote_stack):\n"
                    f"{stacks.format_frames(frames, stacks.MESSAGE_FRAMES)}")
            out = RpcTimeoutError(text.rstrip("\n"))
            out.remote_stack = stacks.format_frames(frames)
            return out
        if state == "queued":
            return RpcTimeoutError(f"{plain}; {name} had not started it yet: it was queued for {age:.1f}s "
                                   f"behind the calls running there (its user thread pool is busy)")
        if state == "waiting":
            return RpcTimeoutError(f"{plain}; {name} ran {function!r}, which returned a future that had not "
                                   f"completed after {age:.1f}s")
        return plain
