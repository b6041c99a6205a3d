"""The transport seam: what the runtime may ask of a transport, and how one is chosen.

Owns: the ``Transport`` protocol (the only surface of a transport the runtime uses), the
configuration a transport is built from, the addresses a worker publishes at rendezvous,
and the registry of implementations by name (Dask's ``comm/registry.py`` is the model).

Theory of operation:

1. The runtime builds a transport with ``create(config, on_message, on_peer_dead)``; the
   registry picks the implementation named by ``config.kind`` (``"zmq"`` by default; tests
   use ``"inproc"``). Implementations register themselves with ``register`` when their
   module is imported; ``transport/__init__.py`` imports the built-in ones.
2. ``listen()`` binds wherever the implementation sees fit for ``config.host`` and returns
   a ``PeerAddress`` to publish at rendezvous. Endpoint choice (ipc on one host, tcp across
   hosts, a same-host data plane) is the transport's business, never the runtime's.
3. ``connect_peers(peers, timeout)`` joins the group: it learns the members and may connect
   to them (all of them, or - ``TransportConfig.connect="lazy"`` - only a bounded few, the
   others on first use). From then on the runtime sends with
   ``request`` / ``send`` / ``respond`` and asks questions: ``is_alive``, ``is_local``,
   ``dead_peers``. In a dynamic group ``add_peers`` / ``remove_peer`` change the mesh
   of a running transport (docs/dynamic-groups.md). Callbacks (``on_message``, a request's
   ``on_done``, ``on_peer_dead``) run on a transport thread and must only hand work on; a
   callback that raises is logged and never takes that thread down.
4. ``close()`` never hangs and fails every pending request.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

#: on_done(meta, frames, error): exactly one of (meta/frames) or error is meaningful.
OnDone = Callable[[Any, Sequence[Any], "BaseException | None"], None]
#: on_message(src_id, kind, msg_id, meta, frames) for kinds >= wire.FIRST_APP_KIND.
OnMessage = Callable[[int, int, int, Any, Sequence[Any]], None]
#: on_peer_dead(peer_id, cause)
OnPeerDead = Callable[[int, str], None]


@dataclass(frozen=True)
class PeerAddress:
    """What a worker publishes at rendezvous so that others can reach it.

    ``endpoints`` maps an endpoint scheme (``"tcp"``, ``"ipc"``, ``"unix"``, ...) to an
    address of that scheme; ``host`` identifies the machine (same value = same host, so a
    same-host path may be used)."""

    host: str
    endpoints: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "endpoints": dict(self.endpoints)}

    @classmethod
    def from_wire(cls, d: Any) -> "PeerAddress":
        if not isinstance(d, dict) or not isinstance(d.get("host"), str) or not isinstance(d.get("endpoints"), dict):
            raise ValueError(f"malformed peer address: {d!r}")
        eps = {str(k): str(v) for k, v in d["endpoints"].items()}
        return cls(d["host"], eps)


@dataclass(frozen=True)
class PeerSpec:
    """A member of the group as the transport needs to know it."""

    id: int
    name: str
    incarnation: int
    address: PeerAddress


@dataclass
class TransportConfig:
    """Everything a transport is built from. Implementations ignore what they do not use."""

    worker_id: int
    name: str
    incarnation: int
    #: interface to bind for cross-host traffic (the interface of MASTER_ADDR)
    host: str = "127.0.0.1"
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 3.0
    route_grace: float = 0.5
    max_message_size: int = 1 << 31
    linger: float = 0.5
    #: the per-job secret (bytes) or None: implementations authenticate peers with it
    secret: bytes | None = None
    world_size: int = 0
    #: registry name of the implementation
    kind: str = "zmq"
    #: same-host channels (ipc / a same-host data plane) may be used between workers of one host
    same_host: bool = True
    #: "lazy": connect to a peer on first use (and to ``join_fanout`` peers at the join), so a
    #: worker's connections grow with the peers it talks to; "eager": the whole mesh at the
    #: join (NOTE [Lazy connections] in rrefrt_transport.zmq.agent). init_rpc asks for
    #: "lazy" unless RREFRT_CONNECT=eager; a transport built directly joins eagerly
    connect: str = "eager"
    join_fanout: int = 1
    #: implementation-specific settings
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Transport(Protocol):
    """The surface of a transport that the runtime uses; nothing else is public."""

    id: int
    name: str
    #: counters shown by get_debug_info (messages/bytes sent and received, drops, ...)
    stats: collections.Counter
    #: tests install a fault hook to drop/delay/duplicate/reorder outgoing messages by label
    fault_hook: Any

    def listen(self) -> PeerAddress:
        """Bind (before start) and return the address to publish at rendezvous."""
        ...

    def start(self) -> None:
        """Start the transport's threads; peers may reach it from now on."""
        ...

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Join the mesh; raise TransportError (AuthenticationFailed) naming who is missing."""
        ...

    def add_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """A running transport meets peers that joined later (dynamic groups): connect as
        ``connect_peers`` does, without touching the members already up. A peer whose id
        belonged to a departed member replaces it (a new incarnation). Waits at most
        ``timeout`` seconds for them to be up (0: do not wait); raise PeersUnreachable
        naming those that are not (its ``ids``)."""
        ...

    def remove_peer(self, peer_id: int, cause: str) -> None:
        """A member left the group (or was evicted): fail its pending requests with
        ``PeerUnavailable(name, cause)``, drop its late messages, report it through
        ``on_peer_dead(peer_id, cause)`` once, and stop reconnecting to it. Unlike a death
        verdict nobody is told (no notices, no fencing: it is leaving anyway). Idempotent."""
        ...

    def request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone,
        label: str = "",
    ) -> int:
        """Send a request; ``on_done`` runs exactly once with the response or an error."""
        ...

    def send(self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = "") -> None:
        """Send a one-way message."""
        ...

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        """Answer request ``msg_id`` of ``dest``."""
        ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the transport's thread after ``delay`` seconds (guarded like every callback)."""
        ...

    def read_until(self, dest: int, done: Callable[[], bool], timeout: float | None) -> None:
        """Called by a thread about to wait for an answer from ``dest``: read that answer on
        this thread if the transport can (NOTE [Own reads] in rrefrt_transport.unix.receiver)
        until ``done()`` or a bounded time; a no-op elsewhere. Never raises for the peer's
        state: the caller waits for its future afterwards as before."""
        ...

    def is_alive(self, peer_id: int) -> bool: ...

    def is_local(self, peer_id: int) -> bool:
        """Whether ``peer_id`` runs on this host (a same-host path is or could be used)."""
        ...

    def dead_peers(self) -> set[int]: ...

    def peer_name(self, peer_id: int) -> str: ...

    def pending_per_peer(self) -> dict[str, int]: ...

    def close(self, timeout: float = 2.0) -> None:
        """Stop, fail every pending request; never hangs."""
        ...


Factory = Callable[[TransportConfig, OnMessage, OnPeerDead], Transport]
_registry: dict[str, Factory] = {}


def register(kind: str, factory: Factory) -> None:
    """Make an implementation available as ``TransportConfig(kind=...)``."""
    _registry[kind] = factory


def registered() -> list[str]:
    return sorted(_registry)


def create(config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> Transport:
    """Build the transport ``config.kind`` names."""
    try:
        factory = _registry[config.kind]
    except KeyError:
        raise ValueError(f"unknown transport {config.kind!r}; registered: {', '.join(registered())}") from None
    return factory(config, on_message, on_peer_dead)
