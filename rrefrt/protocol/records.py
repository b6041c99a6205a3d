"""The records the RRef context keeps: an owned value (``OwnerRecord``) and a user's fork
(``UserRecord``), and the states of an owned value.

Owns: these plain data classes and nothing else (no lock, no I/O, no protocol rule: the
rules that change them live in ``rrefrt/protocol/context.py``, which re-exports every name
here). Must not import the context, the runtime or the
transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rrefrt.protocol.ids import ForkId, RRefId

PENDING, READY, FAILED = "pending", "ready", "failed"


@dataclass(eq=False, slots=True, weakref_slot=True)
class OwnerRecord:
    """The value of an RRef on its owner."""

    rref_id: RRefId
    type_name: str = "object"
    state: str = PENDING  #: pending -> ready | failed (set once)
    value: Any = None
    error: BaseException | None = None
    created: bool = False  #: the creating call (or RRef(value)) has reached this worker
    waiters: list[tuple[int, int]] = field(default_factory=list)  #: fetches (src, msg_id) before the value


@dataclass(eq=False)
class UserRecord:
    """One fork of an RRef held by this (non-owner) worker."""

    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int
    type_name: str = "object"
    confirmed: bool = False  #: the owner has registered this fork
    #: False: a fork received in a call's arguments whose fork request was not sent (NOTE
    #: [Lazy registration] in docs/protocol.md); its parent's fork covers the value
    registered: bool = True
    alive: bool = True  #: the Python RRef object still exists
    children: int = 0  #: forks passed on from this one and not yet accepted
    error: BaseException | None = None  #: creation failure / owner death, raised on next use
    creation_deadline: float | None = None  #: remote(timeout): confirmation expected before
    #: its fork request was never acknowledged (retries exhausted: ``give_up_user``); the
    #: owner may have registered it all the same. It fails on every use; its delete, once
    #: it has no child pending, goes with the RREF_CHILD_ACCEPT its parent still waits for
    given_up: bool = False
    closed_by_shutdown: bool = False
    #: where the Python object was created: (file, line, function) of a remote() call, or a
    #: text (rref_audit.site_text writes either); "" if unknown (leak report, OwnerDiedError)
    site: Any = ""


class _NoValue:
    """The marker for "no value yet" (``RRef(value)`` vs a pending creation)."""


_NO_VALUE: Any = _NoValue()
