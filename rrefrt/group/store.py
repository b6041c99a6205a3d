"""A small key-value store for rendezvous and barriers (standard library only).

Owns: the store server (hosted by rank 0, or by ``rrefrt-run`` on the master node) and
its client.

It offers the subset of ``torch.distributed.TCPStore`` that rrefrt needs - ``set``,
``get``, ``add``, ``wait``, ``check`` and ``delete_key`` - and every blocking call takes
a timeout, so no rendezvous or barrier can hang.

NOTE [Store hardening] (issue 11 item 13)
  - One thread serves every connection (a ``selectors`` loop); a blocked GET/WAIT is parked
    with its deadline, never a thread. Connections, key and value sizes, the number of keys
    and the bytes stored are capped (``StoreLimits``); a request over a cap gets an error
    answer, a connection over the cap is closed at once.
  - With a secret, every connection starts with a mutual HMAC-SHA256 challenge-response
    before any request is read: a client without the secret (or with another one) is
    refused and cannot read or write a key; the client checks the server's proof too, so a
    forged store cannot feed it forged addresses.
  - NOTE [Refused clients]: a refused connection is refused and forgotten. Its handshake
    is unauthenticated, so nothing it says (the identity field included) reaches a log line,
    an error or ``auth_failures``, and nothing it does changes the store's state: only its
    address is counted (``refused``, ``refused_from``: the latest 16). The one exception is
    a client that the kernel shows to be a process of this store's own user on this host
    (``rrefrt.group.store_peer.local_peer_uid``, looked up while it still waits for the answer):
    it is inside the trust boundary already (it could read the secret from the workers'
    environment), almost always a worker started with another secret, and its claimed
    identity goes into ``auth_failures`` so the rendezvous can fail fast naming it. A flood
    of refusals cannot turn that look-up into a CPU sink: after each, none runs for
    ``_VERIFY_IDLE`` times its cost, and a refusal in between counts as a stranger's.
  - ``close()`` answers parked requests with CLOSED, so a client learns that the store
    retired (a re-initialising group reconnects to the next one) rather than timing out.

Wire format (one TCP connection per client, requests answered in order)::

    frame    = u32 length | u8 head | field*         field = u32 length | bytes
    hello    (server, first)  head 0, fields: b"rrefrt-store/2", nonce_s, b"1" if auth else b"0",
                              the largest request it accepts (ascii int)
    auth     (client, if auth) head 0, fields: nonce_c, HMAC(secret, "client" nonce_s nonce_c)
                               (empty without a secret), identity (text; used only when the
                               client is a process of the store's own user: NOTE [Refused clients])
             (server answer)   status 0, field HMAC(secret, "server" nonce_s nonce_c) / status 2
    request  head = op;     response head = status: 0 ok, 1 timeout, 2 error, 3 store closed

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
import hmac
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time

from rrefrt.group.store_peer import local_peer_uid
from rrefrt.group.store_wire import (
    _ADD, _CHECK, _CLOSED, _DELETE, _ERROR, _GET, _HANDSHAKE_S, _MAGIC, _OK, _SET, _TIMEOUT, _U32, _WAIT,
    PortInUseError, StoreAuthError, StoreClosed, StoreError, StoreLimits, StoreTimeout,
    pack, proof, recv_frame, secret_bytes, unpack,
)

__all__ = [
    "StoreClient",
    "StoreServer",
    "StoreLimits",
    "StoreError",
    "StoreTimeout",
    "StoreClosed",
    "StoreAuthError",
    "PortInUseError",
]

log = logging.getLogger("rrefrt.store")

#: NOTE [Refused clients]: after a look-up of a refused client's owner, none for this many
#: times its cost (so look-ups take at most a fifth of the store's thread)
_VERIFY_IDLE = 4


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "authed", "nonce", "since", "parked", "peer")

    def __init__(self, sock: socket.socket, nonce: bytes, authed: bool, peer: str) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = authed
        self.nonce = nonce
        self.since = time.monotonic()
        #: (op, keys, deadline) of a GET/WAIT waiting for its keys; requests behind it wait
        self.parked: tuple[int, list[bytes], float] | None = None
        self.peer = peer


class StoreServer:
    """Serves the store on ``host:port`` from one daemon thread until ``close()``."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str | bytes | None = None,
        limits: StoreLimits | None = None,
        label: str = "",
    ) -> None:
        self._secret = secret_bytes(secret)
        #: who hosts the store (e.g. "worker 'w0' (rank 0)"), named to refused clients
        self.label = label
        #: (monotonic time, the identity it claimed) of each refused client that the kernel
        #: shows to be a process of this store's own user on this host: the latest 16
        #: (NOTE [Refused clients]; nobody else's claim is ever kept)
        self.auth_failures: list[tuple[float, str]] = []
        #: refused connections in all (strangers and the above)
        self.refused = 0
        #: the addresses ("host:port") of the latest 16 refused connections
        self.refused_from: list[str] = []
        self._verify_at = 0.0  #: monotonic time before which no owner look-up runs
        self.limits = limits or StoreLimits()
        self._data: dict[bytes, bytes] = {}  #: key -> value; keys stay until deleted
        self._bytes = 0
        self._conns: dict[socket.socket, _Conn] = {}
        self._closed = False
        try:  # keep half of this process's file descriptors for everything else
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (OSError, ValueError):
            soft = -1
        self._max_conns = self.limits.max_connections if soft < 0 else min(self.limits.max_connections, max(16, soft // 2))
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"rendezvous port {host}:{port} is already in use by another process (Address already "
                    "in use); choose another MASTER_PORT (or stop the job that holds it)"
                ) from None
            raise StoreError(f"cannot bind the rendezvous store on {host}:{port}: {e}") from e
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="rrefrt-store", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event loop
    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, events in self._sel.select(self._next_timeout()):
                    s = key.fileobj
                    if s is self._sock:
                        self._accept()
                    elif s is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                    else:
                        c = self._conns.get(s)  # type: ignore[arg-type]
                        if c is None:
                            continue
                        if events & selectors.EVENT_WRITE:
                            self._flush(c)
                        if events & selectors.EVENT_READ and s in self._conns:
                            self._read(c)
                self._expire()
        except Exception:  # never expected; the store must not die silently
            log.exception("rendezvous store loop failed")
        finally:
            self._shutdown_all()

    def _next_timeout(self) -> float:
        now, t = time.monotonic(), 0.5
        for c in self._conns.values():
            if c.parked is not None:
                t = min(t, c.parked[2] - now)
            if not c.authed:
                t = min(t, c.since + _HANDSHAKE_S - now)
        return max(0.0, t)

    def _accept(self) -> None:
        while True:
            try:
                s, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._conns) >= self._max_conns:
                log.warning("rendezvous store: refusing %s, already %d connections", addr, len(self._conns))
                s.close()
                continue
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(32)
            c = _Conn(s, nonce, self._secret is None, f"{addr[0]}:{addr[1]}")
            self._conns[s] = c
            self._sel.register(s, selectors.EVENT_READ, None)
            max_frame = self.limits.max_key_bytes + self.limits.max_value_bytes + 64
            self._send(c, _OK, [_MAGIC, nonce, b"1" if self._secret else b"0", str(max_frame).encode()])

    def _read(self, c: _Conn) -> None:
        try:
            chunk = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(c)
            return
        c.inbuf += chunk
        if len(chunk) > 4096 and sum(len(x.inbuf) for x in self._conns.values()) > self.limits.max_total_bytes:
            log.warning("rendezvous store: dropping %s (requests buffered over the store's byte limit)", c.peer)
            self._drop(c)
            return
        self._process(c)

    def _process(self, c: _Conn) -> None:
        lim = self.limits
        max_frame = lim.max_key_bytes + lim.max_value_bytes + 64 if c.authed else 1024
        while c.parked is None and c.sock in self._conns and len(c.inbuf) >= 4:
            (n,) = _U32.unpack_from(c.inbuf, 0)
            if n == 0 or n > max_frame:
                log.warning("rendezvous store: dropping %s (frame of %d bytes)", c.peer, n)
                self._drop(c)
                return
            if len(c.inbuf) < 4 + n:
                return
            body = bytes(c.inbuf[4 : 4 + n])
            del c.inbuf[: 4 + n]
            try:
                op, fields = unpack(body)
            except (ValueError, struct.error):
                self._drop(c)
                return
            if not c.authed:
                self._handshake(c, fields)
                continue
            try:
                self._request(c, op, fields)
            except (ValueError, IndexError):
                self._send(c, _ERROR, [b"malformed request"])

    def _handshake(self, c: _Conn, fields: list[bytes]) -> None:
        assert self._secret is not None
        if len(fields) >= 2 and len(fields[0]) == 32:
            expect = proof(self._secret, b"client", c.nonce, fields[0])
            if hmac.compare_digest(expect, fields[1]):
                c.authed = True
                self._send(c, _OK, [proof(self._secret, b"server", c.nonce, fields[0])])
                return
        self.refused += 1
        self.refused_from = self.refused_from[-15:] + [c.peer]
        ours = self._owned_by_us(c)
        if ours and len(fields) >= 3 and fields[2]:  # NOTE [Refused clients]: a claim of our own user only
            who = "".join(ch for ch in fields[2].decode(errors="replace")[:300] if ch.isprintable())
            log.warning("rendezvous store: %s (a process of this user at %s) failed to authenticate (no or wrong "
                        "job secret)", who, c.peer)
            self.auth_failures = self.auth_failures[-15:] + [(time.monotonic(), who or f"a process at {c.peer}")]
        elif ours:
            log.warning("rendezvous store: a process of this user at %s failed to authenticate", c.peer)
            self.auth_failures = self.auth_failures[-15:] + [(time.monotonic(), f"a process at {c.peer}")]
        elif self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8, ...: a flood does not flood the log
            log.warning("rendezvous store: refused %s, which did not prove the job secret (%d refused so far)",
                        c.peer, self.refused)
        host = f" of {self.label}" if self.label else ""
        self._send(c, _ERROR, [f"authentication failed: the rendezvous store{host} needs the job secret".encode()])
        self._flush(c)
        self._drop(c)

    def _owned_by_us(self, c: _Conn) -> bool:
        """NOTE [Refused clients]: whether the kernel shows ``c``'s client to be a process of
        this store's user on this host (rate-limited: False when asked too soon)."""
        now = time.monotonic()
        if now < self._verify_at:
            return False
        uid = local_peer_uid(c.sock)
        took = time.monotonic() - now
        self._verify_at = now + (_VERIFY_IDLE + 1) * took
        return uid is not None and uid == os.geteuid()

    def _request(self, c: _Conn, op: int, f: list[bytes]) -> None:
        lim = self.limits
        if op in (_SET, _ADD, _GET, _DELETE) and len(f[0]) > lim.max_key_bytes:
            self._send(c, _ERROR, [b"key too long"])
            return
        if op == _SET:
            self._store(c, f[0], f[1])
        elif op == _ADD:
            value = int(self._data.get(f[0], b"0")) + int(f[1])
            if self._store(c, f[0], str(value).encode(), answer=False):
                self._send(c, _OK, [self._data[f[0]]])
        elif op == _CHECK:
            self._send(c, _OK, [b"1" if all(k in self._data for k in f) else b"0"])
        elif op == _DELETE:
            old = self._data.pop(f[0], None)
            if old is not None:
                self._bytes -= len(f[0]) + len(old)
            self._send(c, _OK, [b"1" if old is not None else b"0"])
        elif op in (_GET, _WAIT):
            keys, timeout_ms = ([f[0]], int(f[1])) if op == _GET else (f[1:], int(f[0]))
            c.parked = (op, keys, time.monotonic() + max(0, timeout_ms) / 1000.0)
            self._try_unpark(c)
        else:
            self._send(c, _ERROR, [b"unknown op"])

    def _store(self, c: _Conn, key: bytes, value: bytes, answer: bool = True) -> bool:
        lim = self.limits
        old = self._data.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key))
        if len(value) > lim.max_value_bytes:
            self._send(c, _ERROR, [b"value too large (%d bytes, limit %d)" % (len(value), lim.max_value_bytes)])
            return False
        if old is None and len(self._data) >= lim.max_keys:
            self._send(c, _ERROR, [b"too many keys in the store (limit %d)" % lim.max_keys])
            return False
        if self._bytes + grow > lim.max_total_bytes:
            self._send(c, _ERROR, [b"store full (limit %d bytes)" % lim.max_total_bytes])
            return False
        self._data[key] = value
        self._bytes += grow
        if answer:
            self._send(c, _OK, [])
        for other in list(self._conns.values()):
            if other.parked is not None:
                self._try_unpark(other)
        return True

    def _try_unpark(self, c: _Conn) -> None:
        assert c.parked is not None
        op, keys, deadline = c.parked
        if all(k in self._data for k in keys):
            c.parked = None
            self._send(c, _OK, [self._data[keys[0]]] if op == _GET else [])
        elif time.monotonic() >= deadline:
            c.parked = None
            self._send(c, _TIMEOUT, [])
        else:
            return
        self._process(c)  # requests that arrived behind the parked one

    def _expire(self) -> None:
        now = time.monotonic()
        for c in list(self._conns.values()):
            if c.parked is not None and now >= c.parked[2]:
                self._try_unpark(c)
            elif not c.authed and now - c.since > _HANDSHAKE_S:
                log.warning("rendezvous store: %s did not authenticate in time", c.peer)
                self._drop(c)

    def _send(self, c: _Conn, status: int, fields: list[bytes]) -> None:
        c.outbuf += pack(status, fields)
        if len(c.outbuf) > 2 * self.limits.max_value_bytes + 4096:  # a client that never reads its answers
            log.warning("rendezvous store: dropping %s (does not read its answers)", c.peer)
            self._drop(c)
            return
        self._flush(c)

    def _flush(self, c: _Conn) -> None:
        if c.sock not in self._conns:
            return
        try:
            while c.outbuf:
                n = c.sock.send(c.outbuf)
                del c.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(c)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.outbuf else 0)
        try:
            self._sel.modify(c.sock, want, None)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock, None) is None:
            return
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        c.sock.close()

    def _shutdown_all(self) -> None:
        for c in list(self._conns.values()):
            if c.parked is not None:  # blocked GET/WAIT requests learn that the store retired
                c.parked = None
                c.outbuf += pack(_CLOSED, [b"the rendezvous store closed"])
            try:
                c.sock.setblocking(True)
                c.sock.settimeout(0.2)
                if c.outbuf:
                    c.sock.sendall(c.outbuf)
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(c)
        for s in (self._sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, RuntimeError):
            pass

    @property
    def connections(self) -> int:
        """Open connections (authenticated or not)."""
        return len(self._conns)

    @property
    def parked(self) -> int:
        """GET/WAIT requests waiting for their keys."""
        for _ in range(5):  # read from another thread: the loop may resize the dict meanwhile
            try:
                return sum(1 for c in list(self._conns.values()) if c.parked is not None)
            except RuntimeError:
                continue
        return -1

    def close(self) -> None:
        """Stop serving: parked requests are answered CLOSED, connections and the port are
        released before this returns (bounded)."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # never expected: release the port anyway
            try:
                self._sock.close()
            except OSError:
                pass


class StoreClient:
    """A thread-safe client; ``connect_timeout`` bounds how long it retries to connect.

    With ``secret`` it authenticates to a store that asks for it and checks the store's
    proof; ``require_auth`` (default: whether a secret is given) refuses a store that does
    not ask (a forged or unauthenticated store)."""

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout: float = 30.0,
        secret: str | bytes | None = None,
        require_auth: bool | None = None,
        identity: str = "",
    ) -> None:
        self.host, self.port = host, port
        self._max_frame = 1 << 62  #: the largest request the store accepts (from its greeting)
        self._identity = identity
        self._lock = threading.Lock()
        #: how long a request waits for its answer beyond its own wait (a busy store host -
        #: its process in a long gc.collect(), a loaded machine - is not a dead one; callers
        #: with a longer deadline raise it: Rendezvous.barrier)
        self.answer_timeout = 10.0
        self._secret = secret_bytes(secret)
        self._require = (self._secret is not None) if require_auth is None else require_auth
        deadline = time.monotonic() + connect_timeout
        last: BaseException | None = None
        pause = 0.005  #: retry back-off: 5 ms doubling to 50 ms (a store that starts a moment later is met at once)
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.05, min(5.0, connect_timeout)))
                try:
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._handshake(max(0.5, min(5.0, deadline - time.monotonic())))
                except BaseException:
                    self._sock.close()
                    raise
                break
            except StoreAuthError:
                raise
            except (OSError, StoreClosed, StoreError) as e:
                last = e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout(
                        f"could not reach the rendezvous store at {host}:{port} within "
                        f"{connect_timeout:.1f}s ({last}); is rank 0 (or the launcher) running?"
                    ) from None
                threading.Event().wait(min(pause, left))  # retry back-off, not synchronisation
                pause = min(0.05, pause * 2)

    def _handshake(self, timeout: float) -> None:
        where = f"{self.host}:{self.port}"
        self._sock.settimeout(timeout)
        try:
            head, hello = unpack(recv_frame(self._sock))
        except socket.timeout:
            raise StoreError(f"the service at {where} is not an rrefrt rendezvous store (no greeting)") from None
        except (ConnectionError, ValueError, struct.error) as e:
            raise StoreError(f"the service at {where} is not an rrefrt rendezvous store ({e})") from None
        if head == _CLOSED:
            raise StoreClosed(f"the rendezvous store at {where} is closing")
        if head != _OK or len(hello) != 4 or hello[0] != _MAGIC or not hello[3].isdigit():
            raise StoreError(f"the service at {where} is not an rrefrt rendezvous store")
        nonce_s, wants_auth, self._max_frame = hello[1], hello[2] == b"1", int(hello[3])
        if not wants_auth:
            if self._require:
                raise StoreAuthError(
                    f"the rendezvous store at {where} does not authenticate its clients but this worker has a "
                    "job secret: a store of another job (or a forged one) holds the port, or the store host "
                    "has no secret; give every process the same RREFRT_SECRET"
                )
            return
        nonce_c = os.urandom(32)
        # without a secret, still answer (with no proof) so the store can name us in its error
        answer = proof(self._secret, b"client", nonce_s, nonce_c) if self._secret is not None else b""
        self._sock.sendall(pack(0, [nonce_c, answer, self._identity.encode()[:300]]))
        try:
            status, out = unpack(recv_frame(self._sock))
        except (OSError, ConnectionError, ValueError, struct.error):
            status, out = _ERROR, []
        said = out[0].decode(errors="replace") if status != _OK and out else "authentication failed"
        # the store's own words (it names its host), unauthenticated: one printable line, bounded
        said = "".join(ch for ch in said[:300] if ch.isprintable()) or "authentication failed"
        if self._secret is None:
            raise StoreAuthError(
                f"{said} (at {where}) and this process has none: set the same RREFRT_SECRET "
                "(or RpcBackendOptions(secret=...)) on every worker"
            )
        if status != _OK or not out or not hmac.compare_digest(out[0], proof(self._secret, b"server", nonce_s, nonce_c)):
            raise StoreAuthError(
                f"{said} (at {where}): it refused this process's job secret (or failed to prove it has the same "
                "one); every worker must use the same RREFRT_SECRET / RpcBackendOptions(secret=...)"
            )

    def _call(self, op: int, fields: list[bytes], wait_s: float = 0.0) -> tuple[int, list[bytes]]:
        frame = pack(op, fields)
        if len(frame) - 4 > self._max_frame:  # refused here: the store would drop the connection
            raise StoreError(
                f"request of {len(frame)} bytes is over the rendezvous store's limit ({self._max_frame} bytes: "
                "a key or value too large)"
            )
        with self._lock:
            try:
                self._sock.settimeout(wait_s + self.answer_timeout)
                self._sock.sendall(frame)
                status, out = unpack(recv_frame(self._sock))
            except socket.timeout:
                # the answer may still come: the connection is out of step, never reuse it
                self._sock.close()
                raise StoreTimeout(
                    f"rendezvous store at {self.host}:{self.port} did not answer within "
                    f"{wait_s + self.answer_timeout:.0f}s"
                ) from None
            except (OSError, ConnectionError, ValueError, struct.error) as e:
                raise StoreClosed(f"rendezvous store at {self.host}:{self.port} failed: {e}") from None
        if status == _CLOSED:
            raise StoreClosed(f"rendezvous store at {self.host}:{self.port} closed")
        if status == _ERROR:
            why = out[0].decode(errors="replace") if out else "error"
            raise StoreError(f"rendezvous store at {self.host}:{self.port} refused the request: {why}")
        return status, out

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
