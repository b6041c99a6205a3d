"""The ZeroMQ transport: one data ROUTER socket per process, owned by one I/O loop.

Owns: the data socket, endpoint choice (``listen``), the join (HELLO exchange), the receive
path (response correlation, dispatch to ``on_message``), peer death and fencing on the data
loop, the changes to a running mesh (NOTE [Mesh changes] in ``rrefrt_transport.zmq.mesh``,
which plans who connects to whom), the send path (NOTE [Send path] below) and the close
sequence. Its collaborators, one object each: the heartbeat (``rrefrt_transport.zmq.heartbeat``,
its own socket and thread) with the liveness table (``rrefrt_transport.liveness``), the echo
(``rrefrt_transport.zmq.echo``), the join's authentication policy
(``rrefrt_transport.zmq.joinpolicy``), CURVE (``rrefrt_transport.zmq.security``) and the loop
(``rrefrt_transport.zmq.loop``). Registered as ``"zmq"``.

Rules:

1. Only the data loop's thread touches the data socket, the peer records, the pending
   requests and the backlogs. Other threads hand it closures (``IOLoop.call_soon``).
2. The loop never runs user code and never blocks outside ``poll``: callbacks it runs
   (``on_message``, a request's ``on_done``, ``on_peer_dead``) belong to the runtime, must
   only hand work on, and run guarded (an exception is logged and counted).
3. Every request has a deadline or is bounded by peer death: when a peer is declared dead
   every request pending on it fails with ``PeerUnavailable`` naming it, and its late
   messages are dropped for the life of the transport (it is fenced, and told so). Fenced
   itself, it reports every peer to ``on_peer_dead`` and tells nobody (issue 11 item 5).
4. With a secret every connection, accepted or made, passes CURVE and the ZAP handler
   before libzmq hands over any of its messages (NOTE [Authentication] in
   ``rrefrt_transport.zmq.security``).
5. A message larger than its receiver's limit (exchanged in HELLO) raises MessageTooLarge
   at the sender; nothing is sent (a receiver's libzmq would drop the connection).

NOTE [Close]: two libzmq aborts (SIGABRT) showed up when many peers close at once, both
reproduced by ``scripts/zmq_close_campaign.py`` on the old agent (2 of 128 processes in 4
rounds of 32, 5 of 192 in 3 rounds of 64):
(1) ``Assertion failed: !_io_error (stream_engine_base.cpp:310)``: when an engine cannot
    push a received message to its pipe (the pipe is full, or terminating because a socket
    closes), it stops input and marks ``_io_error``; the ZMTP heartbeat interval timer then
    calls ``out_event`` on it, which asserts. So no socket sets HEARTBEAT_IVL: heartbeats
    are our own PINGs, answered by the peers' echo sockets (NOTE [Liveness]). Measured with
    the campaign: ZMTP heartbeats on a data-free liveness connection only still aborted 4
    of 704 processes; with none, 0 of 512 (32 and 64 workers).
(2) ``Assertion failed: !_more (fq.cpp:80)``: with IMMEDIATE, a connecting session whose
    connection fails terminates its pipe at once (``reconnect()``: ``terminate(false)``),
    even while this thread is between two frames of a message from it (libzmq processes
    commands inside ``recv`` every 100 frames); the fair queue then finds the rest of the
    message missing. The data socket therefore does not set IMMEDIATE (its connecting
    pipes survive a reconnect; an accepted pipe is terminated with the delay of a non-zero
    linger, after its messages are read). The heartbeat socket keeps IMMEDIATE for its
    route probes: its messages are one frame after the routing id, which the ROUTER reads
    whole before returning the routing id, so a pipe never goes away mid-message.
Then: close stops the heartbeat loop first (its socket closes with linger 0: PINGs need no
delivery), then the echo (TERMINATE to its proxy), then the data loop, whose socket closes
with ``linger`` after the runtime's own drain; the ZAP handler closes after the sockets;
only then ``Context.term()``, which the lingers bound.

NOTE [Fenced while joining]: a worker declared dead while it still joins (starved of CPU
past the heartbeat timeout, say) can never complete the join (its HELLOs are dropped and
answered FENCED): ``connect_peers`` raises ``Fenced`` at once, naming who expelled it, rather
than time out blaming the peers that refused it ("could not reach 'w26', 'w27'").

NOTE [Lazy connections] (issue 22): ``connect_peers`` learns the members (from the store's
records) and, by default (``TransportConfig.connect="lazy"``), connects to ``join_fanout``
of them only (the next ids: a differing job secret still fails a join at once); a worker
connects to any other peer when it first sends to it, so its connections and descriptors
grow with the peers it talks to, not with the group. ``connect="eager"`` keeps the mesh of
before (every pair connected and watched at the join).
1. Pipes: a ROUTER both accepts and connects. The pipe we connect to X is named
   ``wire.outgoing_id(X)`` (``b"w<X>>"``, ZMQ_CONNECT_ROUTING_ID); the pipe X connects to us
   carries X's own routing id ``b"w<X>"``, so both may exist when both sides connect at
   once. Received messages map both names to X (``wire.pipe_owner``).
2. Sending to X uses the pipe chosen for X once and kept (per-pair FIFO): ours if we
   connected first, else X's, known once its HELLO arrived on it; with neither, we connect
   now. Data waits in X's backlog until the pipe is validated: a HELLO_ACK of X's current
   incarnation on our pipe (HELLO repeats until answered, after 5 ms, then twice as long
   each time up to PROBE_S: X drops HELLOs until it knows us, which its own join usually
   brings a few ms later), or X's HELLO on its own.
3. A pipe carries application messages only after a HELLO or HELLO_ACK with the sender's
   current incarnation arrived on it (both sides send one first on every pipe they send
   on): a message from an old incarnation, or before its HELLO, is dropped and counted.
4. Liveness: the heartbeat watches X (echo PINGs, NOTE [Liveness]) from the first HELLO
   exchanged with it, on both sides; a peer never talked to is not judged. Its death is
   learnt from a DEAD_NOTICE of a worker that watches it, or at first use: a first contact
   that is never answered is a death after ``contact_timeout`` (liveness Rule 8).
5. A failed handshake at a first contact after the join (a stranger's keys, a different
   secret) fails what was sent to X with AuthenticationFailed naming X and the cause, and
   whatever is sent later (NOTE [Handshake failures]).

NOTE [Send path]: ``request`` / ``send`` / ``respond`` run on any thread: they check the
size (Rule 5) and the header, lend large frames (NOTE [Lent frames] in
``rrefrt_transport.zmq.lend``) and hand the message to the data loop, which registers a
request in its peer's pending table with its deadline timer, fails a request once, passes
the fault hook, keeps a per-peer backlog of messages not yet routable and sends without
blocking.

NOTE [Fault injection]: tests install ``fault_hook`` to drop, delay, duplicate or reorder
(delay one so later ones overtake) outgoing messages by label. It sits after a request is
registered, so a dropped request still fails at its deadline, exactly like a lost one.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from rrefrt_transport import base

from rrefrt_transport.zmq import lend, mesh, security

from rrefrt_transport import wire

from rrefrt_transport.base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, TransportConfig
from rrefrt_transport.errors import (
    AgentClosed,
    AuthenticationFailed,
    Fenced,
    MessageTooLarge,
    PeersUnreachable,
    PeerUnavailable,
    RequestTimeout,
    TransportError,
)
from rrefrt_transport.zmq.echo import Echo
from rrefrt_transport.zmq.heartbeat import PROBE_S, Heartbeat
from rrefrt_transport.hosts import IpcDir, host_id
from rrefrt_transport.zmq.joinpolicy import JoinPolicy
from rrefrt_transport.liveness import LivenessTable, PeerState, Verdict
from rrefrt_transport.zmq.records import ZERO_COPY_MIN, Pending, Peer, nbytes
from rrefrt_transport.zmq.loop import IOLoop, LoopClosed
from rrefrt_transport.zmq.mesh import ECHO, LIVE  # suffixes of the heartbeat / echo endpoints in a PeerAddress

log = logging.getLogger("rrefrt.transport")

_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


class ZmqTransport:
    """``rrefrt_transport.base.Transport`` over ZeroMQ (see the module docstring)."""

    def __init__(self, config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> None:
        self.config = c = config
        self.id, self.name, self.incarnation = c.worker_id, c.name, c.incarnation
        self._on_message, self._on_peer_dead = on_message, on_peer_dead
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        self.stats: collections.Counter = collections.Counter()
        #: fault_hook(dest, label) -> delays: [] drops the message, [0] sends it, [0, 0]
        #: duplicates it, [d] delays it by d seconds. Installed by tests only.
        self.fault_hook: Callable[[int, str], list[float]] | None = None
        auth = c.extra.get("auth")
        if auth is None and c.secret is not None:
            auth = security.CurveAuth.for_job(c.secret, c.worker_id, c.world_size)
        if auth is not None and auth.rank != c.worker_id:
            raise ValueError(f"the CURVE keys are those of rank {auth.rank}, not of worker id {c.worker_id}")
        self._auth: security.CurveAuth | None = auth
        self.host = host_id()
        self._peers: dict[int, Peer] = {}  #: worker id -> peer (data loop only after start)
        self._peer_max: dict[int, int] = {}  #: worker id -> its max_message_size (from HELLO)
        self._local: dict[int, bool] = {}  #: worker id -> same host
        self._names: dict[int, str] = {}
        self._adding: dict[int, int] = {}  #: id -> incarnation: add_peers issued, setup not yet run
        self._eager = c.connect == "eager"  #: NOTE [Lazy connections]
        self._awaited: set[int] = set()  #: the peers a join waits for (data loop)
        self._watched: set[int] = set()  #: peers the heartbeat watches (data loop)
        self._self_pending: dict[int, Pending] = {}  #: msg_id -> request sent to ourselves
        self._all_up = threading.Event()
        #: one entry per join setup queued for the data loop and not run yet (``_queue_setup``)
        self._setups: collections.deque = collections.deque()
        self._closed = threading.Event()
        self._closing = False
        self._fenced: Fenced | None = None
        self._join_error: AuthenticationFailed | None = None
        self._ipc: IpcDir | None = None
        self.endpoints: list[str] = []
        #: two libzmq I/O threads: data connections on the first, liveness on the second
        #: (AFFINITY), so that encrypting or decrypting a large message (CURVE works on a whole
        #: message at once) never holds up a heartbeat (NOTE [Liveness], Rule 2)
        self._ctx = zmq.Context(io_threads=2)
        self._ctx.setsockopt(zmq.LINGER, int(c.linger * 1000))
        #: bound before the sockets bind, closed after them (NOTE [Authentication], Rule 3)
        self._zap = security.ZapHandler(self._ctx, auth, self.stats) if auth is not None else None
        self._sock = self._make_socket()
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | security.HANDSHAKE_EVENTS)
        self._policy = JoinPolicy(c.name, self.stats)
        self.table = LivenessTable(c.heartbeat_timeout, c.route_grace, time.monotonic)
        self._hb = Heartbeat(
            self._ctx, c.worker_id, c.name, c.incarnation, c.heartbeat_interval, self.table, auth, self.stats,
            self._peer_verdict, self._on_fenced, self._wake_join,
        )
        if c.extra.get("contact_timeout"):
            self._hb.contact_timeout = float(c.extra["contact_timeout"])
        self._echo = Echo(self._ctx, c.worker_id, auth)
        self._loop = IOLoop(f"rrefrt-io-{c.name}", self.stats, self._shutdown_data)
        self._loop.register(self._sock, self._recv_all)
        self._loop.register(self._monitor, self._read_monitor)
        if self._zap is not None:
            self._loop.register(self._zap.socket, self._zap.serve)
        self._loop.wake_hint = self._wake_hint
        self._loop.each_pass = self._tend

    def _make_socket(self) -> zmq.Socket:
        c = self.config
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTING_ID, wire.routing_id(self.id))
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # no IMMEDIATE: NOTE [Close] (2)
        s.setsockopt(zmq.AFFINITY, 1)  # libzmq I/O thread 0
        s.setsockopt(zmq.LINGER, int(c.linger * 1000))
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.MAXMSGSIZE, c.max_message_size + wire.MAX_HEADER_BYTES)
        s.setsockopt(zmq.RECONNECT_IVL, 100)  # no HEARTBEAT_*: NOTE [Close], NOTE [Liveness]
        if self._auth is not None:
            security.configure_keys(s, self._auth)
        return s

    # ------------------------------------------------------------------ setup (before start)
    def listen(self) -> PeerAddress:
        """Bind tcp on ``config.host`` (port 0) and, unless ``config.same_host`` is False or
        RREFRT_NO_IPC=1, ipc in a private directory (NOTE [ipc socket files]); each for data
        and for liveness. Returns the address to publish."""
        tcp = f"tcp://{self.config.host}:0"
        eps = {"tcp": self._bind_data(tcp), "tcp" + LIVE: self._hb.bind(tcp), "tcp" + ECHO: self._echo.bind(tcp)}
        if self.config.same_host and os.environ.get("RREFRT_NO_IPC") != "1":
            self._ipc = IpcDir()
            eps["ipc"] = self._bind_data(self._ipc.endpoint("d"))
            eps["ipc" + LIVE] = self._hb.bind(self._ipc.endpoint("l"))
            eps["ipc" + ECHO] = self._echo.bind(self._ipc.endpoint("e"))
        self._hb.watch_self(eps.get("ipc" + ECHO) or eps["tcp" + ECHO])  # its own liveness (liveness Rule 5)
        return PeerAddress(self.host, eps)

    def _bind_data(self, endpoint: str) -> str:
        return security.bind(self._sock, self._auth, endpoint, self.endpoints)

    def start(self) -> None:
        self._echo.start()
        self._hb.start()
        self._loop.start()
        self._loop.call_soon(lambda: self._loop.every(self.config.heartbeat_interval, self._housekeeping))

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Join the group (NOTE [Lazy connections]): learn the members; connect to those
        ``mesh.contacts`` names (ipc when the peer is on this host, tcp otherwise), exchange
        HELLO, hear each one's heartbeat, and return once they are up; raise TransportError
        naming the missing peers after ``timeout`` seconds, AuthenticationFailed naming those
        that fail the handshake (NOTE [Handshake failures]), or at once ``Fenced`` naming
        the member that expelled this worker meanwhile."""
        self._check_usable()
        plan = self._plan(peers)
        contact = mesh.contacts(self.id, [s.id for s, *_ in plan], self._eager, self.config.join_fanout)
        members = [(s.id, s.name, s.incarnation, live, echo) for s, _, _, live, echo in plan]
        awaited = {s.id for s, *_ in plan} if self._eager else contact
        # before the data loop's setup: a first contact must find them known
        learn = (lambda: self._hb.join(members, timeout)) if self._eager else (lambda: self._hb.know(members))
        self._queue_setup(learn, plan, contact, awaited)
        joined = self._all_up.wait(timeout)
        if self._join_error is not None:
            raise self._join_error
        if self._fenced is not None:  # NOTE [Fenced while joining]
            raise self._fenced
        if not joined:
            missing = ", ".join(sorted(repr(p.spec.name) for p in list(self._peers.values())
                                       if p.spec.id in self._awaited and not self._is_up(p)))
            raise TransportError(f"worker {self.name!r} could not reach {missing or 'its peers'} within {timeout:.1f}s")

    def add_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Peers that joined a running group (NOTE [Mesh changes])."""
        self._check_usable()
        known = {i: p.spec.incarnation for i, p in list(self._peers.items())} | self._adding
        fresh = [s for s in peers if s.id != self.id and known.get(s.id) != s.incarnation]
        ids = {s.id for s in peers if s.id != self.id}
        # eager: the mesh rule; lazy: a joiner that waits meets those it waits for, the
        # members it joins meet it on first use (NOTE [Lazy connections])
        contact = mesh.contacts(self.id, [s.id for s in fresh], True, 0) if self._eager else (ids if timeout > 0 else set())
        awaited = {s.id for s in fresh} if self._eager else set(contact)
        if fresh:  # peers already added (the same incarnation) are only waited for
            steps = self._plan(fresh)
            self._adding.update({s.id: s.incarnation for s in fresh})
            self._join_error = None
            members = [(s.id, s.name, s.incarnation, live, echo) for s, _, _, live, echo in steps]
            if self._eager or contact:
                learn = lambda: self._hb.join(members, timeout if timeout > 0 else None)  # noqa: E731
            else:
                learn = lambda: self._hb.know(members)  # noqa: E731
            # awaited: the mesh is forming again, HELLOs go out (``_tend``)
            self._queue_setup(learn, steps, contact, awaited, clear=bool(awaited))
        elif contact:
            self._queue_setup(lambda: None, [], contact, awaited, clear=True)
        if timeout <= 0:
            return
        deadline = time.monotonic() + timeout
        ids = {s.id for s in peers if s.id != self.id}
        while True:
            pending = [p for p in list(self._peers.values()) if p.spec.id in ids and not self._is_up(p)
                       and self.table.state(p.spec.id) is not PeerState.DEAD]
            if self._join_error is not None:
                raise self._join_error
            left = deadline - time.monotonic()
            if not pending and all(i in self._peers for i in ids):
                return
            if left <= 0:
                late = {p.spec.id for p in pending} | (ids - set(self._peers))
                names = sorted(s.name for s in peers if s.id in late)
                raise PeersUnreachable(
                    f"worker {self.name!r} could not reach {', '.join(map(repr, names))} within {timeout:.1f}s", sorted(late))
            self._all_up.wait(min(left, 0.05))

    def remove_peer(self, peer_id: int, cause: str) -> None:
        """A member left or was evicted (NOTE [Mesh changes] (2)): declared dead here, quietly."""
        if peer_id == self.id or self._closing:
            return
        self._hb.forget(peer_id, cause)

        def detach() -> None:
            self._disconnect(peer_id)

        try:
            self._loop.call_soon(detach)
        except Exception:  # closed: nothing to detach
            pass

    def watch(self, peer_id: int) -> None:
        """Any thread: watch ``peer_id``'s liveness from now on, without a data connection
        (the composite transport talks to it over another path: transport/auto.py)."""
        if peer_id != self.id:
            self._schedule(lambda: self._watch(peer_id))

    def connected_peers(self) -> set[int]:
        """The peers this worker has a data pipe with (ours or theirs): NOTE [Lazy connections]."""
        return {i for i, p in list(self._peers.items()) if p.rid is not None}

    def declare_dead(self, peer_id: int, cause: str) -> None:
        """Another transport's verdict (the composite's same-host path saw the process go):
        judged here too and spread to every member as this worker's own (NOTE [Membership]
        in rrefrt_transport.zmq.heartbeat). Any thread."""
        self._hb.declare(peer_id, cause)

    # ------------------------------------------------------------------ API (any thread)
    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the data loop after ``delay`` seconds, guarded. From the loop's own
        thread (``on_message``, ``on_done``) it is pushed directly; from others scheduled."""
        if self._loop.in_loop():
            self._loop.call_later(delay, fn)
        else:
            self._schedule(lambda: self._loop.call_later(delay, fn))

    def read_until(self, dest: int, done: Callable[[], bool], timeout: float | None) -> None:
        """No own reads here: the caller waits for its future."""

    def peer_name(self, peer_id: int) -> str:
        return self._names.get(peer_id) or ("self" if peer_id == self.id else f"<worker {peer_id}>")

    def dead_peers(self) -> set[int]:
        return self.table.dead()

    def is_alive(self, peer_id: int) -> bool:
        if peer_id == self.id:
            return not self._closed.is_set() and self._fenced is None
        state = self.table.state(peer_id)
        if state is None:  # a member not watched yet (lazy connections): not known dead
            return peer_id in self._names
        return state is not PeerState.DEAD

    def is_local(self, peer_id: int) -> bool:
        return peer_id == self.id or self._local.get(peer_id, False)

    def peer_limit(self, peer_id: int) -> int:
        """The largest message ``peer_id`` accepts (its HELLO), else our own limit."""
        return self._peer_max.get(peer_id, self.config.max_message_size)

    def pending_per_peer(self) -> dict[str, int]:
        return {p.spec.name: len(p.pending) for p in list(self._peers.values())}

    def close(self, timeout: float = 2.0) -> None:
        """Stop both loops, fail every pending request, close the sockets and the context
        (NOTE [Close]). Never hangs; in a forked child it only abandons the inherited state."""
        if os.getpid() != self._pid or self._closed.is_set():
            return
        self._closing = True
        deadline = time.monotonic() + timeout
        for loop in (self._hb.loop, self._echo, self._loop):
            if loop is self._echo:
                if not self._echo.stop(max(0.0, deadline - time.monotonic())):
                    log.error("the echo of %r did not stop within %.1fs; abandoning the transport", self.name, timeout)
                    return
                continue
            if not loop.started:
                loop.finish()  # never started: nobody else owns its sockets
                continue
            loop.stop()
            if not loop.join(max(0.0, deadline - time.monotonic())):
                log.error("%s did not stop within %.1fs; abandoning the transport", loop.name, timeout)
                return
        if self._zap is not None:  # after the sockets: no connection is ever left without it
            self._zap.close()
        self._ctx.term()
        if self._ipc is not None:
            self._ipc.remove()
        self._closed.set()

    # ------------------------------------------------------------------ internals
    def _check_usable(self, fenced_ok: bool = False) -> None:
        if os.getpid() != self._pid:
            raise AgentClosed("the transport was inherited through fork(); it is unusable in the child")
        if self._fenced is not None and not fenced_ok:
            raise self._fenced
        if self._closed.is_set() or self._closing:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed")

    def _call_soon(self, fn: Callable[[], None]) -> None:  # tests inject raw frames with it
        self._schedule(fn)

    def _schedule(self, fn: Callable[[], None]) -> None:
        try:
            self._loop.call_soon(fn)
        except LoopClosed:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed") from None

    def _is_up(self, peer: Peer) -> bool:
        return peer.joined and self.table.state(peer.spec.id) not in (None, PeerState.JOINING)

    def _wake_join(self) -> None:
        """Heartbeat thread: a peer was heard for the first time."""
        try:
            self._loop.call_soon(self._check_all_up)
        except LoopClosed:
            pass

    def _queue_setup(self, learn: Callable[[], None], steps: mesh.Plan, contact: set[int], awaited: set[int],
                     clear: bool = False) -> None:
        """Tell the heartbeat the join's members (``learn``), then hand the join's setup to the
        data loop (``clear``: the join waits, ``_all_up`` is cleared first). ``_setups`` holds
        one entry per setup not run yet, from before the heartbeat can hear a new member
        until the data loop ran the setup (``_check_all_up``)."""
        def run() -> None:
            try:
                self._setup(steps, contact, awaited)
            finally:
                self._setups.pop()
                self._check_all_up()

        self._setups.append(None)
        try:
            learn()
            if clear:
                self._all_up.clear()
            self._loop.call_soon(run)
        except BaseException:
            self._setups.pop()
            raise

    def _check_all_up(self) -> None:
        if self._setups:  # a join's members are not all known to the data loop yet: a peer heard
            return  # before its setup ran must not make an empty ``_awaited`` read as "all up"
        awaited = [self._peers[i] for i in self._awaited if i in self._peers]
        if all(self._is_up(p) or self.table.state(p.spec.id) is PeerState.DEAD for p in awaited):
            self._all_up.set()
        elif self._join_error is None:  # a peer added later, or a new incarnation, is joining
            self._all_up.clear()

    def _wake_hint(self, now: float) -> float | None:
        if (self._awaited and not self._all_up.is_set()) or any(p.backlog for p in self._peers.values()):
            due = [p.hello_due for p in self._peers.values() if p.connected and not p.joined and p.error is None]
            return min([now + PROBE_S, *due])
        return None

    # ------------------------------------------------------------------ data loop thread
    def _housekeeping(self) -> None:
        """Periodic (and every loop pass while joining or backlogged, via the wake hint)."""
        if not self._all_up.is_set() and self._join_error is None:
            now = time.monotonic()
            missing = [p.spec.name for i in self._awaited if (p := self._peers.get(i)) is not None
                       and not p.joined and not p.connected and self.table.state(i) is not PeerState.DEAD]
            err = self._policy.check_accepts(now, missing, self.endpoints)
            if err is not None:
                self._fail_join(err)

    def _tend(self) -> None:
        if self._all_up.is_set() and not any(p.backlog for p in self._peers.values()):
            return
        now = time.monotonic()
        for peer in self._peers.values():
            if not peer.joined:
                if peer.connected and peer.error is None and now >= peer.hello_due:
                    peer.hello_gap = min(PROBE_S, peer.hello_gap * 2)
                    peer.hello_due = now + peer.hello_gap
                    self._try_send(peer, self._hello(wire.HELLO))
            elif peer.backlog:
                self._flush_backlog(peer)
        if not self._all_up.is_set():
            self._housekeeping()

    def _recv_all(self) -> None:
        sock = self._sock
        for _ in range(1000):
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                return
            msg = sock.recv_multipart(_NOBLOCK, copy=False)
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f) for f in msg)
            pipe = msg[0].bytes
            owner = wire.pipe_owner(pipe)
            peer = self._peers.get(owner[0]) if owner is not None else None
            if peer is None:
                self.stats["bad_frames_dropped"] += 1
                self.stats["unknown_peer_dropped"] += 1
                continue
            if self.table.state(peer.spec.id) is PeerState.DEAD:
                self.stats["fenced_dropped"] += 1
                self._hb.tell_fenced(peer.spec.id)
                continue
            self._deliver(peer.spec.id, msg[1:], peer, pipe)

    def _deliver(self, src: int, frames: list, peer: Peer | None = None, pipe: bytes = b"") -> None:
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
        if peer is not None and pipe not in peer.valid and kind not in (wire.HELLO, wire.HELLO_ACK):
            self.stats["unvalidated_dropped"] += 1  # NOTE [Lazy connections] (3)
            return
        if kind >= wire.FIRST_APP_KIND:
            self._loop.guard(self._on_message, "on_message", src, kind, msg_id, meta, body)
        elif kind == wire.RESPONSE:
            table = peer.pending if peer is not None else self._self_pending
            pending = table.pop(msg_id, None)
            if pending is None:
                self.stats["late_responses_dropped"] += 1
                return
            pending.done = True
            self._loop.guard(pending.on_done, "on_done", meta, body, None)
        elif kind in (wire.HELLO, wire.HELLO_ACK) and peer is not None:
            if not (type(meta) is list and len(meta) == 3 and meta[0] == peer.spec.incarnation and type(meta[2]) is int):
                self.stats["bad_frames_dropped"] += 1
                self.stats["fenced_dropped"] += 1
                return
            self._peer_max[src] = meta[2]
            peer.valid.add(pipe)
            if peer.rid is None and kind == wire.HELLO:  # its pipe: ours to send on (Rule 2)
                peer.rid = pipe
            if kind == wire.HELLO:  # on the pipe it came on: validates that pipe at the peer
                self._send_on(pipe, self._hello(wire.HELLO_ACK))
            self._watch(src)
            if not peer.joined and pipe == peer.rid:
                peer.joined = True
                self._flush_backlog(peer)
                self._check_all_up()
        elif kind == wire.PING:
            pass
        else:
            self.stats["bad_frames_dropped"] += 1

    def _fail_join(self, err: AuthenticationFailed) -> None:
        if self._join_error is None:
            self._join_error = err
            self._all_up.set()

    def _peer_verdict(self, v: Verdict) -> None:
        """Heartbeat thread: hand the death to the data loop."""
        try:
            self._loop.call_soon(lambda: self._peer_died(v.peer, v.cause))
        except LoopClosed:
            pass

    def _peer_died(self, pid: int, cause: str) -> None:
        peer = self._peers.get(pid)
        if peer is None or self.table.state(pid) is not PeerState.DEAD:  # or a new incarnation replaced it
            return
        err = PeerUnavailable(peer.spec.name, cause)
        pending, peer.pending = peer.pending, {}
        peer.backlog.clear()
        for p in pending.values():
            self._fail(p, err)
        self._loop.guard(self._on_peer_dead, "on_peer_dead", pid, cause)
        self._check_all_up()

    def _on_fenced(self, by: str, cause: str) -> None:
        """Heartbeat thread: a member declared us dead (NOTE [Membership])."""
        if self._fenced is not None:
            return
        self._fenced = Fenced(self.name, by, cause)
        log.error("%s", self._fenced)
        self.stats["fenced"] += 1
        self._all_up.set()  # a join still waiting fails now (NOTE [Fenced while joining])
        try:
            self._loop.call_soon(self._expelled)
        except LoopClosed:
            pass

    def _expelled(self) -> None:
        assert self._fenced is not None
        self._fail_everything(self._fenced)
        for pid in [p for p in self._peers if p != self.id and p not in self.table.dead()]:
            self._loop.guard(self._on_peer_dead, "on_peer_dead", pid, f"this worker was expelled: {self._fenced}")

    def _fail_everything(self, err: BaseException) -> None:
        tables = [p.pending for p in self._peers.values()] + [self._self_pending]
        for table in tables:
            pending = list(table.values())
            table.clear()
            for p in pending:
                self._fail(p, err)

    def _shutdown_data(self) -> None:
        """Last on the data loop (after its final drain): NOTE [Close]."""
        self._closing = True
        self._fail_everything(self._fenced or AgentClosed(f"the transport was shut down (worker {self.name!r})"))
        self._monitor.close(0)
        self._sock.close(int(self.config.linger * 1000))

    # ------------------------------------------------------------------ the mesh (NOTE [Mesh changes])
    def _plan(self, peers: Sequence[PeerSpec]) -> mesh.Plan:
        """The endpoints to use for each peer (``mesh.plan``); records names and locality
        (read by any thread)."""
        steps = mesh.plan(self.id, self.host, self.config.same_host, self._ipc is not None,
                          self._auth.world_size if self._auth is not None else None, peers)
        for spec, local, _, _, _ in steps:
            self._local[spec.id], self._names[spec.id] = local, spec.name
        return steps

    def _setup(self, steps: mesh.Plan, contact: set[int], awaited: set[int]) -> None:
        """Data loop: a peer record per peer (replacing a departed incarnation, NOTE [Mesh
        changes] (3)), a first contact with those of ``contact`` (NOTE [Lazy connections]);
        the join waits for ``awaited``."""
        now = time.monotonic()
        self._policy.started_at = now
        for spec, local, data, _, _ in steps:
            self._adding.pop(spec.id, None)
            old = self._peers.get(spec.id)
            if old is not None:  # NOTE [Mesh changes] (3): what still waits on the old incarnation fails now
                pending, old.pending = list(old.pending.values()), {}
                for p in pending:
                    self._fail(p, PeerUnavailable(old.spec.name, "it left the group (a new incarnation of its id joined)"))
                self._disconnect(spec.id)
                self._watched.discard(spec.id)
                if self.table.state(spec.id) is PeerState.DEAD:  # before the heartbeat thread's own
                    # the dead verdict must not count it as up; lazy: unwatched until first contact
                    self.table.replace(spec.id) if spec.id in awaited else self.table.drop(spec.id)
            self._peers[spec.id] = Peer(spec, None, local, data=data, hello_due=now)
        self._awaited |= awaited
        for pid in sorted(contact):
            peer = self._peers.get(pid)
            if peer is not None:
                self._contact(peer)
        self._check_all_up()

    def _contact(self, peer: Peer) -> None:
        """Data loop: connect our pipe to ``peer`` and HELLO it (NOTE [Lazy connections] (2));
        nothing when a pipe to it is chosen already."""
        if peer.rid is not None or peer.connected:
            return
        pid = peer.spec.id
        if self._auth is not None:  # NOTE [Authentication], Rule 2 (rrefrt_transport.zmq.security)
            security.configure_client(self._sock, self._auth, pid)
        rid = wire.outgoing_id(pid)
        self._sock.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
        self._policy.connects[peer.data] = (pid, peer.spec.name)
        self._sock.connect(peer.data)
        self.stats["data_connects"] += 1
        peer.connected, peer.rid = True, rid
        peer.hello_due = time.monotonic() + peer.hello_gap
        self._try_send(peer, self._hello(wire.HELLO))
        self._watch(pid)

    def _watch(self, pid: int) -> None:
        """Data loop: the heartbeat watches ``pid`` from now on (NOTE [Lazy connections] (4))."""
        if pid not in self._watched and pid != self.id:
            self._watched.add(pid)
            self._hb.watch(pid)

    def _fail_peer(self, peer: Peer, err: AuthenticationFailed) -> None:
        """Data loop: ``peer``'s first contact failed its handshake (NOTE [Lazy connections]
        (5)): what waits on it fails now, and what is sent to it later at once."""
        peer.error = err
        for frames in peer.backlog:
            lend.drop(frames)
        peer.backlog.clear()
        pending, peer.pending = list(peer.pending.values()), {}
        for p in pending:
            self._fail(p, err)
        self._disconnect(peer.spec.id)

    def _disconnect(self, peer_id: int) -> None:
        for ep, (pid, _) in list(self._policy.connects.items()):
            if pid == peer_id:
                del self._policy.connects[ep]
                try:
                    self._sock.disconnect(ep)
                except Exception:  # already gone (libzmq forgot it): nothing to stop
                    pass

    def _read_monitor(self) -> None:
        """Data loop: the data socket's monitor events - the handshakes of the join, judged by
        the join policy (``rrefrt_transport.zmq.joinpolicy``)."""
        while True:
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            event, endpoint = int(ev["event"]), ev["endpoint"].decode(errors="replace")
            if event & security.HANDSHAKE_FAILED:
                pid = self._policy.connects.get(endpoint, (None, ""))[0]
                peer = self._peers.get(pid) if pid is not None else None
                err = self._policy.failed(endpoint, event, int(ev["value"]), not self._all_up.is_set(),
                                          peer is not None and not peer.joined, time.monotonic())
                if err is not None and peer is not None:
                    if pid in self._awaited and not self._all_up.is_set():
                        self._fail_join(err)
                    else:  # a first contact after the join
                        self._fail_peer(peer, err)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._policy.succeeded(endpoint)

    # ------------------------------------------------------------------ the send path (NOTE [Send path])
    def request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone,
        label: str = "",
    ) -> int:
        """Send a request; ``on_done`` runs once, on the data loop, with the response or an
        error. ``timeout`` <= 0 means no deadline (still bounded by peer death). ``label``
        names the message for the fault hook (tests). Once this worker was fenced, the
        request is accepted and fails through ``on_done`` with ``Fenced``, like those
        pending at that moment."""
        self._check_usable(fenced_ok=True)
        self._check_size(dest, frames)
        msg_id = next(self._ids)
        out = self._prepare(dest, self._header(kind, msg_id, meta), frames)
        pending = Pending(dest, msg_id, timeout, on_done)
        self._schedule(lambda: self._issue(pending, out, label))
        self._await_lent(out, dest, time.monotonic() + timeout if timeout > 0 else None)
        return msg_id

    def send(self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = "") -> None:
        """Send a one-way message (or a RESPONSE when kind is wire.RESPONSE)."""
        self._check_usable()
        self._check_size(dest, frames)
        out = self._prepare(dest, self._header(kind, msg_id, meta), frames)
        self._schedule(lambda: self._send_faulty(dest, out, label))
        self._await_lent(out, dest, None)

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        self.send(dest, wire.RESPONSE, meta, frames, msg_id, label)

    def _check_size(self, dest: int, frames: Sequence[Any]) -> None:
        size = sum(nbytes(f) for f in frames)
        limit = min(self.config.max_message_size, self.peer_limit(dest))
        if size > limit:
            raise self._too_large(dest, size, limit)

    def _too_large(self, dest: int, size: int, limit: int) -> MessageTooLarge:
        whose = "" if limit == self.config.max_message_size else f" of worker {self.peer_name(dest)!r}"
        return MessageTooLarge(f"message of {size} bytes exceeds the limit{whose} of {limit} bytes")

    def _prepare(self, dest: int, header: bytes, frames: Sequence[Any]) -> list[Any]:
        """NOTE [Lent frames] in rrefrt_transport.zmq.lend: large buffers lent, small ones copied."""
        out, self.stats["bytes_lent"] = lend.prepare(
            [header, *frames], dest == self.id or self.fault_hook is not None or self._loop.in_loop(),
            self.stats["bytes_lent"])
        return out

    def _await_lent(self, msg: list[Any], dest: int, deadline: float | None) -> None:
        if not isinstance(msg, lend.Lent):
            return
        gone = lambda: self._closing or self._fenced is not None or self.table.state(dest) is PeerState.DEAD  # noqa: E731
        if not lend.await_release(msg, gone, deadline):
            self.stats["lent_unreleased"] += 1  # Rule 3: a peer that stopped reading mid-message

    @staticmethod
    def _header(kind: int, msg_id: int, meta: Any) -> bytes:
        head = wire.encode_header(kind, msg_id, meta)
        if len(head) > wire.MAX_HEADER_BYTES:  # the receiver would drop it without a word
            raise MessageTooLarge(f"message header of {len(head)} bytes exceeds the limit of {wire.MAX_HEADER_BYTES} bytes")
        return head

    # ------------------------------------------------------------------ data loop thread
    def _fail(self, p: Pending, err: BaseException) -> None:
        if not p.done:
            p.done = True
            self._loop.guard(p.on_done, "on_done", None, (), err)

    def _issue(self, p: Pending, frames: list, label: str) -> None:
        if self._closing or self._fenced is not None:
            lend.drop(frames)
            self._fail(p, self._fenced or AgentClosed(f"the transport was shut down (worker {self.name!r})"))
            return
        if p.dest != self.id:
            peer = self._peers.get(p.dest)
            if peer is None or self.table.state(p.dest) is PeerState.DEAD:
                lend.drop(frames)
                cause = self.table.cause(p.dest) or "it was declared dead" if peer else "it is not a member of this group"
                self._fail(p, PeerUnavailable(self.peer_name(p.dest), cause))
                return
            if peer.error is not None:
                lend.drop(frames)
                self._fail(p, peer.error)
                return
        table = self._peers[p.dest].pending if p.dest != self.id else self._self_pending
        table[p.msg_id] = p
        if p.timeout > 0:
            # the timer holds the id, never the request: a completed request's on_done (and
            # whatever its future holds, a traceback with RRefs, say) must not live on until
            # the deadline
            self._loop.call_later(p.timeout, lambda t=table, m=p.msg_id: self._expire(t, m))
        self._send_faulty(p.dest, frames, label)

    def _expire(self, table: dict[int, Pending], msg_id: int) -> None:
        p = table.pop(msg_id, None)
        if p is not None:
            self.stats["requests_timed_out"] += 1
            self._fail(p, RequestTimeout(self.peer_name(p.dest), p.timeout))

    def _send_faulty(self, dest: int, frames: list, label: str) -> None:
        """Send through the fault hook, when one is installed (NOTE [Fault injection])."""
        hook = self.fault_hook
        if hook is None or isinstance(frames, lend.Lent):  # lent: prepared before the hook came
            self._send(dest, frames)
            return
        for delay in hook(dest, label):
            if delay <= 0:
                self._send(dest, frames)
            else:
                self._loop.call_later(delay, lambda: self._send(dest, frames))

    def _send(self, dest: int, frames: list) -> None:
        if dest == self.id:
            self._deliver(dest, [bytes(f) if not isinstance(f, bytes) else f for f in frames])
            return
        peer = self._peers.get(dest)
        if peer is None or self.table.state(dest) is PeerState.DEAD or peer.error is not None:
            self.stats["dropped_to_dead"] += 1
            lend.drop(frames)
            return
        if peer.rid is None:  # first use (NOTE [Lazy connections] (2))
            self._contact(peer)
        if self._over_limit(peer, frames):
            return
        if peer.backlog or not peer.joined or not self._try_send(peer, frames):
            peer.backlog.append(frames)

    def _try_send(self, peer: Peer, frames: list) -> bool:
        return peer.rid is not None and self._send_on(peer.rid, frames)

    def _send_on(self, rid: bytes, frames: list) -> bool:
        parts = lend.begin(frames) if isinstance(frames, lend.Lent) else None  # NOTE [Lent frames]
        if parts == []:  # its sender gave up on it (lend Rule 3)
            return True
        small = parts is None and all((f.nbytes if isinstance(f, memoryview) else len(f)) < ZERO_COPY_MIN for f in frames)
        size = sum(nbytes(f) for f in frames)
        try:
            self._sock.send_multipart([rid, *(frames if parts is None else parts)], flags=_NOBLOCK, copy=small)
        except zmq.ZMQError as e:
            if parts is not None:
                lend.finish(frames, parts, False)  # type: ignore[arg-type]
            if e.errno in (errno.EHOSTUNREACH, errno.EAGAIN):
                return False
            raise
        if parts is not None:
            lend.finish(frames, parts, True)  # type: ignore[arg-type]
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += size
        return True

    def _flush_backlog(self, peer: Peer) -> None:
        while peer.backlog and peer.joined:
            frames = peer.backlog[0]
            if self._over_limit(peer, frames):  # its HELLO came: what waited is checked against it
                peer.backlog.popleft()
                continue
            if not self._try_send(peer, frames):
                return
            peer.backlog.popleft()

    def _over_limit(self, peer: Peer, frames: list) -> bool:
        """Data loop: whether ``frames`` (header first) is over the limit ``peer``'s HELLO
        told; if so it is refused here. The call site checked it against our own limit when
        the peer's was not known yet (lazy connections: before the first contact)."""
        limit = self._peer_max.get(peer.spec.id)
        if limit is None or limit >= self.config.max_message_size:
            return False
        size = sum(nbytes(f) for f in frames[1:])
        if size <= limit:
            return False
        self._refuse_too_large(peer, frames, size, limit)
        return True

    def _refuse_too_large(self, peer: Peer, frames: list, size: int, limit: int) -> None:
        """Data loop: a message over ``peer``'s limit is not sent (the receiver's libzmq would
        drop the connection with it, and a request would only time out): its request fails
        with MessageTooLarge, as at the call site."""
        lend.drop(frames)
        self.stats["messages_too_large"] += 1
        err = self._too_large(peer.spec.id, size, limit)
        try:
            kind, msg_id, _ = wire.decode_header(bytes(frames[0]))
        except wire.MalformedMessage:
            return
        p = peer.pending.pop(msg_id, None) if kind != wire.RESPONSE and msg_id else None
        if p is not None:
            self._fail(p, err)
        else:
            log.warning("worker %r: a message to %r was not sent: %s", self.name, peer.spec.name, err)

    def _hello(self, kind: int) -> list[bytes]:
        return [wire.encode_header(kind, 0, [self.incarnation, self.name, self.config.max_message_size])]


def _factory(config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> ZmqTransport:
    return ZmqTransport(config, on_message, on_peer_dead)


base.register("zmq", _factory)
