"""Who is at the other end of a TCP connection to the store, when the kernel can say.

Owns: ``local_peer_uid``, the user id that owns the client socket of an accepted TCP
connection when that client runs on this host (Linux: ``/proc/net/tcp`` and
``/proc/net/tcp6`` list every socket of the network namespace with its owner's uid), and
None when the client is on another host, the connection is gone, or the platform does not
say. A TCP connection has no SO_PEERCRED; this is its equivalent for loopback and local
addresses. Standard library only; the store imports it (NOTE [Refused clients] in
``rrefrt/group/store.py``).

The uid is the kernel's, not the client's claim: a process cannot make its socket appear
under another user. The look-up must run while the client still holds its socket (a closed
one lingers in TIME_WAIT owned by uid 0 and inode 0, which is never taken as an owner).
"""

from __future__ import annotations

import socket
import struct

__all__ = ["local_peer_uid"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


def _hex_v4(ip: str, port: int) -> str:
    (word,) = struct.unpack("=I", socket.inet_aton(ip))
    return f"{word:08X}:{port:04X}"


def _hex_v6(ip: str, port: int) -> str:
    words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, ip.split("%", 1)[0]))
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _forms(ip: str, port: int) -> set[str]:
    """The ways /proc/net/tcp{,6} may print ``ip:port`` (an IPv4 client of a dual-stack
    socket appears as ::ffff:a.b.c.d on the server's side and as a.b.c.d on its own)."""
    out = set()
    try:
        out.add(_hex_v4(ip, port))
    except OSError:
        pass
    try:
        out.add(_hex_v6(ip, port))
    except OSError:
        pass
    if ip.lower().startswith("::ffff:") and "." in ip:
        out |= _forms(ip[7:], port)
    if "." in ip and ":" not in ip:
        out.add(_hex_v6("::ffff:" + ip, port))
    return out


def local_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the client end of ``sock`` (a connection accepted by a server on this
    host), or None when the kernel does not show it (another host, gone, not Linux)."""
    try:
        peer, mine = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    client, server = _forms(peer[0], peer[1]), _forms(mine[0], mine[1])
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            cols = line.split()
            if len(cols) < 10 or cols[1] not in client or cols[2] not in server:
                continue
            if cols[3] == _ESTABLISHED and cols[9] != "0" and cols[7].isdigit():
                return int(cols[7])
    return None
