"""rrefrt's messaging layer: the transport seam (``rrefrt_transport.base``) and its implementations.

Built-in implementations (registered by name): ``"zmq"``, a ZeroMQ ROUTER mesh with msgpack
headers and raw buffer frames (``rrefrt_transport.zmq.agent``); ``"unix"``, the same-host data plane
over AF_UNIX with shared-memory segments for large frames (``rrefrt_transport.unix.transport``); ``"auto"``,
the default, which sends to same-host peers over ``"unix"`` and to every other peer over
``"zmq"`` (``rrefrt_transport.auto``); ``"inproc"``, an in-process fake for unit tests. Knows nothing about RRefs;
imports only zmq, msgpack and the standard library.

The runtime uses it as::

    t = transport.create(TransportConfig(...), on_message, on_peer_dead)
    address = t.listen()            # publish address.to_wire() at rendezvous
    t.start()
    t.connect_peers([PeerSpec(rank, name, incarnation, PeerAddress.from_wire(d)), ...], timeout)
"""

from rrefrt_transport import wire
from rrefrt_transport.base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, Transport, TransportConfig, create, register, registered
from rrefrt_transport.errors import (
    AgentClosed,
    AuthenticationFailed,
    Fenced,
    MessageTooLarge,
    PeerUnavailable,
    PeersUnreachable,
    RequestTimeout,
    TransportError,
)
from rrefrt_transport.hosts import host_id
from rrefrt_transport.zmq.security import CurveAuth
from rrefrt_transport.wire import FIRST_APP_KIND
from rrefrt_transport.zmq.agent import ZmqTransport
from rrefrt_transport import auto, inproc  # noqa: E402,F401  (register "auto", "inproc")
import rrefrt_transport.unix.transport  # noqa: E402,F401  (registers "unix")

__all__ = [
    "ZmqTransport",
    "Transport",
    "TransportConfig",
    "PeerAddress",
    "PeerSpec",
    "OnDone",
    "OnMessage",
    "OnPeerDead",
    "create",
    "register",
    "registered",
    "host_id",
    "AgentClosed",
    "AuthenticationFailed",
    "CurveAuth",
    "Fenced",
    "MessageTooLarge",
    "PeerUnavailable",
    "PeersUnreachable",
    "RequestTimeout",
    "TransportError",
    "FIRST_APP_KIND",
    "wire",
]
