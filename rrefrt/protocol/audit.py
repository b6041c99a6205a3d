"""Read-only views of an RRef context for diagnostics: the counts of ``get_debug_info()``,
the leak reports of a strict shutdown, the invariant check the tests run, and where user
code created an RRef.

Owns: ``ContextAudit``, a mixin of ``RRefContext`` whose methods only read the context's
maps under its lock (they change nothing, send nothing, wait for nothing), and
``creation_site``. Must not import the context itself
(it is a base class of it), the runtime or the transport.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

from rrefrt.protocol.records import PENDING, OwnerRecord, UserRecord

if TYPE_CHECKING:
    from rrefrt.protocol.ids import ForkId, RRefId


class ContextAudit:
    """The diagnostics of ``RRefContext`` (the maps are its own; see its ``__init__``)."""

    _lock: threading.Lock
    owners: dict[RRefId, OwnerRecord]
    forks: dict[RRefId, dict[ForkId, int]]
    pending_users: dict[ForkId, UserRecord]
    confirmed_users: dict[ForkId, UserRecord]
    deleting_users: dict[ForkId, UserRecord]
    pending_children: dict[ForkId, tuple[UserRecord, int]]
    dead: set[int]

    def live_user_sites(self) -> list[str]:
        """User forks whose Python object is still referenced (strict leak check)."""
        with self._lock:
            return [
                f"RRef {r.rref_id} (fork {r.fork_id}, owner worker {r.owner}) created at {site_text(r.site) or '<unknown>'}"
                for r in list(self.pending_users.values()) + list(self.confirmed_users.values())
                if r.alive
            ]

    def leaks(self) -> list[str]:
        with self._lock:
            return [
                f"RRef {rid} fork {fid} held by worker {holder}"
                for rid, forks in self.forks.items()
                for fid, holder in forks.items()
                if holder not in self.dead
            ]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(f) for f in self.forks.values()),
                "num_pending_users": len(self.pending_users),
                "num_pending_children": len(self.pending_children),
                "num_confirmed_users": len(self.confirmed_users),
                "num_deleting_users": len(self.deleting_users),
                "num_unregistered_users": sum(not r.registered for r in self.pending_users.values()),
            }

    # ------------------------------------------------------------------ invariants
    def validate(self) -> None:
        """Check every invariant; raise AssertionError naming the broken one."""
        with self._lock:
            for rid, forks in self.forks.items():
                assert forks, f"empty fork set kept for {rid}"
                assert rid in self.owners, f"forks of {rid} without an owner record"
            for rid, rec in self.owners.items():
                assert rec.rref_id == rid
                if not self.forks.get(rid):
                    assert rec.state == PENDING, f"owner record {rid} kept with no fork"
                assert rec.state == PENDING or not rec.waiters, f"{rid} has waiters but a value"
            tables = (self.pending_users, self.confirmed_users, self.deleting_users)
            for i, a in enumerate(tables):
                for b in tables[i + 1 :]:
                    assert not (a.keys() & b.keys()), "a user fork is in two user maps"
            for fid, rec in self.pending_users.items():
                assert not rec.confirmed and rec.fork_id == fid
                if not rec.registered:  # NOTE [Lazy registration]: covered by its parent
                    assert rec.parent != rec.owner, f"unregistered fork {fid} has no user parent"
                    assert rec.parent not in self.dead and rec.owner not in self.dead, f"unregistered fork {fid} lost its cover (G3)"
                    assert rec.alive or rec.children > 0, f"dropped unregistered fork {fid} kept without children"
            for fid, rec in self.confirmed_users.items():
                assert rec.confirmed and rec.registered and rec.fork_id == fid
                assert rec.alive or rec.children > 0, f"dropped user {fid} kept without children"
            for fid, rec in self.deleting_users.items():
                assert rec.confirmed and rec.registered and not rec.alive and rec.children == 0, f"early delete of {fid} (G1)"
            count: dict[int, int] = {}
            for fid, (parent, _) in self.pending_children.items():
                count[id(parent)] = count.get(id(parent), 0) + 1
                assert (
                    parent.fork_id in self.pending_users or parent.fork_id in self.confirmed_users
                ), f"pending child {fid} whose parent fork {parent.fork_id} is gone (G2)"
            for rec in list(self.pending_users.values()) + list(self.confirmed_users.values()):
                assert rec.children == count.get(id(rec), 0), f"child count of {rec.fork_id} is off"


def creation_site() -> tuple[str, int, str] | str:
    """The first frame outside rrefrt: where user code created an RRef, as (file, line,
    function) (``site_text`` writes it "file:line in function"). Cheap enough to run on
    every remote() (a walk of a few frames; no source line read, no text made, no frame
    kept): the leak report and OwnerDiedError name it."""
    frame = sys._getframe(1)
    try:
        for _ in range(12):
            if frame is None:
                break
            code = frame.f_code
            file = code.co_filename
            if not file.startswith(_PKG):
                return (file, frame.f_lineno, code.co_name)
            frame = frame.f_back
        return "<unknown>"
    finally:
        del frame


def site_text(site: tuple[str, int, str] | str) -> str:
    """A creation site as text ("file:line in function"); "" when unknown."""
    if type(site) is tuple:
        return f"{site[0]}:{site[1]} in {site[2]}"
    return site  # type: ignore[return-value]


#: rrefrt's own files (a user's checkout may be in a folder named rrefrt too)
_PKG = os.path.dirname(os.path.dirname(__file__)) + os.sep  # rrefrt/, as the code objects name it (relative if imported so)
