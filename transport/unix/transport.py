"""The same-host transport: one AF_UNIX stream per peer pair, shared memory for large frames.

Owns: the listening socket (in a 0700 directory of its own), the peer connections, their
admission, request/response correlation, deadlines, timers and liveness. Registered as
``"unix"``.

Rules:

1. Sending: the thread that holds the bytes writes them itself, and never waits for the
   peer to read. Each peer has an ordered queue and a send lock; a sender that finds the
   lock free and nothing queued or half-written (checked under the lock) writes at once,
   without queueing. What the socket does not take, and every message that finds others
   ahead of it, is copied into the queue (the arguments are a snapshot when ``request``
   returns) and written by whoever holds the lock next, or by the receiver thread on
   EVENT_WRITE; whoever releases the lock re-checks the queue, so a message queued
   meanwhile is never stranded. The queue is bounded in bytes per peer, and a message that
   does not fit waits for room at most until its request's deadline (NOTE [Send queue
   bound] in ``unix_send``); the receiver thread never waits at all.
2. One receiver thread per process waits in a selector over every peer socket, the listening
   socket and a bell (eventfd). It reads whole messages, decodes the header once, and calls
   ``on_message`` or a request's ``on_done`` itself: no thread handoff on receipt. It also
   runs the timer heap (deadlines, ``call_later``, delayed fault-hook messages, heartbeats).
   The runtime may ask it to run a call itself (``run_inline``): then the receiver role can
   move to a standby thread (NOTE [Inline calls] in ``unix_lead``); "the receiver thread"
   is whichever thread leads the loop now.
3. Nothing from a connection is decoded before it is admitted (NOTE [Same-host admission]
   in docs/same-host.md): SO_PEERCRED uid = ours, then the HMAC challenge-response of
   ``unix_wire``. Until ``connect_peers`` gives the group, accepted connections wait.
4. NOTE [Unix liveness]: EOF or a reset on a peer's socket means its process is gone: it is
   declared dead at once. A stopped or hung process keeps its socket open, so every
   ``heartbeat_interval`` the receiver thread PINGs each peer, and a peer from which no
   byte at all (a PING, or any part of any message, however long) arrived for
   ``heartbeat_timeout`` is declared dead. Dead peers stay fenced: their requests fail with
   PeerUnavailable, their late bytes are never read.
5. Fault injection: ``fault_hook`` has the semantics of NOTE [Fault injection] in
   ``rrefrt_transport.zmq.send``; while a hook is installed every frame travels inline (no segment
   is lent twice by a duplicated message).
6. NOTE [Protocol errors]: a connection that breaks the framing (a message prefix out of
   bounds, a shared-memory segment it never sent) is closed - counted as
   ``protocol_errors``, logged - and its peer is not judged dead: without a secret, a
   same-uid process that read the store can pass admission under a member's identity
   (docs/security.md), and one bad frame from it must not make this worker alone hold
   that member dead while the others keep it (a split membership). Before closing, the
   reader sends CLOSE [cause], so that the other end (a real peer with a bug) closes its
   side without reading the EOF as this worker's death (``connections_closed_by_peer``).
   Both then reach each other over the composite transport's inner one (``on_closed``),
   whose liveness alone judges death; requests pending on the closed connection fail with
   PeerUnavailable naming the cause. EOF without CLOSE still means the process is gone.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rrefrt_transport import hosts

from rrefrt_transport import wire
from rrefrt_transport.unix import shm
from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, TransportConfig, register
from rrefrt_transport.errors import AuthenticationFailed, PeerUnavailable, RequestTimeout, TransportError
from rrefrt_transport.unix.admit import ACCEPT_GRACE, Acceptor, connect_and_admit, host_key
from rrefrt_transport.unix.lead import Leadership, inline_enabled
from rrefrt_transport.unix.loop import BELL, READ, Loop, Poller
from rrefrt_transport.unix.send import QUEUE_BYTES, Send

log = logging.getLogger("rrefrt.transport")



def _answered(meta: Any, frames: Sequence[Any], err: Any) -> None:
    """``on_done`` of a request already answered (see ``_Pending.finish``)."""


#: NOTE [Deadline buckets]: request deadlines are kept per slice of this width
_TICK = 0.01


@dataclass(slots=True)
class _Pending:
    dest: int
    deadline: float | None
    timeout: float
    on_done: OnDone
    bucket: int = 0  #: its deadline bucket (NOTE [Deadline buckets]); 0: none

    def finish(self, meta: Any, frames: Sequence[Any], err: Any) -> None:
        """Run ``on_done`` once and drop it: the deadline's timer entry keeps this object until
        the deadline, and must not keep the runtime's future (and what its result or error
        references, RRefs included) alive that long."""
        cb, self.on_done = self.on_done, _answered
        cb(meta, frames, err)


@dataclass(eq=False)
class _Peer:
    spec: PeerSpec
    state: str = "joining"  #: joining -> up -> dead (final)
    sock: socket.socket | None = None
    reader: unix_wire.Reader | None = None
    pending: dict[int, _Pending] = field(default_factory=dict)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    q_lock: threading.Lock = field(default_factory=threading.Lock)
    outq: collections.deque = field(default_factory=collections.deque)  #: (buffers, fds, size) to write
    cur: list | None = None  #: [remaining buffers, fds, size] of the message being written
    #: bytes in ``outq`` and ``cur`` (a message counts whole until written); under ``q_lock``;
    #: at most ``queue_bytes`` unless one message alone is larger (NOTE [Send queue bound])
    qbytes: int = 0
    waiting: int = 0  #: threads waiting for room in the queue (under ``q_lock``)
    room: threading.Condition = field(init=False)  #: on ``q_lock``: notified when ``qbytes`` falls
    want_write: bool = False
    last_rx: float = 0.0
    rx_fds: collections.deque = field(default_factory=collections.deque)  #: fds received, not yet claimed
    segs: dict[int, Any] = field(default_factory=dict)  #: segment id -> our mapping of a segment it sent
    bye: bool = False
    #: the largest payload we may send it: the smaller of our max_message_size and the one
    #: it told at admission (0 until then)
    limit: int = 0

    def __post_init__(self) -> None:
        self.room = threading.Condition(self.q_lock)
    #: why its connection was closed after a protocol error (NOTE [Protocol errors]); "" else.
    #: state is then "dead" (final for the connection) but the peer was not judged dead
    closed: str = ""


class UnixTransport(Send, Loop):
    """The ``Transport`` of transport/base.py over AF_UNIX streams (module docstring)."""

    def __init__(self, config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> None:
        #: judge peers by silence (no byte for heartbeat_timeout); the composite transport turns
        #: it off and judges silence with the inner transport (transport/auto.py, Rule 3)
        self.judge_silence = True
        self.config = config
        self.id, self.name, self.incarnation = config.worker_id, config.name, config.incarnation
        self._on_message, self._on_peer_dead = on_message, on_peer_dead
        #: on_closed(peer id, cause): a connection closed after a protocol error (NOTE
        #: [Protocol errors]); the composite transport routes that peer through its inner one
        self.on_closed: Callable[[int, str], None] | None = None
        #: on_verdict(peer id, cause): this transport judged a peer dead on its own evidence
        #: (EOF, a failed connection, silence; not a BYE, not another's verdict): the
        #: composite transport spreads it through its inner one (transport/auto.py, Rule 3)
        self.on_verdict: Callable[[int, str], None] | None = None
        ex = config.extra
        self.shm_threshold: int = int(ex.get("shm_threshold", 256 << 10))  # 0 disables shared memory
        self.shm_copy_out: bool = bool(ex.get("shm_copy_out", False))
        #: NOTE [Send queue bound] in unix_send: bytes queued per peer before senders wait
        self.queue_bytes: int = int(ex.get("unix_queue_bytes", QUEUE_BYTES))
        #: the smallest size limit of any peer and ours (``_check_size``'s fast path)
        self._min_limit: int = config.max_message_size
        self._dir_base: str | None = ex.get("unix_dir")
        #: counters of rare events; the per-message ones are plain ints (cheaper), merged by ``stats``
        self._stats: collections.Counter = collections.Counter()
        self._n_sent = self._n_received = self._bytes_sent = self._bytes_received = 0
        self.fault_hook: Callable[[int, str], list[float]] | None = None
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        self._peers: dict[int, _Peer] = {}
        self._by_fd: dict[int, _Peer] = {}
        self._self_pending: dict[int, _Pending] = {}
        self._tlock = threading.Lock()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._next_wake = 0.0
        #: NOTE [Deadline buckets]: bucket -> {msg_id: pending} of requests not yet answered
        self._buckets: dict[int, dict[int, _Pending]] = {}
        self._calls: collections.deque = collections.deque()
        self._releases: collections.deque = collections.deque()  #: (peer id, segment id) from finalizers
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._bell_rung = False
        self._watch_needed = False
        self._sel = Poller()
        self._sel.register(self._bell, READ, BELL)
        self._pool = shm.SegmentPool(f"{self.name}", int(ex.get("shm_pool_bytes", 256 << 20)))
        self._listener: socket.socket | None = None
        self._dir: str | None = None
        self._acceptor: Acceptor | None = None
        self._joined = threading.Condition(threading.Lock())
        self._join_error: TransportError | None = None
        self._closing = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-unix-{self.name}", daemon=True)
        #: who runs the receiver loop now, and calls run inline (NOTE [Inline calls])
        self._lead = Leadership(self.name, self._serve, inline_enabled(ex), self._stats)

    @property
    def stats(self) -> collections.Counter:
        """A snapshot of the counters (for tests and debug info; writing to it changes nothing)."""
        c = collections.Counter(self._stats)
        for key, n in (("messages_sent", self._n_sent), ("messages_received", self._n_received),
                       ("bytes_sent", self._bytes_sent), ("bytes_received", self._bytes_received)):
            if n:
                c[key] = n
        return c

    # ------------------------------------------------------------------ setup
    def listen(self) -> PeerAddress:
        base = self._dir_base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        # named like the zmq transport's ipc directories (rrefrt-<pid>-<hex>), so that a start
        # after this process was killed removes it (transport/hosts.py, clean_stale)
        hosts.clean_stale(base)
        self._dir = os.path.join(base, f"rrefrt-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self._dir, 0o700)
        path = os.path.join(self._dir, f"w{self.id}.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.bind(path)
        s.listen(256)
        s.setblocking(False)
        self._listener = s
        self._acceptor = Acceptor(self.id, self.incarnation, self._own_limit(), self.config.secret, self._stats)
        return PeerAddress(host=host_key(), endpoints={"unix": path, "unix-host": host_key()})

    def start(self) -> None:
        if self._listener is not None:
            self._sel.register(self._listener.fileno(), READ, ("listen",))
        self._thread.start()

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Join: connect to (and be admitted by) every peer with a higher id, wait to admit
        every one with a lower id. Raise AuthenticationFailed / TransportError naming peers.
        Joined or not, the socket file is removed on return: it serves the join only."""
        try:
            self._join(peers, timeout)
        finally:
            self._unlink()

    def _join(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        table = {p.id: _Peer(spec=p) for p in peers if p.id != self.id}
        self._peers.update(table)
        assert self._acceptor is not None, "listen() first"
        self._call_soon(lambda: self._set_group({i: p.spec for i, p in table.items()}))
        for peer in sorted(table.values(), key=lambda p: p.spec.id):
            if peer.spec.id < self.id:
                continue
            sock, limit = connect_and_admit(
                peer.spec, self.id, self.incarnation, self._own_limit(), self.config.secret,
                max(0.0, deadline - time.monotonic()),
            )  # raises AuthenticationFailed / TransportError
            self._call_soon(lambda peer=peer, sock=sock, limit=limit: self._admitted(peer.spec.id, sock, limit))
        with self._joined:
            while self._join_error is None and any(p.state == "joining" for p in table.values()):
                left = deadline - time.monotonic()
                acc = self._acceptor
                bad = [p.spec.name for i, p in table.items()
                       if p.state == "joining" and time.monotonic() - acc.failed.get(i, 1e18) > ACCEPT_GRACE]
                if bad:
                    raise AuthenticationFailed(
                        f"worker {self.name!r} could not authenticate {', '.join(map(repr, bad))} over its same-host "
                        "socket: their answer to the challenge was wrong (a different job secret, or a secret on one "
                        "side only); start every worker with the same RREFRT_SECRET", bad)
                if left <= 0:
                    missing = sorted(p.spec.name for p in table.values() if p.state == "joining")
                    raise TransportError(
                        f"worker {self.name!r} was not joined over its same-host socket by "
                        f"{', '.join(map(repr, missing))} within {timeout:.1f}s"
                    )
                self._joined.wait(min(left, 0.1))
        if self._join_error is not None:
            raise self._join_error

    def _unlink(self) -> None:
        """Remove the socket file and its directory (after the join, and at close), so that
        a process killed later leaves nothing behind and nobody can connect any more."""
        d, self._dir = self._dir, None
        if d:
            shutil.rmtree(d, ignore_errors=True)

    def _set_group(self, group: dict[int, PeerSpec]) -> None:
        """Receiver thread: admission can proceed for connections that arrived early."""
        acc = self._acceptor
        assert acc is not None
        acc.set_group(group)
        for c in list(acc.conns.values()):
            self._admission(*acc.advance(c))

    def _own_limit(self) -> int:
        """Our max_message_size as admission tells it (a u64 on the wire)."""
        return max(0, min(self.config.max_message_size, (1 << 64) - 1))

    def _admitted(self, peer_id: int, sock: socket.socket, limit: int) -> None:
        """Receiver thread: ``sock`` passed admission for ``peer_id``, whose max_message_size
        is ``limit``: it carries messages now."""
        peer = self._peers.get(peer_id)
        if peer is None or peer.state != "joining" or self._closing:
            sock.close()
            return
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        except OSError:
            pass
        peer.sock, peer.reader = sock, unix_wire.Reader(self.config.max_message_size + wire.MAX_HEADER_BYTES)
        peer.limit = min(self.config.max_message_size, limit)
        self._min_limit = min(self._min_limit, peer.limit)
        peer.last_rx = time.monotonic()
        peer.state = "up"
        self._by_fd[sock.fileno()] = peer
        self._sel.register(sock.fileno(), READ, peer)
        with self._joined:
            self._joined.notify_all()

    # ------------------------------------------------------------------ API (any thread)
    def request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone, label: str = ""
    ) -> int:
        self._check_usable()
        self._check_size(dest, frames)
        msg_id = next(self._ids)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        p = _Pending(dest, deadline, timeout, on_done)
        if dest == self.id:
            self._self_pending[msg_id] = p
            self._arm(p, msg_id)
            self._local(kind, msg_id, meta, frames)
            return msg_id
        peer = self._peers.get(dest)
        if peer is None or peer.state != "up":
            cause = (peer.closed and f"its same-host connection was closed: {peer.closed}" or "it was declared dead") \
                if peer else "it is not a member of this group (or not on this host)"
            err = PeerUnavailable(self.peer_name(dest), cause)
            self._call_soon(lambda: on_done(None, (), err))
            return msg_id
        peer.pending[msg_id] = p
        if peer.state == "dead" and peer.pending.pop(msg_id, None) is p:  # it died meanwhile
            err = PeerUnavailable(self.peer_name(dest), "it was declared dead")
            self._call_soon(lambda: on_done(None, (), err))
            return msg_id
        self._arm(p, msg_id)
        # not sent (its deadline passed before the queue had room, the peer died, we close):
        # the request fails by its deadline, the death or the close
        self._send_app(peer, kind, msg_id, meta, frames, label, deadline)
        return msg_id

    def send(self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = "") -> None:
        self._check_usable()
        self._check_size(dest, frames)
        if dest == self.id:
            self._local(kind, msg_id, meta, frames)
            return
        peer = self._peers.get(dest)
        if peer is None or peer.state != "up":
            self._stats["dropped_to_dead"] += 1
            return
        self._send_app(peer, kind, msg_id, meta, frames, label, None)

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        self.send(dest, wire.RESPONSE, meta, frames, msg_id, label)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self._push_timer(time.monotonic() + delay, fn)

    def is_alive(self, peer_id: int) -> bool:
        if peer_id == self.id:
            return not self._closed.is_set()
        peer = self._peers.get(peer_id)
        return peer is not None and (peer.state != "dead" or bool(peer.closed))

    def is_local(self, peer_id: int) -> bool:
        return peer_id == self.id or peer_id in self._peers

    def dead_peers(self) -> set[int]:
        return {i for i, p in list(self._peers.items()) if p.state == "dead" and not p.closed}

    def add_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Not supported: the socket file serves the join only (``connect_peers``), so peers
        that join later cannot be admitted; the composite transport sends them through its
        inner one (transport/auto.py, docs/dynamic-groups.md)."""
        raise TransportError(
            f"worker {self.name!r}: the same-host transport forms its mesh once, at the join; peers that "
            "join a running group go through the zmq (or auto) transport"
        )

    def remove_peer(self, peer_id: int, cause: str) -> None:
        """Dynamic groups: ``peer_id`` left; its requests fail, its segments are reclaimed."""
        self.declare_dead(peer_id, cause)

    def declare_dead(self, peer_id: int, cause: str) -> None:
        """Fence ``peer_id`` on another's verdict (the composite transport's inner liveness):
        its pending requests fail, its segments are reclaimed (on the receiver thread)."""
        peer = self._peers.get(peer_id)
        if peer is not None and peer.state != "dead" and not self._closed.is_set():
            self._call_soon(lambda: self._declare_dead(peer, cause, own=False))

    def peer_name(self, peer_id: int) -> str:
        peer = self._peers.get(peer_id)
        return peer.spec.name if peer else ("self" if peer_id == self.id else f"<worker {peer_id}>")

    def pending_per_peer(self) -> dict[str, int]:
        return {p.spec.name: len(p.pending) for p in list(self._peers.values())}

    def shm_segments(self) -> tuple[int, int]:
        """(segments in the pool, segments lent to peers now): for tests and debug info."""
        return self._pool.count(), self._pool.lent()

    # ------------------------------------------------------------------ timers and bell
    def _arm(self, p: _Pending, msg_id: int) -> None:
        """NOTE [Deadline buckets]: a request's deadline used to be one timer-heap entry (a
        closure) that stayed until it fell due, answered or not: at 10,000 calls/s with a
        120 s timeout, over a million live entries, each push O(log n) under the timer lock,
        and a heap the garbage collector scanned again and again. Now requests are grouped
        by deadline in ``_TICK`` slices: one timer per slice, and an answered request leaves
        its slice at once (``_disarm``). A timeout fires at most ``_TICK`` late, never early."""
        if p.deadline is None:
            return
        b = p.bucket = int(p.deadline / _TICK) + 1
        wake = False
        with self._tlock:
            bucket = self._buckets.get(b)
            if bucket is None:
                bucket = self._buckets[b] = {}
                due = b * _TICK
                heapq.heappush(self._timers, (due, next(self._ids), lambda: self._expire_bucket(b)))
                wake = due < self._next_wake
            bucket[msg_id] = p
        if wake:
            self._ring()

    def _disarm(self, p: _Pending, msg_id: int) -> None:
        """The request was answered: it leaves its deadline bucket (receiver thread)."""
        bucket = self._buckets.get(p.bucket)
        if bucket is not None:
            bucket.pop(msg_id, None)

    def _expire_bucket(self, b: int) -> None:
        """Receiver thread: a deadline slice fell due; whatever is still in it timed out."""
        with self._tlock:
            bucket = self._buckets.pop(b, None)
        if bucket:
            for msg_id, p in bucket.items():
                self._guard(lambda p=p, msg_id=msg_id: self._expire(p, msg_id))  # one bad entry must not stop the rest

    def _push_timer(self, due: float, fn: Callable[[], None]) -> None:
        with self._tlock:
            heapq.heappush(self._timers, (due, next(self._ids), fn))
            wake = due < self._next_wake
        if wake:
            self._ring()

    def _ring(self) -> None:
        if not self._bell_rung:
            self._bell_rung = True
            try:
                os.eventfd_write(self._bell, 1)
            except OSError:
                pass

    def _call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        self._ring()

    def _local(self, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        snap = [bytes(memoryview(f).cast("B")) for f in frames]
        self._call_soon(lambda: self._dispatch(None, kind, msg_id, meta, snap))

    def _expire(self, p: _Pending, msg_id: int) -> None:
        table = self._self_pending if p.dest == self.id else self._peers[p.dest].pending
        if table.get(msg_id) is p:
            del table[msg_id]
            self._stats["requests_timed_out"] += 1
            p.finish(None, (), RequestTimeout(self.peer_name(p.dest), p.timeout))


def _factory(config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> UnixTransport:
    return UnixTransport(config, on_message, on_peer_dead)


register("unix", _factory)
