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
    spec: PeerSpec
    rid: bytes
    local: bool  #: same host (ipc is used when both sides listen on it)
    joined: bool = False  #: its HELLO / HELLO_ACK arrived
    pending: dict[int, Pending] = field(default_factory=dict)  #: msg_id -> request awaiting it
    backlog: collections.deque = field(default_factory=collections.deque)  #: frames not yet routable
    hello_due: float = 0.0

