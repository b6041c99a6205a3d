"""Transport.add_peers / remove_peer of the zmq transport (NOTE [Mesh changes] in transport/zmq/mesh.py): a running
mesh meets later peers, drops a departed one quietly, and takes a new incarnation of its id.
Real sockets on 127.0.0.1; the transports live in this process (only ``transport`` is
imported). Every wait is bounded."""

from __future__ import annotations

import queue
import random
from typing import Any, Sequence

import pytest

import rrefrt_transport as transport
from rrefrt_transport import FIRST_APP_KIND, PeerSpec, TransportConfig

ECHO, SILENT = FIRST_APP_KIND, FIRST_APP_KIND + 1
WAIT_S = 30.0


class Node:
    def __init__(self, wid: int, name: str) -> None:
        self.dead: queue.Queue = queue.Queue()
        cfg = TransportConfig(worker_id=wid, name=name, incarnation=random.getrandbits(62),
                              heartbeat_interval=0.2, heartbeat_timeout=3.0, kind="zmq")
        self.t = transport.create(cfg, self._on_message, lambda peer, cause: self.dead.put((peer, cause)))
        self.spec = PeerSpec(wid, name, cfg.incarnation, self.t.listen())
        self.t.start()

    def _on_message(self, src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        if kind == ECHO:
            self.t.respond(src, msg_id, meta)

    def call(self, dest: int, meta: Any = "ping", kind: int = ECHO, timeout: float = WAIT_S) -> Any:
        box: queue.Queue = queue.Queue()
        self.t.request(dest, kind, meta, [], timeout, lambda m, f, err: box.put(err if err is not None else m))
        return box.get(timeout=timeout + 10)


@pytest.mark.timeout(120)
def test_add_remove_and_reincarnate() -> None:
    nodes: list[Node] = []
    try:
        a = Node(0, "a")
        nodes.append(a)
        a.t.connect_peers([a.spec], WAIT_S)  # a group of one
        # a peer with a higher id joins: the member connects to it
        c = Node(2, "c")
        nodes.append(c)
        a.t.add_peers([c.spec], 0)
        c.t.connect_peers([a.spec, c.spec], WAIT_S)
        assert a.call(2, "a->c") == "a->c" and c.call(0, "c->a") == "c->a"
        # one with an id between them: it connects to c, a connects to it
        b = Node(1, "b")
        nodes.append(b)
        a.t.add_peers([b.spec], 0)
        c.t.add_peers([b.spec], 0)
        b.t.add_peers([a.spec, c.spec], WAIT_S)  # add_peers on a fresh transport joins too
        assert b.call(0) == "ping" and b.call(2) == "ping" and c.call(1) == "ping" and a.call(1) == "ping"

        # c leaves: a's pending request fails naming it, once; nobody is fenced
        box: queue.Queue = queue.Queue()
        a.t.request(2, SILENT, None, [], 0, lambda m, f, err: box.put(err))
        a.t.remove_peer(2, "it left the group")
        err = box.get(timeout=WAIT_S)
        assert isinstance(err, transport.PeerUnavailable) and "'c'" in str(err) and "left the group" in str(err)
        assert a.dead.get(timeout=WAIT_S) == (2, "it left the group") and not a.t.is_alive(2)
        late = c.call(0, kind=SILENT, timeout=1.5)  # a drops it without answering FENCED
        assert isinstance(late, transport.RequestTimeout), late
        assert c.t.is_alive(2)  # c itself was not fenced
        a.t.remove_peer(2, "it left the group")  # idempotent
        assert a.dead.empty()

        # a new incarnation of id 2 joins: it replaces the departed one
        c.t.close()
        c2 = Node(2, "c2")
        nodes.append(c2)
        a.t.add_peers([c2.spec], 0)
        b.t.remove_peer(2, "it left the group")
        b.t.add_peers([c2.spec], 0)
        c2.t.connect_peers([a.spec, b.spec, c2.spec], WAIT_S)
        assert a.call(2, "again") == "again" and c2.call(1) == "ping" and a.t.is_alive(2)
    finally:
        for n in nodes:
            n.t.close()
