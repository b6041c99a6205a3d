"""rrefrt's messaging layer: the transport seam (``transport.base``) and its implementations.

Built-in implementations (registered by name): ``"zmq"``, a ZeroMQ ROUTER mesh with msgpack
headers and raw buffer frames (``transport.zmqagent``); ``"unix"``, the same-host data plane
over AF_UNIX with shared-memory segments for large frames (``transport.unix``); ``"auto"``,
the default, which sends to same-host peers over ``"unix"`` and to every other peer over
``"zmq"`` (``transport.auto``); ``"inproc"``, an in-process fake for unit tests. Knows nothing about RRefs;
imports only zmq, msgpack and the standard library.

The runtime uses it as::

    t = transport.create(TransportConfig(...), on_message, on_peer_dead)
    address = t.listen()            # publish address.to_wire() at rendezvous
    t.start()
    t.connect_peers([PeerSpec(rank, name, incarnation, PeerAddress.from_wire(d)), ...], timeout)
"""

from . import wire
from .base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, Transport, TransportConfig, create, register, registered
from .errors import (
    AgentClosed,
    AuthenticationFailed,
    Fenced,
    MessageTooLarge,
    PeerUnavailable,
    PeersUnreachable,
    RequestTimeout,
    TransportError,
)
from .hosts import host_id
from .security import CurveAuth
from .wire import FIRST_APP_KIND
from .legacy import Agent, AgentOptions
from .zmqagent import ZmqTransport
from . import auto, inproc, unix  # noqa: E402,F401  (register "auto", "inproc", "unix")

__all__ = [
    "Agent",
    "AgentOptions",
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
