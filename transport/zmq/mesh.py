"""The connection plan of the zmq transport: which endpoint of each peer, who connects to
whom. Pure: ``ZmqTransport`` performs the plan (``_setup``) and the changes to a running
mesh (``add_peers``: peers that joined later, or a new incarnation of a departed id;
``remove_peer``: a member left or was evicted) by these rules.

NOTE [Mesh changes]:

1. Who connects (NOTE [Lazy connections] in rrefrt_transport.zmq.agent): by default a
   worker connects to a peer when it first sends to it (and, at the join, to a bounded
   fan-out of peers: the next id), and watches the liveness of exactly the peers it
   exchanged a HELLO with; ``connect="eager"`` keeps the full mesh of before: the peer with
   the lower id connects to the one with the higher id, and everyone watches everyone.
   Either way a pipe we connect is named ``wire.outgoing_id(peer)``, one a peer connects to
   us ``wire.routing_id(peer)``, so both may exist. HELLOs repeat every PROBE_S until
   answered, and a HELLO from a peer not (yet) added is dropped, so the order in which the
   two sides add each other does not matter.
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

#: (spec, same host, data endpoint, heartbeat endpoint, echo endpoint): where to connect
#: if this worker connects (``contacts`` says whom it does at the join)
Plan = list[tuple[PeerSpec, bool, str, str, str]]


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
        if any(scheme + suffix not in eps for suffix in ("", LIVE, ECHO)):
            raise TransportError(f"worker {spec.name!r} published no {scheme} endpoints: {sorted(eps)}")
        out.append((spec, local, eps[scheme], eps[scheme + LIVE], eps[scheme + ECHO]))
    return out


def contacts(my_id: int, ids: Sequence[int], eager: bool, fanout: int) -> set[int]:
    """Rule 1: whom this worker connects to at the join. Eager: every higher id. Lazy: the
    ``fanout`` next ids after ``my_id`` in the ring of ``ids`` (a job secret that differs
    between two workers then fails some join at once, and the ring's neighbours are met)."""
    others = sorted(i for i in set(ids) if i != my_id)
    if eager:
        return {i for i in others if i > my_id}
    ring = [i for i in others if i > my_id] + [i for i in others if i < my_id]
    return set(ring[:max(0, fanout)])
