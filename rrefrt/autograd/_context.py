"""Distributed autograd contexts: the per-worker state of every context this worker takes
part in, and nothing else (no I/O, no autograd computation).

Owns: ``AutogradContext`` (send edges, receive edges, their send/recv functions, accumulated
gradients, peers) and the ``Registry`` of live contexts of one runtime (and of the backward
passes running on it). Imports torch (tensors are the payload) and
``rrefrt.state`` only to find the current runtime; it must not import the API, the runtime
internals or the engine.

Rules (each one is checked by ``Registry.validate()``):

Rule 1: a context id is ``(worker id << 48) | n``: unique in the group without
coordination; the worker that opened it (its *initiator*) is ``id >> 48``.
Rule 2: a context exists on a worker from the first call that carries it (or its
``with context()``) until a release for it arrives (or the block exits); it is never
recreated by a gradient message - only a forward call or ``context()`` creates one - nor
by a forward call that arrives after its release (the last ``_TOMBSTONES`` released ids
are remembered; such a call fails with AutogradContextError instead of leaking a context).
Rule 3: a send edge ``e`` of context ``c`` on worker ``w`` is a tensor ``w`` sent (as a call
argument or result) that required grad; its id is unique on ``w``. The tensor, and so its
autograd graph, stays alive until ``c`` is released on ``w``.
Rule 3b: the tensors of one message that require grad go through one *send function*
(``SendRpcBackward``, a node whose next functions are those tensors' grad_fns); a send edge
is one output of it. ``send_functions`` maps the message id to that node (torch's
``_send_functions()``), until release.
Rule 4: a receive edge is a leaf tensor this worker built from a received tensor, paired
with the (peer, edge id) of the peer's send edge: the gradient reaching that leaf in a local
pass is sent to the peer for that send edge. The tensors of one received message that
required grad on their sender come out of one *recv function* (``RecvRpcBackward``, whose
inputs are those leaves); the program gets its outputs, so ``tensor.grad_fn`` is that node
(torch's ``_recv_functions()``).
Rule 5: ``peers`` holds every worker this context exchanged a call with on this worker; a
release is forwarded to each of them (a worker without the context ignores it), so every
worker that took part is reached.
Rule 6: gradients of ordinary leaves are summed into ``grads`` (never into ``.grad``);
``get_gradients`` returns a snapshot.
Rule 7: the registry's lock guards its maps only; no send, wait, autograd work or tensor
destructor runs under it (a released context is popped under the lock and dropped after).
"""

from __future__ import annotations

import collections
import itertools
import pickle
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from rrefrt import state
from rrefrt.errors import RpcError

__all__ = ["AutogradContext", "AutogradContextError", "DistBackwardError", "Registry", "registry", "RecvEdge", "unknown_context"]

_CTX_BITS = 48
_TOMBSTONES = 4096


class AutogradContextError(RpcError):
    """A distributed autograd context is unknown here (never opened, or already released),
    or was used in a way its rules forbid."""


class DistBackwardError(RpcError):
    """The autograd computation of a distributed backward failed on a worker (a backward
    function raised). The message starts with torch's ``Error on Node <worker id>: <the
    original message>``; ``original`` is the exception raised there (None where it could
    not travel) and, on that worker, also ``__cause__``. Failures of the RPC layer itself (a
    dead worker, a timeout) keep their own types (``WorkerUnavailableError``, ...)."""

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original

    def __reduce__(self) -> Any:
        original = self.original
        if original is not None:
            try:
                pickle.loads(pickle.dumps(original))
            except Exception:
                original = None
        return (type(self), (self.args[0], original))


def unknown_context(context_id: int, worker: str) -> AutogradContextError:
    """The error for a context id this worker does not have (torch's phrase first)."""
    return AutogradContextError(
        f"Could not find autograd context with id: {context_id} on worker {worker!r}: the context is not known "
        "here; it was never opened here or was already released (use it inside its `with context()` block)"
    )


@dataclass(frozen=True)
class RecvEdge:
    """A leaf built from a received tensor and the send edge it came from (Rule 4)."""

    leaf: torch.Tensor
    peer: int  #: worker id that sent the tensor
    edge_id: int  #: that worker's send edge id


@dataclass(eq=False)
class AutogradContext:
    context_id: int
    #: send edge id -> tensor sent from here that required grad (Rule 3); until release
    sends: dict[int, torch.Tensor] = field(default_factory=dict)
    #: id(leaf) -> receive edge for that leaf (Rule 4); until release
    recvs: dict[int, RecvEdge] = field(default_factory=dict)
    #: id(leaf) -> (leaf, summed gradient) of ordinary leaves (Rule 6); until release
    grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: worker ids this context exchanged calls with on this worker (Rule 5)
    peers: set[int] = field(default_factory=set)
    #: message id -> SendRpcBackward node of the message's tensors (Rule 3b); until release
    send_functions: dict[int, Any] = field(default_factory=dict)
    #: message key -> RecvRpcBackward node of a received message (Rule 4); until release
    recv_functions: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def initiator(self) -> int:
        return self.context_id >> _CTX_BITS

    # torch.distributed.autograd.DistAutogradContext's introspection, same names and meaning
    def _context_id(self) -> int:
        """This context's id."""
        return self.context_id

    def _send_functions(self) -> dict[int, Any]:
        """{message id: SendRpcBackward node} of the messages this worker sent in this
        context with tensors that require grad, in the order they were sent."""
        with self.lock:
            return dict(self.send_functions)

    def _recv_functions(self) -> dict[int, Any]:
        """{message id: RecvRpcBackward node} of the messages this worker received in this
        context with tensors that required grad on their sender, in the order received."""
        with self.lock:
            return dict(self.recv_functions)

    def _known_worker_ids(self) -> set[int]:
        """Ids of the workers this context exchanged calls with on this worker."""
        with self.lock:
            return set(self.peers)

    def add_send_function(self, message_id: int, node: Any, peer: int) -> None:
        with self.lock:
            self.send_functions[message_id] = node
            self.peers.add(peer)

    def add_recv_function(self, message_key: int, node: Any) -> None:
        with self.lock:
            self.recv_functions[message_key] = node

    def add_send(self, edge_id: int, tensor: torch.Tensor, peer: int) -> None:
        with self.lock:
            self.sends[edge_id] = tensor
            self.peers.add(peer)

    def add_recv(self, leaf: torch.Tensor, peer: int, edge_id: int) -> None:
        with self.lock:
            self.recvs[id(leaf)] = RecvEdge(leaf, peer, edge_id)
            self.peers.add(peer)

    def add_peer(self, peer: int) -> None:
        with self.lock:
            self.peers.add(peer)

    def send_tensor(self, edge_id: int, worker: str) -> torch.Tensor:
        with self.lock:
            t = self.sends.get(edge_id)
        if t is None:
            raise AutogradContextError(
                f"worker {worker!r} has no send edge {edge_id} in autograd context {self.context_id}: "
                "was the context released while its backward ran?"
            )
        return t

    def recv_edge(self, leaf: torch.Tensor) -> RecvEdge | None:
        with self.lock:
            r = self.recvs.get(id(leaf))
        return r if r is not None and r.leaf is leaf else None

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            old = self.grads.get(id(leaf))
            self.grads[id(leaf)] = (leaf, grad if old is None else old[1] + grad)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return {leaf: g for leaf, g in self.grads.values()}

    def validate(self) -> None:
        with self.lock:
            for key, r in self.recvs.items():
                assert key == id(r.leaf) and r.leaf.requires_grad and r.leaf.grad_fn is None, r
                assert r.peer in self.peers, (r, self.peers)
            for key, (leaf, g) in self.grads.items():
                assert key == id(leaf) and g.shape == leaf.shape, (leaf, g)


class Registry:
    """The live contexts of one runtime (one worker)."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self._lock = threading.Lock()
        #: context id -> context, from its creation (Rule 2) until its release
        self._contexts: dict[int, AutogradContext] = {}
        #: ids of recently released contexts, oldest first (Rule 2); at most _TOMBSTONES
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: context id -> number of backward passes of it running on this worker now (a
        #: ``backward()`` call here, or a gradient message being processed); 0s are removed
        self._passes: dict[int, int] = {}
        #: context id -> queue of the thread running ``backward()`` of it on this worker,
        #: from that call's start until its end (see NOTE [The root runs its own passes])
        self._roots: dict[int, queue.SimpleQueue[Any]] = {}
        self._next_ctx = itertools.count(1)
        self._next_edge = itertools.count(1)

    def attach_root(self, context_id: int, q: "queue.SimpleQueue[Any]") -> bool:
        """Make ``q`` the queue of the backward of ``context_id`` running here; False if
        another thread's backward of it already has one."""
        with self._lock:
            if context_id in self._roots:
                return False
            self._roots[context_id] = q
            return True

    def detach_root(self, context_id: int) -> None:
        with self._lock:
            self._roots.pop(context_id, None)

    def offer_root(self, context_id: int, item: Any) -> bool:
        """Hand ``item`` to the backward of ``context_id`` running here, if there is one
        (atomic with ``detach_root``: an item handed over is always seen by that thread)."""
        with self._lock:
            q = self._roots.get(context_id)
            if q is None:
                return False
            q.put(item)
            return True

    def new_context_id(self) -> int:
        return (self.worker_id << _CTX_BITS) | next(self._next_ctx)

    def max_id(self) -> int:
        """The largest context id this worker can open (torch's ``_get_max_id``)."""
        return (self.worker_id << _CTX_BITS) | ((1 << _CTX_BITS) - 1)

    def begin_pass(self, context_id: int) -> None:
        with self._lock:
            self._passes[context_id] = self._passes.get(context_id, 0) + 1

    def end_pass(self, context_id: int) -> None:
        with self._lock:
            n = self._passes.get(context_id, 0) - 1
            if n > 0:
                self._passes[context_id] = n
            else:
                self._passes.pop(context_id, None)

    def debug_info(self) -> dict[str, str]:
        """torch's ``_get_debug_info``: contexts with a backward running here, live contexts."""
        with self._lock:
            return {
                "num_current_backward_passes": str(len(self._passes)),
                "num_autograd_contexts": str(len(self._contexts)),
            }

    def new_edge_id(self) -> int:
        return next(self._next_edge)

    def create(self, context_id: int) -> AutogradContext:
        with self._lock:
            if context_id in self._contexts:
                raise AutogradContextError(f"autograd context {context_id} already exists on worker {self.worker_id}")
            ctx = self._contexts[context_id] = AutogradContext(context_id)
            return ctx

    def get_or_create(self, context_id: int) -> AutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                if context_id in self._released:
                    raise AutogradContextError(
                        f"autograd context {context_id} was already released on worker {self.worker_id}: "
                        "a call made inside it arrived after its `with context()` block ended"
                    )
                ctx = self._contexts[context_id] = AutogradContext(context_id)
            return ctx

    def get(self, context_id: int) -> AutogradContext | None:
        with self._lock:
            return self._contexts.get(context_id)

    def pop(self, context_id: int) -> AutogradContext | None:
        """Remove a context; the caller drops it after this returns (Rule 7)."""
        with self._lock:
            self._released[context_id] = None
            while len(self._released) > _TOMBSTONES:
                self._released.popitem(last=False)
            return self._contexts.pop(context_id, None)

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self._contexts)

    def validate(self) -> None:
        with self._lock:
            items = list(self._contexts.items())
        for cid, ctx in items:
            assert cid == ctx.context_id
            ctx.validate()


_registries: "weakref.WeakKeyDictionary[Any, Registry]" = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def registry() -> Registry:
    """The registry of the current runtime (state hangs off the runtime, not the process:
    a new ``init_rpc`` starts with no contexts)."""
    rt = state.current()
    with _registries_lock:
        reg = _registries.get(rt)
        if reg is None:
            reg = _registries[rt] = Registry(rt.info.id)
        return reg
