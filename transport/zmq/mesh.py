"""The connection plan of the zmq transport: which endpoint of each peer, who connects to
whom. Pure: ``ZmqTransport`` performs the plan (``_setup``) and the changes to a running
mesh (``add_peers``: peers that joined later, or a new incarnation of a departed id;
``remove_peer``: a member left or was evicted) by these rules.

NOTE [Mesh changes]:

1. Who connects: the peer with the lower id connects to the one with the higher id (data
   and heartbeat); everyone connects to everyone's echo. So a joiner with a low id connects
   to the members above it, and the members below it connect to the joiner when they learn
   of the join (``add_peers``). HELLOs repeat every PROBE_S until answered, and a HELLO
   from a peer not (yet) added is dropped, so the order in which the two sides add each
   other does not matter.
2. A departed peer is declared dead locally without telling anyone (no DEAD_NOTICE, no
   FENCED: it is leaving, not suspected), its endpoints are disconnected so that libzmq
   stops reconnecting to them, and its late messages are dropped like a dead peer's.
3. A new incarnation of an id replaces the old record on the data loop (the HELLO carries
   the incarnation, so nothing of the old one is accepted) and in the liveness table.
"""

from __future__ import annotations

from typing import Sequence

from rrefrt_transport.base import PeerSpec
from rrefrt_transport.errors import TransportError

LIVE = "-live"  #: suffix of the heartbeat endpoints in a PeerAddress ("tcp-live", "ipc-live")
ECHO = "-echo"  #: suffix of the echo endpoints ("tcp-echo", "ipc-echo")

#: (spec, same host, data endpoint to connect or None, heartbeat endpoint or None, echo endpoint)
Plan = list[tuple[PeerSpec, bool, "str | None", "str | None", str]]


def plan(
    my_id: int, host: str, same_host: bool, ipc: bool, world_size: int | None, peers: Sequence[PeerSpec]
) -> Plan:
    """Rule 1: the endpoints to use for each peer of ``peers``: ipc on this ``host`` (with
    ``same_host`` on and an ``ipc`` directory of ours), tcp otherwise. ``world_size``: the number of CURVE keys of the job (with
    a secret), which bounds the ids."""
    if world_size is not None:
        for spec in peers:
            if not 0 <= spec.id < world_size:
                raise TransportError(f"worker {spec.name!r} has id {spec.id}, outside the job's {world_size} keys")
    out: Plan = []
    for spec in peers:
        if spec.id == my_id:
            continue
        eps = spec.address.endpoints
        local = same_host and spec.address.host == host
        scheme = "ipc" if local and ipc and "ipc" in eps else "tcp"
        if scheme + ECHO not in eps or (spec.id > my_id and (scheme not in eps or scheme + LIVE not in eps)):
            raise TransportError(f"worker {spec.name!r} published no {scheme} endpoints: {sorted(eps)}")
        data, live = (eps[scheme], eps[scheme + LIVE]) if spec.id > my_id else (None, None)
        out.append((spec, local, data, live, eps[scheme + ECHO]))
    return out
