"""The receiver loop of the same-host transport (Rule 2 of ``rrefrt_transport.unix.transport``):
one thread per process waits on every peer socket, the listening socket, admissions and
the bell; reads whole messages and dispatches each on this thread (no hand-off on
receipt); runs the timers; returns shared-memory segments.

Thread roles: ``serve`` runs on the thread that leads the loop (NOTE [Inline calls] in
``rrefrt_transport.unix.lead``: the lead may pass to a standby thread); ``call_soon`` and
``released`` may be called from any thread and ring the bell; everything else runs on the
leading thread.
"""

from __future__ import annotations

import collections
import logging
from time import monotonic as _now
from typing import Any, Protocol

from rrefrt_transport import wire
from rrefrt_transport.base import OnMessage
from rrefrt_transport.unix import shm
from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.unix.channel import UP, Channel, ChannelLost
from rrefrt_transport.unix.lead import Leadership
from rrefrt_transport.unix.poller import READ, WRITE, Bell, Poller
from rrefrt_transport.unix.timers import Pending, Timers, guard

log = logging.getLogger("rrefrt.transport")

_READS_PER_WAKE = 64
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
        pool: shm.SegmentPool,
        lead: Leadership,
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
        self._pool = pool
        self.lead = lead
        self._stats = stats
        self._shm_copy_out = shm_copy_out
        self.poller = Poller()
        self.bell = bell
        self.poller.register(self.bell.fd, READ, BELL)
        self._calls: collections.deque = collections.deque()  #: functions to run on the loop
        self._releases: collections.deque = collections.deque()  #: (peer id, segment id) from finalizers
        self._watch_needed = False
        self.n_received = 0

    # ------------------------------------------------------------------ any thread
    def call_soon(self, fn: Any) -> None:
        """Run ``fn`` on the loop's thread, soon."""
        self._calls.append(fn)
        self.bell.ring()

    def want_write(self) -> None:
        """A channel waits for EVENT_WRITE: the loop watches for it at its next turn."""
        self._watch_needed = True
        self.bell.ring()

    def released(self, peer_id: int, seg_id: int) -> None:
        """A finalizer: the last view of a segment's frames went; the loop tells its sender."""
        if not self._host.closing:
            self._releases.append((peer_id, seg_id))
            self.bell.ring()

    # ------------------------------------------------------------------ the loop
    def serve(self) -> bool:
        """Run the loop on the leading thread until the transport closes (True, shut down)
        or the lead passed to the standby while this thread ran an inline call (False: the
        loop's state is the new leader's now)."""
        lead, host, poller, timers = self.lead, self._host, self.poller, self.timers
        closed = True
        due = timers.next_due()
        try:
            while not host.closing:
                # ``due`` was taken with the timers' planned wake, at the end of the last
                # iteration (after its timers ran): one lock round trip per wake
                timeout = due - _now()
                if timeout < 0.0:
                    timeout = 0.0
                if self._calls or self._releases or lead.queue:
                    timeout = 0.0
                for fd, data, events in poller.poll(timeout):
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
                            self._read(data)
                calls = self._calls
                while calls:
                    guard(calls.popleft())
                if self._releases:
                    self._send_releases()
                if self._watch_needed:
                    self.watch_writes()
                due = timers.run_due()
                if lead.queue and not lead.run_queued():  # at a consistent point only
                    closed = False
                    return False
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("receiver thread of %r crashed", self.name)
        finally:
            if closed:
                host.shutdown()
        return True

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
        dispatch every complete message on this thread."""
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
                self._host.close_connection(ch, f"it broke the same-host framing ({e})", True)
                return
            for m in msgs:
                if ch.state is not UP:
                    self._stats["fenced_dropped"] += 1
                    continue
                self._incoming(ch, m)
            if drained:
                return

    def _incoming(self, ch: Channel, m: unix_wire.Incoming) -> None:
        self.n_received += 1
        frames = m.frames
        if m.shm_sizes:
            try:
                mapping = ch.map_segment(m.seg_id, m.fd_attached)
            except (IndexError, KeyError, OSError, ValueError):  # NOTE [Protocol errors] in rrefrt_transport.unix.transport
                self._host.close_connection(ch, f"it named shared-memory segment {m.seg_id} it never sent", True)
                return
            pid, seg_id = ch.id, m.seg_id
            release = lambda: self.released(pid, seg_id)  # noqa: E731
            mapped = iter(shm.frames_of(mapping, m.shm_sizes, release, self._shm_copy_out))
            frames = [f if f is not None else next(mapped) for f in frames]
            self._stats["shm_frames_received"] += len(m.shm_sizes)
        try:
            kind, msg_id, meta = wire.decode_header(m.header)
        except wire.MalformedMessage:
            self._stats["bad_frames_dropped"] += 1
            return
        self.dispatch(ch, kind, msg_id, meta, frames)

    def dispatch(self, ch: Channel | None, kind: int, msg_id: int, meta: Any, frames: list) -> None:
        """One message from ``ch`` (None: from ourselves), on the loop's thread."""
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
        elif kind == unix_wire.SHM_RELEASE and type(meta) is list:
            forget: list[tuple[int, int]] = []
            for seg in meta:
                if type(seg) is int:
                    forget += self._pool.release(seg, ch.id)
            self.forget(forget)
        elif kind == unix_wire.SHM_FORGET and type(meta) is list:
            for seg in meta:
                if type(seg) is int:
                    ch.forget_segment(seg)
        elif kind == unix_wire.BYE:
            ch.bye = True
        elif kind == unix_wire.CLOSE:  # it read a protocol error from us
            why = meta[0] if type(meta) is list and len(meta) == 1 and isinstance(meta[0], str) else "?"
            self._host.close_connection(ch, f"it closed the connection after a protocol error ({why:.200})", False)
        else:
            self._stats["bad_frames_dropped"] += 1

    # ------------------------------------------------------------------ shared memory
    def _send_releases(self) -> None:
        by_peer: dict[int, list[int]] = {}
        while self._releases:
            pid, seg = self._releases.popleft()
            by_peer.setdefault(pid, []).append(seg)
        for pid, segs in by_peer.items():
            ch = self._channels.get(pid)
            if ch is not None and ch.state is UP:
                ch.write(unix_wire.encode(unix_wire.SHM_RELEASE, 0, segs, ()))
        self.watch_writes()

    def forget(self, forget: list[tuple[int, int]]) -> None:
        """Tell each peer which of our segments it must unmap (the pool destroyed them)."""
        by_peer: dict[int, list[int]] = {}
        for pid, seg in forget:
            by_peer.setdefault(pid, []).append(seg)
        for pid, segs in by_peer.items():
            ch = self._channels.get(pid)
            if ch is not None and ch.state is UP:
                ch.write(unix_wire.encode(unix_wire.SHM_FORGET, 0, segs, ()))

    def close(self) -> None:
        self.poller.close()
        self.bell.close()

