"""Admission of same-host connections: peer credentials and the HMAC challenge-response.

Owns: both ends of the handshake in ``unix_wire`` - the connector's (blocking, on the thread
that joins) and the acceptor's (a non-blocking state machine fed by the receiver thread) -
and the host key that says whether two workers share a host. Nothing a connection sends is decoded here beyond the fixed
binary records of the handshake, and nothing is handed on before the connection passed.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from rrefrt_transport.unix import wire as uw
from rrefrt_transport.base import PeerSpec
from rrefrt_transport.errors import AuthenticationFailed, TransportError

log = logging.getLogger("rrefrt.transport")

ADMIT_TIMEOUT = 10.0  #: an accepted connection that has not passed by then is closed
#: connections waiting for admission at most; more are refused at once (the tcp stream
#: port is reachable from the network: idle strangers must not use up the fd limit)
MAX_ADMITTING = 256
#: NOTE [Accept failures] in ``transport``: seconds the listener is not watched after an
#: accept failed with connections still waiting
ACCEPT_PAUSE = 0.1
#: a peer whose connection failed the challenge fails the join if it is still missing this
#: long after (a stray connection claiming its id cannot abort a join that completes)
ACCEPT_GRACE = 2.0
_CRED = struct.Struct("3i")  # pid, uid, gid


def host_key() -> str:
    """Same value <=> a unix socket path of one worker can be reached by the other: same
    kernel boot, same mount namespace, same uid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        mnt = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        mnt = 0
    return f"{boot}/{mnt}/{os.getuid()}"


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("closed by the peer")
        buf += chunk
    return buf


#: NOTE [Tcp stream plane]: a TCP connect that has not completed by then fails (a firewall that
#: drops the SYN would otherwise hold the connector for the kernel's own timeout, minutes)
STREAM_CONNECT_TIMEOUT = 3.0


class Unreachable(TransportError):
    """The TCP connect itself failed (refused, unreachable, timed out): nothing listens
    there for us, or the path is blocked."""


def split_stream_endpoint(ep: str) -> tuple[int, tuple[str, int]]:
    """``"host:port"`` (``"[v6]:port"``) of a tcp stream endpoint -> (address family, sockaddr)."""
    host, _, port = ep.rpartition(":")
    if host.startswith("["):
        return socket.AF_INET6, (host[1:-1], int(port))
    return socket.AF_INET, (host, int(port))


def stream_endpoint(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


def connect_and_admit(
    spec: PeerSpec, my_id: int, my_inc: int, my_limit: int, secret: bytes | None, timeout: float,
    key: str = "unix",
) -> tuple[socket.socket, int]:
    """Connect to ``spec``'s ``key`` endpoint ("unix": its same-host socket, "stream": its tcp
    stream endpoint) and pass its admission; return the socket and the peer's
    ``max_message_size`` (its WELCOME)."""
    path = spec.address.endpoints.get(key)
    plane = "same-host" if key == "unix" else "tcp stream"
    if not path:
        raise TransportError(f"worker {spec.name!r} published no {plane} ({key}) endpoint")
    deadline = time.monotonic() + timeout
    stage = "connect"
    try:
        if key == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            addr: Any = path
        else:
            family, addr = split_stream_endpoint(path)
            s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except (OSError, ValueError) as e:
        raise TransportError(f"could not join worker {spec.name!r} over its {plane} endpoint {path}: {e}") from None
    try:
        s.settimeout(max(0.001, timeout if key == "unix" else min(timeout, STREAM_CONNECT_TIMEOUT)))
        s.connect(addr)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        if key == "unix":
            _, uid, _ = peer_cred(s)
            if uid != os.getuid():
                raise AuthenticationFailed(
                    f"the same-host socket of worker {spec.name!r} ({path}) belongs to uid {uid}, not ours ({os.getuid()})",
                    [spec.name],
                )
        else:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rec, nonce_c = uw.hello(my_id, my_inc, my_limit)
        s.sendall(rec)
        stage = "welcome"
        raw = _recv_exact(s, uw.WELCOME_LEN, deadline)
        wid, inc, limit, nonce_s = uw.parse_id(raw)
        if wid != spec.id or inc != spec.incarnation:
            raise TransportError(
                f"the {plane} endpoint {path} answered as worker id {wid} (incarnation {inc}), "
                f"not as {spec.name!r} (id {spec.id}, incarnation {spec.incarnation})"
            )
        ids = ((my_id, my_inc, my_limit), (spec.id, spec.incarnation, limit))
        if not hmac.compare_digest(raw[uw.HELLO_LEN :], uw.mac(secret, "acceptor", nonce_c, nonce_s, *ids)):
            raise AuthenticationFailed(
                f"worker {spec.name!r} failed the {plane} challenge (it holds a different job secret, "
                "or only one side has one): start every worker with the same RREFRT_SECRET",
                [spec.name],
            )
        s.sendall(uw.mac(secret, "connector", nonce_c, nonce_s, *ids))
        stage = "admit"
        if _recv_exact(s, len(uw.ADMIT), deadline) != uw.ADMIT:
            raise uw.ProtocolError("bad admission answer")
        s.settimeout(None)
        return s, limit
    except (AuthenticationFailed, TransportError):
        s.close()
        raise
    except (OSError, uw.ProtocolError, struct.error) as e:
        s.close()
        if stage == "admit" and (key == "unix" or secret is not None):
            # (over TCP without a secret nothing was proven: a reset there is the network's)
            raise AuthenticationFailed(
                f"worker {spec.name!r} refused our {plane} proof (a different job secret?): {e}", [spec.name]
            ) from None
        cls = Unreachable if stage == "connect" and key != "unix" else TransportError
        raise cls(
            f"could not join worker {spec.name!r} over its {plane} endpoint {path} ({stage}): {e or type(e).__name__}"
        ) from None


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    since: float
    buf: bytes = b""
    stage: str = "hello"
    peer: PeerSpec | None = None
    nonce_c: bytes = b""
    nonce_s: bytes = b""
    limit: int = 0  #: the connector's max_message_size (its HELLO)


@dataclass
class Acceptor:
    """The acceptor's side of admission, run by the receiver thread only."""

    my_id: int
    my_inc: int
    my_limit: int  #: our max_message_size, told to every connector in WELCOME
    secret: bytes | None
    stats: Any
    group: dict[int, PeerSpec] | None = None
    conns: dict[int, _Conn] = field(default_factory=dict)  #: fd -> connection in admission
    admitted: set[int] = field(default_factory=set)
    #: peer id -> when a connection claiming it first failed the challenge (read by the join)
    failed: dict[int, float] = field(default_factory=dict)
    plane: str = "same-host"  #: or "tcp stream" (for what it logs)

    def set_group(self, group: dict[int, PeerSpec]) -> None:
        self.group = group

    def accept(self, listener: socket.socket) -> tuple[list[socket.socket], bool]:
        """Accept waiting connections (on a unix socket: those whose uid is ours); return
        them (to be watched), and whether an accept failed with connections still waiting
        (out of file descriptors, say: the listener stays readable, so its caller must stop
        watching it for a while, NOTE [Accept failures] in ``transport``)."""
        out = []
        unix = self.plane == "same-host"
        while True:
            try:
                s, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return out, False
            except OSError as e:
                self.stats["accept_failures"] += 1
                n = self.stats["accept_failures"]
                if n & (n - 1) == 0:  # 1, 2, 4, ...: a lasting shortage does not flood the log
                    log.warning("worker id %d could not accept a connection on its %s socket: %s (%d failures "
                                "so far; it tries again in %.1f s)", self.my_id, self.plane, e, n, ACCEPT_PAUSE)
                return out, True
            if len(self.conns) >= MAX_ADMITTING:
                self._refuse(s, f"{MAX_ADMITTING} connections wait for admission already")
                continue
            if unix:
                _, uid, _ = peer_cred(s)
                if uid != os.getuid():
                    self._refuse(s, f"uid {uid} is not ours")
                    continue
            else:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            self.conns[s.fileno()] = _Conn(s, time.monotonic())
            out.append(s)

    def _refuse(self, s: socket.socket, why: str, close: bool = True) -> None:
        self.stats["unix_refused"] += 1
        n = self.stats["unix_refused"]
        if n & (n - 1) == 0:
            log.warning("worker id %d refused a %s connection: %s (%d refused so far)", self.my_id, self.plane, why, n)
        if close:
            s.close()

    def feed(self, fd: int) -> tuple[str, Any]:
        """Read what ``fd`` sent and advance its admission. Returns ("wait", None),
        ("refused", sock) - stop watching it and close it - or ("admitted", (peer id, sock,
        the peer's max_message_size))."""
        c = self.conns.get(fd)
        if c is None:
            return "wait", None
        try:
            data = c.sock.recv(256)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError:
            data = b""
        if data == b"":
            return self._drop(c, "closed during admission")
        if data:
            c.buf += data
            if len(c.buf) > uw.HELLO_LEN + uw.PROOF_LEN:
                return self._drop(c, "it sent more than the handshake before it was admitted")
        return self.advance(c)

    def advance(self, c: _Conn) -> tuple[str, Any]:
        if c.stage == "hello":
            if len(c.buf) < uw.HELLO_LEN or self.group is None:
                return "wait", None
            try:
                wid, inc, c.limit, c.nonce_c = uw.parse_id(c.buf[: uw.HELLO_LEN])
            except uw.ProtocolError as e:
                return self._drop(c, str(e))
            spec = self.group.get(wid)
            if spec is None or wid >= self.my_id or inc != spec.incarnation or wid in self.admitted:
                return self._drop(c, f"it claims worker id {wid} (incarnation {inc}), which may not connect here")
            c.peer, c.buf, c.stage = spec, c.buf[uw.HELLO_LEN :], "proof"
            c.nonce_s = secrets.token_bytes(32)
            ids = ((wid, inc, c.limit), (self.my_id, self.my_inc, self.my_limit))
            mac_a = uw.mac(self.secret, "acceptor", c.nonce_c, c.nonce_s, *ids)
            try:
                c.sock.send(uw.welcome(self.my_id, self.my_inc, self.my_limit, c.nonce_s, mac_a))
            except OSError as e:
                return self._drop(c, f"send failed: {e}")
        if c.stage == "proof" and len(c.buf) >= uw.PROOF_LEN:
            assert c.peer is not None
            ids = ((c.peer.id, c.peer.incarnation, c.limit), (self.my_id, self.my_inc, self.my_limit))
            if not hmac.compare_digest(c.buf[: uw.PROOF_LEN], uw.mac(self.secret, "connector", c.nonce_c, c.nonce_s, *ids)):
                self.stats["handshake_failures"] += 1
                self.failed.setdefault(c.peer.id, time.monotonic())
                return self._drop(c, f"worker {c.peer.name!r} failed the challenge (a different job secret?)")
            if len(c.buf) > uw.PROOF_LEN:
                return self._drop(c, "it sent before it was admitted")
            try:
                c.sock.send(uw.ADMIT)
            except OSError as e:
                return self._drop(c, f"send failed: {e}")
            del self.conns[c.sock.fileno()]
            self.admitted.add(c.peer.id)
            return "admitted", (c.peer.id, c.sock, c.limit)
        return "wait", None

    def _drop(self, c: _Conn, why: str) -> tuple[str, Any]:
        if c.stage == "proof" and c.peer is not None:  # it saw our answer and hung up: it refused us
            self.failed.setdefault(c.peer.id, time.monotonic())
        self.conns.pop(c.sock.fileno(), None)
        self._refuse(c.sock, why, close=False)
        return "refused", c.sock  # the receiver thread stops watching it, then closes it

    def expire(self, now: float) -> list[tuple[str, Any]]:
        return [self._drop(c, "admission timed out") for c in list(self.conns.values()) if now - c.since > ADMIT_TIMEOUT]
