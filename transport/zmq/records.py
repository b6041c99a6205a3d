"""The data loop's records: a request awaiting its response, and a peer as the data loop
sees it. Owned and mutated by the data loop's thread only (``rrefrt_transport.zmq.agent``, Rule 1).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from rrefrt_transport.base import OnDone, PeerSpec

ZERO_COPY_MIN = 1 << 16  #: frames this large are sent without a copy (libzmq keeps a reference)


def nbytes(f: Any) -> int:
    """Size in bytes of a frame: len() of an array.array or a numpy array counts items."""
    return len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes


@dataclass
class Pending:
    dest: int
    msg_id: int
    timeout: float
    on_done: OnDone
    done: bool = False


@dataclass
class Peer:
    """NOTE [Lazy connections] in rrefrt_transport.zmq.agent: a peer has up to two pipes, the
    one we connect (``outgoing_id``) and the one it connects (``routing_id``); ``rid`` is the
    one we send on, chosen once and kept (per-pair order), None until first contact."""

    spec: PeerSpec
    rid: bytes | None
    local: bool  #: same host (ipc is used when both sides listen on it)
    data: str = ""  #: its data endpoint (where we connect, if we do)
    connected: bool = False  #: we connected our pipe to it (and HELLO it until answered)
    valid: set = field(default_factory=set)  #: pipes a HELLO / HELLO_ACK of its incarnation arrived on
    error: BaseException | None = None  #: its first contact failed (authentication): fails what is sent to it
    joined: bool = False  #: the pipe we send on is validated (its HELLO / HELLO_ACK arrived on it)
    pending: dict[int, Pending] = field(default_factory=dict)  #: msg_id -> request awaiting it
    backlog: collections.deque = field(default_factory=collections.deque)  #: frames not yet routable
    hello_due: float = 0.0
    #: the pause before the next HELLO while unanswered: HELLO_FIRST_S doubling to PROBE_S (a
    #: peer drops HELLOs until its own join knows us, usually a few ms later)
    hello_gap: float = 0.005

