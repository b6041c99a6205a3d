"""Functions the lazy-registration tests (tests/protocol/test_lazy_forks.py) call remotely
(NOTE [Lazy registration] in docs/protocol.md); importable on every worker."""

from __future__ import annotations

import threading
import time
from typing import Any

import rrefrt
from rrefrt import faults

_kept: list = []


def count_protocol() -> bool:
    """Count (never delay: delay 0) every RREF_* message this worker sends."""
    return faults.install(faults.FaultPlan([faults.Rule("RREF_*", "delay", delay=0.0)]))


def sent() -> dict:
    """``{label: n}`` of the RREF_* messages sent since ``count_protocol``."""
    return {k.split(":", 1)[1]: n for k, n in faults.stats().items()}


def state() -> dict:
    """This worker's RRef counts, after checking every invariant of its context."""
    rt = rrefrt.state.current()
    rt.ctx.validate()
    return rt.ctx.counts()


def registered_at_start(rref: rrefrt.RRef) -> bool:
    """Whether the received fork was registered when the function ran (it drops it)."""
    return getattr(rref._user_rec, "registered", True)


def keep(rref: rrefrt.RRef) -> bool:
    _kept.append(rref)
    return getattr(rref._user_rec, "registered", True)


def drop_kept() -> int:
    n = len(_kept)
    _kept.clear()
    return n


def relay(rref: rrefrt.RRef, to: str) -> Any:
    """Fork an unregistered fork onward, to a function that drops it."""
    assert not getattr(rref._user_rec, "registered", False)
    return rrefrt.rpc_sync(to, registered_at_start, args=(rref,))


def confirmed(rref: rrefrt.RRef) -> tuple:
    registered = getattr(rref._user_rec, "registered", True)
    return registered, rref.confirmed_by_owner(), rref.to_here()


def wait_for_death_then_fetch(rref: rrefrt.RRef, worker: str, seconds: float = 20.0) -> tuple:
    """Hold an unregistered fork until ``worker`` is declared dead here, then use it.
    Returns (registered at start, registered after the death, the value or the error's
    type name, seconds the fetch took)."""
    rt = rrefrt.state.current()
    wid = rrefrt.get_worker_info(worker).id
    at_start = getattr(rref._user_rec, "registered", True)
    deadline = time.monotonic() + seconds
    while wid not in rt.transport.dead_peers() and time.monotonic() < deadline:
        threading.Event().wait(0.02)  # polls a condition; the kill is the test's
    after = getattr(rref._user_rec, "registered", True)
    t0 = time.monotonic()
    try:
        value: Any = rref.to_here(timeout=10)
    except rrefrt.RpcError as e:
        value = type(e).__name__
    out = (at_start, after, value, time.monotonic() - t0)
    _outcomes.append(out)
    return out


_outcomes: list = []


def outcomes() -> list:
    return list(_outcomes)


def hand_kept_on(to: str, worker: str) -> bool:
    """On the parent: start ``wait_for_death_then_fetch`` on ``to`` with a fork of the RRef
    this worker keeps (it will be killed while that runs) and return at once."""
    _kept.append(rrefrt.rpc_async(to, wait_for_death_then_fetch, args=(_kept[0], worker)))
    return True
