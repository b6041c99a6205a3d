"""A small key-value store for rendezvous and barriers (standard library only).

Owns: the store server (hosted by rank 0, or by ``rrefrt-run`` on the master node) and
its client. Must not import anything outside the standard library: the launcher uses it.

It offers the subset of ``torch.distributed.TCPStore`` that rrefrt needs - ``set``,
``get``, ``add``, ``wait``, ``check`` and ``delete_key`` - and every blocking call takes
a timeout, so no rendezvous or barrier can hang.

Wire format (one TCP connection per client, requests answered in order)::

    request  = u32 length | u8 op | field*      field = u32 length | bytes
    response = u32 length | u8 status | field*  status 0 = ok, 1 = timeout, 2 = error

    op  name     fields in                  fields out
    1   SET      key, value                 -
    2   GET      key, timeout_ms            value
    3   ADD      key, delta (ascii int)     new value (ascii int)
    4   WAIT     timeout_ms, key*           -            (status 1 if any key is missing)
    5   CHECK    key*                       b"1" / b"0"
    6   DELETE   key                        b"1" / b"0"
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time

__all__ = ["StoreClient", "StoreServer", "StoreTimeout", "StoreError", "PortInUseError"]

log = logging.getLogger("rrefrt.store")

_U32 = struct.Struct("!I")
_SET, _GET, _ADD, _WAIT, _CHECK, _DELETE = 1, 2, 3, 4, 5, 6
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_MAX_FRAME = 64 << 20


class StoreError(RuntimeError):
    """The store could not be reached or answered badly."""


class StoreTimeout(StoreError, TimeoutError):
    """A key did not appear within the timeout."""


class PortInUseError(StoreError, OSError):
    """The rendezvous port is already taken by another process (errno EADDRINUSE)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.EADDRINUSE
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror


def _pack(head: int, fields: list[bytes]) -> bytes:
    body = bytearray([head])
    for f in fields:
        body += _U32.pack(len(f))
        body += f
    return _U32.pack(len(body)) + bytes(body)


def _unpack(body: bytes) -> tuple[int, list[bytes]]:
    head, pos, fields = body[0], 1, []
    while pos < len(body):
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        fields.append(body[pos : pos + n])
        pos += n
    return head, fields


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("store connection closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if n == 0 or n > _MAX_FRAME:
        raise ConnectionError(f"bad store frame length {n}")
    return _recv_exact(sock, n)


class StoreServer:
    """Serves the store on ``host:port`` from daemon threads until ``close()``."""

    def __init__(self, host: str, port: int) -> None:
        self._data: dict[bytes, bytes] = {}  #: key -> value; keys stay until deleted
        self._cond = threading.Condition()
        self._closed = False
        #: open connections, each with the lock its thread holds while answering a request
        self._conns: dict[socket.socket, threading.Lock] = {}
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"rendezvous port {host}:{port} is already in use by another process; "
                    "choose another MASTER_PORT (or stop the job that holds it)"
                ) from None
            raise StoreError(f"cannot bind the rendezvous store on {host}:{port}: {e}") from e
        sock.listen(128)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="rrefrt-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = threading.Lock()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lock = self._conns[conn]
        try:
            while True:
                request = _recv_frame(conn)
                with lock:  # close() never cuts a connection between a request and its answer
                    op, fields = _unpack(request)
                    status, out = self._handle(op, fields)
                    conn.sendall(_pack(status, out))
        except (OSError, ConnectionError, struct.error, IndexError, ValueError):
            pass
        finally:
            with self._cond:
                self._conns.pop(conn, None)
            conn.close()

    def _handle(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        with self._cond:
            if op == _SET:
                self._data[f[0]] = f[1]
                self._cond.notify_all()
                return _OK, []
            if op == _ADD:
                value = int(self._data.get(f[0], b"0")) + int(f[1])
                self._data[f[0]] = str(value).encode()
                self._cond.notify_all()
                return _OK, [self._data[f[0]]]
            if op == _GET:
                keys, timeout_ms = [f[0]], int(f[1])
            elif op == _WAIT:
                keys, timeout_ms = f[1:], int(f[0])
            elif op == _CHECK:
                return _OK, [b"1" if all(k in self._data for k in f) else b"0"]
            elif op == _DELETE:
                return _OK, [b"1" if self._data.pop(f[0], None) is not None else b"0"]
            else:
                return _ERROR, [b"unknown op"]
            deadline = time.monotonic() + timeout_ms / 1000.0
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return _TIMEOUT, []
                self._cond.wait(left)
            return _OK, [self._data[keys[0]]] if op == _GET else []

    def close(self) -> None:
        with self._cond:
            self._closed = True  # blocked GET/WAIT requests return (timeout) at once
            conns = list(self._conns.items())
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c, lock in conns:
            got = lock.acquire(timeout=1.0)  # let an answer in progress go out first
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                if got:
                    lock.release()
        self._thread.join(timeout=2.0)


class StoreClient:
    """A thread-safe client; ``connect_timeout`` bounds how long it retries to connect."""

    def __init__(self, host: str, port: int, connect_timeout: float = 30.0) -> None:
        self.host, self.port = host, port
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout
        last: OSError | None = None
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=min(5.0, connect_timeout))
                break
            except OSError as e:
                last = e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout(
                        f"could not reach the rendezvous store at {host}:{port} within "
                        f"{connect_timeout:.1f}s ({last}); is rank 0 (or the launcher) running?"
                    ) from None
                threading.Event().wait(min(0.05, left))  # retry back-off, not synchronisation
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call(self, op: int, fields: list[bytes], wait_s: float = 0.0) -> tuple[int, list[bytes]]:
        with self._lock:
            try:
                self._sock.settimeout(wait_s + 10.0)
                self._sock.sendall(_pack(op, fields))
                return _unpack(_recv_frame(self._sock))
            except (OSError, ConnectionError) as e:
                raise StoreError(f"rendezvous store at {self.host}:{self.port} failed: {e}") from e

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, [key.encode(), bytes(value)])

    def get(self, key: str, timeout: float) -> bytes:
        status, out = self._call(_GET, [key.encode(), str(int(timeout * 1000)).encode()], timeout)
        if status != _OK:
            raise StoreTimeout(f"key {key!r} did not appear in the store within {timeout:.1f}s")
        return out[0]

    def add(self, key: str, delta: int) -> int:
        return int(self._call(_ADD, [key.encode(), str(int(delta)).encode()])[1][0])

    def wait(self, keys: list[str], timeout: float) -> bool:
        """True once every key exists; False after ``timeout`` seconds."""
        fields = [str(int(timeout * 1000)).encode()] + [k.encode() for k in keys]
        return self._call(_WAIT, fields, timeout)[0] == _OK

    def check(self, keys: list[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, [key.encode()])[1][0] == b"1"

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
