"""The caller side: the calls a program makes (``rpc_async`` / ``rpc_sync`` / ``remote``),
the to_here() of a user RRef (``fetch``) and of an owner RRef (``owner_value``).

Owns: turning a call into a request (its destination, payload, piggybacked deletes and
error texts) and a remote() into a pending user and its creation. Sending and answers are
the requests' (rrefrt/runtime/requests.py), payloads and forks the payloads', the
creation's protocol the creation tracker's; a remote() to this very worker runs on the
callee like any call.

Threads: the user's thread.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import rrefrt_transport as transport
from rrefrt.errors import RpcTimeoutError, fresh
from rrefrt.futures import Future
from rrefrt.protocol.context import _NO_VALUE, FAILED, OwnerRecord, creation_site
from rrefrt.protocol.messages import ForkData, PythonCall, RemoteRequest
from rrefrt.rref import RRef, RRefHost, _invoke_on_owner
from rrefrt.runtime.callee import Callee
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore
from rrefrt.runtime.creation import UNKNOWN, CreationTracker
from rrefrt.runtime.lifecycle import Lifecycle
from rrefrt.runtime.payloads import Payloads
from rrefrt.runtime.requests import Requests, WaitedFuture, rref_text, translate

__all__ = ["Caller"]


class Caller:
    def __init__(self, core: WorkerCore, host: RRefHost, control: ControlLoop, lifecycle: Lifecycle,
                 payloads: Payloads, requests: Requests, creation: CreationTracker, callee: Callee) -> None:
        self.core = core
        #: what the RRef objects made here refer to (the worker's runtime)
        self.host = host
        self.control = control
        self.lifecycle = lifecycle
        self.payloads = payloads
        self.requests = requests
        self.creation = creation
        self.callee = callee

    # ------------------------------------------------------------------ calls (user thread)
    def rpc_async(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0,
                  waited: bool = False) -> Future[Any]:
        core = self.core
        core.check_running()
        dest = core.worker_info(to).id
        frames, forks = self.payloads.dumps_call(func, args, kwargs, dest)
        fut: Future[Any] = WaitedFuture() if waited else Future()
        fut._callback_pool = core.callbacks
        if waited:  # NOTE [Own reads] in transport/unix/receiver.py
            fut._reader = (core.transport.read_until, dest)
        call = self.requests.new_call(fut, dest, forks)
        call.func = func  # the error's text names it (formatted only if the call fails)
        if func is _invoke_on_owner and args:  # a proxy call: the RRef (only it is kept)
            target = args[0]
            call.owner_of = lambda: rref_text(target)  # noqa: E731
        deletes = self.requests.flush_drops(dest) if self.control.drops else ()  # NOTE [Drops]
        call.deletes = deletes
        # the forks are in wire form already (dumps): PythonCall.meta without the round trip
        self.requests.send(call, PythonCall.KIND, PythonCall.NAME, PythonCall.wire_meta(forks, deletes), frames,
                           core.timeout(timeout))
        return fut

    def rpc_sync(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> Any:
        fut = self.rpc_async(to, func, args, kwargs, timeout, waited=True)
        t = self.core.timeout(timeout)
        try:
            return fut.result(t + 5.0 if t > 0 else None)
        except BaseException:
            fut = None  # type: ignore[assignment]  # NOTE [No cycle through a raised error] (futures.py)
            raise

    def remote(self, to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
        core, ctx = self.core, self.core.ctx
        core.check_running()
        dest = core.worker_info(to).id
        tname = func.__qualname__ if isinstance(func, type) else "object"
        frames, forks = self.payloads.dumps_call(func, args, kwargs, dest)
        fork_data = tuple(ForkData.from_wire(f) for f in forks)
        if dest == core.info.id:
            rec = ctx.new_local_owner(_NO_VALUE, tname)
            msg = RemoteRequest(dest, rec.rref_id, rec.rref_id, tname, fork_data)
            rrefs = self.payloads.rrefs_from_forks(fork_data, dest)
            self.lifecycle.track_call(+1, dest)
            core.pool.submit(self.callee.run_call, dest, msg, 0, frames, rrefs, rec)
            return RRef._from_owner(self.host, rec)
        urec = ctx.new_remote_user(dest, tname, core.timeout(timeout))
        urec.site = creation_site()  # named by leak reports and OwnerDiedError (docs/stuck.md)
        # NOTE [Drops]; NOTE [Piggybacked deletes] in docs/protocol.md
        deletes = self.requests.flush_drops(dest) if self.control.drops else ()
        msg = RemoteRequest(dest, urec.rref_id, urec.fork_id, tname, fork_data, deletes)
        cell = self.creation.new(urec.fork_id)
        try:
            self.creation.send(msg, frames, cell)
        except transport.TransportError as e:
            self.control.deletes_delivered(dest, deletes, e)
            self.payloads.abort_forks(forks)
            # no RRef will hold the record: it leaves as a lost creation does (a delete for a
            # creation that may have reached the owner; its tombstone stops a late one)
            self.control.perform(ctx.abandon_user(urec.fork_id, translate(e, "remote()")))
            raise translate(e, "remote()") from None
        rref = RRef._from_user(self.host, urec)
        rref._creation = cell  # NOTE [Inline creation values] in rrefrt/runtime/creation.py
        return rref

    def fetch(self, rref: RRef[Any], timeout: float, waited: bool = False) -> Future[Any]:
        """``waited``: the caller only waits for the value (``to_here``): a WaitedFuture.
        An RRef created here by remote() may need no fetch: its creation's answer carried
        the value, or will (NOTE [Inline creation values] in rrefrt/runtime/creation.py)."""
        core = self.core
        rec = rref._user_rec
        assert rec is not None
        t = core.timeout(timeout)
        if not rec.confirmed and rec.creation_deadline is not None:
            left = rec.creation_deadline - time.monotonic()
            t = max(0.001, min(t, left)) if t > 0 else max(0.001, left)
        fut: Future[Any] = WaitedFuture() if waited else Future()
        fut._callback_pool = core.callbacks
        if waited:  # NOTE [Own reads] in transport/unix/receiver.py: the owner answers
            fut._reader = (core.transport.read_until, rec.owner)
        cell = rref._creation
        if cell is not None:
            value = cell.value
            if value is not UNKNOWN:  # a plain value, carried by the creation's answer
                fut._finish(value, None)
                return fut
            if cell.waiters is not None and self.creation.park(cell, rref, fut, t):
                return fut  # released by the creation's first answer
        self.creation.send_fetch(rref, fut, t)
        return fut

    def owner_value(self, rec: OwnerRecord, timeout: float) -> Any:
        core = self.core
        deadline = time.monotonic() + (timeout if timeout > 0 else 1e9)
        if not core.ctx.wait_value(rec, deadline):
            raise RpcTimeoutError(f"the value of RRef {rec.rref_id} on worker {core.info.name!r} was not created within {timeout:.3f}s")
        if rec.state == FAILED:
            raise fresh(rec.error)  # type: ignore[arg-type]
        return rec.value
