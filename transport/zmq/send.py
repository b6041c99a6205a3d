"""The send path of the zmq transport: from ``request`` / ``send`` to the data socket.

Owns: the outgoing half of ``ZmqTransport`` (a base class of it, ``SendPath``): the size
and header checks at the sender, the lending of large frames (NOTE [Lent frames] in
``rrefrt_transport.zmq.lend``), a request's registration in its peer's pending table and its
deadline timer, failing one request once, the fault hook (NOTE [Fault injection]), the
per-peer backlog of messages not yet routable, the non-blocking send, and the HELLO
frames. The transport's ``__init__`` sets every attribute this class uses (they are
listed, annotated, in its body); the receive path, liveness, the join and the close
sequence stay in ``rrefrt_transport.zmq.agent``.

Must not import ``rrefrt_transport.zmq.agent`` (it derives from this class), ``rrefrt_transport.zmq.mesh``,
the heartbeat, the echo or the join policy; never rrefrt, never torch.

Rules (those of ``rrefrt_transport.zmq.agent``): ``request`` / ``send`` / ``respond`` run on any
thread and only hand the prepared message to the data loop; every other method runs on
the data loop's thread (Rule 1) and never blocks (Rule 2); every request has a deadline
or is bounded by its peer's death (Rule 3); an oversized message raises MessageTooLarge at
the sender (Rule 5).

NOTE [Fault injection]: tests install ``fault_hook`` to drop, delay, duplicate or reorder
(delay one so later ones overtake) outgoing messages by label. It sits after a request is
registered, so a dropped request still fails at its deadline, exactly like a lost one.
"""

from __future__ import annotations

import collections
import errno
import itertools
import time
from typing import Any, Callable, Sequence

import zmq

from rrefrt_transport.zmq import lend

from rrefrt_transport import wire
from rrefrt_transport.base import OnDone, TransportConfig
from rrefrt_transport.errors import AgentClosed, Fenced, MessageTooLarge, PeerUnavailable, RequestTimeout
from rrefrt_transport.liveness import LivenessTable, PeerState
from rrefrt_transport.zmq.loop import IOLoop
from rrefrt_transport.zmq.records import ZERO_COPY_MIN, Pending as _Pending, Peer as _Peer, nbytes as _nbytes

_NOBLOCK = int(zmq.NOBLOCK)


class SendPath:
    """The outgoing half of ``ZmqTransport`` (see the module docstring)."""

    # set by ZmqTransport.__init__ (the transport's state this class reads or writes)
    config: TransportConfig
    id: int
    name: str
    incarnation: int
    stats: collections.Counter
    fault_hook: Callable[[int, str], list[float]] | None
    table: LivenessTable
    _ids: itertools.count
    _sock: zmq.Socket
    _loop: IOLoop
    _peers: dict[int, _Peer]
    _self_pending: dict[int, _Pending]
    _closing: bool
    _fenced: Fenced | None
    # methods of ZmqTransport used here
    _check_usable: Callable[..., None]
    _schedule: Callable[[Callable[[], None]], None]
    _deliver: Callable[..., None]
    peer_name: Callable[[int], str]
    peer_limit: Callable[[int], int]

    # ------------------------------------------------------------------ API (any thread)
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
        pending = _Pending(dest, msg_id, timeout, on_done)
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
        size = sum(_nbytes(f) for f in frames)
        limit = min(self.config.max_message_size, self.peer_limit(dest))
        if size > limit:
            whose = "" if limit == self.config.max_message_size else f" of worker {self.peer_name(dest)!r}"
            raise MessageTooLarge(f"message of {size} bytes exceeds the limit{whose} of {limit} bytes")

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
    def _fail(self, p: _Pending, err: BaseException) -> None:
        if not p.done:
            p.done = True
            self._loop.guard(p.on_done, "on_done", None, (), err)

    def _issue(self, p: _Pending, frames: list, label: str) -> None:
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
        table = self._peers[p.dest].pending if p.dest != self.id else self._self_pending
        table[p.msg_id] = p
        if p.timeout > 0:
            # the timer holds the id, never the request: a completed request's on_done (and
            # whatever its future holds, a traceback with RRefs, say) must not live on until
            # the deadline
            self._loop.call_later(p.timeout, lambda t=table, m=p.msg_id: self._expire(t, m))
        self._send_faulty(p.dest, frames, label)

    def _expire(self, table: dict[int, _Pending], msg_id: int) -> None:
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
        if peer is None or self.table.state(dest) is PeerState.DEAD:
            self.stats["dropped_to_dead"] += 1
            lend.drop(frames)
            return
        if peer.backlog or not peer.joined or not self._try_send(peer, frames):
            peer.backlog.append(frames)

    def _try_send(self, peer: _Peer, frames: list) -> bool:
        parts = lend.begin(frames) if isinstance(frames, lend.Lent) else None  # NOTE [Lent frames]
        if parts == []:  # its sender gave up on it (lend Rule 3)
            return True
        small = parts is None and all((f.nbytes if isinstance(f, memoryview) else len(f)) < ZERO_COPY_MIN for f in frames)
        size = sum(_nbytes(f) for f in frames)
        try:
            self._sock.send_multipart([peer.rid, *(frames if parts is None else parts)], flags=_NOBLOCK, copy=small)
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

    def _flush_backlog(self, peer: _Peer) -> None:
        while peer.backlog and peer.joined:
            if not self._try_send(peer, peer.backlog[0]):
                return
            peer.backlog.popleft()

    def _hello(self, kind: int) -> list[bytes]:
        return [wire.encode_header(kind, 0, [self.incarnation, self.name, self.config.max_message_size])]
