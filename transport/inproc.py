"""An in-process fake transport for unit tests: several workers in one process, joined by a
hub, with no sockets. Registered as ``"inproc"``.

Owns: ``InprocHub`` (the shared "network": one delivery thread, one timer heap, the members
and who is dead) and ``InprocTransport`` (one worker's end, implementing
``rrefrt_transport.base.Transport``). Imports only the standard library and rrefrt_transport.base /
rrefrt_transport.errors; never zmq, msgpack, torch or rrefrt.

Theory of operation:

1. Every callback - ``on_message``, a request's ``on_done``, ``on_peer_dead``, ``call_later``
   functions - runs on the hub's thread, never on the sender's, as with a real transport's
   I/O thread. A callback that raises is logged; the hub thread goes on.
2. ``meta`` is copied the way msgpack would turn it (tuples become lists), and frames are
   copied to ``bytes`` when sent, so a receiver never shares objects with its sender.
3. ``hub.kill(peer_id)`` simulates the death of a worker: nothing more is delivered to or
   from it, every pending request to it fails with ``PeerUnavailable``, and every other
   member's ``on_peer_dead`` runs (its requests are not failed: the dead worker never runs
   a callback again).
4. ``fault_hook(dest, label)`` (optional, as in transport/agent.py) returns the delays at
   which copies of a message leave: ``[]`` drops it, ``[0.0, 0.0]`` duplicates it.
5. No wait without a deadline: the hub thread waits on its condition for at most the next
   timer or 0.5 s; ``close`` joins it with a timeout.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

from rrefrt_transport.base import OnDone, OnMessage, OnPeerDead, PeerAddress, PeerSpec, TransportConfig, register
from rrefrt_transport.errors import AgentClosed, PeerUnavailable, RequestTimeout

log = logging.getLogger("rrefrt.transport.inproc")

RESPONSE = -1  #: internal kind of a response (never seen by on_message)


def _copy_meta(meta: Any) -> Any:
    """What a msgpack round trip would give: lists for tuples, plain dicts."""
    if isinstance(meta, (list, tuple)):
        return [_copy_meta(x) for x in meta]
    if isinstance(meta, dict):
        return {_copy_meta(k): _copy_meta(v) for k, v in meta.items()}
    return meta


def _copy_frame(f: Any) -> bytes:
    return bytes(f.raw() if hasattr(f, "raw") else memoryview(f))


class InprocHub:
    """The network of one test: members by id, one delivery thread, one timer heap."""

    def __init__(self, name: str = "inproc") -> None:
        self._cond = threading.Condition()
        #: (due, seq, fn): work for the hub thread, due at a monotonic time
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._members: dict[int, InprocTransport] = {}  #: worker id -> its transport
        self._dead: set[int] = set()  #: killed workers (never come back)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-hub", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def transport(self, worker_id: int, name: str, on_message: OnMessage, on_peer_dead: OnPeerDead) -> "InprocTransport":
        t = InprocTransport(self, worker_id, name, on_message, on_peer_dead)
        with self._cond:
            if worker_id in self._members:
                raise ValueError(f"worker id {worker_id} is already a member of this hub")
            self._members[worker_id] = t
        return t

    def kill(self, peer_id: int) -> None:
        """Simulate the death of ``peer_id`` (see the module docstring, 3)."""
        with self._cond:
            if peer_id in self._dead:
                return
            self._dead.add(peer_id)
            victim = self._members.get(peer_id)
            others = [t for pid, t in self._members.items() if pid != peer_id and pid not in self._dead]
        if victim is not None:
            victim._stopped = True

        def announce() -> None:
            for t in others:
                t._peer_died(peer_id, "killed (inproc hub)")

        self.schedule(0.0, announce)

    def is_dead(self, peer_id: int) -> bool:
        return peer_id in self._dead

    def member(self, peer_id: int) -> "InprocTransport | None":
        return self._members.get(peer_id)

    def schedule(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise AgentClosed("the inproc hub is closed")
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay), next(self._seq), fn))
            self._cond.notify()

    def close(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ hub thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        _, _, fn = heapq.heappop(self._heap)
                        break
                    wait = min(0.5, self._heap[0][0] - now) if self._heap else 0.5
                    self._cond.wait(wait)
            try:
                fn()
            except Exception:
                log.exception("inproc callback raised")
            del fn


class InprocTransport:
    """One worker's end of an ``InprocHub`` (implements rrefrt_transport.base.Transport)."""

    def __init__(self, hub: InprocHub, worker_id: int, name: str, on_message: OnMessage, on_peer_dead: OnPeerDead) -> None:
        self.hub = hub
        self.id = worker_id
        self.name = name
        self.stats: collections.Counter = collections.Counter()
        self.fault_hook: Any = None
        self._on_message = on_message
        self._on_peer_dead = on_peer_dead
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: msg_id -> (dest, on_done, timeout): requests awaiting their response
        self._pending: dict[int, tuple[int, OnDone, float]] = {}
        self._names: dict[int, str] = {worker_id: name}
        self._dead: set[int] = set()  #: peers this worker was told are dead
        self._closed = False
        self._stopped = False  #: killed: deliver nothing more, run no callback

    # ------------------------------------------------------------------ set-up
    def listen(self) -> PeerAddress:
        return PeerAddress("inproc", {"inproc": f"inproc://{self.id}"})

    def start(self) -> None:
        return None

    def connect_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        for p in peers:
            self._names[p.id] = p.name

    def add_peers(self, peers: Sequence[PeerSpec], timeout: float) -> None:
        """Dynamic groups: a peer met later (a departed id comes back as a new member)."""
        for p in peers:
            self._names[p.id] = p.name
            self._dead.discard(p.id)

    def remove_peer(self, peer_id: int, cause: str) -> None:
        """Dynamic groups: ``peer_id`` left; its pending requests fail (on the hub thread)."""
        try:
            self.hub.schedule(0.0, lambda: self._peer_died(peer_id, cause))
        except AgentClosed:
            pass

    # ------------------------------------------------------------------ sending
    def request(self, dest: int, kind: int, meta: Any, frames: Sequence[Any], timeout: float, on_done: OnDone,
                label: str = "") -> int:
        self._check_usable()
        msg_id = next(self._ids)
        with self._lock:
            self._pending[msg_id] = (dest, on_done, timeout)
        if timeout > 0:
            self.hub.schedule(timeout, lambda: self._expire(msg_id))
        if dest in self._dead or self.hub.is_dead(dest) and dest != self.id:
            self.hub.schedule(0.0, lambda: self._fail(msg_id, PeerUnavailable(self.peer_name(dest), "declared dead")))
            return msg_id
        self._post(dest, kind, msg_id, meta, frames, label)
        return msg_id

    def send(self, dest: int, kind: int, meta: Any, frames: Sequence[Any] = (), msg_id: int = 0, label: str = "") -> None:
        self._check_usable()
        self._post(dest, kind, msg_id, meta, frames, label)

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any] = (), label: str = "") -> None:
        self._check_usable()
        self._post(dest, RESPONSE, msg_id, meta, frames, label)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.hub.schedule(delay, lambda: None if self._stopped or self._closed else fn())

    def read_until(self, dest: int, done: Callable[[], bool], timeout: float | None) -> None:
        """No own reads here: the caller waits for its future."""

    def _post(self, dest: int, kind: int, msg_id: int, meta: Any, frames: Sequence[Any], label: str) -> None:
        meta, frames = _copy_meta(meta), [_copy_frame(f) for f in frames]
        delays = [0.0]
        hook = self.fault_hook
        if hook is not None:
            delays = hook(dest, label)
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += sum(len(f) for f in frames)
        src = self.id
        for d in delays:
            self.hub.schedule(d, lambda: self._arrive(src, dest, kind, msg_id, meta, frames))

    def _arrive(self, src: int, dest: int, kind: int, msg_id: int, meta: Any, frames: list) -> None:
        """Hub thread: hand a message to ``dest``, unless either end is dead or closed."""
        if self._stopped or self.hub.is_dead(src):
            return
        target = self.hub.member(dest)
        if target is None or target._stopped or target._closed or self.hub.is_dead(dest):
            return
        target.stats["messages_received"] += 1
        target.stats["bytes_received"] += sum(len(f) for f in frames)
        if kind == RESPONSE:
            with target._lock:
                entry = target._pending.pop(msg_id, None)
            if entry is None:
                target.stats["late_responses_dropped"] += 1
                return
            entry[1](meta, frames, None)
        else:
            target._on_message(src, kind, msg_id, meta, frames)

    # ------------------------------------------------------------------ failures (hub thread)
    def _fail(self, msg_id: int, err: BaseException) -> None:
        with self._lock:
            entry = self._pending.pop(msg_id, None)
        if entry is not None and not self._stopped:
            entry[1](None, (), err)

    def _expire(self, msg_id: int) -> None:
        with self._lock:
            entry = self._pending.get(msg_id)
        if entry is None:
            return
        self.stats["requests_timed_out"] += 1
        self._fail(msg_id, RequestTimeout(self.peer_name(entry[0]), entry[2]))

    def _peer_died(self, peer: int, cause: str) -> None:
        if self._stopped or self._closed or peer in self._dead:
            return
        self._dead.add(peer)
        self.stats["peers_declared_dead"] += 1
        with self._lock:
            lost = [mid for mid, (dest, _, _) in self._pending.items() if dest == peer]
        err = PeerUnavailable(self.peer_name(peer), cause)
        for mid in lost:
            try:
                self._fail(mid, err)
            except Exception:
                log.exception("on_done raised")
        self._on_peer_dead(peer, cause)

    # ------------------------------------------------------------------ questions
    def is_alive(self, peer_id: int) -> bool:
        if peer_id == self.id:
            return not self._closed and not self._stopped
        return peer_id in self._names and peer_id not in self._dead

    def is_local(self, peer_id: int) -> bool:
        return True

    def dead_peers(self) -> set[int]:
        return set(self._dead)

    def peer_name(self, peer_id: int) -> str:
        return self._names.get(peer_id, f"<worker {peer_id}>")

    def pending_per_peer(self) -> dict[str, int]:
        with self._lock:
            counts = collections.Counter(self.peer_name(d) for d, _, _ in self._pending.values())
        return {self.peer_name(p): counts.get(self.peer_name(p), 0) for p in self._names if p != self.id}

    def _check_usable(self) -> None:
        if self._closed or self._stopped:
            raise AgentClosed(f"the transport of worker {self.name!r} is closed")

    def close(self, timeout: float = 2.0) -> None:
        """Fail every pending request (on the hub thread); never hangs."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        err = AgentClosed(f"the transport of worker {self.name!r} is closed")

        def fail_all() -> None:
            for _, on_done, _ in pending:
                try:
                    on_done(None, (), err)
                except Exception:
                    log.exception("on_done raised during close")

        try:
            self.hub.schedule(0.0, fail_all)
        except AgentClosed:
            fail_all()


def _factory(config: TransportConfig, on_message: OnMessage, on_peer_dead: OnPeerDead) -> InprocTransport:
    """``rrefrt_transport.base.create`` entry: the hub is ``config.extra["hub"]`` (required: a
    test owns its hub and closes it; there is no process-wide one)."""
    hub = config.extra.get("hub")
    if not isinstance(hub, InprocHub):
        raise ValueError('the inproc transport needs TransportConfig(extra={"hub": InprocHub()})')
    return hub.transport(config.worker_id, config.name, on_message, on_peer_dead)


register("inproc", _factory)
