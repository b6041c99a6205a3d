"""A stranger to a job's rendezvous store: ``python -m tests.support.store_stranger PORT TEXT [UID]``.

It does what any local user can do: connect to 127.0.0.1:PORT, read the store's greeting and
answer the challenge without the secret (a random proof, then an empty one), each time
claiming an identity of its choosing that contains TEXT - one claims to be a worker, one an
``rrefrt-run`` launcher. With UID (and run as root) it first becomes that user, so the store
sees another local user, as it would on a shared machine. Standard library only, so that it
runs as any user (what it needs is imported before it changes user). Prints ``REFUSED <n>`` (the handshakes the store answered with an error)
and exits 0.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 - used by getaddrinfo; another user cannot import it later
import os
import socket
import struct
import sys

_U32 = struct.Struct("!I")


def _frame(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    (n,) = _U32.unpack(exact(4))
    return exact(n)


def _pack(head: int, fields: list[bytes]) -> bytes:
    body = bytes([head]) + b"".join(_U32.pack(len(f)) + f for f in fields)
    return _U32.pack(len(body)) + body


def main() -> int:
    port, text = int(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        uid = int(sys.argv[3])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    claims = [
        f"worker 'w2' (rank 2, pid 1 on {text}) {text}",
        f"rrefrt-run node 1 (host {text}, pid 1) {text}",
        f"{text}\n\x1b[2J{text}",
    ]
    refused = 0
    for i, claim in enumerate(claims):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            _frame(s)  # the greeting: magic, challenge, whether it authenticates, frame limit
            answer = os.urandom(32) if i % 2 == 0 else b""
            s.sendall(_pack(0, [os.urandom(32), answer, claim.encode()]))
            if _frame(s)[0] == 2:  # status 2: an error, i.e. refused
                refused += 1
    print(f"REFUSED {refused}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
