"""The ZeroMQ agent: one ROUTER socket per process, owned by one I/O thread.

Owns: the socket, the peer table, request/response correlation, per-request deadlines and
liveness. Imports only zmq, msgpack (through ``wire``) and the standard library; never
torch, never rrefrt. The wire format is documented in ``transport.wire``.

Rules:

1. Only the I/O thread touches the socket, the peer table's mutable state, the pending
   requests and the deadline heap. Other threads hand it work through ``_outbox`` (a deque)
   and ring ``_bell`` (an eventfd watched by the poller). So none of that state needs a lock.
2. The I/O thread never runs user code and never blocks outside ``poll``: callbacks it runs
   (``on_message``, a request's ``on_done``) belong to the runtime and must only hand work on.
3. Every request has a deadline or is bounded by peer death: when a peer is declared dead,
   every request pending on it fails with ``PeerUnavailable`` naming it, and its late
   messages are dropped for the life of the agent (it is fenced).
4. With ``AgentOptions.auth`` every connection, accepted or made, passes CURVE and the ZAP
   handler before libzmq hands over any of its messages (NOTE [Authentication] in
   ``transport.security``); a mesh that cannot authenticate fails ``connect_peers`` with
   ``AuthenticationFailed`` naming the peers (NOTE [Handshake failures]).

NOTE [Liveness]: libzmq's heartbeats (HEARTBEAT_IVL/TIMEOUT/TTL) are answered by libzmq's own
thread, so a busy or deadlocked Python process still looks alive, while a dead, stopped or
partitioned one has its connection closed by libzmq. With ROUTER_MANDATORY and IMMEDIATE a
send to a peer without a connection fails with EHOSTUNREACH at once, so the agent probes
routes (PING) on every disconnect event from the socket monitor and every heartbeat
interval. A peer whose route stays gone for ``route_grace`` seconds is declared dead. A
successful send proves nothing (the peer may vanish right after), which is why every
request also carries its own deadline.

NOTE [Handshake failures]: the monitor reports failed handshakes. On a connect (whose peer
we know) libzmq retries only one closed mid-handshake, so a protocol or authentication
failure, or HANDSHAKE_ATTEMPTS closed handshakes in a row, fail ``connect_peers`` at once
naming that peer. On an accepted connection the monitor names only our own endpoint, and
anyone may connect there: so a failure while lower-ranked peers (those that connect to
us) are still missing fails ``connect_peers`` naming them only if they are still missing
ACCEPT_GRACE seconds later - a stray connection cannot abort a join that completes. After
the join, failures are counted (``handshake_failures``) and logged, nothing else.

NOTE [Fault injection]: tests install ``fault_hook`` to drop, delay, duplicate or reorder
(delay one so later ones overtake) outgoing messages by label. It sits after a request is
registered, so a dropped request still fails at its deadline, exactly like a lost one.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import security, wire
from .errors import (
    AgentClosed,
    AuthenticationFailed,
    MessageTooLarge,
    PeerUnavailable,
    RequestTimeout,
    TransportError,
)

log = logging.getLogger("rrefrt.transport")

#: on_done(meta, frames, error): exactly one of (meta/frames) or error is meaningful.
OnDone = Callable[[Any, Sequence[Any], "TransportError | None"], None]
#: on_message(src_id, kind, msg_id, meta, frames) for kinds >= wire.FIRST_APP_KIND.
OnMessage = Callable[[int, int, int, Any, Sequence[Any]], None]
#: on_peer_dead(peer_id, cause)
OnPeerDead = Callable[[int, str], None]

_PROBE_SUSPECT_S = 0.05
HANDSHAKE_ATTEMPTS = 3  #: closed handshakes in a row on a connect that fail the join
ACCEPT_GRACE = 2.0  #: seconds a peer may stay missing after a failed accepted handshake

_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
_ZERO_COPY_MIN = 1 << 16  #: frames this large are sent without a copy (libzmq keeps a reference)


def _nbytes(f: Any) -> int:
    """Size in bytes of a frame: len() of an array.array or a numpy array counts items."""
    return len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes


@dataclass(frozen=True)
class PeerSpec:
    id: int
    name: str
    incarnation: int
    endpoint: str


@dataclass
class _Pending:
    dest: int
    msg_id: int
    deadline: float | None
    timeout: float
    on_done: OnDone


@dataclass
class _Peer:
    spec: PeerSpec
    rid: bytes
    state: str = "joining"  #: joining -> up <-> suspect -> dead (final)
    suspect_since: float = 0.0
    pending: dict[int, _Pending] = field(default_factory=dict)  #: msg_id -> request awaiting it
    backlog: collections.deque = field(default_factory=collections.deque)  #: frames not yet routable
    hello_due: float = 0.0


@dataclass
class AgentOptions:
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 3.0
    route_grace: float = 0.5
    max_message_size: int = 1 << 31
    linger: float = 0.5
    #: CURVE keys of the job (NOTE [Authentication]); None: no authentication (ZeroMQ NULL)
    auth: security.CurveAuth | None = None


class Agent:
    def __init__(
        self,
        worker_id: int,
        name: str,
        incarnation: int,
        on_message: OnMessage,
        on_peer_dead: OnPeerDead,
        options: AgentOptions | None = None,
    ) -> None:
        self.id, self.name, self.incarnation = worker_id, name, incarnation
        self.options = options or AgentOptions()
        self._on_message = on_message
        self._on_peer_dead = on_peer_dead
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        self._outbox: collections.deque = collections.deque()
        self._outbox_lock = threading.Lock()
        self._outbox_closed = False  #: set, under the lock, by the final drain of the outbox
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._bell_rung = False
        self._peers: dict[int, _Peer] = {}  #: worker id -> peer (I/O thread only after start)
        self._self_pending: dict[int, _Pending] = {}  #: msg_id -> request sent to ourselves
        self._deadlines: list[tuple[float, int, int]] = []  #: heap of (deadline, msg_id, dest)
        #: heap of (due, seq, dest, frames): messages the fault hook delayed
        self._delayed: list[tuple[float, int, int, list]] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  #: (due, seq, fn): call_later
        #: fault_hook(dest, label) -> delays: [] drops the message, [0] sends it, [0, 0]
        #: duplicates it, [d] delays it by d seconds. Installed by tests only.
        self.fault_hook: Callable[[int, str], list[float]] | None = None
        self._all_up = threading.Event()
        self._closed = threading.Event()
        self._stopping = False
        self._next_probe = 0.0
        self._probe_now = False
        #: re-probe every route until then: a probe right after a disconnect event can still
        #: "succeed" into the closing pipe (libzmq detaches it from the socket later)
        self._probe_until = 0.0
        self.endpoints: list[str] = []
        self.stats: collections.Counter = collections.Counter()
        self._ctx = zmq.Context(io_threads=1)
        self._ctx.setsockopt(zmq.LINGER, int(self.options.linger * 1000))
        auth = self.options.auth
        if auth is not None and auth.rank != worker_id:
            raise ValueError(f"the CURVE keys are those of rank {auth.rank}, not of worker id {worker_id}")
        #: bound before the socket binds, closed after it (NOTE [Authentication], Rule 3)
        self._zap = security.ZapHandler(self._ctx, auth, self.stats) if auth is not None else None
        self._connects: dict[str, int] = {}  #: connect endpoint -> peer id (I/O thread)
        self._connect_failures: dict[int, int] = {}  #: peer id -> closed handshakes in a row
        self._accept_failed_at = 0.0  #: first failed accepted handshake before the join ended
        self._accept_cause = ""
        self._join_started = 0.0
        self._join_error: AuthenticationFailed | None = None  #: set once; wakes connect_peers
        self._sock = self._make_socket()
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | security.HANDSHAKE_EVENTS
        )
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-io-{name}", daemon=True)

    # ------------------------------------------------------------------ setup (any thread)
    def _make_socket(self) -> zmq.Socket:
        o = self.options
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTING_ID, wire.routing_id(self.id))
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.LINGER, int(o.linger * 1000))
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.MAXMSGSIZE, o.max_message_size + wire.MAX_HEADER_BYTES)
        s.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(o.heartbeat_interval * 1000)))
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(o.heartbeat_timeout * 1000)))
        s.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(o.heartbeat_timeout * 1000)))
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        if o.auth is not None:
            security.configure_keys(s, o.auth)
        return s

    def bind(self, endpoint: str) -> str:
        """Bind before start(); returns the concrete endpoint (port 0 -> the chosen port)."""
        if self.options.auth is not None:  # options are copied at bind (NOTE [Authentication], Rule 2)
            security.configure_server(self._sock, self.options.auth)
        self._sock.bind(endpoint)
        actual = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(actual)
        return actual

    def start(self) -> None:
        self._thread.start()

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Join the mesh: connect to peers with a higher id, exchange HELLO with all of
        them, and return once every route is up; raise TransportError naming the missing
        peers after ``timeout`` seconds, or AuthenticationFailed naming the peers that
        fail the handshake (NOTE [Handshake failures])."""
        self._check_usable()
        auth = self.options.auth
        if auth is not None:
            for spec in peers:
                if not 0 <= spec.id < auth.world_size:
                    raise TransportError(f"worker {spec.name!r} has id {spec.id}, outside the job's {auth.world_size} keys")

        def setup() -> None:
            now = time.monotonic()
            self._join_started = now
            for spec in peers:
                if spec.id == self.id:
                    continue
                peer = _Peer(spec=spec, rid=wire.routing_id(spec.id), hello_due=now)
                self._peers[spec.id] = peer
                if spec.id > self.id:
                    if auth is not None:  # options are copied at connect (NOTE [Authentication], Rule 2)
                        security.configure_client(self._sock, auth, spec.id)
                    self._connects[spec.endpoint] = spec.id
                    self._sock.connect(spec.endpoint)
            self._check_all_up()

        self._call_soon(setup)
        joined = self._all_up.wait(timeout)
        if self._join_error is not None:
            raise self._join_error
        if not joined:
            missing = sorted(p.spec.name for p in list(self._peers.values()) if p.state == "joining")
            raise TransportError(
                f"worker {self.name!r} could not reach {', '.join(map(repr, missing)) or 'its peers'} "
                f"within {timeout:.1f}s"
            )

    # ------------------------------------------------------------------ API (any thread)
    def request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone,
        label: str = "",
    ) -> int:
        """Send a request; ``on_done`` runs once, on the I/O thread, with the response or an
        error. ``timeout`` <= 0 means no deadline (still bounded by peer death). ``label``
        names the message for the fault hook (tests)."""
        self._check_usable()
        self._check_size(frames)
        msg_id = next(self._ids)
        out = [self._header(kind, msg_id, meta), *frames]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        pending = _Pending(dest, msg_id, deadline, timeout, on_done)
        self._enqueue(("req", pending, out, label))
        return msg_id

    def send(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = ""
    ) -> None:
        """Send a one-way message (or a RESPONSE when kind is wire.RESPONSE)."""
        self._check_usable()
        self._check_size(frames)
        self._enqueue(("send", dest, [self._header(kind, msg_id, meta), *frames], label))

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        self.send(dest, wire.RESPONSE, meta, frames, msg_id, label)

    def peer_name(self, peer_id: int) -> str:
        peer = self._peers.get(peer_id)
        return peer.spec.name if peer else ("self" if peer_id == self.id else f"<worker {peer_id}>")

    def dead_peers(self) -> set[int]:
        return {pid for pid, p in list(self._peers.items()) if p.state == "dead"}

    def is_alive(self, peer_id: int) -> bool:
        if peer_id == self.id:
            return not self._closed.is_set()
        peer = self._peers.get(peer_id)
        return peer is not None and peer.state != "dead"

    def pending_per_peer(self) -> dict[str, int]:
        return {p.spec.name: len(p.pending) for p in list(self._peers.values())}

    def close(self, timeout: float = 2.0) -> None:
        """Stop the I/O thread, fail every pending request, close the socket with a small
        linger. Never hangs; in a forked child it only abandons the inherited state."""
        if os.getpid() != self._pid:
            return
        if self._closed.is_set():
            return
        if self._thread.ident is None:  # never started: no I/O thread owns the socket
            self._shutdown()
            return
        if self._thread.is_alive():
            try:
                self._enqueue(("stop",))
            except AgentClosed:  # the I/O thread is already shutting down
                pass
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("I/O thread of %r did not stop within %.1fs; abandoning it", self.name, timeout)
            return
        self._closed.set()

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise AgentClosed("the transport was inherited through fork(); it is unusable in the child")
        if self._closed.is_set() or self._stopping:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed")

    def _check_size(self, frames: Sequence[Any]) -> None:
        size = sum(_nbytes(f) for f in frames)
        if size > self.options.max_message_size:
            raise MessageTooLarge(
                f"message of {size} bytes exceeds the limit of {self.options.max_message_size} bytes"
            )

    @staticmethod
    def _header(kind: int, msg_id: int, meta: Any) -> bytes:
        head = wire.encode_header(kind, msg_id, meta)
        if len(head) > wire.MAX_HEADER_BYTES:  # the receiver would drop it without a word
            raise MessageTooLarge(f"message header of {len(head)} bytes exceeds the limit of {wire.MAX_HEADER_BYTES} bytes")
        return head

    def _enqueue(self, item: tuple) -> None:
        # Under the lock, so that an item is either taken by the final drain of the outbox
        # (and its request failed) or refused here: never left behind after shutdown, and
        # the bell is never rung after it was closed.
        with self._outbox_lock:
            if self._outbox_closed:
                raise AgentClosed(f"the transport of worker {self.name!r} is closed")
            self._outbox.append(item)
            if not self._bell_rung:
                self._bell_rung = True
                try:
                    os.eventfd_write(self._bell, 1)
                except OSError:
                    pass

    def _call_soon(self, fn: Callable[[], None]) -> None:
        self._enqueue(("call", fn))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._bell, zmq.POLLIN)
        zap = self._zap.socket if self._zap is not None else None
        if zap is not None:
            poller.register(zap, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._bell in events:
                    try:
                        os.eventfd_read(self._bell)
                    except OSError:
                        pass
                self._bell_rung = False
                self._drain_outbox()
                if self._sock in events:
                    self._recv_all()
                if zap is not None and zap in events:
                    self._zap.serve()  # type: ignore[union-attr]
                if self._monitor in events:
                    self._read_monitor()
                now = time.monotonic()
                self._send_delayed(now)
                self._expire(now)
                self._check_routes(now)
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("I/O thread of %r crashed", self.name)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._stopping = True
        self._fail_everything("the transport was shut down")
        self._monitor.close(0)
        self._sock.close(int(self.options.linger * 1000))
        if self._zap is not None:  # after the socket: no connection is ever left without it
            self._zap.close()
        self._ctx.term()
        os.close(self._bell)
        self._closed.set()

    def _send_faulty(self, dest: int, frames: list, label: str) -> None:
        """Send through the fault hook, when one is installed (NOTE [Fault injection])."""
        hook = self.fault_hook
        if hook is None:
            self._send(dest, frames)
            return
        for delay in hook(dest, label):
            if delay <= 0:
                self._send(dest, frames)
            else:
                heapq.heappush(self._delayed, (time.monotonic() + delay, next(self._ids), dest, frames))

    def _send_delayed(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            _, _, dest, frames = heapq.heappop(self._delayed)
            self._send(dest, frames)
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            try:
                fn()
            except Exception:
                log.exception("timer callback failed")

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread after ``delay`` seconds (I/O thread only: from
        ``on_message`` or a request's ``on_done``). ``fn`` must be quick and non-blocking."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._ids), fn))

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wake = self._next_probe
        if self._delayed:
            wake = min(wake, self._delayed[0][0])
        if self._timers:
            wake = min(wake, self._timers[0][0])
        if self._deadlines:
            wake = min(wake, self._deadlines[0][0])
        if now < self._probe_until:
            wake = min(wake, now + _PROBE_SUSPECT_S)
        for p in self._peers.values():
            if p.state in ("suspect", "joining") or p.backlog:
                wake = min(wake, now + _PROBE_SUSPECT_S)
                break
        return max(0, int((wake - now) * 1000) + 1)

    def _drain_outbox(self) -> None:
        box = self._outbox
        while box:
            item = box.popleft()
            op = item[0]
            if op == "send":
                self._send_faulty(item[1], item[2], item[3])
            elif op == "req":
                pending, frames = item[1], item[2]
                peer = self._peers.get(pending.dest)
                if pending.dest != self.id and (peer is None or peer.state == "dead"):
                    cause = "it was declared dead" if peer else "it is not a member of this group"
                    pending.on_done(None, (), PeerUnavailable(self.peer_name(pending.dest), cause))
                    continue
                self._register(pending)
                self._send_faulty(pending.dest, frames, item[3])
            elif op == "call":
                item[1]()
            elif op == "stop":
                self._stopping = True
                return

    def _register(self, p: _Pending) -> None:
        table = self._peers[p.dest].pending if p.dest != self.id else self._self_pending
        table[p.msg_id] = p
        if p.deadline is not None:
            heapq.heappush(self._deadlines, (p.deadline, p.msg_id, p.dest))

    def _send(self, dest: int, frames: list) -> None:
        if dest == self.id:
            self._deliver(dest, [bytes(f) if not isinstance(f, bytes) else f for f in frames])
            return
        peer = self._peers.get(dest)
        if peer is None or peer.state == "dead":
            self.stats["dropped_to_dead"] += 1
            return
        if peer.backlog or peer.state == "joining":
            peer.backlog.append(frames)
            return
        if not self._try_send(peer, frames):
            peer.backlog.append(frames)

    def _try_send(self, peer: _Peer, frames: list) -> bool:
        small = all((f.nbytes if isinstance(f, memoryview) else len(f)) < _ZERO_COPY_MIN for f in frames)
        try:
            self._sock.send_multipart([peer.rid, *frames], flags=_NOBLOCK, copy=small)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                if peer.state == "up":
                    peer.state, peer.suspect_since = "suspect", time.monotonic()
                return False
            if e.errno == errno.EAGAIN:
                return False
            raise
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += sum(_nbytes(f) for f in frames)
        if peer.state == "suspect":
            peer.state = "up"
        return True

    def _flush_backlog(self, peer: _Peer) -> None:
        while peer.backlog:
            if not self._try_send(peer, peer.backlog[0]):
                return
            peer.backlog.popleft()

    def _recv_all(self) -> None:
        sock = self._sock
        for _ in range(1000):
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                return
            msg = sock.recv_multipart(_NOBLOCK, copy=False)
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f) for f in msg)
            wid = wire.worker_id_of(msg[0].bytes)
            peer = self._peers.get(wid) if wid is not None else None
            if peer is None:
                self.stats["bad_frames_dropped"] += 1
                self.stats["unknown_peer_dropped"] += 1
                continue
            if peer.state == "dead":
                self.stats["fenced_dropped"] += 1
                continue
            self._deliver(wid, msg[1:], peer)

    def _deliver(self, src: int, frames: list, peer: _Peer | None = None) -> None:
        if len(frames) < 1 or len(frames) > wire.MAX_FRAMES + 1:
            self.stats["bad_frames_dropped"] += 1
            return
        head = frames[0]
        try:
            kind, msg_id, meta = wire.decode_header(head if isinstance(head, bytes) else head.bytes)
        except wire.MalformedMessage:
            self.stats["bad_frames_dropped"] += 1
            return
        body = frames[1:]
        if kind >= wire.FIRST_APP_KIND:
            self._on_message(src, kind, msg_id, meta, body)
        elif kind == wire.RESPONSE:
            table = peer.pending if peer is not None else self._self_pending
            pending = table.pop(msg_id, None)
            if pending is None:
                self.stats["late_responses_dropped"] += 1
                return
            pending.on_done(meta, body, None)
        elif kind in (wire.HELLO, wire.HELLO_ACK) and peer is not None:
            if not (type(meta) is list and len(meta) == 2 and meta[0] == peer.spec.incarnation):
                self.stats["bad_frames_dropped"] += 1
                self.stats["fenced_dropped"] += 1
                return
            if kind == wire.HELLO:
                self._try_send(peer, [wire.encode_header(wire.HELLO_ACK, 0, [self.incarnation, self.name])])
            if peer.state == "joining":
                peer.state = "up"
                self._flush_backlog(peer)
                self._check_all_up()
        elif kind == wire.PING:
            pass
        else:
            self.stats["bad_frames_dropped"] += 1

    def _check_all_up(self) -> None:
        if all(p.state != "joining" for p in self._peers.values()):
            self._all_up.set()

    def _read_monitor(self) -> None:
        while True:
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            event = int(ev["event"])
            if event & security.HANDSHAKE_FAILED:
                self._on_handshake_failed(ev["endpoint"].decode(errors="replace"), event, int(ev["value"]))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                pid = self._connects.get(ev["endpoint"].decode(errors="replace"))
                if pid is not None:
                    self._connect_failures.pop(pid, None)
            else:
                self._probe_now = True
                self._probe_until = time.monotonic() + self.options.route_grace

    def _on_handshake_failed(self, endpoint: str, event: int, value: int) -> None:
        """NOTE [Handshake failures]."""
        self.stats["handshake_failures"] += 1
        cause = security.describe_failure(event, value)
        joining = not self._all_up.is_set()
        pid = self._connects.get(endpoint)
        peer = self._peers.get(pid) if pid is not None else None
        if peer is not None:
            n = self._connect_failures[peer.spec.id] = self._connect_failures.get(peer.spec.id, 0) + 1
            if joining and peer.state == "joining" and (security.is_terminal(event) or n >= HANDSHAKE_ATTEMPTS):
                tries = "" if security.is_terminal(event) else f" ({n} attempts)"
                self._fail_join(
                    [peer.spec.name],
                    f"worker {self.name!r} could not authenticate with worker {peer.spec.name!r} at "
                    f"{endpoint}{tries}: {cause}",
                )
            elif not joining and n & (n - 1) == 0:  # 1, 2, 4, 8, ... in a row
                log.warning("handshake of %r with worker %r failed (%d in a row): %s", self.name, peer.spec.name, n, cause)
            return
        if joining:
            if not self._accept_failed_at:
                self._accept_failed_at = time.monotonic()
            if not self._accept_cause or event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._accept_cause = cause  # the most telling one
            return
        n = self.stats["handshake_failures"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a flood of strangers does not flood the log
            log.warning(
                "worker %r refused a connection on %s: %s (%d refused so far)", self.name, endpoint, cause, n
            )

    def _check_accept_failures(self, now: float) -> None:
        """During the join: fail it when peers that should connect to us are still missing
        ACCEPT_GRACE seconds after an accepted handshake failed (NOTE [Handshake failures])."""
        since = max(self._accept_failed_at, self._join_started)
        if not self._join_started or now - since < ACCEPT_GRACE:
            return
        missing = [p.spec.name for p in self._peers.values() if p.state == "joining" and p.spec.id < self.id]
        if not missing:
            self._accept_failed_at = 0.0
            return
        who = ("worker " if len(missing) == 1 else "workers ") + ", ".join(map(repr, missing))
        self._fail_join(
            missing,
            f"worker {self.name!r} could not authenticate with {who}: connections to "
            f"{', '.join(self.endpoints)} failed the handshake ({self._accept_cause}) and "
            f"{who} never authenticated within {ACCEPT_GRACE:.1f}s after that",
        )

    def _fail_join(self, peers: list[str], message: str) -> None:
        if self._join_error is None:
            self._join_error = AuthenticationFailed(message, peers)
            self._all_up.set()

    def _check_routes(self, now: float) -> None:
        if self._accept_failed_at and not self._all_up.is_set():
            self._check_accept_failures(now)
        regular = now >= self._next_probe or self._probe_now or now < self._probe_until
        if regular:
            self._next_probe = now + self.options.heartbeat_interval
            self._probe_now = False
        ping = None
        for peer in list(self._peers.values()):
            if peer.state == "dead":
                continue
            if peer.state == "joining":
                if peer.spec.id > self.id and now >= peer.hello_due:
                    peer.hello_due = now + 0.05
                    self._try_send(peer, [wire.encode_header(wire.HELLO, 0, [self.incarnation, self.name])])
                continue
            if peer.backlog:
                self._flush_backlog(peer)
            elif regular or peer.state == "suspect":
                ping = ping or [wire.encode_header(wire.PING, 0, None)]
                self._try_send(peer, ping)
            if peer.state == "suspect" and now - peer.suspect_since > self.options.route_grace:
                self._declare_dead(peer, f"its connection was lost for over {self.options.route_grace:.1f}s")

    def _declare_dead(self, peer: _Peer, cause: str) -> None:
        peer.state = "dead"
        log.warning("worker %r declared dead: %s", peer.spec.name, cause)
        self.stats["peers_declared_dead"] += 1
        err = PeerUnavailable(peer.spec.name, cause)
        pending, peer.pending = peer.pending, {}
        peer.backlog.clear()
        for p in pending.values():
            p.on_done(None, (), err)
        try:
            self._on_peer_dead(peer.spec.id, cause)
        except Exception:
            log.exception("peer-death callback failed")

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, msg_id, dest = heapq.heappop(heap)
            table = self._self_pending if dest == self.id else self._peers[dest].pending
            p = table.pop(msg_id, None)
            if p is not None:
                self.stats["requests_timed_out"] += 1
                p.on_done(None, (), RequestTimeout(self.peer_name(dest), p.timeout))

    def _fail_everything(self, cause: str) -> None:
        err = AgentClosed(f"{cause} (worker {self.name!r})")
        tables = [p.pending for p in self._peers.values()] + [self._self_pending]
        for table in tables:
            pending = list(table.values())
            table.clear()
            for p in pending:
                try:
                    p.on_done(None, (), err)
                except Exception:
                    log.exception("on_done failed during close")
        with self._outbox_lock:
            self._outbox_closed = True
            items = list(self._outbox)
            self._outbox.clear()
        for item in items:
            if item[0] == "req":
                try:
                    item[1].on_done(None, (), err)
                except Exception:
                    log.exception("on_done failed during close")
