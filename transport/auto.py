"""The composite transport: same-host peers over AF_UNIX, the others over a TCP stream or an inner one.

Owns: the choice, per peer, of the path a message takes, and the merging of what the two
transports report. Registered as ``"auto"``.

Rules:

1. The inner transport does everything it did alone: it binds, joins the whole group first
   (joining stays with it), and carries traffic to peers on other hosts and to ourselves.
2. A peer is reached over the unix transport iff both of us published a ``"unix"`` endpoint
   with the same ``"unix-host"`` key (same kernel, mount namespace and uid). Both sides
   decide from the same published addresses, so they agree: a request and its response
   always travel on the same transport. ``TransportConfig.same_host=False``,
   ``extra["same_host"]=False`` or the environment variable ``RREFRT_SAME_HOST=0`` publish
   no unix endpoint, which turns the same-host path off for every pair involving us.
3. Liveness: a peer is dead as soon as either transport says so (the unix one sees a killed
   process at once, by EOF); ``on_peer_dead`` is reported once per peer, and the unix path
   fences a peer the inner transport declared dead, and the inner transport declares - and
   spreads to every member, as its own verdicts - a death the unix path saw first (an EOF
   from a connection admitted under a member's identity must not make this worker alone
   hold that member dead). Silence is judged by the inner
   transport alone (which, with lazy connections, watches a peer from its first contact:
   the first message to or from it over the unix path asks it to, ``watch``): zmq's echo
   is answered by libzmq without the GIL, so a handler that holds
   the GIL or deadlocks is not taken for a death (found 2026-11-30: the unix transport's
   Python-level pings declared such a worker dead after heartbeat_timeout), while a stopped
   or partitioned process falls silent on both.
5. A response goes back on the transport its request came in on, whatever the routing of
   new requests says at that moment: the two sides finish their joins at different times,
   so a request may arrive over zmq when the answer would be routed over unix (or the other
   way), and a response on the other transport matches no pending request and is lost
   (found 2026-11-30: calls between some pairs timed out right after init). A request that
   arrived over unix reaches the runtime with ``LOCAL_TAG`` set in its msg_id (the runtime
   treats msg ids as opaque), and ``respond`` routes by that bit.
7. With lazy connections the same-host plane connects on first use (NOTE [Lazy same-host
   connections] in rrefrt_transport.unix.transport); the higher id of a pair asks the lower
   one to connect with an UNIX_CONNECT message over the inner transport, which this
   transport takes before the runtime sees it; if the lower one cannot make it, it says so
   the same way (UNIX_CONNECT ["failed", plane, cause]) and the higher one gives up its
   waiting messages at once.
8. The tcp stream plane (NOTE [Tcp stream plane] in rrefrt_transport.unix.transport) carries
   the traffic to every peer not reached over the same-host one iff both published a
   ``"stream"`` endpoint: every worker does unless the job has a secret (the plane does not
   encrypt; zmq's CURVE does), ``extra["stream"]`` is False or ``RREFRT_TCP_STREAM=0``. Both
   sides decide from the published addresses alone, as in Rule 2 (a peer that could be
   reached over the same-host plane never goes over the stream plane, whether or not its
   same-host join succeeded). It connects lazily (Rule 7, the inner transport carrying
   UNIX_CONNECT ["stream"]); its requests are tagged ``STREAM_TAG`` (Rule 5); a closed
   connection (a protocol error, an EOF or a reset without BYE) sends that peer through
   the inner transport from then on (Rule 6); silence is judged by the inner transport
   (Rule 3). So the inner transport carries the join, liveness and what the planes do not.
4. If the unix join fails for a reason other than authentication (the socket path is not
   reachable from the peer, e.g. another mount namespace), the whole group falls back to the
   inner transport for this worker after logging why; an authentication failure fails the
   join (a same-host stranger is refused exactly as a CURVE one would be).
6. A same-host connection closed after a protocol error (NOTE [Protocol errors] in
   rrefrt_transport.unix.transport) is not a death: that peer goes through the inner transport from then on,
   and only the inner transport's liveness (which spreads its verdicts to every member)
   judges it. So no frame on one connection can make one member alone hold a peer dead.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from rrefrt_transport import wire
from rrefrt_transport.base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, Transport, TransportConfig, create, register
from rrefrt_transport.errors import AuthenticationFailed, TransportError
from rrefrt_transport.unix.transport import UnixTransport
from rrefrt_transport.unix.admit import host_key

log = logging.getLogger("rrefrt.transport")

#: Rule 5: set in the msg_id of a request that arrived over the same-host path
LOCAL_TAG = 1 << 62
#: Rule 5: set in the msg_id of a request that arrived over the tcp stream plane (Rule 8)
STREAM_TAG = 1 << 61


def _tagging(on_message: OnMessage, tag: int = LOCAL_TAG) -> OnMessage:
    def tagged(src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        on_message(src, kind, msg_id | tag if msg_id else 0, meta, frames)

    return tagged


def _on(value: Any) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def stream_enabled(config: TransportConfig) -> bool:
    """Rule 8: the tcp stream plane is used unless the job has a secret (its traffic would
    not be encrypted: zmq's CURVE carries it), ``extra["stream"]`` is False or
    RREFRT_TCP_STREAM=0."""
    return (
        config.secret is None
        and _on(config.extra.get("stream", True))
        and _on(os.environ.get("RREFRT_TCP_STREAM", "1"))
    )


def same_host_enabled(config: TransportConfig) -> bool:
    return (
        config.same_host
        and bool(config.extra.get("same_host", True))
        and os.environ.get("RREFRT_SAME_HOST", "1").strip().lower() not in ("0", "false", "no", "off")
    )


class AutoTransport:
    """The ``Transport`` of transport/base.py that picks a path per peer (module docstring)."""

    def __init__(self, config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> None:
        self.id, self.name = config.worker_id, config.name
        self._on_peer_dead = on_peer_dead
        self._dead: set[int] = set()
        self._dead_lock = threading.Lock()
        inner_kind = str(config.extra.get("auto_inner", "zmq"))
        if inner_kind == "auto":
            raise ValueError("the inner transport of 'auto' cannot be 'auto'")
        self._on_message = on_message
        self.inner: Transport = create(dataclasses.replace(config, kind=inner_kind), self._inner_message, self._died)
        self.local: UnixTransport | None = (
            UnixTransport(config, _tagging(on_message), self._died) if same_host_enabled(config) else None
        )
        if self.local is not None:
            self._wire(self.local, self._path_closed, self._ask_connect)
        self._local_ids: frozenset[int] = frozenset()
        #: Rule 8: the tcp stream plane, for the peers not reached over the same-host one
        # always lazy, also with RREFRT_CONNECT=eager: a pair that cannot reach each other's
        # port then costs that pair alone, never the join
        self.stream: UnixTransport | None = (
            UnixTransport(dataclasses.replace(config, connect="lazy"), _tagging(on_message, STREAM_TAG), self._died,
                          plane="stream")
            if stream_enabled(config) else None
        )
        if self.stream is not None:
            self._wire(self.stream, self._stream_closed, self._ask_stream_connect)
        self._stream_ids: frozenset[int] = frozenset()
        self._closed_streams: set[int] = set()
        #: peers whose same-host connection was closed after a protocol error (Rule 6): never
        #: routed locally again, also when that happened before the join returned
        self._closed_paths: set[int] = set()
        self._hook: Any = None
        #: Rule 3: peers whose liveness the inner transport was asked to watch
        self._watched: set[int] = set()

    def _wire(self, plane: UnixTransport, on_closed: Callable[[int, str], None],
              ask: Callable[[int], None]) -> None:
        """Connect a plane's reports to this transport (Rules 3, 6, 7)."""
        plane.judge_silence = False  # Rule 3: silence is judged by the inner transport's echo
        plane.on_closed = on_closed
        plane.on_verdict = self._spread
        plane.on_connect_wanted = ask
        plane.on_connect_failed = lambda peer, cause: self._tell_failed(peer, plane.key, cause)

    # ------------------------------------------------------------------ setup
    def listen(self) -> PeerAddress:
        addr = self.inner.listen()
        endpoints = dict(addr.endpoints)
        for plane in (self.local, self.stream):
            if plane is not None:
                endpoints.update(plane.listen().endpoints)
        return PeerAddress(addr.host, endpoints)

    def start(self) -> None:
        """The tcp stream plane starts at the join, and only if some peer is reached over it
        (``_join_stream``)."""
        self.inner.start()
        if self.local is not None:
            self.local.start()

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.inner.connect_peers(peers, timeout)
        key = host_key()
        local = [
            p for p in peers
            if p.id != self.id and p.address.endpoints.get("unix-host") == key and "unix" in p.address.endpoints
        ] if self.local is not None else []
        if self.stream is not None:
            near = {p.id for p in local}  # decided from published addresses alone, as the peer decides
            self._join_stream([p for p in peers if p.id != self.id and p.id not in near
                               and "stream" in p.address.endpoints], deadline)
        if not local or self.local is None:
            return
        try:
            self.local.connect_peers(local, max(1.0, deadline - time.monotonic()))
        except AuthenticationFailed:
            raise
        except TransportError as e:
            log.warning("worker %r: the same-host data plane is not used (%s); every peer goes through %s",
                        self.name, e, type(self.inner).__name__)
            self.local.abandon(f"its same-host join failed: {e}", 1.0)
            self.local = None
            return
        with self._dead_lock:
            self._local_ids = frozenset(p.id for p in local) - self._closed_paths

    def _join_stream(self, remote: list[PeerSpec], deadline: float) -> None:
        """Rule 8: join the tcp stream plane with ``remote`` (lazily: nothing is connected yet).
        With no peer to reach over it (every one on this host: a one-node job) it closes, so
        that no thread serves it and its port listens no more (no peer routes to us over it:
        each decides from the same published addresses)."""
        stream = self.stream
        if stream is None:
            return
        if not remote:
            stream.close(0.5)
            self.stream = None
            return
        stream.start()
        try:
            stream.connect_peers(remote, max(1.0, deadline - time.monotonic()))
        except AuthenticationFailed:
            raise
        except TransportError as e:
            log.warning("worker %r: the tcp stream plane is not used (%s); peers on other hosts go through %s",
                        self.name, e, type(self.inner).__name__)
            stream.abandon(f"its tcp stream join failed: {e}", 1.0)
            self.stream = None
            return
        with self._dead_lock:
            self._stream_ids = frozenset(p.id for p in remote) - self._closed_streams

    def add_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Dynamic groups: peers met after the join go through the inner transport only
        (the same-host and tcp stream planes are formed once, at the join;
        docs/dynamic-groups.md)."""
        ids = {p.id for p in peers}
        with self._dead_lock:
            self._dead.difference_update(ids)  # a departed id may come back
            self._local_ids = self._local_ids - ids
            self._stream_ids = self._stream_ids - ids
        self.inner.add_peers(peers, timeout)

    def remove_peer(self, peer_id: int, cause: str) -> None:
        """Dynamic groups: both paths drop ``peer_id``; ``on_peer_dead`` runs once (``_died``)."""
        if self.local is not None and peer_id in self._local_ids:
            self.local.remove_peer(peer_id, cause)
        if self.stream is not None and peer_id in self._stream_ids:
            self.stream.remove_peer(peer_id, cause)
        self.inner.remove_peer(peer_id, cause)

    # ------------------------------------------------------------------ lazy same-host connections
    def _ask_connect(self, peer_id: int) -> None:
        """The unix path has a message for the lower ``peer_id`` and no connection: ask it,
        over the inner transport, to connect (NOTE [Lazy same-host connections])."""
        self.inner.send(peer_id, wire.UNIX_CONNECT, None)

    def _ask_stream_connect(self, peer_id: int) -> None:
        """The same for the tcp stream plane (Rule 8)."""
        self.inner.send(peer_id, wire.UNIX_CONNECT, "stream")

    def _tell_failed(self, peer_id: int, plane: str, cause: str) -> None:
        """Rule 7: the connection a (higher) peer asked us for could not be made; it gives up
        its side now rather than at its CONNECT_TIMEOUT."""
        try:
            self.inner.send(peer_id, wire.UNIX_CONNECT, ["failed", plane, cause[:500]])
        except TransportError as e:  # closed, or the peer gone: its own bound holds
            log.info("worker %r could not tell worker %r its %s connection failed: %s", self.name, peer_id, plane, e)

    def _inner_message(self, src: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any]) -> None:
        if kind == wire.UNIX_CONNECT:
            failed = type(meta) is list and len(meta) == 3 and meta[0] == "failed" and isinstance(meta[2], str)
            which = "stream" if (meta[1] if failed else meta) == "stream" else "unix"
            plane = self.stream if which == "stream" else self.local
            if plane is None:
                if not failed:  # closed here (its join failed): the asker gives up now, not at its timeout
                    self._tell_failed(src, which, f"worker {self.name!r} has no {which} plane")
                return
            if failed:
                plane.connect_failed(src, meta[2])
            else:
                plane.connect_wanted(src)
            return
        self._on_message(src, kind, msg_id, meta, frames)

    # ------------------------------------------------------------------ routing
    def _via(self, dest: int) -> Transport:
        local = self.local
        if local is not None and dest in self._local_ids:
            if dest not in self._watched:
                self._watch(dest)
            return local  # type: ignore[return-value]
        stream = self.stream
        if stream is not None and dest in self._stream_ids:
            if dest not in self._watched:
                self._watch(dest)
            return stream  # type: ignore[return-value]
        return self.inner

    def _watch(self, dest: int) -> None:
        """Rule 3: the inner transport judges the silence of a peer reached over the unix path."""
        self._watched.add(dest)
        watch = getattr(self.inner, "watch", None)
        if watch is not None:
            watch(dest)

    def request(
        self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone, label: str = ""
    ) -> int:
        return self._via(dest).request(dest, kind, meta, frames, timeout, on_done, label)

    def send(self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = "") -> None:
        self._via(dest).send(dest, kind, meta, frames, msg_id, label)

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        """Rule 5: the answer goes back on the transport its request came in on."""
        if msg_id & LOCAL_TAG and self.local is not None:
            if dest not in self._watched:
                self._watch(dest)
            self.local.respond(dest, msg_id & ~LOCAL_TAG, meta, frames, label)
        elif msg_id & STREAM_TAG and self.stream is not None:
            if dest not in self._watched:
                self._watch(dest)
            self.stream.respond(dest, msg_id & ~STREAM_TAG, meta, frames, label)
        else:
            self.inner.respond(dest, msg_id, meta, frames, label)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        (self.local if self.local is not None else self.inner).call_later(delay, fn)

    # ------------------------------------------------------------------ questions
    def _died(self, peer_id: int, cause: str) -> None:
        with self._dead_lock:
            if peer_id in self._dead:
                return
            self._dead.add(peer_id)
        for plane in (self.local, self.stream):  # whoever saw it first, every path fences it
            if plane is not None:
                plane.declare_dead(peer_id, cause)
        self._on_peer_dead(peer_id, cause)

    def _spread(self, peer_id: int, cause: str) -> None:
        """Rule 3: the unix transport judged ``peer_id`` dead on its own evidence (an EOF: the
        process is gone, or a connection that only claimed to be that peer closed); the inner
        transport declares it too and tells every member (NOTE [Membership] in
        rrefrt_transport.zmq.heartbeat), so no worker holds a peer dead alone."""
        declare = getattr(self.inner, "declare_dead", None)
        if declare is not None:
            declare(peer_id, cause)

    def _path_closed(self, peer_id: int, cause: str) -> None:
        """Rule 6: the same-host connection with ``peer_id`` was closed after a protocol
        error; the peer goes through the inner transport from now on (both sides do)."""
        with self._dead_lock:
            self._closed_paths.add(peer_id)
            self._local_ids = self._local_ids - {peer_id}
        log.info("worker %r: worker %r is reached through %s from now on (%s)",
                 self.name, self.inner.peer_name(peer_id), type(self.inner).__name__, cause)

    def _stream_closed(self, peer_id: int, cause: str) -> None:
        """Rules 6 and 8: the tcp stream connection with ``peer_id`` closed (a protocol
        error, a reset, an EOF without BYE); the peer goes through the inner transport from
        now on, whose liveness alone judges it."""
        with self._dead_lock:
            self._closed_streams.add(peer_id)
            self._stream_ids = self._stream_ids - {peer_id}
        log.info("worker %r: worker %r is reached through %s from now on (%s)",
                 self.name, self.inner.peer_name(peer_id), type(self.inner).__name__, cause)

    def read_until(self, dest: int, done: Callable[[], bool], timeout: float | None) -> None:
        """NOTE [Own reads] in transport/unix/receiver.py: only over the same-host path."""
        local = self.local
        if local is not None and dest in self._local_ids:
            local.read_until(dest, done, timeout)
            return
        stream = self.stream
        if stream is not None and dest in self._stream_ids:
            stream.read_until(dest, done, timeout)

    def is_alive(self, peer_id: int) -> bool:
        return peer_id not in self._dead and self._via(peer_id).is_alive(peer_id) and self.inner.is_alive(peer_id)

    def is_local(self, peer_id: int) -> bool:
        return peer_id in self._local_ids or self.inner.is_local(peer_id)

    def uses_same_host_path(self, peer_id: int) -> bool:
        return self.local is not None and peer_id in self._local_ids

    def uses_stream_path(self, peer_id: int) -> bool:
        """Rule 8: ``peer_id`` is reached over the tcp stream plane."""
        return self.stream is not None and peer_id in self._stream_ids

    def dead_peers(self) -> set[int]:
        dead = set(self._dead) | self.inner.dead_peers()
        for plane in (self.local, self.stream):
            if plane is not None:
                dead |= plane.dead_peers()
        return dead

    def peer_name(self, peer_id: int) -> str:
        return self.inner.peer_name(peer_id)

    def pending_per_peer(self) -> dict[str, int]:
        out = collections.Counter(self.inner.pending_per_peer())
        for plane in (self.local, self.stream):
            if plane is not None:
                out.update(plane.pending_per_peer())
        return dict(out)

    @property
    def stats(self) -> collections.Counter:  # type: ignore[override]
        """Both transports' counters added up (a fresh Counter: read it, do not update it)."""
        total = collections.Counter(self.inner.stats)
        for plane in (self.local, self.stream):
            if plane is not None:
                total.update(plane.stats)
        return total

    @property
    def fault_hook(self) -> Any:  # type: ignore[override]
        return self._hook

    @fault_hook.setter
    def fault_hook(self, hook: Any) -> None:
        self._hook = hook
        self.inner.fault_hook = hook
        for plane in (self.local, self.stream):
            if plane is not None:
                plane.fault_hook = hook

    def close(self, timeout: float = 2.0) -> None:
        planes = [p for p in (self.local, self.stream) if p is not None]
        for plane in planes:
            plane.close(timeout / 2 / len(planes))
        self.inner.close(timeout / 2)


register("auto", AutoTransport)
