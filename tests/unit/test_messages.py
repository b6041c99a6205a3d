"""The message table on its own: every kind round-trips through meta() and decode(), and
malformed meta of every kind is refused with MalformedMessage (nothing else escapes)."""

from __future__ import annotations

from typing import Any

import pytest

from rrefrt.protocol.ids import ForkId, RRefId
from rrefrt.protocol.messages import (
    ERROR,
    KIND_NAMES,
    MESSAGES,
    OK,
    ChildAccept,
    ChildAccepts,
    Fetch,
    ForkData,
    ForkRequest,
    MalformedMessage,
    PythonCall,
    RemoteRequest,
    RemoteRet,
    StackQuery,
    Response,
    UserDelete,
    UserDeletes,
    decode,
)

pytestmark = pytest.mark.timeout(30)

RID, FID = RRefId(1, 2), ForkId(3, 4)
FORK = ForkData(RID, FID, 1, 3, "Box")

EXAMPLES = [
    PythonCall(0, (FORK,)),
    PythonCall(0, ()),
    RemoteRequest(0, RID, FID, "Box", (FORK, FORK)),
    Fetch(0, RID, FID),
    ForkRequest(0, RID, FID, 2),
    ChildAccept(0, FID),
    ChildAccepts(0, (FID, ForkId(3, 5))),
    UserDelete(0, RID, FID),
    UserDeletes(0, ((RID, FID), (RID, FID))),
    RemoteRet(0, RID, OK),
    RemoteRet(0, RID, ERROR),
    # NOTE [Piggybacked deletes]: deletes riding in a call or a creation
    PythonCall(0, (FORK,), ((RID, FID),)),
    RemoteRequest(0, RID, FID, "Box", (), ((RID, FID), (RID, ForkId(3, 5)))),
    # docs/stuck.md: where is a call (by its request's id) or a remote() creation (by RRef id)
    StackQuery(0, 7),
    StackQuery(0, 0, RID),
]


def msgpack_like(x: Any) -> Any:
    return [msgpack_like(v) for v in x] if isinstance(x, (list, tuple)) else x


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Any) -> None:
    assert decode(msg.KIND, msgpack_like(msg.meta()), 0) == msg
    assert KIND_NAMES[msg.KIND] == msg.NAME and MESSAGES[msg.KIND] is type(msg)


def test_one_class_per_kind() -> None:
    assert len(MESSAGES) == 10 and len(set(KIND_NAMES.values())) == 10


GOOD_ID = [0, 1]
BAD_FIELDS = [None, "x", 1.5, [1], [1, 2, 3], ["a", "b"], {"a": 1}, [None, 1], True]


def _malformed(cls: type) -> list[Any]:
    """Meta of the wrong shape for ``cls``: wrong container, length and every field broken."""
    good = msgpack_like(next(m for m in EXAMPLES if type(m) is cls).meta())
    out: list[Any] = [None, 5, "x", {}, (), [], good + [0], good[:-1]]
    for i in range(len(good)):
        for bad in BAD_FIELDS:
            meta = list(good)
            meta[i] = bad
            if meta != good:
                out.append(meta)
    return out


@pytest.mark.parametrize("cls", list(MESSAGES.values()), ids=lambda c: c.NAME)
def test_malformed_meta_of_every_kind_is_refused(cls: type) -> None:
    refused = 0
    for meta in _malformed(cls):
        try:
            msg = decode(cls.KIND, meta, 0)
        except MalformedMessage:
            refused += 1
            continue
        # the few that parse must have exactly the declared field types
        assert type(msg) is cls and msg.meta() == meta, (cls.NAME, meta)
    assert refused >= len(_malformed(cls)) - 2


def test_bad_fork_data_inside_calls() -> None:
    for forks in (["x"], [[1, 2, 3, 4, 5]], [[GOOD_ID, GOOD_ID, "o", 1, "t"]], [[GOOD_ID, GOOD_ID, 1, 1, 5]]):
        with pytest.raises(MalformedMessage):
            decode(PythonCall.KIND, [forks], 0)
        with pytest.raises(MalformedMessage):
            decode(RemoteRequest.KIND, [GOOD_ID, GOOD_ID, "t", forks], 0)


def test_piggybacked_deletes_are_an_optional_last_field() -> None:
    """NOTE [Piggybacked deletes]: absent when there are none (the header is as before),
    refused when empty, malformed or followed by more."""
    assert len(PythonCall(0, ()).meta()) == 1 and len(RemoteRequest(0, RID, FID, "t").meta()) == 4
    pair = [*GOOD_ID, *GOOD_ID]
    for bad in ([], [[GOOD_ID]], [*pair, "x"], "x", [[GOOD_ID, "x"]], [GOOD_ID, GOOD_ID], [1, 2, 3],
                [1, 2, 3, True], [1, 2, 3, 4.0], [1, 2, 3, None]):
        with pytest.raises(MalformedMessage):
            decode(PythonCall.KIND, [[], bad], 0)
        with pytest.raises(MalformedMessage):
            decode(RemoteRequest.KIND, [GOOD_ID, GOOD_ID, "t", [], bad], 0)
    with pytest.raises(MalformedMessage):
        decode(PythonCall.KIND, [[], pair, 0], 0)
    with pytest.raises(MalformedMessage):
        decode(RemoteRequest.KIND, [GOOD_ID, GOOD_ID, "t", [], pair, 0], 0)


def test_deletes_travel_as_four_ints_each() -> None:
    """RREF_USER_DELETES and piggybacked deletes are flat int lists on the wire (an owner
    checks and decodes a thousand in whole-list calls); decoded ids equal the ids."""
    other = ForkId(3, 5)
    msg = UserDeletes(0, ((RID, FID), (FID, other)))
    assert msg.meta() == [*RID, *FID, *FID, *other]
    assert PythonCall(0, (), msg.deletes).meta()[1] == msg.meta()
    got = decode(UserDeletes.KIND, msg.meta(), 0)
    assert got == msg and {got.deletes[0][0]: 1}[RID] == 1  # hash and equality of ids
    for bad in ([], [1, 2, 3], [1, 2, 3, True], [1, 2, 3, "4"], [[1, 2], [3, 4]], 5):
        with pytest.raises(MalformedMessage):
            decode(UserDeletes.KIND, bad, 0)


def test_unknown_kinds() -> None:
    for kind in (0, 1, 15, 23, 99, -1, "16", None, 16.0):
        with pytest.raises(MalformedMessage):
            decode(kind, [], 0)


def test_responses() -> None:
    assert Response.decode([OK, []]) == Response(OK)
    assert Response.decode([ERROR, [], 1]) == Response(ERROR, (), True)
    assert Response.decode([OK, [FORK.to_wire()], 0]).forks == (FORK,)
    assert Response(OK, (FORK,), True).meta(True) == [OK, [FORK.to_wire()], 1]
    assert Response.decode([OK, [], 1, 2]) == Response(OK, (), True, (2,))  # an inline value
    assert Response(OK, (), True, (b"x",)).meta(True) == [OK, [], 1, b"x"]
    for meta in (None, [], [OK], [7, []], ["0", []], [OK, "x"], [OK, [], 1, 2, 3], [OK, [], 1, [2]],
                 [OK, [["bad"]]]):
        with pytest.raises(MalformedMessage):
            Response.decode(meta)


def test_a_plain_call_decodes_to_one_shared_message_and_others_still_validate():
    """A call with no forks and no deletes (the hot path) decodes without allocating: one
    immutable PythonCall per destination; anything else takes the validating path."""
    a, b = decode(PythonCall.KIND, [[]], 3), decode(PythonCall.KIND, [[]], 3)
    assert a == PythonCall(3) and a is b and decode(PythonCall.KIND, [[]], 4) == PythonCall(4)
    assert PythonCall.wire_meta([], ()) == [[]] == PythonCall(3).meta()
    assert decode(PythonCall.KIND, [[FORK.to_wire()]], 3) == PythonCall(3, (FORK,))
    for bad in ([()], [[], [], []], [[1]], [[], []]):
        with pytest.raises(MalformedMessage):
            decode(PythonCall.KIND, bad, 3)
