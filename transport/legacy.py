"""The old construction of the zmq agent, kept until the runtime uses ``transport.create``.

Owns: ``AgentOptions`` and ``Agent``, the zmq transport built the old way::

    agent = Agent(worker_id, name, incarnation, on_message, on_peer_dead, AgentOptions(...))
    tcp = agent.bind("tcp://host:0"); ipc = agent.bind("ipc:///tmp/...")   # opaque strings
    agent.start(); agent.connect_peers([PeerSpec(id, name, incarnation, tcp_or_ipc), ...], t)

``bind`` binds a data, a heartbeat and an echo endpoint and returns both as one opaque string
(``"<data>|<heartbeat>|<echo>"``) that the caller publishes and hands back in ``PeerSpec.address``; for
``ipc://`` the requested path is ignored and the private directory is used (NOTE [ipc socket
files] in ``rrefrt_transport.hosts``). New code uses ``create(TransportConfig)``, ``listen()`` and
``PeerSpec(..., PeerAddress)``; ``Agent(config, on_message, on_peer_dead)`` also works.
Imports only the transport's own modules and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from rrefrt_transport.zmq import security
from rrefrt_transport.base import PeerAddress, PeerSpec, TransportConfig
from rrefrt_transport.hosts import IpcDir
from rrefrt_transport.zmq.agent import ECHO, LIVE, ZmqTransport

_SEP = "|"


@dataclass
class AgentOptions:
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 3.0
    route_grace: float = 0.5
    max_message_size: int = 1 << 31
    linger: float = 0.5
    #: CURVE keys of the job (NOTE [Authentication]); None: no authentication (ZeroMQ NULL)
    auth: security.CurveAuth | None = None


class Agent(ZmqTransport):
    """The zmq transport; accepts the old constructor arguments as well as a TransportConfig."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and isinstance(args[0], TransportConfig):
            super().__init__(*args, **kwargs)
            self.options = AgentOptions(
                self.config.heartbeat_interval, self.config.heartbeat_timeout, self.config.route_grace,
                self.config.max_message_size, self.config.linger, self._auth,
            )
            return
        worker_id, name, incarnation, on_message, on_peer_dead, *rest = args
        o = (rest[0] if rest else kwargs.get("options")) or AgentOptions()
        self.options = o
        config = TransportConfig(
            worker_id, name, incarnation, heartbeat_interval=o.heartbeat_interval,
            heartbeat_timeout=o.heartbeat_timeout, route_grace=o.route_grace,
            max_message_size=o.max_message_size, linger=o.linger,
            world_size=o.auth.world_size if o.auth is not None else 0, extra={"auth": o.auth},
        )
        super().__init__(config, on_message, on_peer_dead)

    @property
    def _outbox_lock(self) -> Any:
        """The data loop's outbox lock (tests/support/failure_scenarios.py forks while it is held)."""
        return self._loop._lock

    def bind(self, endpoint: str) -> str:
        """Bind before start(); returns an opaque address to publish (see the docstring)."""
        if endpoint.startswith("ipc://"):
            if self._ipc is None:
                self._ipc = IpcDir()
            n = len(self.endpoints)
            data = self._bind_data(self._ipc.endpoint(f"d{n}"))
            live = self._hb.bind(self._ipc.endpoint(f"l{n}"))
            echo = self._echo.bind(self._ipc.endpoint(f"e{n}"))
        else:
            data = self._bind_data(endpoint)
            any_port = endpoint.rsplit(":", 1)[0] + ":0"
            live, echo = self._hb.bind(any_port), self._echo.bind(any_port)
        return _SEP.join((data, live, echo))

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        specs = []
        for s in peers:
            if isinstance(s.address, str):  # an opaque string from bind(): connect to exactly it
                data, live, echo = s.address.split(_SEP)
                scheme = "ipc" if data.startswith("ipc://") else "tcp"
                host = self.host if scheme == "ipc" else f"legacy-tcp-{s.id}"
                s = replace(s, address=PeerAddress(host, {scheme: data, scheme + LIVE: live, scheme + ECHO: echo}))
            specs.append(s)
        super().connect_peers(specs, timeout)
