"""The mesh of the zmq transport: which peers it connects to, and changes to a running mesh.

Owns: the connection plan of a join (which endpoint of each peer, who connects to whom),
the data socket's monitor (``read_monitor``: handshakes of the join), and the two
operations of a dynamic group on a running ``ZmqTransport``: ``add_peers``
(peers that joined later, or a new incarnation of a departed id) and ``remove_peer`` (a
member left or was evicted).

Rules:

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

import logging
import time
from typing import TYPE_CHECKING, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from rrefrt_transport.zmq import security

from rrefrt_transport import wire
from rrefrt_transport.base import PeerSpec
from rrefrt_transport.errors import PeersUnreachable, PeerUnavailable, TransportError
from rrefrt_transport.liveness import PeerState
from rrefrt_transport.zmq.records import Peer

if TYPE_CHECKING:
    from rrefrt_transport.zmq.agent import ZmqTransport

log = logging.getLogger("rrefrt.transport")

LIVE = "-live"  #: suffix of the heartbeat endpoints in a PeerAddress ("tcp-live", "ipc-live")
ECHO = "-echo"  #: suffix of the echo endpoints ("tcp-echo", "ipc-echo")

#: (spec, same host, data endpoint to connect or None, heartbeat endpoint or None, echo endpoint)
Plan = list[tuple[PeerSpec, bool, "str | None", "str | None", str]]


def plan(t: "ZmqTransport", peers: Sequence[PeerSpec]) -> Plan:
    """Rule 1: the endpoints to use for each peer (ipc on this host, tcp otherwise); records
    names and locality (read by any thread)."""
    if t._auth is not None:
        for spec in peers:
            if not 0 <= spec.id < t._auth.world_size:
                raise TransportError(f"worker {spec.name!r} has id {spec.id}, outside the job's {t._auth.world_size} keys")
    out: Plan = []
    for spec in peers:
        if spec.id == t.id:
            continue
        eps = spec.address.endpoints
        local = t.config.same_host and spec.address.host == t.host
        scheme = "ipc" if local and "ipc" in eps and t._ipc is not None else "tcp"
        if scheme + ECHO not in eps or (spec.id > t.id and (scheme not in eps or scheme + LIVE not in eps)):
            raise TransportError(f"worker {spec.name!r} published no {scheme} endpoints: {sorted(eps)}")
        data, live = (eps[scheme], eps[scheme + LIVE]) if spec.id > t.id else (None, None)
        out.append((spec, local, data, live, eps[scheme + ECHO]))
        t._local[spec.id], t._names[spec.id] = local, spec.name
    return out


def setup(t: "ZmqTransport", steps: Plan) -> None:
    """Data loop: a peer record per peer (replacing a departed incarnation, Rule 3), connect
    the data socket where we connect (Rule 1)."""
    now = time.monotonic()
    t._policy.started_at = now
    for spec, local, data, _, _ in steps:
        t._adding.pop(spec.id, None)
        old = t._peers.get(spec.id)
        if old is not None:  # Rule 3: what still waits on the old incarnation fails now
            pending, old.pending = list(old.pending.values()), {}
            for p in pending:
                t._fail(p, PeerUnavailable(old.spec.name, "it left the group (a new incarnation of its id joined)"))
            _disconnect(t, spec.id)
            if t.table.state(spec.id) is PeerState.DEAD:  # before the heartbeat thread's own
                t.table.replace(spec.id)  # replace: the dead verdict must not count it as up
        t._peers[spec.id] = Peer(spec, wire.routing_id(spec.id), local, hello_due=now)
        if data is not None:
            if t._auth is not None:  # NOTE [Authentication], Rule 2 (rrefrt_transport.zmq.security)
                security.configure_client(t._sock, t._auth, spec.id)
            t._policy.connects[data] = (spec.id, spec.name)
            t._sock.connect(data)
    t._check_all_up()


def _disconnect(t: "ZmqTransport", peer_id: int) -> None:
    for ep, (pid, _) in list(t._policy.connects.items()):
        if pid == peer_id:
            del t._policy.connects[ep]
            try:
                t._sock.disconnect(ep)
            except Exception:  # already gone (libzmq forgot it): nothing to stop
                pass


def add_peers(t: "ZmqTransport", peers: Sequence[PeerSpec], timeout: float) -> None:
    """``Transport.add_peers`` (transport/base.py) for zmq; see the module rules."""
    t._check_usable()
    known = {i: p.spec.incarnation for i, p in list(t._peers.items())} | t._adding
    fresh = [s for s in peers if s.id != t.id and known.get(s.id) != s.incarnation]
    if fresh:  # peers already added (the same incarnation) are only waited for
        steps = plan(t, fresh)
        t._adding.update({s.id: s.incarnation for s in fresh})
        t._join_error = None
        t._all_up.clear()  # the mesh is forming again: HELLOs go out (``_tend``)
        t._loop.call_soon(lambda: setup(t, steps))
        t._hb.join([(s.id, s.name, s.incarnation, live, echo) for s, _, _, live, echo in steps],
                   timeout if timeout > 0 else None)
    if timeout <= 0:
        return
    deadline = time.monotonic() + timeout
    ids = {s.id for s in peers if s.id != t.id}
    while True:
        pending = [p for p in list(t._peers.values()) if p.spec.id in ids and not t._is_up(p)
                   and t.table.state(p.spec.id) is not PeerState.DEAD]
        if t._join_error is not None:
            raise t._join_error
        left = deadline - time.monotonic()
        if not pending and all(i in t._peers for i in ids):
            return
        if left <= 0:
            late = {p.spec.id for p in pending} | (ids - set(t._peers))
            names = sorted(s.name for s in peers if s.id in late)
            raise PeersUnreachable(
                f"worker {t.name!r} could not reach {', '.join(map(repr, names))} within {timeout:.1f}s", sorted(late))
        t._all_up.wait(min(left, 0.05))


def remove_peer(t: "ZmqTransport", peer_id: int, cause: str) -> None:
    """``Transport.remove_peer`` for zmq (Rule 2): declared dead here, quietly."""
    if peer_id == t.id or t._closing:
        return
    t._hb.forget(peer_id, cause)

    def detach() -> None:
        _disconnect(t, peer_id)

    try:
        t._loop.call_soon(detach)
    except Exception:  # closed: nothing to detach
        pass


__all__ = ["plan", "setup", "add_peers", "remove_peer", "LIVE", "ECHO"]


def read_monitor(agent: ZmqTransport) -> None:
    """Data loop: the data socket's monitor events - the handshakes of the join, judged by
    the join policy (``rrefrt_transport.zmq.joinpolicy``)."""
    while True:
        try:
            ev = parse_monitor_message(agent._monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        event, endpoint = int(ev["event"]), ev["endpoint"].decode(errors="replace")
        if event & security.HANDSHAKE_FAILED:
            pid = agent._policy.connects.get(endpoint, (None, ""))[0]
            peer = agent._peers.get(pid) if pid is not None else None
            err = agent._policy.failed(endpoint, event, int(ev["value"]), not agent._all_up.is_set(),
                                      peer is not None and not peer.joined, time.monotonic())
            if err is not None:
                agent._fail_join(err)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            agent._policy.succeeded(endpoint)
