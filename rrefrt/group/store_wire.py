"""The rendezvous store's wire format, errors and limits (standard library only).

Owns: framing (``pack``/``unpack``/``recv_frame``), the op and status codes, the HMAC
proofs of the handshake, the store's error classes and ``StoreLimits``. Imported by
``rrefrt.group.store`` (server and client), which documents the protocol and re-exports the
public names.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

from rrefrt.errors import AuthenticationError, RpcError, RpcTimeoutError

_U32 = struct.Struct("!I")
_SET, _GET, _ADD, _WAIT, _CHECK, _DELETE = 1, 2, 3, 4, 5, 6
_OK, _TIMEOUT, _ERROR, _CLOSED = 0, 1, 2, 3
_MAGIC = b"rrefrt-store/2"
_HANDSHAKE_S = 10.0  #: a connection must finish its handshake within this time


class StoreError(RpcError):
    """The store could not be reached or answered badly."""


class StoreTimeout(StoreError, RpcTimeoutError):
    """A key did not appear (or the store did not answer) within the timeout."""


class StoreClosed(StoreError):
    """The store closed (its host left or retired it) while this client used it."""


class StoreAuthError(StoreError, AuthenticationError):
    """The store and this client do not share the job secret."""


class PortInUseError(StoreError, OSError):
    """The rendezvous port is already taken by another process (errno EADDRINUSE)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.EADDRINUSE
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror


@dataclass(frozen=True)
class StoreLimits:
    """Caps that keep one client from exhausting the store host's memory or threads."""

    max_connections: int = 1024
    max_key_bytes: int = 4096
    max_value_bytes: int = 1 << 20
    max_keys: int = 100_000
    max_total_bytes: int = 64 << 20


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None or secret == "" or secret == b"":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def proof(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"rrefrt-store-auth\0" + role + b"\0" + nonce_s + nonce_c, hashlib.sha256).digest()


def pack(head: int, fields: list[bytes]) -> bytes:
    body = bytearray([head])
    for f in fields:
        body += _U32.pack(len(f))
        body += f
    return _U32.pack(len(body)) + bytes(body)


def unpack(body: bytes) -> tuple[int, list[bytes]]:
    head, pos, fields = body[0], 1, []
    while pos < len(body):
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ValueError("truncated store field")
        fields.append(body[pos : pos + n])
        pos += n
    return head, fields


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("store connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _U32.unpack(recv_exact(sock, 4))
    if n == 0 or n > (64 << 20):
        raise ConnectionError(f"bad store frame length {n}")
    return recv_exact(sock, n)
