"""The wire format of rrefrt's transport: how a message is laid out in ZeroMQ frames.

Owns: header encoding and decoding, and the checks a received message must pass before
anything in it is handed on.

A message is one ZeroMQ multipart message on a ROUTER-to-ROUTER mesh::

    frame 0   routing id of the peer (added / stripped by the ROUTER socket): b"w<worker id>"
    frame 1   header: a msgpack array  [version, kind, msg_id, meta]
    frame 2+  buffer frames: raw bytes (pickle payloads, tensor storage), sent zero-copy

    field     type            meaning
    version   int             WIRE_VERSION; anything else is dropped as malformed
    kind      int             message kind; < 16 belong to the transport (table below),
                              >= 16 are opaque to it and handed to the runtime
    msg_id    int >= 0        request id chosen by the sender; 0 for one-way messages;
                              a RESPONSE carries the id of the request it answers
    meta      msgpack value   kind-specific, never pickled

    transport kind  meaning
    HELLO (1)       [incarnation, name, max_message_size]: first message on a new data
                    route; answered by HELLO_ACK. max_message_size is the largest payload
                    the sender accepts: a sender checks every message against its
                    receiver's limit and raises MessageTooLarge at the call site
    HELLO_ACK (2)   [incarnation, name, max_message_size]: the route back is up
    PING (3)        data socket: None, probes a route, ignored by the receiver.
                    liveness socket: [incarnation, answer wanted], a route probe; sent
                    while joining, after a disconnect and to suspects (NOTE [Liveness] in
                    rrefrt_transport.zmq.heartbeat); answered with [incarnation, false] when wanted
    RESPONSE (4)    answer to the request msg_id; meta and frames belong to the runtime
    DEAD_NOTICE (5) liveness socket: [peer id, peer incarnation, cause]: the sender
                    declared that peer dead; the receiver declares it dead too, naming the
                    sender (NOTE [Membership] in rrefrt_transport.zmq.heartbeat). About the receiver
                    itself: read as FENCED
    FENCED (6)      liveness socket: [cause]: the sender declared the receiver dead; the
                    receiver fails every pending and later request with Fenced
    SUSPECT (7)     liveness socket: [peer id, peer incarnation]: the sender has not heard
                    that peer for over heartbeat_timeout; the receiver counts it as a
                    second witness of its own suspicion (Rule 6 in rrefrt_transport.liveness),
                    never as a verdict. Repeated every heartbeat while it lasts
    UNWATCHED (8)   liveness socket: [peer id, peer incarnation]: the answer to a SUSPECT
                    from a member that does not watch that peer (it never exchanged a
                    HELLO with it: NOTE [Lazy connections] in rrefrt_transport.zmq.agent), so
                    it can never be a second witness (Rule 6 (b) in rrefrt_transport.liveness)

The data socket and the liveness socket are two ROUTER sockets with the same routing id;
the liveness socket never carries kinds >= 16, RESPONSE or HELLO.

Buffer frames are never interpreted by the transport. The runtime decides what they hold
(for rrefrt: frame 2 is a pickle-5 payload and later frames are its out-of-band buffers).
A received message is dropped and counted - never decoded further - when its header is not
valid msgpack within the limits below, has the wrong shape or version, comes from a routing
id that is not a member of the group, or exceeds the size limit.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import msgpack

WIRE_VERSION = 1
HELLO, HELLO_ACK, PING, RESPONSE, DEAD_NOTICE, FENCED, SUSPECT, UNWATCHED = 1, 2, 3, 4, 5, 6, 7, 8
FIRST_APP_KIND = 16
#: the last kind of the application range, reserved for the composite transport: the inner
#: transport carries it like any application message and the composite takes it before the
#: runtime sees it (UNIX_CONNECT: None "connect to me over the same-host path", "stream" the
#: same over the tcp stream plane, ["failed", plane, cause] "the connection you asked for
#: could not be made"; NOTE [Lazy same-host connections] in rrefrt_transport.unix.transport)
UNIX_CONNECT = 255
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4096

_packer = msgpack.Packer(use_bin_type=True)


class MalformedMessage(ValueError):
    """A received message failed validation; the agent drops and counts it."""


def routing_id(worker_id: int) -> bytes:
    return b"w%d" % worker_id


def worker_id_of(rid: bytes) -> int | None:
    """The worker id whose routing id is exactly ``rid``; None for anything else (so b"w03"
    is not an alias of worker 3, whose routing id is b"w3")."""
    if len(rid) < 2 or rid[:1] != b"w" or not rid[1:].isdigit():
        return None
    wid = int(rid[1:])
    return wid if routing_id(wid) == rid else None


def outgoing_id(worker_id: int) -> bytes:
    """A new name for a pipe we connect to ``worker_id`` (ZMQ_CONNECT_ROUTING_ID): distinct
    from ``routing_id(worker_id)``, the name of the pipe that worker connects to us, so that
    both may exist at once on one ROUTER (NOTE [Lazy connections] in rrefrt_transport.zmq.agent),
    and distinct from every earlier one: libzmq aborts a connect whose routing id names a pipe
    still attached (``!has_out_pipe`` in router.cpp), and a disconnected pipe goes away only
    later (a new incarnation of a peer, contacted right after the old one's pipe was dropped)."""
    return b"w%d>%d" % (worker_id, next(_pipe_seq))


_pipe_seq = itertools.count(1)


def pipe_owner(rid: bytes) -> tuple[int, bool] | None:
    """(worker id, outgoing) for ``routing_id(w)`` (its pipe to us: outgoing False) or an
    ``outgoing_id(w)`` (our pipe to it: True); None for anything else."""
    head, sep, seq = rid.partition(b">")
    if sep:
        wid = worker_id_of(head)
        return None if wid is None or not seq.isdigit() else (wid, True)
    wid = worker_id_of(rid)
    return None if wid is None else (wid, False)


_packers = threading.local()  #: one msgpack Packer per thread (packb builds one per call)


def encode_header(kind: int, msg_id: int, meta: Any) -> bytes:
    try:
        pack = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack  # autoreset: bytes per call
    return pack([WIRE_VERSION, kind, msg_id, meta])  # type: ignore[no-any-return]


def decode_header(raw: bytes | memoryview) -> tuple[int, int, Any]:
    """Decode and validate a header frame; raise MalformedMessage on anything unexpected."""
    if len(raw) > MAX_HEADER_BYTES:
        raise MalformedMessage("header too large")
    try:
        head = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
            max_array_len=65536,
            max_map_len=65536,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types for bad input
        raise MalformedMessage(f"invalid msgpack header: {type(e).__name__}") from None
    if (
        type(head) is not list
        or len(head) != 4
        or head[0] != WIRE_VERSION
        or type(head[1]) is not int
        or type(head[2]) is not int
        or head[1] < 1
        or head[2] < 0
    ):
        raise MalformedMessage("header has the wrong shape")
    return head[1], head[2], head[3]
