"""The message table: one frozen dataclass per message kind, decoded once on arrival, and
the protocol actions the RRef context asks its caller to perform.

See docs/protocol.md for the protocol itself.

One name per message: the class (``ForkRequest``) is what the context returns as an
action, what the runtime sends, what ``decode`` returns on arrival, what the control thread
handles and what the tests build. Its ``NAME`` (``"RREF_FORK_REQUEST"``) is the label the
fault hook and the logs use; its ``KIND`` is the int on the wire. Nothing else names it.

Every kind is a request answered by a RESPONSE of the transport (the "ack"); ``meta`` is
plain msgpack (never pickled). Payload frames - present only where the table says so - are a
pickle-5 stream followed by its out-of-band buffers (tensor storage), decoded only after the
header passed validation (``decode``), which is the only place meta is parsed.

    class          NAME (label)       KIND  sender -> receiver     meta (request)                   payload
    PythonCall     PYTHON_CALL        16    caller -> callee       [forks(, deletes)]               (func, args, kwargs)
    RemoteRequest  PYTHON_REMOTE      17    caller -> owner        [rref_id, fork_id, type, forks   (func, args, kwargs)
                                                                    (, deletes)]
                   deletes: optional, flat [rref w, rref n, fork w, fork n, ...] as in RREF_USER_DELETES, applied
                   by the receiver before it handles the call; the call's answer acknowledges
                   them (NOTE [Piggybacked deletes] in docs/protocol.md)
                   retried until answered, deduplicated by fork id on the owner, so the
                   function runs once; see NOTE [Creation acks] in rrefrt/runtime/creation.py
    Fetch          RREF_FETCH         18    user   -> owner        [rref_id, fork_id]               -
    ForkRequest    RREF_FORK_REQUEST  19    child  -> owner        [rref_id, fork_id, parent]       -
                   answered OK (registered) or, when the value is gone, ERROR with two frames:
                   the error's type name and text (not pickled)
    ChildAccept    RREF_CHILD_ACCEPT  20    child/owner -> parent  [fork_id]                        -
    UserDelete     RREF_USER_DELETE   21    user   -> owner        [rref_id, fork_id]               -
    UserDeletes    RREF_USER_DELETES  23    user   -> owner        [rref w, rref n, fork w, fork n, ...] -
                   several UserDelete in one message (NOTE [Drops] in rrefrt/runtime/control.py)
    ChildAccepts   RREF_CHILD_ACCEPTS 24    child  -> parent       [fork_id, ...]                   -
                   several ChildAccept in one message (NOTE [Lazy registration] in
                   docs/protocol.md: the accepts of dropped call arguments)
    RemoteRet      REMOTE_RET         22    owner  -> caller       [rref_id, status(, value)]       error if status ERROR
    StackQuery     CALL_STACK_QUERY   25    caller -> callee       [msg_id] or [0, rref_id]         -
                   "where is my call?", sent only when a call timed out (or a shutdown gave up):
                   the call by the msg_id of its request, or the remote() creation of rref_id;
                   handled on the transport thread (never the user pool, so a full pool still
                   answers). Its answer's meta is [state, function, age, frames] (rrefrt/
                   inflight.py ``InFlight.describe``), not the response meta below

    response meta: [status, forks] or, answering PYTHON_REMOTE, [status, forks, done(, value)]
        status   OK=0 / ERROR=1; the payload is the value, or the pickled error
        forks    fork data of the RRefs inside the payload (``ForkData.to_wire``)
        done     PYTHON_REMOTE only: 1 = the value (or error) exists and this answer is its
                 result (no REMOTE_RET follows); 0 = accepted only, REMOTE_RET follows
        value    PYTHON_REMOTE done with OK, and REMOTE_RET with OK, optionally: the created
                 value itself when it is plain and immutable (``INLINE_TYPES``: None, bool,
                 int, float, str, bytes, as msgpack carries them), so the creator's
                 ``to_here()`` needs no fetch (NOTE [Inline creation values] in
                 rrefrt/runtime/creation.py). Absent: the creator fetches. A peer of an older
                 version rejects the longer meta (no mixed versions in one group).

A message ``dest`` is the worker it goes to; a decoded message has ``dest`` = the receiver.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from rrefrt.protocol.ids import ForkId, RRefId

OK, ERROR = 0, 1

#: the types of a value that may ride in a creation's answer meta (exactly these: msgpack
#: gives back these types, never a subclass; see ``value`` in the docstring)
INLINE_TYPES = (type(None), bool, int, float, str, bytes)


#: the largest str (in UTF-8) or bytes value that rides in a creation's answer meta
INLINE_VALUE_BYTES = 64 * 1024
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


def inline_value(value: Any) -> tuple[Any, ...]:
    """``(value,)`` if ``value`` may ride in a creation's answer meta: of a type in
    ``INLINE_TYPES`` exactly (a subclass may carry state, and msgpack would return the base
    type), an int msgpack can carry, a str/bytes of at most ``INLINE_VALUE_BYTES`` (a str
    must encode as UTF-8: no lone surrogates); else ``()``. Such a value is immutable and
    holds no RRef or tensor, so the creator may keep it (NOTE [Inline creation values])."""
    t = type(value)
    if value is None or t is bool or t is float:
        return (value,)
    if t is int:
        return (value,) if _INT_MIN <= value <= _INT_MAX else ()
    if t is bytes:
        return (value,) if len(value) <= INLINE_VALUE_BYTES else ()
    if t is str and len(value) <= INLINE_VALUE_BYTES:
        if value.isascii():
            return (value,)
        try:
            return (value,) if len(value.encode("utf-8")) <= INLINE_VALUE_BYTES else ()
        except UnicodeEncodeError:
            return ()
    return ()


def _inline(raw: Any) -> tuple[Any, ...]:
    """The optional value of a creation's answer, as a 1-tuple (validated)."""
    if type(raw) not in INLINE_TYPES:
        raise ValueError(f"an inline value must be plain, got {type(raw).__name__}")
    return (raw,)


class MalformedMessage(ValueError):
    """A message whose meta does not have the shape of its kind (counted and dropped)."""


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


def _forks(raw: Any) -> tuple[ForkData, ...]:
    if type(raw) is not list:
        raise ValueError("fork list expected")
    return tuple(ForkData.from_wire(f) for f in raw)


def _rid(raw: Any) -> RRefId:
    return RRefId.from_wire(raw)


def _deletes_wire(deletes: tuple) -> list[int]:
    """((rref id, fork id), ...) -> the flat ``[rref worker, rref n, fork worker, fork n, ...]``
    (one C call; a nested list costs an owner about 1 us per delete to decode and check)."""
    return list(itertools.chain.from_iterable(itertools.chain.from_iterable(deletes)))


def _deletes(raw: Any) -> tuple:
    """The flat wire form -> ``((rref id, fork id), ...)``, checked in whole-list C calls,
    the ids left as plain ``(worker, n)`` tuples, which hash and compare as ids do (an owner
    decodes a thousand deletes at once in the benchmark's drain; ``RRefContext`` makes named
    ids where it needs their fields)."""
    if type(raw) is not list or not raw or len(raw) % 4 or set(map(type, raw)) != {int}:
        raise ValueError("delete list expected: [rref worker, rref n, fork worker, fork n, ...]")
    it = iter(raw)
    ids = zip(it, it)
    return tuple(zip(ids, ids))


# ---------------------------------------------------------------------------- messages
_PLAIN_CALL_META: list[Any] = [[]]
_plain_calls: dict[int, "PythonCall"] = {}  #: dest -> PythonCall(dest): a call with no forks, no deletes

@dataclass(frozen=True, slots=True)
class PythonCall:
    KIND: ClassVar[int] = 16
    NAME: ClassVar[str] = "PYTHON_CALL"
    dest: int
    forks: tuple[ForkData, ...] = ()
    #: NOTE [Piggybacked deletes] in docs/protocol.md: ((rref_id, fork_id), ...) to apply first
    deletes: tuple = ()

    def meta(self) -> list[Any]:
        return self.wire_meta([f.to_wire() for f in self.forks], self.deletes)

    @staticmethod
    def wire_meta(forks: list[Any], deletes: tuple = ()) -> list[Any]:
        """The meta of a call whose forks are in wire form already (``ForkData.to_wire``),
        without building the message (the caller's hot path)."""
        return [forks, _deletes_wire(deletes)] if deletes else [forks]

    @classmethod
    def decode(cls, dest: int, meta: list) -> "PythonCall":
        if meta == _PLAIN_CALL_META and type(meta[0]) is list:  # no forks, no deletes: the common case
            plain = _plain_calls.get(dest)
            if plain is None:
                plain = _plain_calls[dest] = cls(dest)
            return plain  # immutable: one per destination, no allocation per call
        forks, *rest = meta
        if len(rest) > 1:
            raise ValueError("too many fields")
        return cls(dest, _forks(forks), _deletes(rest[0]) if rest else ())


@dataclass(frozen=True, slots=True)
class RemoteRequest:
    KIND: ClassVar[int] = 17
    NAME: ClassVar[str] = "PYTHON_REMOTE"
    dest: int
    rref_id: RRefId
    fork_id: ForkId
    type_name: str
    forks: tuple[ForkData, ...] = ()
    #: NOTE [Piggybacked deletes] in docs/protocol.md: ((rref_id, fork_id), ...) to apply first
    deletes: tuple = ()

    def meta(self) -> list[Any]:
        meta = [self.rref_id.to_wire(), self.fork_id.to_wire(), self.type_name, [f.to_wire() for f in self.forks]]
        if self.deletes:
            meta.append(_deletes_wire(self.deletes))
        return meta

    @classmethod
    def decode(cls, dest: int, meta: list) -> "RemoteRequest":
        rid, fid, tname, forks, *rest = meta
        if type(tname) is not str:
            raise ValueError("type name must be a string")
        if len(rest) > 1:
            raise ValueError("too many fields")
        return cls(dest, _rid(rid), ForkId.from_wire(fid), tname, _forks(forks), _deletes(rest[0]) if rest else ())


class _OwnerForkMessage:
    """The wire form shared by messages that name one fork of an RRef to its owner:
    meta ``[rref_id, fork_id]`` (Fetch, UserDelete)."""

    __slots__ = ()
    rref_id: RRefId
    fork_id: ForkId

    def meta(self) -> list[Any]:
        return [self.rref_id.to_wire(), self.fork_id.to_wire()]

    @classmethod
    def decode(cls, dest: int, meta: list) -> Any:
        rid, fid = meta
        return cls(dest, _rid(rid), ForkId.from_wire(fid))  # type: ignore[call-arg]


@dataclass(frozen=True, slots=True)
class Fetch(_OwnerForkMessage):
    KIND: ClassVar[int] = 18
    NAME: ClassVar[str] = "RREF_FETCH"
    dest: int  # the owner
    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class ForkRequest:
    KIND: ClassVar[int] = 19
    NAME: ClassVar[str] = "RREF_FORK_REQUEST"
    dest: int  # the owner
    rref_id: RRefId
    fork_id: ForkId
    parent: int

    def meta(self) -> list[Any]:
        return [self.rref_id.to_wire(), self.fork_id.to_wire(), self.parent]

    @classmethod
    def decode(cls, dest: int, meta: list) -> "ForkRequest":
        rid, fid, parent = meta
        if type(parent) is not int:
            raise ValueError("parent must be a worker id")
        return cls(dest, _rid(rid), ForkId.from_wire(fid), parent)


@dataclass(frozen=True, slots=True)
class ChildAccept:
    KIND: ClassVar[int] = 20
    NAME: ClassVar[str] = "RREF_CHILD_ACCEPT"
    dest: int  # the parent
    fork_id: ForkId

    def meta(self) -> list[Any]:
        return [self.fork_id.to_wire()]

    @classmethod
    def decode(cls, dest: int, meta: list) -> "ChildAccept":
        (fid,) = meta
        return cls(dest, ForkId.from_wire(fid))


@dataclass(frozen=True, slots=True)
class UserDelete(_OwnerForkMessage):
    KIND: ClassVar[int] = 21
    NAME: ClassVar[str] = "RREF_USER_DELETE"
    dest: int  # the owner
    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class UserDeletes:
    """Several ``UserDelete`` to one owner in one message (the deletes of RRefs dropped
    together: NOTE [Drops] in rrefrt/runtime/control.py). Handled and acknowledged as a whole."""

    KIND: ClassVar[int] = 23
    NAME: ClassVar[str] = "RREF_USER_DELETES"
    dest: int  # the owner
    deletes: tuple  #: ((rref_id, fork_id), ...)

    def meta(self) -> list[Any]:
        return _deletes_wire(self.deletes)

    @classmethod
    def decode(cls, dest: int, meta: list) -> "UserDeletes":
        return cls(dest, _deletes(meta))


@dataclass(frozen=True, slots=True)
class ChildAccepts:
    """Several ``ChildAccept`` to one parent in one message (the accepts of unregistered
    forks dropped together: NOTE [Lazy registration] in docs/protocol.md). Handled and
    acknowledged as a whole."""

    KIND: ClassVar[int] = 24
    NAME: ClassVar[str] = "RREF_CHILD_ACCEPTS"
    dest: int  # the parent
    fork_ids: tuple  #: (fork_id, ...)

    def meta(self) -> list[Any]:
        return [[*fid] for fid in self.fork_ids]  # ids are (worker, n) tuples

    @classmethod
    def decode(cls, dest: int, meta: list) -> "ChildAccepts":
        if not meta:
            raise ValueError("no accepts")
        return cls(dest, tuple(ForkId.from_wire(fid) for fid in meta))


@dataclass(frozen=True, slots=True)
class RemoteRet:
    """The owner's result of a remote() whose answer was not ``done`` (an accept only).
    ``rref_id`` is also the creator's fork id."""

    KIND: ClassVar[int] = 22
    NAME: ClassVar[str] = "REMOTE_RET"
    dest: int  # the creator
    rref_id: RRefId
    status: int
    #: the pickled error when status is ERROR (payload frames, not meta)
    payload: tuple = field(default=(), compare=False, repr=False)
    #: ``(value,)``: the plain value itself (status OK only; NOTE [Inline creation values])
    inline: tuple = field(default=(), compare=False, repr=False)

    def meta(self) -> list[Any]:
        if self.inline:
            return [self.rref_id.to_wire(), self.status, self.inline[0]]
        return [self.rref_id.to_wire(), self.status]

    @classmethod
    def decode(cls, dest: int, meta: list) -> "RemoteRet":
        if len(meta) not in (2, 3):
            raise ValueError("REMOTE_RET meta must be [rref_id, status] or [rref_id, status, value]")
        rid, status = meta[0], meta[1]
        if status not in (OK, ERROR) or type(status) is not int:
            raise ValueError("status must be OK or ERROR")
        inline = _inline(meta[2]) if len(meta) == 3 and status == OK else ()
        return cls(dest, _rid(rid), status, (), inline)


@dataclass(frozen=True, slots=True)
class StackQuery:
    """Where is a call now (docs/stuck.md)? ``call_id``: the msg_id of the caller's
    request (the receiver adds the tag bits of this query's own id, rrefrt/inflight.py
    ``TAG_MASK``); 0 with ``rref_id``: the remote() creation of that RRef."""

    KIND: ClassVar[int] = 25
    NAME: ClassVar[str] = "CALL_STACK_QUERY"
    dest: int  # the callee
    call_id: int
    rref_id: RRefId | None = None

    def meta(self) -> list[Any]:
        return [self.call_id] if self.rref_id is None else [0, self.rref_id.to_wire()]

    @classmethod
    def decode(cls, dest: int, meta: list) -> "StackQuery":
        if not meta or type(meta[0]) is not int or meta[0] < 0:
            raise ValueError("call id must be an int >= 0")
        if len(meta) == 1 and meta[0] > 0:
            return cls(dest, meta[0])
        call_id, rid = meta
        if call_id != 0:
            raise ValueError("a creation's query has call id 0")
        return cls(dest, 0, _rid(rid))


Message = (PythonCall | RemoteRequest | Fetch | ForkRequest | ChildAccept | ChildAccepts | UserDelete | UserDeletes
           | RemoteRet | StackQuery)

#: the message table: wire kind -> class (docstring above); the runtime's handler table
#: (rrefrt/runtime/root.py, ``Runtime.HANDLERS``) sits beside it, one entry per class
MESSAGES: dict[int, type] = {
    cls.KIND: cls
    for cls in (PythonCall, RemoteRequest, Fetch, ForkRequest, ChildAccept, ChildAccepts, UserDelete, UserDeletes, RemoteRet,
                StackQuery)
}
#: kind -> label, for the transport's fault hook and logs
KIND_NAMES: dict[int, str] = {kind: cls.NAME for kind, cls in MESSAGES.items()}


def decode(kind: int, meta: Any, dest: int) -> Message:
    """Validate and parse a message header in one step; raise MalformedMessage for an
    unknown kind or meta of the wrong shape. Nothing is unpickled here."""
    cls = MESSAGES.get(kind) if type(kind) is int else None
    if cls is None:
        raise MalformedMessage(f"unknown message kind {kind!r}")
    if type(meta) is not list:
        raise MalformedMessage(f"{cls.NAME}: meta must be a list, got {type(meta).__name__}")
    try:
        return cls.decode(dest, meta)  # type: ignore[attr-defined, no-any-return]
    except (ValueError, TypeError) as e:
        raise MalformedMessage(f"{cls.NAME}: malformed meta: {e}") from None


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response meta (see the docstring): validated once, on arrival."""

    status: int
    forks: tuple[ForkData, ...] = ()
    done: bool = False
    #: answering PYTHON_REMOTE, done and OK: ``(value,)`` when the plain value rides in the
    #: meta (NOTE [Inline creation values] in rrefrt/runtime/creation.py); else ``()``
    inline: tuple = ()

    def meta(self, with_done: bool = False) -> list[Any]:
        out: list[Any] = [self.status, [f.to_wire() for f in self.forks]]
        if with_done:
            out.append(1 if self.done else 0)
            if self.inline:
                out.append(self.inline[0])
        return out

    @classmethod
    def decode(cls, meta: Any) -> "Response":
        try:
            if type(meta) is not list or not 2 <= len(meta) <= 4:
                raise ValueError("response meta must be [status, forks], [status, forks, done] or [status, forks, done, value]")
            status = meta[0]
            if type(status) is not int or status not in (OK, ERROR):
                raise ValueError(f"bad status {status!r}")
            if len(meta) == 2:
                return cls(status, _forks(meta[1]))
            done = bool(meta[2])
            inline = _inline(meta[3]) if len(meta) == 4 and done and status == OK else ()
            return cls(status, _forks(meta[1]), done, inline)
        except (ValueError, TypeError) as e:
            raise MalformedMessage(f"malformed response: {e}") from None


# ---- actions returned by the context besides the messages above; the caller performs them
# after releasing its lock (see the home-thread table in rrefrt/runtime/control.py)
@dataclass(frozen=True, slots=True)
class ServeFetch:
    """Answer a fetch that waited for the value: respond to ``src``'s request ``msg_id``."""

    src: int
    msg_id: int
    record: Any  # OwnerRecord


@dataclass(frozen=True, slots=True)
class Release:
    """An OwnerRecord left the owners map; drop it outside the lock (its value's destructor
    may run user code, so never on the control thread)."""

    record: Any


@dataclass(frozen=True, slots=True)
class Releases:
    """Several ``Release`` at once (an owner's batch of deletes freed many values); the
    performer moves the records out of ``records`` (NOTE [Release home] in control.py)."""

    records: list


Action = ForkRequest | ChildAccept | UserDelete | ServeFetch | Release | Releases


#: NOTE [Drops] in rrefrt/runtime/control.py: the most deletes one RREF_USER_DELETES (or one call) carries
DELETES_PER_MESSAGE = 2048


def child_accepts(dest: int, c: list[ChildAccept]) -> ChildAccepts:
    return ChildAccepts(dest, tuple(x.fork_id for x in c))


def batch_actions(actions: list[Action]) -> list[Action]:
    """How the actions of the RRef context travel: the UserDelete actions to one owner
    become one UserDeletes, and the ChildAccept actions to one parent one ChildAccepts
    (NOTE [Lazy registration] in docs/protocol.md), at the place of the first (the list is
    returned as it is unless some owner or parent gets several)."""
    actions = batch_kind(actions, ChildAccept, child_accepts)
    return batch_kind(actions, UserDelete, lambda dest, c: UserDeletes(dest, tuple((x.rref_id, x.fork_id) for x in c)))


def batch_kind(actions: list[Action], kind: type, many: Callable[[int, list[Any]], Action]) -> list[Action]:
    """The ``kind`` actions to one worker become ``many(dest, chunk)`` (at most
    ``DELETES_PER_MESSAGE`` each) at the place of the first; a lone one stays as it is."""
    if sum(type(a) is kind for a in actions) < 2:
        return actions
    by_dest: dict[int, list[Any]] = {}
    for a in actions:
        if type(a) is kind:
            by_dest.setdefault(a.dest, []).append(a)
    out: list[Action] = []
    for a in actions:
        if type(a) is not kind:
            out.append(a)
            continue
        same = by_dest.pop(a.dest, None)
        if same is None:
            continue  # batched with the first one to its worker
        for i in range(0, len(same), DELETES_PER_MESSAGE):
            chunk = same[i : i + DELETES_PER_MESSAGE]
            out.append(chunk[0] if len(chunk) == 1 else many(a.dest, chunk))
    actions.clear()
    return out


# wire kind constants, kept for the transport tests and the fault labels' readers
PYTHON_CALL = PythonCall.KIND
PYTHON_REMOTE = RemoteRequest.KIND
RREF_FETCH = Fetch.KIND
RREF_FORK_REQUEST = ForkRequest.KIND
RREF_CHILD_ACCEPT = ChildAccept.KIND
RREF_USER_DELETE = UserDelete.KIND
REMOTE_RET = RemoteRet.KIND
CALL_STACK_QUERY = StackQuery.KIND
