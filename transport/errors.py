"""Errors raised or delivered by the transport. The runtime translates them once, at its
boundary, into rrefrt's own error tree. Imports nothing."""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class of every transport failure."""


class PeerUnavailable(TransportError):
    """The destination is unknown, unreachable or declared dead."""

    def __init__(self, peer: str, cause: str) -> None:
        super().__init__(f"worker {peer!r} is unavailable: {cause}")
        self.peer = peer
        self.cause = cause


class RequestTimeout(TransportError, TimeoutError):
    """No response arrived before the request's deadline."""

    def __init__(self, peer: str, timeout: float) -> None:
        super().__init__(f"no response from worker {peer!r} within {timeout:.3f}s")
        self.peer = peer
        self.timeout = timeout


class MessageTooLarge(TransportError):
    """A message exceeds the size limit; checked at the sender, nothing was sent."""


class AgentClosed(TransportError):
    """The agent was closed (shutdown) or is used from a forked child."""


class Fenced(AgentClosed):
    """Another member declared this worker dead (it was stopped, hung or cut off past the
    heartbeat timeout) and expelled it: every pending and later request fails with this.
    ``by`` names the worker that declared it, ``cause`` says why."""

    def __init__(self, worker: str, by: str, cause: str) -> None:
        super().__init__(
            f"worker {worker!r} was declared dead by worker {by!r} ({cause}) and expelled from "
            "the group: its calls fail; shut it down and start a new job (or re-initialise)"
        )
        self.worker = worker
        self.by = by
        self.cause = cause


class AuthenticationFailed(TransportError):
    """Peers failed the CURVE handshake while the mesh formed (a different secret, or a
    secret on one side only). ``peers`` names the workers concerned."""

    def __init__(self, message: str, peers: list[str]) -> None:
        super().__init__(message)
        self.peers = list(peers)


class PeersUnreachable(TransportError):
    """``add_peers`` ran out of time: ``ids`` are the peers that were not up (dynamic groups)."""

    def __init__(self, message: str, ids: list[int]) -> None:
        super().__init__(message)
        self.ids = list(ids)
