"""A transport peer for tests/transport/test_transport.py, run as its own process.

    python peer.py '{"id": 1, "name": "B", "options": {...}}'      (PYTHONPATH=<repo root>)

Protocol with the test process, one JSON object per line:

- stdout: {"event": "hello", "id", "name", "address", "incarnation", "pid"} once bound;
  {"event": "ready"} once ``connect_peers`` returned; {"event": "peer_dead", "peer", "cause"}
  whenever the agent declares a peer dead; {"event": "stats", ...} in answer to a command;
  {"event": "error", "error"} if joining the mesh failed.
- stdin: first line is the peer table (a list of PeerSpec fields), later lines are commands
  ({"cmd": "stats"}, answered with its stats and dead peers; {"cmd": "deafen"}: its heartbeat
  socket drops every echo from now on, its own included (a starved observer: its ticks run,
  it hears nobody), answered by {"event": "deaf", "at"}; {"cmd": "declare", "peer", "cause"}; {"cmd": "request", "dest", "kind", "meta", "size", "timeout"} answered by
  {"event": "done", "meta", "error", "message", "elapsed"}). End of stdin (the test process went away) closes the agent and exits.

Only ``transport`` is imported: the transport is tested on its own.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from typing import Any, Sequence

from rrefrt_transport import PeerAddress, PeerSpec, Transport, TransportConfig, create

ECHO = 16  #: respond with the request's meta and frames
IGNORE = 17  #: never respond (a peer that does not answer)
SHUFFLE = 18  #: hold requests until meta["batch"] are held, then answer all in random order
COUNT = 19  #: respond with the number of application messages received before this one
STALL = 20  #: block the I/O thread for meta["stall"] seconds (a stuck handler), never respond


class EchoBehaviour:
    """on_message for an agent: the kinds above. Runs on the agent's I/O thread."""

    def __init__(self, seed: int = 0) -> None:
        self.agent: Transport | None = None
        self.received = 0
        self.sources: list[int] = []
        self._held: list[tuple[int, int, Any, Sequence[Any]]] = []
        self._rng = random.Random(seed)

    def __call__(self, src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        agent = self.agent
        assert agent is not None
        self.received += 1
        self.sources.append(src)
        if kind == ECHO:
            agent.respond(src, msg_id, meta, list(frames))
        elif kind == SHUFFLE:
            self._held.append((src, msg_id, meta, frames))
            if len(self._held) >= meta["batch"]:
                held, self._held = self._held, []
                self._rng.shuffle(held)
                for s, m, mt, fr in held:
                    agent.respond(s, m, mt, list(fr))
        elif kind == COUNT:
            agent.respond(src, msg_id, [self.received - 1])
        elif kind == STALL:
            time.sleep(meta["stall"])  # simulates a stuck handler on the I/O thread
        # IGNORE and anything else: no answer


def spec_to_json(spec: PeerSpec) -> dict:
    return {"id": spec.id, "name": spec.name, "incarnation": spec.incarnation, "address": spec.address.to_wire()}


def spec_from_json(d: dict) -> PeerSpec:
    return PeerSpec(d["id"], d["name"], d["incarnation"], PeerAddress.from_wire(d["address"]))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def on_peer_dead(peer: int, cause: str) -> None:
        emit({"event": "peer_dead", "peer": peer, "cause": cause})

    behaviour = EchoBehaviour(seed=cfg["id"])
    incarnation = random.SystemRandom().getrandbits(62)
    config = TransportConfig(cfg["id"], cfg["name"], incarnation, **cfg.get("options", {}))
    agent = create(config, behaviour, on_peer_dead)
    behaviour.agent = agent
    address = agent.listen()
    agent.start()
    emit({"event": "hello", "id": cfg["id"], "name": cfg["name"], "address": address.to_wire(),
          "incarnation": incarnation, "pid": __import__("os").getpid()})
    try:
        line = sys.stdin.readline()
        if not line:
            return
        peers = [spec_from_json(p) for p in json.loads(line)]
        try:
            agent.connect_peers(peers, timeout=cfg.get("connect_timeout", 10.0))
        except Exception as e:  # reported, then wait for the test to end us
            emit({"event": "error", "error": repr(e)})
        else:
            emit({"event": "ready"})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "stats":
                emit({"event": "stats", "received": behaviour.received, "stats": dict(agent.stats),
                      "dead": sorted(agent.dead_peers())})
            elif cmd.get("cmd") == "deafen":  # its liveness socket drops every echo from now on
                hb = agent._hb  # type: ignore[attr-defined]

                def deafen(hb: Any = hb) -> None:  # on the heartbeat thread, which owns the map
                    hb._echo_peer = {}  # echoes then count as frames of no member: dropped
                    emit({"event": "deaf", "at": time.monotonic()})

                hb.loop.call_soon(deafen)
            elif cmd.get("cmd") == "declare":  # this worker declares a peer dead on its own evidence
                agent._hb.declare(cmd["peer"], cmd.get("cause", "a test said so"))  # type: ignore[attr-defined]
            elif cmd.get("cmd") == "request":  # one request; its outcome is reported
                t0 = time.monotonic()

                def done(meta: Any, frames: Sequence[Any], error: BaseException | None, t0: float = t0) -> None:
                    emit({"event": "done", "meta": meta, "error": type(error).__name__ if error else None,
                          "message": str(error) if error else "", "elapsed": time.monotonic() - t0})

                try:
                    agent.request(cmd["dest"], cmd.get("kind", ECHO), cmd.get("meta"),
                                  [bytes(cmd.get("size", 0))], cmd.get("timeout", 10.0), done)
                except Exception as e:
                    emit({"event": "done", "meta": None, "error": type(e).__name__, "message": str(e), "elapsed": 0.0})
    finally:
        agent.close()


if __name__ == "__main__":
    main()
