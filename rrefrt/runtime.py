"""The runtime of one worker: glue between the transport, the RRef context and user code.

Owns: the agent, the user thread pool, the callback pool, the control thread, the event
loop for ``async def`` functions, and the handlers of every message kind. Imports from
rrefrt: everything below it (errors, options, futures, messages, rref_context,
serialization, rref, pool) and transport. The API module (above) creates it.

Threads and what runs where:
    I/O thread (transport)  decodes headers, turns fork data into RRef objects (no user
                            code), hands calls to the pool and control messages to the
                            control thread, completes futures lazily.
    control thread          RRef protocol messages, fetches (serving to_here), drops of
                            RRefs, peer deaths. Never runs user functions, so a pool full
                            of blocked nested calls cannot stall the protocol.
    user pool               user functions (num_worker_threads, compensated when blocked).
    callback pool           callbacks of futures completed by the I/O thread.
    event loop thread       ``async def`` user functions (started on first use).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import inspect
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import transport
from transport import Agent

from . import serialization as ser
from .errors import (
    OwnerDiedError,
    RpcError,
    RemoteSerializationError,
    RpcTimeoutError,
    RRefCreationError,
    SerializationError,
    ShutdownError,
    WorkerUnavailableError,
    fresh,
)
from .futures import Future
from .ids import ForkId, IdGenerator, RRefId
from .messages import (
    CONTROL_KINDS,
    ERROR,
    KIND_NAMES,
    REMOTE_RET,
    OK,
    PYTHON_CALL,
    PYTHON_REMOTE,
    RREF_CHILD_ACCEPT,
    RREF_FETCH,
    RREF_FORK_REQUEST,
    RREF_USER_DELETE,
    ChildAccept,
    ForkData,
    ForkRequest,
    ServeFetch,
    UserDelete,
)
from .options import RpcBackendOptions, WorkerInfo
from .pool import WorkerPool
from .rref import RRef, _invoke_on_owner
from .rref_context import _NO_VALUE, FAILED, PENDING, OwnerRecord, RRefContext, creation_site

log = logging.getLogger("rrefrt")

#: NOTE [Creation acks]: how long a PYTHON_REMOTE's accept waits for the value, so that a
#: quick creation costs one answer; well below the creator's retry interval
ACCEPT_DELAY_S = 0.05


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


class Runtime:
    def __init__(self, info: WorkerInfo, options: RpcBackendOptions, agent_options: transport.AgentOptions, incarnation: int) -> None:
        self.info = info
        self.options = options
        self.pid = os.getpid()
        self.ctx = RRefContext(info.id, IdGenerator(info.id))
        self.agent = Agent(info.id, info.name, incarnation, self._on_message, self._on_peer_dead, agent_options)
        self.pool = WorkerPool(f"rrefrt-{info.name}-worker", options.num_worker_threads)
        self.callbacks = WorkerPool(f"rrefrt-{info.name}-callback", 4)
        self.workers_by_id: dict[int, WorkerInfo] = {info.id: info}
        self.workers_by_name: dict[str, WorkerInfo] = {info.name: info}
        self._control: queue.SimpleQueue = queue.SimpleQueue()
        self._control_thread = threading.Thread(target=self._control_loop, name=f"rrefrt-{info.name}-control", daemon=True)
        self._control_stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._active_calls = 0  #: user functions running or queued on behalf of peers
        #: caller id -> its calls counted in _active_calls (shutdown waits for live callers only)
        self._active_from: collections.Counter = collections.Counter()
        self._outgoing_calls = 0  #: calls and fetches sent from here still awaiting an answer
        #: src -> (ids, order): recent PYTHON_CALL ids per peer, to drop duplicates (I/O thread)
        self._seen_calls: dict[int, tuple[set[int], collections.deque]] = {}
        #: rref id -> (creator, msg_id): PYTHON_REMOTE not yet answered (NOTE [Creation acks]);
        #: popped by whoever answers first, the finished call or the accept timer
        self._accepts: dict[RRefId, tuple[int, int]] = {}
        #: fork id -> to_here futures of a not yet confirmed remote(), failed if it is lost
        self._fetches: dict[ForkId, list[Future[Any]]] = {}
        #: NOTE [Retries]: the ack wait per attempt of a control message, and the attempts
        self.control_retry_interval = 2.0
        self.control_attempts = 15
        self._active_lock = threading.Condition()
        self.accepting = True
        self.closed = False
        self._control_thread.start()

    def set_world(self, workers: Sequence[WorkerInfo]) -> None:
        for w in workers:
            self.workers_by_id[w.id] = w
            self.workers_by_name[w.name] = w

    # ------------------------------------------------------------------ lookups
    def worker_info(self, to: Any = None) -> WorkerInfo:
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            w = self.workers_by_id.get(to.id)
            if w is None or w.name != to.name:
                raise WorkerUnavailableError(f"{to!r} is not a member of this RPC group")
            return w
        if isinstance(to, str):
            w = self.workers_by_name.get(to)
            if w is None:
                known = ", ".join(sorted(self.workers_by_name))
                raise WorkerUnavailableError(f"unknown worker name {to!r}; the group has: {known}")
            return w
        if isinstance(to, int) and not isinstance(to, bool):
            w = self.workers_by_id.get(to)
            if w is None:
                raise WorkerUnavailableError(f"unknown worker id {to}; ids run 0..{len(self.workers_by_id) - 1}")
            return w
        raise TypeError(f"'to' must be a worker name, id or WorkerInfo, not {type(to).__name__}")

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None or timeout < 0:
            return self.options.rpc_timeout
        return float(timeout)

    def _device_map(self, dest: int) -> dict[str, str] | None:
        return self.options.device_maps.get(self.workers_by_id[dest].name)

    def _check_running(self) -> None:
        if self.closed or not self.accepting:
            raise ShutdownError(f"RPC on worker {self.info.name!r} is shutting down or shut down")

    # ------------------------------------------------------------------ outgoing calls
    def rpc_async(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Future[Any]:
        self._check_running()
        dest = self.worker_info(to).id
        frames, forks = self._dumps_call(func, args, kwargs, dest)
        fut: Future[Any] = Future()
        fut._callback_pool = self.callbacks
        what = f"rpc to {self.workers_by_id[dest].name!r} of {getattr(func, '__qualname__', func)!r}"
        owner_of = repr(args[0]) if func is _invoke_on_owner and args else None  # a proxy call
        self._send_request(dest, PYTHON_CALL, [forks], frames, self._timeout(timeout), fut, what, forks, owner_of)
        return fut

    def rpc_sync(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
        fut = self.rpc_async(to, func, args, kwargs, timeout)
        t = self._timeout(timeout)
        return fut.result(t + 5.0 if t > 0 else None)

    def remote(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
        self._check_running()
        dest = self.worker_info(to).id
        tname = func.__qualname__ if isinstance(func, type) else "object"
        frames, forks = self._dumps_call(func, args, kwargs, dest)
        if dest == self.info.id:
            rec = self.ctx.new_local_owner(_NO_VALUE, tname)
            rrefs = self._rrefs_from_forks(forks, dest)
            self._track_call(+1, dest)
            self.pool.submit(self._run_call, dest, PYTHON_REMOTE, 0, frames, rrefs, rec)
            return RRef._from_owner(self, rec)
        t = self._timeout(timeout)
        urec = self.ctx.new_remote_user(dest, tname, t)
        if self.options.strict_rref_leaks:
            urec.site = creation_site()
        meta = [urec.rref_id.to_wire(), urec.fork_id.to_wire(), tname, forks]
        fid = urec.fork_id

        def on_accept(err: Any) -> None:
            if isinstance(err, transport.RequestTimeout):
                self._control.put(("remote_lost", fid, dest))

        def on_reply(m: Any, fr: Sequence[Any]) -> None:
            if len(m) > 2 and m[2]:  # accepted and already done: the answer is the REMOTE_RET
                self._control.put(("remote_done", fid, m[0], fr, dest))

        try:
            self._control_request(dest, PYTHON_REMOTE, meta, frames, on_accept, on_reply=on_reply)
        except transport.TransportError as e:
            self._abort_forks(forks)
            self._perform(self.ctx.on_remote_ret(fid, translate(e, "remote()")))
            raise translate(e, "remote()") from None
        return RRef._from_user(self, urec)

    def fetch(self, rref: RRef[Any], timeout: float) -> Future[Any]:
        rec = rref._user_rec
        assert rec is not None
        t = self._timeout(timeout)
        if not rec.confirmed and rec.creation_deadline is not None:
            t = max(0.001, min(t, rec.creation_deadline - time.monotonic())) if t > 0 else max(0.001, rec.creation_deadline - time.monotonic())
        fut: Future[Any] = Future()
        fut._callback_pool = self.callbacks
        if not rec.confirmed:  # fails at once if the creation turns out lost
            fid = rec.fork_id
            self._fetches.setdefault(fid, []).append(fut)

            def forget(f: Future[Any], fid: ForkId = fid) -> None:
                waiting = self._fetches.get(fid)
                if waiting is not None and f in waiting:
                    waiting.remove(f)
                    if not waiting:
                        self._fetches.pop(fid, None)

            fut.add_done_callback(forget)
        self._send_request(rec.owner, RREF_FETCH, [rec.rref_id.to_wire(), rec.fork_id.to_wire()], [], t, fut, f"to_here() of {rref!r}", [], repr(rref))
        return fut

    def owner_value(self, rec: OwnerRecord, timeout: float) -> Any:
        deadline = time.monotonic() + (timeout if timeout > 0 else 1e9)
        if not self.ctx.wait_value(rec, deadline):
            raise RpcTimeoutError(f"the value of RRef {rec.rref_id} on worker {self.info.name!r} was not created within {timeout:.3f}s")
        if rec.state == FAILED:
            raise fresh(rec.error)  # type: ignore[arg-type]
        return rec.value

    def _dumps_call(self, func: Any, args: Any, kwargs: Any, dest: int) -> tuple[list[Any], list[Any]]:
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}")
        args = () if args is None else tuple(args)
        kwargs = {} if kwargs is None else dict(kwargs)
        return self._dumps((func, args, kwargs), dest)

    def _dumps(self, obj: Any, dest: int) -> tuple[list[Any], list[Any]]:
        try:
            return ser.dumps(obj, lambda r: self._fork(r, dest), self._device_map(dest))
        except Exception as e:
            self._abort_forks(getattr(e, "forks", []))
            raise

    def _send_request(
        self, dest: int, kind: int, meta: Any, frames: Any, timeout: float, fut: Future[Any], what: str,
        forks: list[Any], owner_of: str | None = None,
    ) -> None:
        def on_done(m: Any, fr: Sequence[Any], err: Any) -> None:
            try:
                if err is not None:
                    fut._fail(translate(err, what, owner_of))
                    return
                self._complete(fut, dest, m, fr)
            finally:
                self._track_outgoing(-1)

        self._track_outgoing(+1)
        try:
            self.agent.request(dest, kind, meta, frames, timeout, on_done, KIND_NAMES[kind])
        except transport.TransportError as e:
            self._track_outgoing(-1)
            self._abort_forks(forks)
            raise translate(e, what, owner_of) from None

    def _complete(self, fut: Future[Any], src: int, meta: Any, frames: Sequence[Any]) -> None:
        """On the I/O thread: account for the forks now, decode the payload lazily."""
        try:
            status, forks = meta[0], meta[1]
            rrefs = self._rrefs_from_forks(forks, src) if forks else []
        except Exception as e:
            fut._fail(SerializationError(f"malformed response from worker {self.workers_by_id[src].name!r}: {e}"))
            return
        name = self.workers_by_id[src].name
        if status == OK:
            fut._complete_lazy(lambda: ser.loads(frames, rrefs))
        else:
            def raise_remote() -> Any:
                raise ser.loads_error(frames, name)

            fut._complete_lazy(raise_remote)

    # ------------------------------------------------------------------ forks
    def _fork(self, rref: RRef[Any], dest: int) -> list[Any]:
        if rref._rt is not self:
            raise RpcError(f"{rref!r} belongs to another (shut down) RPC group")
        rref._check()
        if rref._owner_rec is not None:
            return self.ctx.fork_owned(rref._owner_rec, dest).to_wire()
        return self.ctx.fork_user(rref._user_rec, dest).to_wire()  # type: ignore[arg-type]

    def _abort_forks(self, forks: list[Any]) -> None:
        for f in forks:
            self._perform(self.ctx.abort_fork(ForkData.from_wire(f)))

    def _rrefs_from_forks(self, forks: list[Any], src: int) -> list[RRef[Any]]:
        out = []
        strict = self.options.strict_rref_leaks
        for raw in forks:
            data = ForkData.from_wire(raw)
            rec, actions = self.ctx.on_fork_received(data, src)
            if isinstance(rec, OwnerRecord):
                out.append(RRef._from_owner(self, rec))
            else:
                if strict:
                    rec.site = f"received from worker {self.workers_by_id[src].name!r}"
                out.append(RRef._from_user(self, rec))
            self._perform(actions)
        return out

    def enqueue_drop(self, fork_id: ForkId) -> None:
        if not self.closed:
            self._control.put(("drop", fork_id))

    # ------------------------------------------------------------------ protocol actions
    def _perform(self, actions: list[Any]) -> None:
        for a in actions:
            try:
                if isinstance(a, ForkRequest):
                    fid = a.fork_id
                    self._control_request(
                        a.dest, RREF_FORK_REQUEST, [a.rref_id.to_wire(), fid.to_wire(), a.parent], [],
                        lambda e, fid=fid: self._control.put(("fork_ack", fid, e)),
                    )
                elif isinstance(a, ChildAccept):
                    self._control_request(a.dest, RREF_CHILD_ACCEPT, [a.fork_id.to_wire()], [], _ignore_ack)
                elif isinstance(a, UserDelete):
                    fid = a.fork_id
                    self._control_request(
                        a.dest, RREF_USER_DELETE, [a.rref_id.to_wire(), fid.to_wire()], [],
                        lambda e, fid=fid: self._control.put(("delete_ack", fid, e)),
                    )
                elif isinstance(a, ServeFetch):
                    self._serve_fetch(a)
                # Release: dropping the action drops the value, here, outside every lock
            except transport.AgentClosed:
                log.debug("protocol message %r not sent: transport closed", a)

    def _control_request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], on_ack: Callable[[Any], None], attempt: int = 1,
        on_reply: Callable[[Any, Sequence[Any]], None] | None = None,
    ) -> None:
        """Send a protocol message and retry it until acknowledged.

        NOTE [Retries]: a control message whose ack does not come within
        ``control_retry_interval`` is sent again (``control_attempts`` times at most); the
        receivers' handlers are idempotent, and deleted forks leave tombstones, so a
        duplicate or late retry changes nothing. A dead peer stops the retries (G3 cleans up).
        """

        def done(meta: Any, fr: Sequence[Any], err: Any) -> None:
            if isinstance(err, transport.RequestTimeout) and attempt < self.control_attempts and not self.closed:
                self.agent.stats["control_retries"] += 1
                try:
                    self._control_request(dest, kind, meta_out, frames, on_ack, attempt + 1, on_reply)
                    return
                except transport.TransportError as e:
                    err = e
            if isinstance(err, transport.RequestTimeout):
                log.error("%s to worker %r was never acknowledged after %d attempts", KIND_NAMES[kind],
                          self.workers_by_id[dest].name, attempt)
            if err is None and on_reply is not None:
                on_reply(meta, fr)
            on_ack(err)

        meta_out = meta
        self.agent.request(dest, kind, meta, frames, self.control_retry_interval, done, KIND_NAMES[kind])

    def _serve_fetch(self, sf: ServeFetch) -> None:
        rec = sf.record
        if rec.state == FAILED:
            self._respond(sf.src, sf.msg_id, [ERROR, []], ser.dumps_error(rec.error, self.info.name), RREF_FETCH)
            return
        try:
            frames, forks = self._dumps(rec.value, sf.src)
        except Exception as e:
            self._respond(sf.src, sf.msg_id, [ERROR, []], ser.dumps_error(e, self.info.name), RREF_FETCH)
            return
        self._respond(sf.src, sf.msg_id, [OK, forks], frames, RREF_FETCH)

    # ------------------------------------------------------------------ incoming (I/O thread)
    def _on_message(self, src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        if kind in CONTROL_KINDS:
            if not _control_meta_ok(kind, meta):  # malformed: dropped and counted here
                self.agent.stats["bad_frames_dropped"] += 1
                return
            self._control.put(("msg", src, kind, msg_id, meta, frames))
            return
        if kind not in (PYTHON_CALL, PYTHON_REMOTE):
            self.agent.stats["bad_frames_dropped"] += 1
            return
        try:
            if kind == PYTHON_CALL:
                (forks,) = meta
                [ForkData.from_wire(f) for f in forks]  # malformed input changes no state
                rec = None
                if self._seen_before(src, msg_id):
                    self.agent.stats["duplicate_calls_dropped"] += 1
                    return
            else:
                rid, fid, tname, forks = meta
                [ForkData.from_wire(f) for f in forks]  # malformed input changes no state
                rec = self.ctx.on_remote_request(RRefId.from_wire(rid), ForkId.from_wire(fid), src, str(tname))
                if rec is None:
                    # a duplicate or retry: accept it now, and let the result go as REMOTE_RET
                    # (the creator may already have this request id answered)
                    rref_id = RRefId.from_wire(rid)
                    self._accepts.pop(rref_id, None)
                    done = self.ctx.owned_record(rref_id)
                    if done is not None and done.state != PENDING:  # the value exists: say so
                        failed = done.state == FAILED
                        frames = ser.dumps_error(done.error, self.info.name) if failed else []
                        self._respond(src, msg_id, [ERROR if failed else OK, [], 1], frames, PYTHON_REMOTE)
                    else:
                        self._respond(src, msg_id, [OK, [], 0], [], PYTHON_REMOTE)  # accepted (again)
                    self.agent.stats["duplicate_calls_dropped"] += 1
                    return
                # NOTE [Creation acks]: the accept waits up to ACCEPT_DELAY_S for the value,
                # so a quick creation is answered once, accept and result together
                self._accepts[rec.rref_id] = (src, msg_id)
                self.agent.call_later(ACCEPT_DELAY_S, lambda rid=rec.rref_id: self._accept_now(rid))
                msg_id = 0  # the result goes back with the accept or as REMOTE_RET
            rrefs = self._rrefs_from_forks(forks, src)
        except Exception:
            self.agent.stats["bad_frames_dropped"] += 1
            return
        if not self.accepting:
            err = ShutdownError(f"worker {self.info.name!r} is shutting down and accepts no new calls")
            self._finish_call(src, kind, msg_id, rec, None, err)
            return
        self._track_call(+1, src)
        self.pool.submit(self._run_call, src, kind, msg_id, frames, rrefs, rec)

    def _seen_before(self, src: int, msg_id: int) -> bool:
        """I/O thread only: a PYTHON_CALL delivered twice must not run twice."""
        seen = self._seen_calls.get(src)
        if seen is None:
            seen = self._seen_calls[src] = (set(), collections.deque())
        ids, order = seen
        if msg_id in ids:
            return True
        ids.add(msg_id)
        order.append(msg_id)
        if len(order) > 65536:
            ids.discard(order.popleft())
        return False

    def _track_call(self, delta: int, src: int) -> None:
        with self._active_lock:
            self._active_calls += delta
            self._active_from[src] += delta
            if self._active_calls == 0:
                self._active_lock.notify_all()

    def _track_outgoing(self, delta: int) -> None:
        with self._active_lock:
            self._outgoing_calls += delta
            if self._outgoing_calls == 0:
                self._active_lock.notify_all()

    def _run_call(self, src: int, kind: int, msg_id: int, frames: Sequence[Any], rrefs: list[Any], rec: OwnerRecord | None) -> None:
        def done(value: Any, exc: BaseException | None) -> None:
            try:
                self._finish_call(src, kind, msg_id, rec, value, exc)
            finally:
                self._track_call(-1, src)

        try:
            func, args, kwargs = ser.loads(frames, rrefs)
        except BaseException as e:
            if isinstance(e, SerializationError):  # we lack (or refuse) a class: say so, typed
                cause = e.__cause__ or e
                err = RemoteSerializationError(str(e), f"{type(cause).__module__}.{type(cause).__qualname__}", self.info.name)
                err.__cause__ = e
                e = err
            done(None, e)
            return
        del rrefs, frames
        self._invoke(func, args, kwargs, done)

    def _invoke(self, func: Any, args: tuple, kwargs: dict, done: Callable[[Any, BaseException | None], None]) -> None:
        try:
            result = func(*args, **kwargs)
        except BaseException as e:
            done(None, e)
            return
        if getattr(func, "_rrefrt_async_execution", False):
            self._when_done(result, done, func)
        elif inspect.iscoroutine(result):
            cf = asyncio.run_coroutine_threadsafe(result, self._event_loop())
            cf.add_done_callback(lambda f: self.pool.submit(_settle, f, done))
        else:
            done(result, None)

    def _when_done(self, fut: Any, done: Callable[[Any, BaseException | None], None], func: Any) -> None:
        if isinstance(fut, concurrent.futures.Future):
            fut.add_done_callback(lambda f: _settle(f, done))
        elif hasattr(fut, "add_done_callback") and hasattr(fut, "wait"):  # torch.futures.Future
            def torch_done(f: Any) -> None:
                try:
                    value = f.wait()
                except BaseException as e:
                    done(None, e)
                    return
                done(value, None)

            fut.add_done_callback(torch_done)
        else:
            done(None, TypeError(f"@async_execution function {getattr(func, '__qualname__', func)!r} must return a Future, got {type(fut).__name__}"))

    def _finish_call(self, src: int, kind: int, msg_id: int, rec: OwnerRecord | None, value: Any, exc: BaseException | None) -> None:
        if kind == PYTHON_REMOTE:
            assert rec is not None
            self._perform(self.ctx.set_value(rec, value, exc))
            if src == self.info.id:  # remote() to self
                return
            frames = [] if exc is None else ser.dumps_error(exc, self.info.name)
            accept = self._accepts.pop(rec.rref_id, None)
            if accept is not None:  # not yet accepted: accept and result in one answer
                self._respond(accept[0], accept[1], [OK if exc is None else ERROR, [], 1], frames, PYTHON_REMOTE)
                return
            meta = [rec.rref_id.to_wire(), OK if exc is None else ERROR]
            try:
                self._control_request(src, REMOTE_RET, meta, frames, _ignore_ack)
            except transport.TransportError:
                log.debug("REMOTE_RET for %s not sent: transport closed", rec.rref_id)
            return
        if exc is None:
            try:
                frames, forks = self._dumps(value, src)
                self._respond(src, msg_id, [OK, forks], frames, kind)
                return
            except Exception as e:
                exc = e
        self._respond(src, msg_id, [ERROR, []], ser.dumps_error(exc, self.info.name), kind)

    def _respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any], about: int = 0) -> None:
        try:
            self.agent.respond(dest, msg_id, meta, frames, "RESPONSE:" + KIND_NAMES.get(about, "?"))
        except transport.MessageTooLarge as e:
            self.agent.respond(dest, msg_id, [ERROR, []], ser.dumps_error(SerializationError(f"result too large: {e}"), self.info.name))
        except transport.AgentClosed:
            log.debug("response to worker %d dropped: transport closed", dest)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name=f"rrefrt-{self.info.name}-asyncio", daemon=True)
                t.start()
                self._loop, self._loop_thread = loop, t
            return self._loop

    # ------------------------------------------------------------------ control thread
    def _accept_now(self, rref_id: RRefId) -> None:
        """I/O thread timer: the value is taking a while, accept its creation now."""
        accept = self._accepts.pop(rref_id, None)
        if accept is not None:
            self._respond(accept[0], accept[1], [OK, [], 0], [], PYTHON_REMOTE)

    def _control_loop(self) -> None:
        q = self._control
        while not self._control_stop:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._control_item(item)
            except Exception:
                log.exception("control message %r failed on worker %r", item[0], self.info.name)
            del item

    def _control_item(self, item: tuple) -> None:
        op = item[0]
        ctx = self.ctx
        if op == "msg":
            _, src, kind, msg_id, meta, _frames = item
            if kind == RREF_FETCH:
                sf = ctx.on_fetch(RRefId.from_wire(meta[0]), src, msg_id)
                if sf is not None:
                    self._serve_fetch(sf)
            elif kind == RREF_FORK_REQUEST:
                ctx.on_fork_request(RRefId.from_wire(meta[0]), ForkId.from_wire(meta[1]), src)
                self._respond(src, msg_id, [OK, []], [], kind)
            elif kind == RREF_CHILD_ACCEPT:
                actions = ctx.on_child_accept(ForkId.from_wire(meta[0]))
                self._respond(src, msg_id, [OK, []], [], kind)
                self._perform(actions)
            elif kind == RREF_USER_DELETE:
                actions = ctx.on_user_delete(RRefId.from_wire(meta[0]), ForkId.from_wire(meta[1]))
                self._respond(src, msg_id, [OK, []], [], kind)
                self._perform(actions)
            elif kind == REMOTE_RET:
                rid, status = RRefId.from_wire(meta[0]), meta[1]
                error = None if status == OK else ser.loads_error(item[5], self.workers_by_id[src].name)
                self._respond(src, msg_id, [OK, []], [], kind)
                self._perform(ctx.on_remote_ret(rid, error))
        elif op == "drop":
            self._perform(ctx.user_dropped(item[1]))
        elif op == "fork_ack":
            if item[2] is None:
                self._perform(ctx.on_fork_request_ack(item[1]))
            elif isinstance(item[2], transport.RequestTimeout):  # retries exhausted
                ctx.give_up_user(item[1], RpcError(f"the owner never confirmed fork {item[1]} of this RRef"))
        elif op == "delete_ack":
            # acknowledged, or never (retries exhausted: the owner will report the leak), or
            # the owner died: either way this worker is done with the fork
            ctx.on_user_delete_ack(item[1])
        elif op == "remote_done":
            _, fid, status, frames, dest = item
            error = None if status == OK else ser.loads_error(frames, self.workers_by_id[dest].name)
            self._perform(ctx.on_remote_ret(fid, error))
        elif op == "remote_lost":
            _, fid, dest = item
            error = RRefCreationError(
                f"RRef creation failed: worker {self.workers_by_id[dest].name!r} never acknowledged the creation "
                f"of RRef {fid} after {self.control_attempts} attempts (the message was lost)"
            )
            self._perform(ctx.abandon_user(fid, error))
            for fut in self._fetches.pop(fid, ()):
                fut._fail(fresh(error))
        elif op == "dead":
            self._perform(ctx.on_peer_dead(item[1]))
        elif op == "sync":
            item[1].set()

    def _on_peer_dead(self, peer: int, cause: str) -> None:
        self._control.put(("dead", peer))

    def sync_control(self, deadline: float) -> bool:
        """Wait (bounded) until everything enqueued for the control thread so far is done."""
        ev = threading.Event()
        self._control.put(("sync", ev))
        return ev.wait(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ shutdown
    def wait_idle(self, deadline: float) -> bool:
        """Until no call from a peer is running or queued here and no call or fetch made
        here is still waiting for its answer (in-flight calls complete before shutdown)."""
        with self._active_lock:
            while self._outgoing_calls or any(
                n and (src == self.info.id or self.agent.is_alive(src)) for src, n in self._active_from.items()
            ):  # calls on behalf of a dead worker are not waited for: their answers go nowhere
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._active_lock.wait(min(left, 0.1))
            return True

    def release_rrefs(self, deadline: float) -> list[str]:
        """Graceful shutdown, RRef part: returns the live-user sites found (strict mode)."""
        gc.collect()
        self.sync_control(deadline)
        sites = self.ctx.live_user_sites() if self.options.strict_rref_leaks else []
        self._perform(self.ctx.delete_all_users())
        self.ctx.wait_users_settled(deadline)
        self.ctx.wait_owners_drained(deadline)
        return sites

    def debug_info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(self.ctx.counts())
        stats = self.agent.stats
        for key in ("messages_sent", "messages_received", "bytes_sent", "bytes_received", "bad_frames_dropped",
                    "unknown_peer_dropped", "fenced_dropped", "late_responses_dropped", "requests_timed_out",
                    "peers_declared_dead", "control_retries", "duplicate_calls_dropped"):
            info[f"agent.{key}"] = int(stats.get(key, 0))
        for name, n in self.agent.pending_per_peer().items():
            info[f"agent.pending_futures.{name}"] = n
        for key, n in self.pool.stats().items():
            info[f"pool.{key}"] = n
        info["agent.dead_peers"] = len(self.agent.dead_peers())
        return info

    def close(self) -> None:
        """Stop everything; bounded; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.accepting = False
        self.agent.close()
        self._control_stop = True
        self._control.put(("sync", threading.Event()))
        self._control_thread.join(2.0)
        self.pool.stop()
        self.callbacks.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(2.0)


def _control_meta_ok(kind: int, meta: Any) -> bool:
    """Whether a control message's meta has the shape its handler reads (messages.py table)."""
    try:
        if type(meta) is not list:
            return False
        if kind == RREF_CHILD_ACCEPT:
            ForkId.from_wire(meta[0])
        elif kind == REMOTE_RET:
            RRefId.from_wire(meta[0])
            return meta[1] in (OK, ERROR)
        else:  # RREF_FETCH, RREF_USER_DELETE [rref_id, fork_id]; RREF_FORK_REQUEST [.., parent]
            RRefId.from_wire(meta[0])
            ForkId.from_wire(meta[1])
            return kind != RREF_FORK_REQUEST or type(meta[2]) is int
        return True
    except Exception:
        return False


def _ignore_ack(err: Any) -> None:
    return None


def _settle(f: concurrent.futures.Future, done: Callable[[Any, BaseException | None], None]) -> None:
    try:
        value = f.result()
    except BaseException as e:
        done(None, e)
        return
    done(value, None)
