"""A same-uid impostor for tests/transport/test_unix_transport.py: it reads a member's identity (as a
process that reads the store can) and passes the same-host admission of a worker that has
no secret under that identity (the empty-key HMAC), then sends one frame that breaks the
framing.

    python unix_impostor.py '{"path": <unix socket>, "id": <claimed id>, "incarnation": <its incarnation>,
                             "target_id": <acceptor id>, "target_incarnation": <its incarnation>,
                             "then": "bad_frame" or "close"}'

stdout, one JSON object per line: "hello_sent" (connected, HELLO sent: the acceptor holds
it until its group is known), "admitted", "bad_frame_sent", then "closed" with the bytes it
read after admission once the acceptor closes the connection. With "then": "close" it
closes the connection itself once admitted ("closed_by_me"). Exits at the end of stdin.
"""

from __future__ import annotations

import json
import socket
import struct
import sys

from rrefrt_transport.unix import wire as uw
from rrefrt_transport.wire import MAX_HEADER_BYTES


def main() -> None:
    cfg = json.loads(sys.argv[1])

    def emit(event: str, **kw: object) -> None:
        sys.stdout.write(json.dumps({"event": event, **kw}) + "\n")
        sys.stdout.flush()

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(cfg["path"])
    limit = 1 << 31  # the max_message_size it claims (the admission records carry it)
    rec, nonce_c = uw.hello(cfg["id"], cfg["incarnation"], limit)
    s.sendall(rec)
    emit("hello_sent")
    raw = b""
    while len(raw) < uw.WELCOME_LEN:
        chunk = s.recv(uw.WELCOME_LEN - len(raw))
        if not chunk:
            emit("refused")
            return
        raw += chunk
    _, _, target_limit, nonce_s = uw.parse_id(raw)
    ids = ((cfg["id"], cfg["incarnation"], limit), (cfg["target_id"], cfg["target_incarnation"], target_limit))
    s.sendall(uw.mac(None, "connector", nonce_c, nonce_s, *ids))
    if s.recv(len(uw.ADMIT)) != uw.ADMIT:
        emit("refused")
        return
    emit("admitted")
    if cfg.get("then") == "close":
        s.close()
        emit("closed_by_me")
        sys.stdin.read()
        return
    # one message whose prefix is out of bounds: a header longer than any header may be
    s.sendall(struct.pack("<IHBx", MAX_HEADER_BYTES + 1, 0, 0))
    emit("bad_frame_sent")
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    emit("closed", read=len(got))
    sys.stdin.read()


if __name__ == "__main__":
    main()
