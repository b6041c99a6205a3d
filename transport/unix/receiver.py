"""The receiver loop of the same-host transport (Rule 2 of ``rrefrt_transport.unix.transport``):
one thread per process waits on every peer socket, the listening socket, admissions and
the bell; reads whole messages and dispatches each on this thread (no hand-off on
receipt); runs the timers.

Thread roles: ``serve`` runs on the transport's receiver thread (``loop_thread``);
``call_soon`` and ``want_write`` may be called from any thread and ring the bell;
``read_until`` runs on a caller's thread that waits for an answer (NOTE [Own reads]);
everything else runs on the receiver thread.

NOTE [Own reads]: a caller blocked for its answer (``rpc_sync``, ``to_here``) used to be
woken by the receiver thread, which the kernel had woken first: two wake-ups and a GIL
hand-off per answer. So a waiting caller may read its peer's socket itself
(``read_until``, reached through ``Transport.read_until``), a leader/follower hand-over
per channel:

1. One reader per channel at a time: the read token (``Channel.claim_read``). The loop
   takes it around every read of a channel; a caller takes it only if it is free (else it
   waits for its future as before) and never on the loop's own thread.
2. While a caller holds it the loop does not read that socket: the caller mutes it in the
   loop's epoll set (one-shot, so a hang-up is reported once, never in a loop); a loop
   that still sees it readable mutes it again under the token's lock, and the holder
   unmutes it under that lock when it gives the token back, so the socket is never left
   muted without a holder (epoll is level-triggered: bytes left unread are reported at
   once).
3. The caller handles what needs no loop state: answers (``Pending`` of any caller: the
   timers' lock guards the deadlines), PINGs, BYE and segment forgets (the channel's read side, which the token holder owns). The first message
   of any other kind - a call, a protocol message, a nested call back to this worker -
   is handed to the loop with every message read after it (``call_soon``, in order), and
   the token goes with them: the loop dispatches them and then gives it back. So nothing
   that may run user code or touch the loop's state runs on the caller's thread, and a
   callee that calls back while its caller reads is served by the loop as before.
4. Every wait is bounded: the caller polls its socket in slices of ``OWN_READ_SLICE`` and
   checks its future between them (a deadline or a death is decided by the loop, which
   completes the future), and reads for ``OWN_READ_LIMIT`` at most, then waits for its
   future as before. EOF, a failed read or a framing error are handed to the loop, whose
   verdict fails the future.
5. Liveness is unchanged: the caller's reads set ``last_rx`` like the loop's.
6. Also after a request that lent the peer a shared-memory segment: the peer returns it by
   a mark in the segment, no message follows the answer (NOTE [Segments] (5) in ``shm``).
7. A bounded spin before the first sleep: the caller polls its socket without sleeping for
   up to ``spin`` (``OWN_READ_SPIN``, 200 us; ``extra["own_read_spin_us"]`` or
   ``RREFRT_OWN_SPIN_US``, 0: off) before it sleeps in ``poll``, once per wait. Spins that
   end without an answer ``SPIN_MISSES`` times in a row on a channel pause the spinning
   there for ``SPIN_PAUSE`` waits (both in ``rrefrt_transport.spin``), so a peer that
   answers late (a long call) or shares this core (it cannot answer while we spin) costs
   at most 4 spins per 68 waits. The spin stretches to ``STRETCH`` (1.5) x the channel's
   last wait for an answer where that was at most ``STRETCH_MAX`` (1 ms; both in
   ``rrefrt_transport.spin``; whatever ``spin`` is as long as it is not 0; never past the
   wait's own bound): a 1 MB round trip's answer comes some 300 us after the
   request, past the 200 us bound, and each wait missed it and slept. It yields the core
   between polls: a worker that shares this core may be the one that must run before the
   answer can come (3 workers on 2 cores, user->user forks).
   Measured (bench/bench_rpc.py, A/B against the same spin without the stretch and the
   yield, 3 rounds, 2 workers one per core unless said): a 1 MB round trip 0.65x the time
   for 1.20x the CPU per call (both sides, and with the loop's stretch, NOTE [Receiver
   spin] (4); without it 0.88x: both ends wake for each message otherwise); forks 1.11x
   the rate for 0.89x the CPU per fork; 8 workers on 2 cores 1.10x the calls per second;
   rpc_sync, rpc_async, 4 KB, remote() + to_here() and 16-64 MB unchanged (0.98-1.02x).
   The stretch without the yield cost forks 0.82x the rate. ``STRETCH_MAX`` is 1 ms, not
   the 500 us first tried: without the spins a 1 MB round trip takes 550-600 us, so one
   slow moment of the machine (or a machine slower than this one) took the last wait
   past 500 us and left the stretch off for good, every round trip then as slow as
   without it; with 1 ms it comes back at the next wait (A/B on the loaded machine, 3
   rounds: 1 MB 0.64x the time for 1.07x the CPU per call against 500 us; forks, 8
   workers on 2 cores, rpc_async, remote() + to_here(), 16-64 MB and a join of 128
   workers unchanged within the noise). A call that takes 0.5-1 ms is spun for, at the
   cost of the caller's core for its duration (yielded to whatever else wants it).
   Measured with 2 workers pinned one per core on the loaded 2-core machine (paired A/B,
   4 rounds, load average about 2): rpc_sync no-op p50 140 -> 99 us, remote() +
   to_here() 191 -> 160 us, 4 KB round trip 282 -> 238 us, for 0-18% more CPU per call
   (both sides: 145 -> 171, 219 -> 259, 292 -> 287 us); with both workers on one core it
   paused itself and cost nothing measurable (107 vs 107 us, same CPU). The bound was
   100 us until the receiver loop's spin (NOTE [Receiver spin]) brought a remote() +
   to_here() answer to 80-95 us: answers then came just after a 100 us spin often enough
   that 4 misses in a row paused the spin in some runs, and the 64 calls that followed
   paid a sleep each (one such pause: p50 100 -> 119 us, p99 194 -> 270 us in a run of
   1000). With 200 us (A/B, 7 rounds): remote() + to_here() p99 0.84x (0.42-1.04), p50,
   rpc_sync, 4 KB and CPU per call unchanged (0.99-1.02x).

NOTE [Receiver spin]: on this kind of VM a ``sendmsg`` that wakes a thread sleeping in
``epoll_wait`` costs the sender about 14 us of CPU (2.3 us when the peer sleeps in
``recv``), and the message reaches the woken thread ~40 us later than one that polls (a
raw two-process ping-pong: 60 us round trip when the receiver sleeps, 18.5 us when it
polls; docs/performance.md, "Known limits"). Every request to an idle loop paid it.

1. Before it sleeps, the loop polls every fd it watches without sleeping for up to
   ``rx_spin`` (``RX_SPIN``, 150 us; ``extra["rx_spin_us"]`` or ``RREFRT_RX_SPIN_US``, 0:
   off). A message that arrives meanwhile wakes nobody. Only while calls or answers come
   often and one came just now: the last two wakes that read one were at most 2 x
   ``rx_spin`` apart, and the last was at most ``rx_spin`` ago (PINGs between them do
   not count). So a ping-pong of small calls (the next request
   arrives about one caller's turn after the answer left) and a burst of ``rpc_async``
   calls are caught by the spin; a large transfer (a round trip longer than 2 x
   ``rx_spin``), a worker called seldom and a loop woken by a timer never spin.
2. Between two polls it yields the core (``sched_yield``): the pool thread that runs the
   call it just handed on is usually waiting for this core, and must not wait for the spin.
3. ``SPIN_MISSES`` spins in a row that catch nothing pause it for ``SPIN_PAUSE`` waits (as
   a caller's spin, (7) above): a caller that stops, or calls just too seldom to be
   caught, costs at most 4 spins per 68 waits.
4. Where the last gap between two messages that count was longer than (1) reaches but at
   most ``STRETCH_MAX`` (1 ms), the loop spins until ``STRETCH`` (1.5) x that gap after
   the last one, when the next is due (a 1 MB ping-pong: a request every 350-600 us),
   whatever ``rx_spin`` is as long as it is not 0 (0 turns both off). It
   pays together with a caller's stretched spin (NOTE [Own reads] (7), measured there):
   each side then catches the other's message without a wake-up. Messages further apart
   than 1 ms never make a loop spin, so a worker called seldom sleeps as before.
   Measured with 2 workers pinned one per core (bench/bench_rpc.py, A/B against a 50 us
   spin that caught bursts only, 3 rounds): rpc_sync no-op p50 0.61x, p99 0.59x, for 0.81x
   the CPU per call (both sides: the caller's sendmsg no longer wakes a sleeper and its own
   spin for the answer is shorter, which outweighs the callee's spin); remote() + to_here()
   p50 0.67x, 4 KB round trip 0.67x, both for less CPU per call; rpc_async and 1 MB-64 MB
   unchanged. More workers than cores (A/B, 3 rounds): 8 workers on 2 cores, rank 0
   calling the 7 others, 1.22x (1.07-1.23) the calls per second; user->user forks, 3
   workers on 2 cores, 0.96x (0.93-0.97). Before that, a 50 us spin for bursts only
   (a ping-pong never spun): 1000 rpc_async calls in flight 1.55x the calls per second
   for 0.66x the CPU per call against no spin.
"""

from __future__ import annotations

import collections
import logging
import threading
import select
from time import monotonic as _now
from typing import Any, Callable, Protocol

from rrefrt_transport import wire
from rrefrt_transport.base import OnMessage
from rrefrt_transport.spin import RX_SPIN, STRETCH, STRETCH_MAX, LoopSpin
from rrefrt_transport.spin import spin as spin_poll
from rrefrt_transport.unix import shm
from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.unix.channel import UP, Channel, ChannelLost
from rrefrt_transport.unix.poller import READ, WRITE, Bell, Poller
from rrefrt_transport.unix.timers import Pending, Timers, guard

log = logging.getLogger("rrefrt.transport")

_READS_PER_WAKE = 64
#: NOTE [Own reads] (4): a caller reading its own answer checks its future this often ...
OWN_READ_SLICE = 0.02
#: ... and reads for this long at most before it waits for its future as before
OWN_READ_LIMIT = 1.0
#: NOTE [Own reads] (7): the default spin before a caller's first sleep, seconds
OWN_READ_SPIN = 200e-6
#: NOTE [Own reads] (3): kinds the caller's thread handles itself
_OWN_KINDS = frozenset({wire.RESPONSE, wire.PING, unix_wire.SHM_FORGET, unix_wire.BYE})
LISTEN = ("listen",)  #: the poller's data of the listening socket
BELL = ("bell",)  #: the poller's data of the bell


class ReceiverHost(Protocol):
    """What the loop needs of its transport: the decisions that concern a whole peer."""

    closing: bool  #: leave the loop

    def channel_lost(self, ch: Channel, cause: str) -> None:
        """``ch``'s process is gone (EOF, a failed read or write)."""

    def close_connection(self, ch: Channel, cause: str, tell: bool) -> None:
        """NOTE [Protocol errors]: close ``ch``'s connection without judging the peer."""

    def on_listener(self) -> None:
        """The listening socket has connections to accept."""

    def on_admission(self, fd: int) -> None:
        """A connection in admission sent bytes."""

    def shutdown(self) -> None:
        """The loop ends (closed, or crashed): release everything, fail what waits."""


class Receiver:
    """The loop and the dispatch of what it reads (module docstring)."""

    def __init__(
        self,
        name: str,
        my_id: int,
        host: ReceiverHost,
        channels: dict[int, Channel],
        self_pending: dict[int, Pending],
        on_message: OnMessage,
        timers: Timers,
        bell: Bell,
        stats: collections.Counter,
        shm_copy_out: bool,
    ) -> None:
        self.name = name
        self._id = my_id
        self._host = host
        self._channels = channels  #: the transport's, by peer id
        self._self_pending = self_pending  #: requests to ourselves (the transport's)
        self._on_message = on_message
        self.timers = timers
        self.loop_thread = 0  #: ident of the thread that runs ``serve``
        self._stats = stats
        self._shm_copy_out = shm_copy_out
        self.poller = Poller()
        self.bell = bell
        self.poller.register(self.bell.fd, READ, BELL)
        self._calls: collections.deque = collections.deque()  #: functions to run on the loop
        self._watch_needed = False
        self.n_received = 0
        #: NOTE [Own reads] (7): seconds a caller polls before its first sleep (0: never)
        self.spin = OWN_READ_SPIN
        #: NOTE [Receiver spin]: when the loop polls before it sleeps (its ``seconds``, 0:
        #: never); it counts the calls and answers read, ``_n_msgs`` those dispatched here
        self.rx_spin = LoopSpin(RX_SPIN)
        self._n_msgs = 0

    # ------------------------------------------------------------------ any thread
    def call_soon(self, fn: Any) -> None:
        """Run ``fn`` on the loop's thread, soon."""
        self._calls.append(fn)
        self.bell.ring()

    def want_write(self) -> None:
        """A channel waits for EVENT_WRITE: the loop watches for it at its next turn."""
        self._watch_needed = True
        self.bell.ring()

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """Run the loop on this thread until the transport closes, then shut it down."""
        self.loop_thread = threading.get_ident()
        host, poller, timers, rx_spin = self._host, self.poller, self.timers, self.rx_spin
        poll_now = lambda: poller.poll(0.0)  # noqa: E731  # the spin's poll
        due = timers.next_due()
        try:
            while not host.closing:
                # ``due`` was taken with the timers' planned wake, at the end of the last
                # iteration (after its timers ran): one lock round trip per wake
                timeout = due - _now()
                if timeout < 0.0:
                    timeout = 0.0
                if self._calls:
                    timeout = 0.0
                ready = rx_spin.before_sleep(poll_now, timeout, self._stats, "rx_spin")
                if ready is not None and not ready:  # a spin that missed took some of the sleep's time
                    timeout = max(0.0, due - _now())
                for fd, data, events in ready or poller.poll(timeout):
                    if data is BELL:
                        self.bell.clear()
                    elif data is LISTEN:
                        host.on_listener()
                    elif type(data) is tuple:
                        host.on_admission(fd)
                    else:
                        if events & WRITE:
                            self._writable(data)
                        if events & READ:
                            n = self._n_msgs
                            self._read(data)
                            if self._n_msgs != n:
                                rx_spin.note(_now())
                calls = self._calls
                while calls:
                    guard(calls.popleft())
                if self._watch_needed:
                    self.watch_writes()
                due = timers.run_due()
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("receiver thread of %r crashed", self.name)
        finally:
            host.shutdown()

    def _writable(self, ch: Channel) -> None:
        ch.want_write = False
        if ch.sock is not None:
            self.poller.modify(ch.sock.fileno(), READ, ch)
        ch.try_flush()

    def watch_writes(self) -> None:
        """Watch EVENT_WRITE of every channel that asked for it."""
        self._watch_needed = False
        for ch in list(self._channels.values()):
            if ch.want_write and ch.state is UP and ch.sock is not None:
                if not self.poller.events_of(ch.sock.fileno()) & WRITE:
                    self.poller.modify(ch.sock.fileno(), READ | WRITE, ch)

    def watch(self, ch: Channel) -> None:
        """``ch`` was admitted: read it."""
        assert ch.sock is not None
        self.poller.register(ch.sock.fileno(), READ, ch)

    def unwatch(self, ch: Channel) -> None:
        if ch.sock is not None:
            try:
                self.poller.unregister(ch.sock.fileno())
            except (KeyError, ValueError, OSError):
                pass

    # ------------------------------------------------------------------ reading
    def _read(self, ch: Channel) -> None:
        """Read what ``ch`` sent (bounded per wake: the poller is level-triggered) and
        dispatch every complete message on this thread, holding its read token (NOTE [Own
        reads]); a channel that a caller reads now is muted instead."""
        sock = ch.sock
        if sock is None or not ch.claim_read(lambda: self.poller.mute(sock.fileno())):
            return
        try:
            self._read_held(ch)
        finally:
            ch.release_read()  # (its teardown ran meanwhile: the read side closes now)

    def _read_held(self, ch: Channel) -> None:
        for _ in range(_READS_PER_WAKE):
            if ch.state is not UP:
                return
            msgs: list[unix_wire.Incoming] = []
            try:
                drained = ch.read_some(msgs)
            except ChannelLost as e:
                self._host.channel_lost(ch, str(e))
                return
            except unix_wire.ProtocolError as e:  # NOTE [Protocol errors] in rrefrt_transport.unix.transport
                self._host.close_connection(ch, e.cause(), True)
                return
            for m in msgs:
                if ch.state is not UP:
                    self._stats["fenced_dropped"] += 1
                    continue
                self._incoming(ch, m)
            if drained:
                return

    def _incoming(self, ch: Channel, m: unix_wire.Incoming) -> None:
        got = self._decode(ch, m)
        if got is not None:
            self.dispatch(ch, *got)

    def _decode(self, ch: Channel, m: unix_wire.Incoming) -> tuple[int, int, Any, list] | None:
        """(kind, msg id, meta, frames) of ``m``; None: dropped (or its connection closed).
        By the holder of ``ch``'s read token."""
        self.n_received += 1
        frames = m.frames
        if m.shm_sizes:
            try:
                mapping = ch.map_segment(m.seg_id, m.fd_attached)
            except (IndexError, KeyError, OSError, ValueError):  # NOTE [Protocol errors] in rrefrt_transport.unix.transport
                why = f"it named shared-memory segment {m.seg_id} it never sent"
                self.on_loop(lambda: self._host.close_connection(ch, why, True))
                return None
            try:
                mapped = iter(shm.frames_of(mapping, m.shm_sizes, m.lease, self._shm_copy_out))
            except ValueError as e:  # (a frame past the segment, or a lease it no longer has)
                why = f"it sent frames that shared-memory segment {m.seg_id} does not hold ({e})"
                self.on_loop(lambda: self._host.close_connection(ch, why, True))
                return None
            frames = [f if f is not None else next(mapped) for f in frames]
            self._stats["shm_frames_received"] += len(m.shm_sizes)
        try:
            kind, msg_id, meta = wire.decode_header(m.header)
        except wire.MalformedMessage:
            self._stats["bad_frames_dropped"] += 1
            return None
        return kind, msg_id, meta, frames

    def on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now if this is the loop's thread, else soon on it."""
        if self._host.on_loop_thread():
            fn()
        else:
            self.call_soon(fn)

    # ------------------------------------------------------------------ own reads (a caller's thread)
    def read_until(self, ch: Channel, done: Callable[[], bool], timeout: float | None) -> None:
        """NOTE [Own reads]: on a caller's thread, read ``ch`` until ``done()`` (its answer
        arrived), a message for the loop arrived, or ``timeout`` (at most OWN_READ_LIMIT)
        passed; without the token (the loop reads ``ch`` now), return at once."""
        sock = ch.sock
        if sock is None or not ch.claim_read():
            return
        fd = sock.fileno()
        self.poller.mute(fd)
        handed = False
        try:
            handed = self._read_own(ch, sock, done, timeout)
        finally:
            if not handed:
                ch.release_read(lambda: self.poller.unmute(fd))

    def _read_own(self, ch: Channel, sock: Any, done: Callable[[], bool], timeout: float | None) -> bool:
        """True: the token went to the loop with the messages handed to it."""
        limit = OWN_READ_LIMIT if timeout is None or timeout <= 0 else min(timeout, OWN_READ_LIMIT)
        start = _now()
        end = start + limit
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        host = self._host
        self._stats["own_reads"] += 1
        spin = self.spin
        if spin and ch.spin_skip:
            ch.spin_skip -= 1
            spin = 0.0
        elif spin and ch.last_wait <= STRETCH_MAX:  # (7): the answer is due about as late as the last
            spin = max(spin, STRETCH * ch.last_wait)
        while not done() and ch.state is UP and not host.closing:
            left = end - _now()
            if left <= 0:
                ch.last_wait = _now() - start  # (7): no answer within the bound: no stretch next time
                return False
            if spin:  # (7): one spin per wait, before its first sleep
                caught = spin_poll(ch, lambda: poll.poll(0), min(spin, left), self._stats, "own_read_spin")
                spin = 0.0
                if not caught:
                    continue
            elif not poll.poll(max(1, int(min(left, OWN_READ_SLICE) * 1000))):
                continue
            msgs: list[unix_wire.Incoming] = []
            try:
                ch.read_some(msgs)
            except ChannelLost as e:
                cause = str(e)
                self.call_soon(lambda: host.channel_lost(ch, cause))
                return False
            except unix_wire.ProtocolError as e:
                why = e.cause()
                self.call_soon(lambda: host.close_connection(ch, why, True))
                return False
            for i, m in enumerate(msgs):
                got = self._decode(ch, m)
                if got is None:
                    continue
                if got[0] not in _OWN_KINDS:  # (3): this one and the rest go to the loop, with the token
                    rest = [got] + [g for g in map(lambda m: self._decode(ch, m), msgs[i + 1:]) if g is not None]
                    self._stats["own_reads_handed"] += 1
                    self.call_soon(lambda: self._dispatch_handed(ch, rest))
                    return True
                if ch.state is UP:
                    self.dispatch(ch, *got)
        if done():
            ch.last_wait = _now() - start
        return False

    def _dispatch_handed(self, ch: Channel, items: list) -> None:
        """The loop: what a caller's own read handed on (NOTE [Own reads] (3)), in order; then
        the token goes back and the socket is watched again."""
        try:
            for got in items:
                if ch.state is not UP:
                    self._stats["fenced_dropped"] += 1
                    continue
                self.dispatch(ch, *got)
        finally:
            sock = ch.sock
            ch.release_read((lambda: self.poller.unmute(sock.fileno())) if sock is not None else None)

    def dispatch(self, ch: Channel | None, kind: int, msg_id: int, meta: Any, frames: list) -> None:
        """One message from ``ch`` (None: from ourselves), on the loop's thread."""
        self._n_msgs += kind >= wire.FIRST_APP_KIND or kind == wire.RESPONSE
        if kind >= wire.FIRST_APP_KIND:
            try:
                self._on_message(ch.id if ch is not None else self._id, kind, msg_id, meta, frames)
            except Exception:
                log.exception("on_message failed")
        elif kind == wire.RESPONSE:
            table = ch.pending if ch is not None else self._self_pending
            p = table.pop(msg_id, None)
            if p is None:
                self._stats["late_responses_dropped"] += 1
                return
            if p.bucket:
                self.timers.disarm(p, msg_id)
            try:
                p.finish(meta, frames, None)
            except Exception:
                log.exception("on_done failed")
        elif kind == wire.PING:
            pass
        elif ch is None:
            self._stats["bad_frames_dropped"] += 1
        elif kind == unix_wire.SHM_FORGET and type(meta) is list:
            for seg in meta:
                if type(seg) is int:
                    ch.forget_segment(seg)
        elif kind == unix_wire.BYE:
            ch.bye = True
        elif kind == unix_wire.CLOSE:  # it read a protocol error from us, or it abandoned the plane
            why = meta[0] if type(meta) is list and len(meta) == 1 and isinstance(meta[0], str) else "?"
            self._host.close_connection(ch, f"it closed the connection: {why:.300}", False)
        else:
            self._stats["bad_frames_dropped"] += 1

    # ------------------------------------------------------------------ shared memory
    def forget(self, forget: list[tuple[int, int]]) -> None:
        """Tell each peer which of our segments it must unmap (the pool destroyed them)."""
        by_peer: dict[int, list[int]] = {}
        for pid, seg in forget:
            by_peer.setdefault(pid, []).append(seg)
        for pid, segs in by_peer.items():
            ch = self._channels.get(pid)
            if ch is not None and ch.state is UP:
                ch.write(unix_wire.encode(unix_wire.SHM_FORGET, 0, segs, ()))

    def run_calls(self) -> None:
        """Run what was handed to the loop and not run yet (the loop ended: by its thread)."""
        calls = self._calls
        while calls:
            guard(calls.popleft())

    def close(self) -> None:
        self.poller.close()
        self.bell.close()

