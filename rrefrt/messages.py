"""Message kinds on the wire and the protocol actions the RRef context asks its caller to
perform. See docs/protocol.md for the message table.

Imports from rrefrt: ids (leaf).

Every kind is a request answered by a RESPONSE of the transport (the "ack"); ``meta`` is
plain msgpack (never pickled). Payload frames - present only where the table says so - are a
pickle-5 stream followed by its out-of-band buffers (tensor storage), decoded only after the
header passed validation.

    kind              sender -> receiver     meta (request)                      payload
    PYTHON_CALL       caller -> callee       [forks]                             (func, args, kwargs)
    PYTHON_REMOTE     caller -> owner        [rref_id, fork_id, type, forks]     (func, args, kwargs)
                      answered at once (accepted); retried until accepted, deduplicated by
                      fork id on the owner, so the function runs once
    REMOTE_RET        owner  -> caller       [rref_id, status]                   error if status ERROR
    RREF_FETCH        user   -> owner        [rref_id, fork_id]                  -
    RREF_FORK_REQUEST child  -> owner        [rref_id, fork_id, parent]          -
    RREF_CHILD_ACCEPT child/owner -> parent  [fork_id]                           -
    RREF_USER_DELETE  user   -> owner        [rref_id, fork_id]                  -

    response meta: [status, forks, error_kind]   status OK=0 / ERROR=1; payload = value or
    the pickled error; forks = fork data of RRefs inside the payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ids import ForkId, RRefId

PYTHON_CALL = 16
PYTHON_REMOTE = 17
RREF_FETCH = 18
RREF_FORK_REQUEST = 19
RREF_CHILD_ACCEPT = 20
RREF_USER_DELETE = 21
REMOTE_RET = 22

CONTROL_KINDS = frozenset({RREF_FETCH, RREF_FORK_REQUEST, RREF_CHILD_ACCEPT, RREF_USER_DELETE, REMOTE_RET})
KIND_NAMES = {
    PYTHON_CALL: "PYTHON_CALL",
    PYTHON_REMOTE: "PYTHON_REMOTE",
    RREF_FETCH: "RREF_FETCH",
    RREF_FORK_REQUEST: "RREF_FORK_REQUEST",
    RREF_CHILD_ACCEPT: "RREF_CHILD_ACCEPT",
    RREF_USER_DELETE: "RREF_USER_DELETE",
    REMOTE_RET: "REMOTE_RET",
}

OK, ERROR = 0, 1


@dataclass(frozen=True, slots=True)
class ForkData:
    """What travels for one RRef inside a message (msgpack, in the header)."""

    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int
    type_name: str

    def to_wire(self) -> list[Any]:
        return [self.rref_id.to_wire(), self.fork_id.to_wire(), self.owner, self.parent, self.type_name]

    @classmethod
    def from_wire(cls, data: Any) -> "ForkData":
        rid, fid, owner, parent, tname = data
        if type(owner) is not int or type(parent) is not int or type(tname) is not str:
            raise ValueError("bad fork data")
        return cls(RRefId.from_wire(rid), ForkId.from_wire(fid), owner, parent, tname)


# ---- actions returned by the context; the caller performs them after releasing its lock
@dataclass(frozen=True, slots=True)
class ForkRequest:
    dest: int  # the owner
    rref_id: RRefId
    fork_id: ForkId
    parent: int


@dataclass(frozen=True, slots=True)
class ChildAccept:
    dest: int  # the parent
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class UserDelete:
    dest: int  # the owner
    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class ServeFetch:
    """Answer a fetch that waited for the value: respond to ``src``'s request ``msg_id``."""

    src: int
    msg_id: int
    record: Any  # OwnerRecord


@dataclass(frozen=True, slots=True)
class Release:
    """An OwnerRecord left the owners map; drop it outside the lock (its value's destructor
    may run user code)."""

    record: Any


Action = ForkRequest | ChildAccept | UserDelete | ServeFetch | Release
