"""The heartbeat loop: liveness judged on a connection of its own, and membership spread.

Owns: the heartbeat socket (a second ROUTER socket that carries only PING, DEAD_NOTICE,
FENCED, SUSPECT and UNWATCHED, connected to the echo and the heartbeat socket of every peer
it watches), its thread (an ``IOLoop``), and the ``LivenessTable`` it feeds. It knows every
member (``know``: names, incarnations, endpoints) and watches those the data loop met
(``watch``: NOTE [Lazy connections] in rrefrt_transport.zmq.agent), or all of them at the
join with ``connect="eager"`` (``join``).

NOTE [Liveness]: liveness must not depend on how long one data message takes to move (issue
11 item 1), must not depend on the GIL (a handler that holds it is slow, not dead), and must
not use ZMTP heartbeats (their timer aborts libzmq, NOTE [Close] in rrefrt_transport.zmq.agent). ZMTP
heartbeats on the data connection failed the first: a PONG queued behind a message of a
gigabyte, the heartbeat timed out mid-transfer, libzmq closed the connection and the partial
message vanished; the route returned 100 ms later, so nobody was declared dead. So:

Rule 1: every worker runs an echo socket (``rrefrt_transport.zmq.echo``): libzmq sends back whatever
    reaches it, on a thread that runs without the GIL. Every worker's heartbeat socket
    connects to the echo of every peer it watches and sends it a PING every
    ``heartbeat_interval``; the echo
    coming back is the heartbeat. These connections never carry data, so a PING never waits
    behind a payload; a peer whose echo stays silent for ``heartbeat_timeout`` is suspected,
    and dead once a second witness agrees (a stopped, frozen or partitioned process; NOTE
    [Witnesses]). Python threads of the peer play no
    part: a deadlocked handler or a long-held GIL is not a death (call timeouts bound it).
Rule 2: the liveness sockets' connections live on a libzmq I/O thread of their own
    (AFFINITY), so that CURVE encrypting a large message, which libzmq does in one piece on
    the data connection's I/O thread, cannot delay an echo; and this loop runs on a Python
    thread of its own, never blocked by the data loop or its callbacks. The table does not
    judge anyone by silence after this thread itself was stalled (liveness Rule 3).
Rule 3: a killed peer's connections close at once; the socket monitor reports it, the loop
    probes the routes to the echoes (ROUTER_MANDATORY with IMMEDIATE: a send without a
    connection fails with EHOSTUNREACH) every PROBE_S, and a route gone for ``route_grace``
    is death. A transfer to a peer stopped mid-way fails with PeerUnavailable within
    heartbeat timeout + interval + the tick.
Rule 4: no socket sets HEARTBEAT_IVL. Heartbeat-socket messages are one frame after the
    routing id (NOTE [Close] (2) in rrefrt_transport.zmq.agent).
Rule 5: the socket also connects to this worker's own echo and PINGs it every tick: the
    echo coming back is this worker's own liveness (liveness Rule 5 (ii): its liveness I/O
    thread and this loop both ran within heartbeat_timeout / 2). A worker whose own echo is
    late accuses nobody.

NOTE [Witnesses] (issue 22): silence is a suspicion first (liveness Rules 5-7). A peer this
worker suspects is told to every other live member as SUSPECT [P, P's incarnation], again
every beat while the suspicion lasts; a receiver that suspects P itself (or does later,
within heartbeat_timeout) declares P dead and tells everyone DEAD_NOTICE as usual. So a
SIGSTOPped peer of a group of three or more is dead within heartbeat_timeout + interval +
a tick (the later of two witnesses), while a worker that is starved of CPU or cut off alone
finds no second witness for its suspicions: the others still hear the peers it misses. It
never tells a suspicion while it hears none of its peers (it suspects itself then, and
logs so once per episode). A receiver that does not watch P answers UNWATCHED: once every
peer told answered so, the suspicion needs no second witness (liveness Rule 6 (b)), so
the bound holds for a pair of workers that only talk to each other.

NOTE [Membership]: when this worker declares peer P dead on its own evidence, it sends
DEAD_NOTICE [P, P's incarnation, cause] to every other live member, and FENCED [cause] to P
(best effort: P's route is usually gone). A receiver of DEAD_NOTICE declares P dead too,
naming who declared it (it does not pass the notice on: the declarer told everyone). A
message that arrives from a dead peer, on either socket, is dropped and answered with FENCED
(at most every FENCE_REPEAT_S per peer): so a worker that was stopped past the timeout
learns at its first word that it was expelled, and fails its calls with ``Fenced``. A
DEAD_NOTICE about this worker itself is treated as FENCED. An expelled worker tells nobody
anything any more (its verdicts are its own), and a FENCED from a peer this worker holds
dead counts only when no other member is left: otherwise a worker expelled by the others
that judged them dead before it learnt it (a resumed process, CPU starvation) would expel
the whole group (found by the chaos campaign: all three workers fenced, after a stop of
0.5-0.6 s under a load of 60 on two cores). A death that another transport of this worker
saw first (the composite's same-host path: an EOF) is declared here too (``declare``) and
told like this worker's own verdicts, so no transport's verdict stays one worker's alone.
"""

from __future__ import annotations

import collections
import errno
import logging
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from rrefrt_transport.zmq import security

from rrefrt_transport import wire
from rrefrt_transport.zmq.echo import echo_id
from rrefrt_transport.liveness import LivenessTable, PeerState, Verdict
from rrefrt_transport.zmq.loop import IOLoop

log = logging.getLogger("rrefrt.transport")

PROBE_S = 0.05  #: route probe period while a connection was lost or a peer is joining
FENCE_REPEAT_S = 0.2  #: at most one FENCED per dead peer in this period
FENCE_RETRY_S = 60.0  #: how long FENCED is retried to a dead peer (until its route returns)
_NOBLOCK = int(zmq.NOBLOCK)


class Heartbeat:
    def __init__(
        self,
        ctx: zmq.Context,
        worker_id: int,
        name: str,
        incarnation: int,
        interval: float,
        table: LivenessTable,
        auth: security.CurveAuth | None,
        stats: collections.Counter,
        on_dead: Callable[[Verdict], None],
        on_fenced: Callable[[str, str], None],
        on_change: Callable[[], None],
    ) -> None:
        self.id, self.name, self.incarnation = worker_id, name, incarnation
        self.interval = interval
        self.table = table
        self._auth = auth
        self.stats = stats
        self._on_dead, self._on_change = on_dead, on_change
        self._tell_fenced = on_fenced
        self.expelled = False  #: a member declared us dead: we tell nobody anything any more
        self.loop = IOLoop(f"rrefrt-hb-{name}", stats, self._close_sockets)
        s = self._sock = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTING_ID, wire.routing_id(worker_id))
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.IMMEDIATE, 1)  # for the echo routes; not for the heartbeat sockets' (``_connect``)
        s.setsockopt(zmq.AFFINITY, 2)  # libzmq I/O thread 1: never busy with data (Rule 2)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10000)
        s.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)  # no HEARTBEAT_*: Rule 4
        if auth is not None:
            security.configure_keys(s, auth)
        self._monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.loop.register(s, self._recv_all)
        self.loop.register(self._monitor, self._read_monitor)
        self._peers: dict[int, tuple[bytes, int, str]] = {}  #: id -> (our pipe's routing id, incarnation, name)
        self._eps: dict[int, tuple[str, str]] = {}  #: id -> (its heartbeat endpoint, its echo endpoint)
        #: Rule 8 of rrefrt_transport.liveness: a peer watched from its first contact is dead
        #: unless heard within this many seconds
        self.contact_timeout = 2 * table.heartbeat_timeout + interval
        self._fenced_told: dict[int, float] = {}  #: dead peer -> when we last sent it FENCED
        self._dead_since: dict[int, float] = {}  #: dead peer -> when; FENCED retried for FENCE_RETRY_S
        self._probe_until = 0.0  #: probe every route every PROBE_S until then (Rule 3)
        self._next_beat = 0.0
        #: the live tick's number: a tick scheduled before a sooner one replaced it does nothing
        self._tick_gen = 0
        #: after new peers are watched, the next ticks come sooner (5 ms doubling to PROBE_S):
        #: a beat sent before the connection is up is dropped, and the join waits for one
        self._soon = PROBE_S
        self._echo_peer: dict[bytes, int] = {}  #: echo routing id -> peer id
        self._connected: dict[int, list[str]] = {}  #: peer id -> endpoints we connected to
        #: peers that left the group (``forget``): their late messages are dropped, never
        #: answered with FENCED (a store host still waiting after its leave is not expelled)
        self._departed: set[int] = set()
        self._ping = wire.encode_header(wire.PING, 0, [incarnation, True])  #: what we send to echoes
        self._told: set[int] = set()  #: peers whose suspicion we told since it began (NOTE [Witnesses])
        self._isolations = 0  #: ``table.isolations`` last logged
        self.endpoints: list[str] = []

    # ------------------------------------------------------------------ setup (before start)
    def bind(self, endpoint: str) -> str:
        return security.bind(self._sock, self._auth, endpoint, self.endpoints)

    def watch_self(self, echo: str) -> None:
        """Any thread: connect to this worker's own echo at ``echo`` (Rule 5)."""

        def setup() -> None:
            self._echo_peer[echo_id(self.id)] = self.id
            if self._auth is not None:
                security.configure_client(self._sock, self._auth, self.id)
            self._sock.connect(echo)

        self.loop.call_soon(setup)

    def start(self) -> None:
        self.loop.start()
        self.loop.call_soon(self._tick_now)

    def know(self, peers: list[tuple[int, str, int, str, str]]) -> None:
        """Any thread: the members, (id, name, incarnation, heartbeat endpoint, echo endpoint)
        each; none is watched yet. A new incarnation of a known id replaces it (dynamic
        groups): unwatched until its own first contact."""
        self.loop.call_soon(lambda: self._know(peers))

    def _know(self, peers: list[tuple[int, str, int, str, str]]) -> None:
        for pid, pname, inc, live, echo in peers:
            old = self._peers.get(pid)
            if old is not None and old[1] != inc:
                self._detach(pid)
                self.table.drop(pid)
            self._departed.discard(pid)
            # the same incarnation keeps its pipe's name (a connected pipe is addressed by it)
            rid = old[0] if old is not None and old[1] == inc else wire.outgoing_id(pid)
            self._peers[pid] = (rid, inc, pname)
            self._eps[pid] = (live, echo)
            self._echo_peer[echo_id(pid)] = pid

    def watch(self, peer: int) -> None:
        """Any thread: watch ``peer`` from now on (its first contact, liveness Rule 8)."""
        self._schedule(lambda: self._watch([peer], None, False))

    def join(self, peers: list[tuple[int, str, int, str, str]], timeout: float | None = None) -> None:
        """Any thread: know and watch every peer of ``peers`` at once (``connect="eager"``, or
        the joiner of a dynamic group); ``timeout``: the join's, which bounds liveness Rule 7."""

        def setup() -> None:
            self._know(peers)
            self._watch([p[0] for p in peers], timeout, True)

        self.loop.call_soon(setup)

    def _watch(self, peers: list[int], timeout: float | None, join: bool) -> None:
        fresh = [p for p in peers if p not in self._connected and p in self._eps and p != self.id
                 and p not in self._departed]
        for pid in fresh:
            live, echo = self._eps[pid]
            self._connected[pid] = [self._connect(pid, live, True), self._connect(pid, echo, False)]
            self.stats["peers_watched"] += 1
        if not fresh:
            return
        self._soon = 0.005
        self._tick_now()  # beat the new peers now, not at the next slow tick (up to 0.25 s away)
        if join:
            self.table.add(fresh, join_timeout=timeout)
            self._probe_until = time.monotonic() + 3600.0  # until the join ends: see _tick
        else:
            self.table.add(fresh, mark=False, contact_timeout=self.contact_timeout)
            self._probe_until = max(self._probe_until, time.monotonic() + self.contact_timeout)

    def _connect(self, pid: int, endpoint: str, named: bool) -> str:
        """Connect to ``endpoint`` of ``pid``: its heartbeat socket (``named``: our pipe is
        ``outgoing_id(pid)``, and without IMMEDIATE, so that it may coexist with the pipe it
        connects to us, NOTE [Close] (2) of rrefrt_transport.zmq.agent does not apply to
        one-frame messages) or its echo (IMMEDIATE: route probes, Rule 3)."""
        s = self._sock
        if self._auth is not None:
            security.configure_client(s, self._auth, pid)
        if named:
            s.setsockopt(zmq.IMMEDIATE, 0)
            s.setsockopt(zmq.CONNECT_ROUTING_ID, self._peers[pid][0])
        try:
            s.connect(endpoint)
        finally:
            if named:
                s.setsockopt(zmq.IMMEDIATE, 1)
        return endpoint

    # ------------------------------------------------------------------ any thread
    def declare(self, peer: int, cause: str) -> None:
        """Declare ``peer`` dead on this worker's own evidence, or on another transport's
        (the composite's same-host path saw its process go): judged on the heartbeat thread
        and told to the others as this worker's own verdict (NOTE [Membership])."""
        # a member not watched here yet (lazy connections) is declared all the same: the
        # verdict must not depend on whether this worker happened to talk to it (NOTE [Membership])
        self._schedule(lambda: self._verdict(self.table.declare(peer, cause, add=peer in self._peers), tell=True))

    def forget(self, peer: int, cause: str) -> None:
        """A member left the group (dynamic groups): dead here, nobody told, its endpoints
        disconnected (transport/zmq/mesh.py, Rule 2)."""

        def run() -> None:
            self._departed.add(peer)
            v = self.table.declare(peer, cause, add=peer in self._peers)  # watched here or not
            if v is not None:
                entry = self._peers.get(peer)
                log.info("worker %r dropped worker %r: %s", self.name, entry[2] if entry else peer, cause)
                self.loop.guard(self._on_dead, "peer death handler", v)
            self._detach(peer)

        self._schedule(run)

    def watching(self, peer: int) -> bool:
        return peer in self._connected

    def _detach(self, peer: int) -> None:
        entry = self._peers.get(peer)
        if entry is not None:  # a later connect names its pipe afresh (wire.outgoing_id)
            self._peers[peer] = (wire.outgoing_id(peer), *entry[1:])
        for ep in self._connected.pop(peer, []):
            try:
                self._sock.disconnect(ep)
            except zmq.ZMQError:  # libzmq forgot it already
                pass

    def tell_fenced(self, peer: int) -> None:
        """A message came from dead ``peer``: answer FENCED (rate-limited)."""
        self._schedule(lambda: self._send_fenced(peer))

    def _schedule(self, fn: Callable[[], None]) -> None:
        try:
            self.loop.call_soon(fn)
        except Exception:  # closed: nobody to tell
            pass

    # ------------------------------------------------------------------ loop thread
    def _close_sockets(self) -> None:
        self._monitor.close(0)
        self._sock.close(0)

    def _send(self, peer: int, frames: list[bytes]) -> bool:
        entry = self._peers.get(peer)
        if entry is None:
            return False
        try:
            self._sock.send_multipart([entry[0], *frames], flags=_NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return False
            if e.errno == errno.EAGAIN:  # queue full: a route exists
                return True
            raise
        return True

    def _beat(self, peer: int) -> bool:
        """PING ``peer``'s echo; False when there is no route to it (Rule 3)."""
        try:
            self._sock.send_multipart([echo_id(peer), self._ping], flags=_NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return False
            if e.errno == errno.EAGAIN:
                return True
            raise
        return True

    def _tick_now(self) -> None:
        """Loop thread: tick as soon as the loop is free; the tick scheduled before is void."""
        self._tick_gen += 1
        gen = self._tick_gen
        self.loop.call_soon(lambda: self._tick(gen))

    def _tick(self, gen: int) -> None:
        """Beat every interval; probe every route while joining or after a disconnect, and
        suspects; judge the table; retry FENCED to dead peers whose route may be back."""
        if gen != self._tick_gen:
            return  # replaced by a sooner tick (``_tick_now``)
        now = time.monotonic()
        joining = self.table.joining()
        if not joining and self._probe_until > now + 60:
            self._probe_until = 0.0  # the join ended
        due = now >= self._next_beat
        if due:
            self._next_beat = now + self.interval
        suspects = [p for p in self._peers if self.table.state(p) is PeerState.SUSPECT]
        probing = now < self._probe_until
        for peer in self.table.live() if (due or probing) else suspects:
            ok = self._beat(peer)
            if peer not in joining:
                self.table.route(peer, ok)
            self.stats["heartbeats_sent"] += ok
        try:  # Rule 5: this worker's own echo
            self._sock.send_multipart([echo_id(self.id), self._ping], flags=_NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
        for v in self.table.tick():
            self._verdict(v, tell=True)
        self._tell_suspicions(due)
        for peer, since in list(self._dead_since.items()):
            if now - since > FENCE_RETRY_S:
                del self._dead_since[peer]
            else:
                self._send_fenced(peer)
        fast = probing or suspects or self._dead_since
        self._tick_gen += 1
        gen = self._tick_gen
        period = PROBE_S if fast else min(0.25, self.interval / 2)
        if self._soon < PROBE_S:
            period, self._soon = min(period, self._soon), self._soon * 2
        self.loop.call_later(period, lambda: self._tick(gen))

    def _tell_suspicions(self, due: bool) -> None:
        """NOTE [Witnesses]: tell each new suspicion at once, and every beat while it lasts."""
        if self.table.isolations != self._isolations:  # at most once per heartbeat_timeout
            log.warning("worker %r heard none of its peers for over %.1fs: it suspects itself and accuses "
                        "nobody (liveness Rule 5)", self.name, self.table.heartbeat_timeout)
            self.stats["isolations"] += self.table.isolations - self._isolations
            self._isolations = self.table.isolations
        suspects = self.table.suspects()
        self._told.intersection_update(suspects)
        if self.expelled:
            return
        for peer in suspects:
            entry = self._peers.get(peer)
            if entry is None or (peer in self._told and not due):
                continue
            if peer not in self._told:
                log.info("worker %r suspects worker %r: no heartbeat for over %.1fs; asking the others",
                         self.name, entry[2], self.table.heartbeat_timeout)
            self._told.add(peer)
            notice = [wire.encode_header(wire.SUSPECT, 0, [peer, entry[1]])]
            for other in self.table.live():
                if other != peer and self._send(other, notice):
                    self.stats["suspicions_sent"] += 1

    def _verdict(self, v: Verdict | None, tell: bool) -> None:
        if v is None:
            return
        entry = self._peers.get(v.peer)
        pname = entry[2] if entry else f"<worker {v.peer}>"
        log.warning("worker %r declared worker %r dead: %s", self.name, pname, v.cause)
        self.stats["peers_declared_dead"] += 1
        if self.watching(v.peer):  # FENCED goes over our pipe to it: none to a peer never watched
            self._dead_since[v.peer] = time.monotonic()
        if tell and entry is not None and not self.expelled:
            notice = [wire.encode_header(wire.DEAD_NOTICE, 0, [v.peer, entry[1], v.cause])]
            for other in self.table.live():
                if self._send(other, notice):
                    self.stats["dead_notices_sent"] += 1
            self._send_fenced(v.peer)
        self.loop.guard(self._on_dead, "peer death handler", v)

    def _on_fenced(self, by: str, cause: str) -> None:
        self.expelled = True
        self._tell_fenced(by, cause)

    def _send_fenced(self, peer: int) -> None:
        if self.expelled or peer in self._departed:
            return
        now = time.monotonic()
        if now - self._fenced_told.get(peer, -FENCE_REPEAT_S) < FENCE_REPEAT_S:
            return
        self._fenced_told[peer] = now
        cause = self.table.cause(peer) or "it was declared dead"
        if self._send(peer, [wire.encode_header(wire.FENCED, 0, [cause])]):
            self.stats["fenced_sent"] += 1
            self._dead_since.pop(peer, None)  # told: no more retries

    def _recv_all(self) -> None:
        sock = self._sock
        for _ in range(1000):
            try:
                msg = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            echoed = self._echo_peer.get(msg[0])
            if echoed == self.id:  # our own echo: this worker's own liveness (Rule 5)
                if len(msg) == 2 and msg[1] == self._ping:
                    self.table.heard_self()
                continue
            if echoed is not None:  # our PING back from that peer's echo: a heartbeat
                if len(msg) == 2 and msg[1] == self._ping and self.table.state(echoed) is not PeerState.DEAD:
                    was_joining = self.table.state(echoed) is PeerState.JOINING
                    self.table.heard(echoed)
                    self.stats["heartbeats_received"] += 1
                    if was_joining:
                        self._on_change()
                else:
                    self.stats["bad_frames_dropped"] += 1
                continue
            owner = wire.pipe_owner(msg[0])
            wid = owner[0] if owner is not None else None
            entry = self._peers.get(wid) if wid is not None else None
            if entry is None or len(msg) != 2:
                self.stats["bad_frames_dropped"] += 1
                continue
            try:
                kind, _, meta = wire.decode_header(msg[1])
            except wire.MalformedMessage:
                self.stats["bad_frames_dropped"] += 1
                continue
            assert wid is not None
            self._handle(wid, entry, kind, meta)

    def _handle(self, src: int, entry: tuple[bytes, int, str], kind: int, meta: Any) -> None:
        state = self.table.state(src)
        if kind == wire.FENCED:
            # from a peer we hold dead, only when no other member is left (NOTE [Membership])
            if state is PeerState.DEAD and any(p != src for p in self.table.live()):
                self.stats["fenced_dropped"] += 1
                return
            if type(meta) is list and len(meta) == 1 and isinstance(meta[0], str):
                self._on_fenced(entry[2], meta[0])
            return
        if state is PeerState.DEAD:
            self.stats["fenced_dropped"] += 1
            self._send_fenced(src)
            return
        if kind == wire.PING:  # heartbeats go to echo sockets, not here
            self.stats["bad_frames_dropped"] += 1
        elif kind == wire.DEAD_NOTICE:
            if not (type(meta) is list and len(meta) == 3 and type(meta[0]) is int and isinstance(meta[2], str)):
                self.stats["bad_frames_dropped"] += 1
                return
            peer, inc, cause = meta
            if peer == self.id:
                if inc == self.incarnation:
                    self._on_fenced(entry[2], cause)
                return
            target = self._peers.get(peer)
            if target is None or target[1] != inc:
                return
            self.stats["dead_notices_received"] += 1
            # a member not watched here is dead all the same (it is learnt from those who do)
            self._verdict(self.table.declare(peer, f"worker {entry[2]!r} declared it dead: {cause}", add=True), tell=False)
        elif kind == wire.SUSPECT:  # NOTE [Witnesses]
            if not (type(meta) is list and len(meta) == 2 and type(meta[0]) is int and type(meta[1]) is int):
                self.stats["bad_frames_dropped"] += 1
                return
            peer, inc = meta
            target = self._peers.get(peer)
            if peer == self.id or target is None or target[1] != inc:
                return
            self.stats["suspicions_received"] += 1
            if self.table.state(peer) is None:  # not watched here: never a witness (NOTE [Witnesses])
                if self._send(src, [wire.encode_header(wire.UNWATCHED, 0, [peer, inc])]):
                    self.stats["unwatched_sent"] += 1
                return
            self._verdict(self.table.suspicion(peer, src), tell=True)
        elif kind == wire.UNWATCHED:
            if not (type(meta) is list and len(meta) == 2 and type(meta[0]) is int and type(meta[1]) is int):
                self.stats["bad_frames_dropped"] += 1
                return
            target = self._peers.get(meta[0])
            if target is not None and target[1] == meta[1]:
                self.table.unwatched(meta[0], src)
        else:
            self.stats["bad_frames_dropped"] += 1

    def _read_monitor(self) -> None:
        while True:
            try:
                parse_monitor_message(self._monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            # a connection closed: probe every route for a while (Rule 3)
            self._probe_until = max(self._probe_until, time.monotonic() + self.table.route_grace + 0.2)
