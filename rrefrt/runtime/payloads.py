"""Payloads with their forks, both ways: pickling what a message carries (forking the RRefs
inside it, undoing those forks when it is never sent) and turning the forks a message
brought into RRef objects.

Owns: ``dumps`` / ``dumps_call`` (with the device plan's route for the destination),
``fork`` / ``abort_forks``, ``rrefs_from_forks`` and the lazy registration of a call's
received forks (``unregistered`` / ``register_survivors``, NOTE [Lazy registration] in
docs/protocol.md). Used by both sides of a call (requests, the callee, remote()); the
protocol messages each fork implies are performed through the control loop.

Threads: any; ``rrefs_from_forks`` runs on the transport thread for answers and calls
(no user code: no unpickling happens here).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from rrefrt.errors import ArgumentError, RpcError
from rrefrt.payload import serialization as ser
from rrefrt.protocol.context import OwnerRecord
from rrefrt.protocol.messages import ForkData
from rrefrt.rref import RRef, RRefHost
from rrefrt.runtime.control import ControlLoop
from rrefrt.runtime.core import WorkerCore

__all__ = ["Payloads"]


class Payloads:
    def __init__(self, core: WorkerCore, control: ControlLoop, host: RRefHost) -> None:
        self.core = core
        self.control = control
        #: what the RRef objects made here refer to (the worker's runtime)
        self.host = host

    # ------------------------------------------------------------------ outgoing
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
        us (NOTE [Device maps] in rrefrt/payload/devices.py)."""
        core = self.core
        plan = core.devices
        route = None
        if plan is not None:
            peer = core.worker_name(dest)  # a member may leave meanwhile (dynamic groups)
            route = plan.reply_route(peer) if reply else plan.request_route(peer)
        try:
            return ser.dumps(obj, lambda r: self.fork(r, dest), route=route)
        except Exception as e:
            self.abort_forks(getattr(e, "forks", []))
            raise

    def fork(self, rref: RRef[Any], dest: int) -> list[Any]:
        ctx = self.core.ctx
        if rref._rt is not self.host:
            raise RpcError(f"{rref!r} belongs to another (shut down) RPC group")
        rref._check()
        if rref._owner_rec is not None:
            return ctx.fork_owned(rref._owner_rec, dest).to_wire()
        return ctx.fork_user(rref._user_rec, dest).to_wire()  # type: ignore[arg-type]

    def abort_forks(self, forks: list[Any]) -> None:
        """The message carrying these forks (wire form) was never sent."""
        for f in forks:
            self.control.perform(self.core.ctx.abort_fork(ForkData.from_wire(f)))

    # ------------------------------------------------------------------ incoming
    def rrefs_from_forks(self, forks: Sequence[ForkData], src: int, lazy: bool = False) -> list[RRef[Any]]:
        """RRef objects for the forks a message from ``src`` carried (no user code); the
        protocol messages this implies are sent now. ``lazy``: the arguments of a call, whose
        forks from other users stay unregistered until ``register_survivors`` (NOTE [Lazy
        registration] in docs/protocol.md)."""
        core, host = self.core, self.host
        out = []
        strict = core.options.strict_rref_leaks
        for data in forks:
            rec, actions = core.ctx.on_fork_received(data, src, lazy)
            if isinstance(rec, OwnerRecord):
                out.append(RRef._from_owner(host, rec))
            else:
                if strict:
                    rec.site = f"received from worker {core.worker_name(src)!r}"
                out.append(RRef._from_user(host, rec))
            self.control.perform(actions)
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
            self.control.perform(self.core.ctx.register_users(recs))

    @staticmethod
    def unregistered(rrefs: Sequence[RRef[Any]]) -> list["weakref.ref[RRef[Any]]"]:
        """Weak references to the RRefs among ``rrefs`` whose fork is not registered yet."""
        return [weakref.ref(r) for r in rrefs if r._user_rec is not None and not r._user_rec.registered]
