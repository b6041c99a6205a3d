"""Tests only: today's ``transport.Agent`` behind the ``Transport`` protocol, registered as
``"zmq-test"``, so that ``"auto"`` can be tested with a real ZeroMQ inner transport before
the agent itself implements the protocol (then ``"zmq"`` replaces it)."""

from __future__ import annotations

from typing import Any, Sequence

from transport import agent as agent_mod
from transport.base import OnMessage, OnPeerDead, PeerAddress, PeerSpec, TransportConfig, register


class AgentAdapter:
    def __init__(self, config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> None:
        opts = agent_mod.AgentOptions(heartbeat_interval=config.heartbeat_interval,
                                      heartbeat_timeout=config.heartbeat_timeout)
        self.agent = agent_mod.Agent(config.worker_id, config.name, config.incarnation, on_message, on_peer_dead, opts)
        self.config = config
        self.id, self.name = config.worker_id, config.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    @property
    def fault_hook(self) -> Any:
        return self.agent.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Any) -> None:
        self.agent.fault_hook = hook

    def listen(self) -> PeerAddress:
        return PeerAddress(self.config.host, {"tcp": self.agent.bind(f"tcp://{self.config.host}:0")})

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        specs = [agent_mod.PeerSpec(p.id, p.name, p.incarnation, p.address.endpoints["tcp"]) for p in peers]
        self.agent.connect_peers(specs, timeout)

    def is_local(self, peer_id: int) -> bool:
        return False


register("zmq-test", AgentAdapter)
