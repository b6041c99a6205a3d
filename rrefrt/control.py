"""The control loop: the one thread that owns the RRef protocol actions and their retries.

Owns: the control queue and its typed items, the control thread, the performance of every
action the RRef context returns, and the retry policy of protocol messages (NOTE
[Retries]). Imports from rrefrt: errors, messages, rref_context (types only). It reaches
the runtime it serves through the ``rt`` it is given (no module state).

Rule 1: user code never runs on the control thread: no unpickling of payloads, no pickling
        of values, no value destructors. Work that may run user code is handed to the
        callback pool (its home in the table below); only ids and records are handled here.
Rule 2: the control thread never waits except on its own queue (bounded ``get``), so a pool
        full of blocked nested calls cannot stall the protocol.

Home threads (each action or item kind runs on exactly one kind of thread):

    what                                 home            why there
    ForkRequest / ChildAccept /          control         protocol sends; retried from here
      UserDelete / RemoteRet (send)
    Retry (an ack timed out)             control         NOTE [Retries]
    Incoming Fetch / ForkRequest /       control         protocol state (RRef context)
      ChildAccept / UserDelete
    Dropped (an RRef's __del__)          control         G1 bookkeeping only
    Acked (final ack of a request)       control
    CreationSettled / CreationLost       control         see rrefrt/creation.py
    PeerDied                             control         G3
    ServeFetch                           callback pool   pickles the value (__reduce__)
    Release                              callback pool   the value's __del__ may run
    error payload of a RemoteRet /       callback pool   unpickles a user exception, then
      PYTHON_REMOTE answer                                 CreationSettled to control

Any thread may call ``perform(actions)``: on the control thread it runs at once, elsewhere
it enqueues a ``Perform`` item.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import transport

from .errors import RpcError
from .ids import ForkId
from .messages import (
    Action,
    ChildAccept,
    Fetch,
    ForkRequest,
    Message,
    Release,
    RemoteRet,
    ServeFetch,
    UserDelete,
)

log = logging.getLogger("rrefrt")


# ---------------------------------------------------------------------------- control items
@dataclass(frozen=True, slots=True)
class Incoming:
    """A protocol message that arrived (decoded once, on the I/O thread)."""

    src: int
    msg_id: int
    msg: Message


@dataclass(frozen=True, slots=True)
class Perform:
    """Actions returned by the RRef context on another thread. The list is emptied as it
    is performed, so no reference to a released value stays behind here (Rule 1)."""

    actions: list = field(compare=False)


@dataclass(frozen=True, slots=True)
class Dropped:
    """The Python object of a user fork went away."""

    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class Acked:
    """The final outcome of a protocol request: acknowledged (``error`` None), or not."""

    msg: Message
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Retry:
    """A protocol request's ack did not come in time: send it again (NOTE [Retries])."""

    msg: Message
    attempt: int
    on_ack: Callable[[Any], None] = field(compare=False)
    on_reply: Callable[[Any, Sequence[Any]], None] | None = field(default=None, compare=False)
    frames: tuple = ()


@dataclass(frozen=True, slots=True)
class CreationSettled:
    """A remote() made here got its result from the owner (``error`` None: a value)."""

    fork_id: ForkId
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class CreationLost:
    """A remote() made here was never acknowledged by ``dest``."""

    fork_id: ForkId
    dest: int


@dataclass(frozen=True, slots=True)
class PeerDied:
    peer: int


@dataclass(frozen=True, slots=True)
class Sync:
    """Sets ``event`` once every item enqueued before it was handled."""

    event: threading.Event = field(compare=False)


ControlItem = Incoming | Perform | Dropped | Acked | Retry | CreationSettled | CreationLost | PeerDied | Sync


def _ignore_ack(err: Any) -> None:
    return None


class ControlLoop:
    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.queue: queue.SimpleQueue[ControlItem] = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-{rt.info.name}-control", daemon=True)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Incoming: self._on_incoming,
            Perform: lambda item: self._perform(item.actions),
            Dropped: lambda item: self._perform(self.rt.ctx.user_dropped(item.fork_id)),
            Acked: self._on_acked,
            Retry: lambda item: self.request(item.msg, item.on_ack, item.frames, item.attempt, item.on_reply),
            CreationSettled: lambda item: self._perform(self.rt.ctx.on_remote_ret(item.fork_id, item.error)),
            CreationLost: lambda item: self.rt.creation.on_lost(item.fork_id, item.dest),
            PeerDied: lambda item: self._perform(self.rt.ctx.on_peer_dead(item.peer)),
            Sync: lambda item: item.event.set(),
        }

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def put(self, item: ControlItem) -> None:
        self.queue.put(item)

    def on_control_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def perform(self, actions: list[Action]) -> None:
        if not actions:
            return
        if self.on_control_thread():
            self._perform(actions)
        else:
            self.queue.put(Perform(actions))

    def sync(self, deadline: float) -> bool:
        """Wait (bounded) until everything enqueued so far is handled."""
        if self.on_control_thread():
            return True
        ev = threading.Event()
        self.queue.put(Sync(ev))
        return ev.wait(max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float = 2.0) -> None:
        self._stop = True
        self.queue.put(Sync(threading.Event()))
        if self._thread.ident is not None and not self.on_control_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ control thread
    def _run(self) -> None:
        q = self.queue
        while not self._stop:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._handlers[type(item)](item)
            except Exception:
                log.exception("control item %s failed on worker %r", type(item).__name__, self.rt.info.name)
            del item

    def _on_incoming(self, item: Incoming) -> None:
        rt, ctx, msg, src = self.rt, self.rt.ctx, item.msg, item.src
        if isinstance(msg, Fetch):
            sf = ctx.on_fetch(msg.rref_id, src, item.msg_id)
            if sf is not None:
                self._perform([sf])
            return
        if isinstance(msg, ForkRequest):
            ctx.on_fork_request(msg.rref_id, msg.fork_id, src)
            actions: list[Action] = []
        elif isinstance(msg, ChildAccept):
            actions = ctx.on_child_accept(msg.fork_id)
        elif isinstance(msg, UserDelete):
            actions = ctx.on_user_delete(msg.rref_id, msg.fork_id)
        else:
            raise TypeError(f"{type(msg).__name__} is not handled by the control thread")
        rt.callee.ack(src, item.msg_id, msg)
        self._perform(actions)

    def _on_acked(self, item: Acked) -> None:
        msg, err, ctx = item.msg, item.error, self.rt.ctx
        if isinstance(msg, ForkRequest):
            if err is None:
                self._perform(ctx.on_fork_request_ack(msg.fork_id))
            elif isinstance(err, transport.RequestTimeout):  # retries exhausted
                ctx.give_up_user(msg.fork_id, RpcError(f"the owner never confirmed fork {msg.fork_id} of this RRef"))
        elif isinstance(msg, UserDelete):
            # acknowledged, or never (retries exhausted: the owner will report the leak), or
            # the owner died: either way this worker is done with the fork
            ctx.on_user_delete_ack(msg.fork_id)

    def _perform(self, actions: list[Action]) -> None:
        """On the control thread: send protocol messages, hand the rest to their homes.
        Empties ``actions`` as it goes.

        NOTE [Release home]: a ``Release`` may hold the last reference to a value, whose
        destructor is user code. The slot in ``actions`` is cleared and the record goes to
        the callback pool in a one-element box that the pool empties; the control thread
        keeps only the box, so the record's last reference goes on the pool."""
        for i in range(len(actions)):
            a = actions[i]
            actions[i] = None  # type: ignore[call-overload]
            try:
                if isinstance(a, (ForkRequest, UserDelete)):
                    self.request(a, lambda e, m=a: self.queue.put(Acked(m, e)))
                elif isinstance(a, (ChildAccept, RemoteRet)):
                    self.request(a, _ignore_ack, a.payload if isinstance(a, RemoteRet) else ())
                elif isinstance(a, ServeFetch):
                    self.rt.callbacks.submit(self.rt.callee.serve_fetch, a)
                elif isinstance(a, Release):
                    # the value's destructor must run on the callback pool: hand over the
                    # only reference held here, then forget it (NOTE [Release home])
                    box = [a.record]
                    del a
                    self.rt.callbacks.submit(box.clear)
                    continue
            except transport.AgentClosed:
                log.debug("protocol message %r not sent: transport closed", a)
            except RuntimeError as e:  # a stopped pool at close
                log.debug("action %r dropped: %s", a, e)
            del a

    def request(
        self, msg: Message, on_ack: Callable[[Any], None], frames: Sequence[Any] = (), attempt: int = 1,
        on_reply: Callable[[Any, Sequence[Any]], None] | None = None,
    ) -> None:
        """Send a protocol message and retry it until acknowledged. On the control thread,
        except the first attempt of a remote() (the caller's thread, so it can raise).

        NOTE [Retries]: a control message whose ack does not come within
        ``rt.control_retry_interval`` is sent again (``rt.control_attempts`` times at most);
        the receivers' handlers are idempotent, and deleted forks leave tombstones, so a
        duplicate or late retry changes nothing. A dead peer stops the retries (G3 cleans
        up). The transport's callback only enqueues the retry: it is sent from here.
        """
        rt = self.rt
        frames = tuple(frames)

        def done(meta: Any, fr: Sequence[Any], err: Any) -> None:  # transport thread
            if isinstance(err, transport.RequestTimeout) and attempt < rt.control_attempts and not rt.closed:
                rt.stats["control_retries"] += 1
                self.queue.put(Retry(msg, attempt + 1, on_ack, on_reply, frames))
                return
            if isinstance(err, transport.RequestTimeout):
                log.error("%s to worker %r was never acknowledged after %d attempts", msg.NAME,
                          rt.worker_name(msg.dest), attempt)
            if err is None and on_reply is not None:
                on_reply(meta, fr)
            on_ack(err)

        try:
            rt.transport.request(msg.dest, msg.KIND, msg.meta(), frames, rt.control_retry_interval, done, msg.NAME)
        except transport.TransportError as e:
            if attempt == 1:
                raise
            on_ack(e)
