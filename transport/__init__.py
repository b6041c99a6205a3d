"""rrefrt's messaging layer: a ZeroMQ ROUTER mesh with msgpack headers and raw buffer frames.

Knows nothing about RRefs; imports only zmq, msgpack and the standard library.
"""

from .agent import Agent, AgentOptions, PeerSpec
from .errors import (
    AgentClosed,
    AuthenticationFailed,
    MessageTooLarge,
    PeerUnavailable,
    RequestTimeout,
    TransportError,
)
from .security import CurveAuth
from .wire import FIRST_APP_KIND

__all__ = [
    "Agent",
    "AgentOptions",
    "PeerSpec",
    "AgentClosed",
    "AuthenticationFailed",
    "CurveAuth",
    "MessageTooLarge",
    "PeerUnavailable",
    "RequestTimeout",
    "TransportError",
    "FIRST_APP_KIND",
]
