"""A same-host transport peer for tests/transport/test_unix_transport.py and tests/unit/test_shm.py.

    python unix_peer.py '{"id": 1, "name": "B", "secret": null, ...}'   (PYTHONPATH=<repo root>)

stdout, one JSON object per line: {"event": "hello", "address", "incarnation", "pid"} once
listening; {"event": "ready"} or {"event": "error", "error", "type"} after joining;
{"event": "peer_dead", "peer", "cause"}; {"event": "stats", ...} in answer to {"cmd": "stats"};
{"event": "called", "meta", "error"} in answer to {"cmd": "call", "dest": id} (an ECHO request);
{"event": "held", "digests"} (sha256 of each held frame) to {"cmd": "held"}; {"event":
"scribbled"} to {"cmd": "scribble"}, which writes 0xEE over the first 4 KB of every held
frame (as a tensor updated in place would).
stdin: first line the peer table (list of {"id", "name", "incarnation", "address"}), then
commands. End of stdin closes the transport and exits.

Kinds served: ECHO answers with the request's meta and frames; IGNORE never answers;
BIG answers with one frame of meta["n"] bytes (byte i = i % 251), or with {"error": type,
"message": text} when the transport refuses that answer (over the caller's limit); HOLD keeps the frames of
the request (so its shared memory stays mapped) and answers [held count].
With "slow_send": true every write to a peer is cut to 32 KB with 5 ms pauses (a slow
link, for the long-transfer liveness test).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import threading
import time
from typing import Any, Sequence

from rrefrt_transport.unix import shm
from rrefrt_transport import auto  # noqa: F401 - registers "auto"
from rrefrt_transport.base import PeerAddress, PeerSpec, TransportConfig, create
from rrefrt_transport.errors import TransportError
from rrefrt_transport.unix.transport import UnixTransport

ECHO, IGNORE, BIG, HOLD = 16, 17, 18, 19


def pattern(n: int) -> bytes:
    return bytes(range(251)) * (n // 251) + bytes(range(n % 251))


class _SlowSock:
    def __init__(self, sock: Any) -> None:
        self._s = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def sendmsg(self, bufs: list, anc: Any = (), flags: int = 0) -> int:
        time.sleep(0.005)
        first = memoryview(bufs[0]).cast("B")[: 32 << 10]
        return self._s.sendmsg([first], anc, flags)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    held: list[Sequence[Any]] = []
    t: Any = None

    def on_message(src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        assert t is not None
        if kind == ECHO:
            t.respond(src, msg_id, meta, list(frames))
        elif kind == BIG:
            try:
                t.respond(src, msg_id, None, [pattern(meta["n"])])
            except TransportError as e:
                t.respond(src, msg_id, {"error": type(e).__name__, "message": str(e)})
        elif kind == HOLD:
            held.append(frames)
            t.respond(src, msg_id, [len(held)])

    def on_peer_dead(peer: int, cause: str) -> None:
        emit({"event": "peer_dead", "peer": peer, "cause": cause})

    inc = random.SystemRandom().getrandbits(62)
    secret = cfg.get("secret")
    tc = TransportConfig(
        worker_id=cfg["id"], name=cfg["name"], incarnation=inc, kind=cfg.get("kind", "unix"),
        secret=secret.encode() if secret else None,
        heartbeat_interval=cfg.get("hb_interval", 1.0), heartbeat_timeout=cfg.get("hb_timeout", 3.0),
        extra={k: cfg[k] for k in ("shm_threshold", "shm_copy_out", "auto_inner", "unix_queue_bytes", "stream")
               if k in cfg},
        **({"max_message_size": cfg["max_message_size"]} if "max_message_size" in cfg else {}),
    )
    t = create(tc, on_message, on_peer_dead)
    addr = t.listen()
    t.start()
    emit({"event": "hello", "address": addr.to_wire(), "incarnation": inc, "pid": __import__("os").getpid()})
    table = json.loads(sys.stdin.readline())
    specs = [PeerSpec(p["id"], p["name"], p["incarnation"], PeerAddress.from_wire(p["address"])) for p in table]
    try:
        t.connect_peers(specs, cfg.get("join_timeout", 10.0))
    except Exception as e:
        emit({"event": "error", "error": str(e), "type": type(e).__name__})
        t.close()
        return
    if cfg.get("slow_send") and isinstance(t, UnixTransport):
        for peer in t._peers.values():
            peer.sock = _SlowSock(peer.sock)
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "stats":
            emit({"event": "stats", "stats": dict(t.stats), "memfds": shm.count_memfds(), "held": len(held),
                  "segments": t.shm_segments() if isinstance(t, UnixTransport) else None,
                  "dead_peers": sorted(t.dead_peers())})
        elif cmd.get("cmd") == "call":
            t.request(cmd["dest"], ECHO, ["echo"], [], 5.0,
                      lambda m, f, e: emit({"event": "called", "meta": m, "error": None if e is None else str(e)}))
        elif cmd.get("cmd") == "held":
            emit({"event": "held", "digests": [hashlib.sha256(f).hexdigest() for fs in held for f in fs]})
        elif cmd.get("cmd") == "scribble":
            for fs in held:
                for f in fs:
                    view = memoryview(f).cast("B")
                    view[:4096] = b"\xee" * min(4096, len(view))
            emit({"event": "scribbled"})
        elif cmd.get("cmd") == "drop_held":
            held.clear()
            emit({"event": "dropped"})
    t.close()


if __name__ == "__main__":
    main()
