"""Distributed autograd engine: recording calls made inside a context, the distributed
backward pass, and the release of contexts on every worker that took part.

Owns: the wire markers (``_Edge``, the ``_Traced`` trampoline), the local backward pass,
and the handlers ``_on_grads`` / ``_on_release`` that peers call. Imports torch, the public
rrefrt API (``rrefrt.rpc_async``, futures, errors) and ``_context``/``_hooks``; it must not
import rrefrt's runtime internals (the call path reaches it only through ``_hooks``).

NOTE [Recording a call]: inside ``with context() as cid`` the API hands every call to
``wrap_call``. The tensor arguments that require grad go through one ``SendRpcBackward``
node (the message's *send function*, whose next functions are their grad_fns, as torch
records it); each of its outputs is registered as a *send edge* on the caller (it keeps the
caller's graph alive, Rule 3) and the tensor travels as ``_Edge(edge_id, message id,
tensor.detach())``. ``func`` travels wrapped in ``_Traced(cid, caller, func)``; on the
callee it opens (or joins) context ``cid``, turns each ``_Edge`` into a fresh leaf that
requires grad, recorded as a *receive edge* (peer, edge id), and hands the program the
outputs of one ``RecvRpcBackward`` node over those leaves (the message's *recv function*:
a received tensor's grad_fn, as in torch); it runs ``func`` with ``cid`` current on its
thread (so nested calls are recorded too), and treats its result the same way in reverse:
result tensors that require grad become send edges on the callee and receive edges on the
caller (``unwrap_result``). ``remote()`` records its arguments; its result stays on the
owner with its graph intact. Both nodes are identities in backward; they carry torch's
names (``torch::distributed::autograd::SendRpcBackward`` / ``RecvRpcBackward``), so graph
inspection (``_send_functions()``, ``next_functions``) and the profiler read as in torch.

NOTE [Backward, FAST mode]: ``backward(cid, roots)`` runs a *local pass* from the roots:
one ``torch.autograd.grad`` over this worker's graph (the engine counts dependencies
inside it, so each local node runs once per pass) with respect to every leaf reachable
from the roots. Gradients of ordinary leaves are summed into the context; a gradient that
reaches a receive edge is sent, batched per peer, to the peer that sent the tensor
(``_on_grads``), which runs a local pass from the matching send edges and continues the
same way. Each ``_on_grads`` answers only when its whole downstream part has answered, so
the root's wait ends exactly when every worker's part is done, and any failure on the way
(a remote error, a dead worker, a timeout) travels back up the chain as a typed error.
A worker reached along several edges runs one pass per gradient message; by linearity the
sums are those of a single-process backward. Local passes retain the graph (a later
message may pass through the same nodes); the graph is freed when the context is released.
As torch's engine, a pass runs the post hooks of the ``AccumulateGrad`` node of each leaf
it reaches (the node itself does not run: ``.grad`` is never touched), and stores a leaf's
first gradient without a copy when nothing else can hold it (a dense contiguous tensor that
owns its storage, or a sparse one with contiguous indices and values, not shared with
another leaf of the pass); otherwise it stores a copy. An exception raised by the autograd
computation on a worker becomes ``DistBackwardError('Error on Node <id>: ...')``.

NOTE [The root runs its own passes]: while ``backward(cid)`` runs on a thread, gradient
messages for ``cid`` that reach this worker are handed to that thread (``offer_root``)
instead of running on the RPC thread that received them, as torch's engine runs a
context's work on the graph task that owns it: the whole backward of the root's part runs
on the caller's thread, so the profiler there records the SendRpcBackward nodes too. The
thread waits on its queue, woken by each message and by the end of the backward; after it
detaches it runs whatever was handed over before (detach and hand-over share a lock).

NOTE [Release]: when ``with context()`` exits, the context is popped here and a release is
sent to every peer it exchanged calls with; each peer pops its own and forwards to its
peers (a worker that no longer has it answers at once). The exit waits, bounded by the rpc
timeout, for that tree to answer; failures (a dead peer) are logged, not raised.
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

import rrefrt
from rrefrt.errors import ArgumentError, RpcError
from rrefrt.functions import async_execution
from rrefrt.futures import Future

from rrefrt import hooks as _hooks
from rrefrt.autograd._context import AutogradContext, AutogradContextError, DistBackwardError, registry, unknown_context

log = logging.getLogger("rrefrt.autograd")

__all__ = [
    "context", "backward", "get_gradients", "wrap_call", "current_context", "retrieve_context", "new_context",
    "release_context", "rref_backward",
]


# ---------------------------------------------------------------------------- wire markers
class _Edge:
    """A tensor that required grad on its sender, travelling with the sender's edge id and
    the id of the message (its send function) it belongs to."""

    __slots__ = ("edge_id", "message_id", "tensor")

    def __init__(self, edge_id: int, message_id: int, tensor: torch.Tensor) -> None:
        self.edge_id, self.message_id, self.tensor = edge_id, message_id, tensor

    def __reduce__(self) -> Any:
        return (_Edge, (self.edge_id, self.message_id, self.tensor))


class _SendRpcBackward(torch.autograd.Function):
    """The send function of a message: forward aliases the tensors (no copy), backward
    passes the gradients a peer sent for them into this worker's graph."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


class _RecvRpcBackward(torch.autograd.Function):
    """The recv function of a message: its inputs are the receive-edge leaves, its outputs
    the tensors the program gets; backward passes their gradients to the leaves."""

    @staticmethod
    def forward(ctx: Any, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def _torch_node_name(fn: type, name: str) -> None:
    """Give a Function's backward node torch's C++ name (what ``node.name()`` and the
    profiler report)."""
    node_cls: Any = getattr(fn, "_backward_cls")
    node_cls.__name__ = node_cls.__qualname__ = name


_torch_node_name(_SendRpcBackward, "torch::distributed::autograd::SendRpcBackward")
_torch_node_name(_RecvRpcBackward, "torch::distributed::autograd::RecvRpcBackward")


class _Traced:
    """The callee side of a recorded call (see NOTE [Recording a call])."""

    __slots__ = ("context_id", "src", "func", "wrap_result")

    def __init__(self, context_id: int, src: int, func: Callable[..., Any], wrap_result: bool) -> None:
        self.context_id, self.src, self.func, self.wrap_result = context_id, src, func, wrap_result

    def __reduce__(self) -> Any:
        return (_Traced, (self.context_id, self.src, self.func, self.wrap_result))

    @property
    def _rrefrt_async_execution(self) -> bool:  # the runtime asks the callable it runs
        return bool(getattr(self.func, "_rrefrt_async_execution", False))

    def __repr__(self) -> str:
        name = getattr(self.func, "__qualname__", None) or repr(self.func)
        return f"{name} (in autograd context {self.context_id})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = registry().get_or_create(self.context_id)
        ctx.add_peer(self.src)
        args, kwargs = _receive(ctx, (args, kwargs), self.src)
        prev = _hooks.set_current(self.context_id)
        try:
            result = self.func(*args, **kwargs)
        finally:
            _hooks.set_current(prev)
        if not self.wrap_result:
            return result
        src = self.src
        if self._rrefrt_async_execution:
            if hasattr(result, "then"):  # rrefrt's or torch's Future
                return result.then(lambda f: _send_out(ctx, f.wait(), src))
            if isinstance(result, concurrent.futures.Future):
                out: Future[Any] = Future()
                result.add_done_callback(lambda f: _complete(out, lambda: _send_out(ctx, f.result(), src)))
                return out
        if inspect.iscoroutine(result):
            return _after(result, lambda v: _send_out(ctx, v, src))
        return _send_out(ctx, result, src)


def _complete(fut: Future[Any], fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:
        fut.set_exception(e)


async def _after(coro: Any, fn: Callable[[Any], Any]) -> Any:
    return fn(await coro)


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every item of its lists, tuples and dicts (nested);
    containers without a change are returned as they are."""
    t = type(obj)
    if t is list or t is tuple or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        items = [_map(x, fn) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if t is list:
            return items
        return t(items) if t is tuple else t(*items)
    if t is dict:
        out = {k: _map(v, fn) for k, v in obj.items()}
        return obj if all(out[k] is v for k, v in obj.items()) else out
    return fn(obj)


def _needs_grad(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and o.requires_grad


def _find(obj: Any, pred: Callable[[Any], bool]) -> list[Any]:
    """The items of ``obj`` (nested lists, tuples, dicts) for which ``pred`` holds, in
    ``_map``'s order."""
    found: list[Any] = []

    def visit(o: Any) -> Any:
        if pred(o):
            found.append(o)
        return o

    _map(obj, visit)
    return found


def _send_out(ctx: AutogradContext, obj: Any, peer: int) -> Any:
    """One message to ``peer``: its tensors that require grad go through one send function
    and become send edges (Rule 3b); they travel as ``_Edge``s."""
    tensors = _find(obj, _needs_grad)
    if not tensors:
        return obj
    reg = registry()
    outs = _SendRpcBackward.apply(*tensors)
    message_id = reg.new_edge_id()
    ctx.add_send_function(message_id, outs[0].grad_fn, peer)
    edges = []
    for t, out in zip(tensors, outs):
        eid = reg.new_edge_id()
        ctx.add_send(eid, out, peer)
        edges.append(_Edge(eid, message_id, t.detach()))
    it = iter(edges)
    return _map(obj, lambda o: next(it) if _needs_grad(o) else o)


def _receive(ctx: AutogradContext, obj: Any, peer: int) -> Any:
    """One message from ``peer``: each ``_Edge`` becomes a leaf recorded as a receive edge,
    and the program gets the outputs of one recv function over those leaves (as torch's,
    its received tensors have a grad_fn, so in-place operations on them are allowed)."""
    edges = _find(obj, lambda o: isinstance(o, _Edge))
    if not edges:
        return obj
    leaves = [e.tensor.detach().requires_grad_(True) for e in edges]
    outs = _RecvRpcBackward.apply(*leaves)
    for e, leaf in zip(edges, leaves):
        ctx.add_recv(leaf, peer, e.edge_id)
    ctx.add_recv_function((peer << 48) | edges[0].message_id, outs[0].grad_fn)
    it = iter(outs)
    return _map(obj, lambda o: next(it) if isinstance(o, _Edge) else o)


def _worker_id(to: Any) -> int:
    if isinstance(to, rrefrt.WorkerInfo):
        return to.id
    if isinstance(to, int):
        return to
    return rrefrt.get_worker_info(to).id


def wrap_call(
    context_id: int, dest: Any, func: Callable[..., Any], args: Any, kwargs: Any, remote: bool
) -> tuple[Callable[..., Any], tuple, dict, Callable[[Any], Any]]:
    """See ``_hooks.wrap_call``."""
    ctx = _known(context_id)
    peer = _worker_id(dest)
    ctx.add_peer(peer)
    args, kwargs = _send_out(ctx, (tuple(args) if args is not None else (), dict(kwargs) if kwargs is not None else {}), peer)
    traced = _Traced(context_id, rrefrt.get_worker_info().id, func, not remote)
    if remote:
        return traced, args, kwargs, _identity
    return traced, args, kwargs, lambda result: _receive(ctx, result, peer)


def _identity(x: Any) -> Any:
    return x


# ---------------------------------------------------------------------------- contexts
def _known(context_id: int) -> AutogradContext:
    ctx = registry().get(context_id)
    if ctx is None:
        raise unknown_context(context_id, rrefrt.get_worker_info().name)
    return ctx


def new_context() -> AutogradContext:
    """Open a context and make it this thread's (torch's ``_new_context``)."""
    if _hooks.active():
        raise AutogradContextError(
            f"Already have an autograd context id for this thread: context {_hooks.current_context_id()} is "
            "active here; distributed autograd contexts do not nest (leave its `with context()` block first)"
        )
    reg = registry()
    ctx = reg.create(reg.new_context_id())
    _hooks.set_current(ctx.context_id)
    return ctx


def current_context() -> AutogradContext:
    """This thread's context (torch's ``_current_context``)."""
    cid = _hooks.current_context_id()
    if cid is None:
        raise AutogradContextError(
            "Current thread doesn't have a valid autograd context. Please wrap your code using: "
            "`with torch.distributed.autograd.context() as context_id` (rrefrt.autograd.context()) "
            "to generate a valid context"
        )
    return _known(cid)


def retrieve_context(context_id: int) -> AutogradContext:
    """The context ``context_id`` on this worker (torch's ``_retrieve_context``)."""
    return _known(context_id)


def release_context(context_id: int) -> None:
    """Release ``context_id`` here and on every worker it reached (torch's
    ``_release_context``); waits for that, bounded by the rpc timeout."""
    _known(context_id)
    if _hooks.current_context_id() == context_id:
        _hooks.set_current(None)
    fut = _release(context_id)
    limit = _limit()
    try:
        fut.result(limit)
    except Exception as e:  # a dead or slow peer: its copy goes with it
        log.warning("release of autograd context %d did not complete everywhere: %s", context_id, e)


class context:
    """``with context() as context_id:`` - every rpc_sync/rpc_async/remote made on this
    thread inside the block records its tensors for a distributed backward; on exit the
    context is released on every worker that took part."""

    def __init__(self) -> None:
        self._id: int | None = None

    def __enter__(self) -> int:
        self._id = new_context().context_id
        return self._id

    def __exit__(self, *exc: Any) -> None:
        assert self._id is not None
        if _hooks.current_context_id() == self._id:
            _hooks.set_current(None)
        if registry().get(self._id) is not None:  # not released already (``_release_context``)
            release_context(self._id)


def _limit() -> float:
    t = rrefrt.get_rpc_timeout()
    return t + 5.0 if t > 0 else 3600.0


def _release(context_id: int) -> Future[Any]:
    ctx = registry().pop(context_id)
    if ctx is None:
        return _done(None)
    me = rrefrt.get_worker_info().id
    peers = sorted(ctx.peers - {me})
    del ctx  # its tensors and graph go here, outside every lock (Rule 7)
    futs = [_call(p, _on_release, (context_id,)) for p in peers]
    out: Future[Any] = Future()

    def settled(_: Any) -> None:
        for p, f in zip(peers, futs):
            if f.exception() is not None:
                log.warning("autograd context %d: release on worker %d failed: %s", context_id, p, f.exception())
        out.set_result(None)

    rrefrt.futures.collect_all(futs).add_done_callback(settled)
    return out


@async_execution
def _on_release(context_id: int) -> Future[Any]:
    return _release(context_id)


def _call(peer: int, fn: Callable[..., Any], args: tuple) -> Future[Any]:
    """An engine call (not recorded); a synchronous failure becomes a failed Future."""
    try:
        with _hooks.suspended():
            return rrefrt.rpc_async(peer, fn, args=args)
    except Exception as e:
        return _failed(e)


def _done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_exception(exc)
    return f


def _all(futs: Sequence[Future[Any]]) -> Future[Any]:
    """Done when every future succeeded; fails with the first error as soon as it occurs."""
    out: Future[Any] = Future()
    if not futs:
        out.set_result(None)
        return out
    remaining = [len(futs)]
    lock = threading.Lock()

    def one(f: Future[Any]) -> None:
        err = f.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if out.done():
            return
        try:
            if err is not None:
                out.set_exception(err)
            elif last:
                out.set_result(None)
        except Exception:  # lost a race with another callback: the first outcome stands
            pass

    for f in futs:
        f.add_done_callback(one)
    return out


# ---------------------------------------------------------------------------- backward
def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """{leaf tensor: gradient} accumulated on this worker in the context."""
    return _known(context_id).gradients()


def _check_roots(roots: Sequence[Any]) -> list[torch.Tensor]:
    """torch's checks of the roots of a distributed backward, with its phrases."""
    roots = list(roots)
    if not roots:
        raise ArgumentError("No tensors provided for gradient computation: backward() needs at least one root tensor")
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise ArgumentError(f"root {i} is not a tensor but {type(r).__name__}: backward() needs scalar tensors")
        if not r.requires_grad:
            raise ArgumentError(f"requires_grad not set on root {i}: it has no graph to differentiate")
        if r.numel() != 1:
            raise ArgumentError(
                f"root {i} has {r.numel()} elements: it is not a scalar, all roots need to be scalar "
                "(the roots of a distributed backward must be scalars)"
            )
        if r.grad_fn is None:
            raise ArgumentError(
                f"root {i} is a leaf tensor: it does not have a valid gradient function "
                "(a root must be computed from the tensors to differentiate)"
            )
    return roots


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars); returns once every
    worker's part is done. Raises the first error of any worker (typed, e.g.
    ``WorkerUnavailableError`` when one died, ``DistBackwardError`` when a backward function
    raised), or ``RpcTimeoutError`` past the rpc timeout."""
    ctx = _known(context_id)
    roots = _check_roots(roots)
    reg = registry()
    t0 = time.monotonic()
    reg.begin_pass(context_id)
    work: queue.SimpleQueue[Any] = queue.SimpleQueue()
    own = reg.attach_root(context_id, work)
    try:
        with torch.autograd.profiler.record_function("torch::distributed::autograd::backward"):
            sends = _local_pass(ctx, [(r, torch.ones_like(r)) for r in roots])
            fut = _send_grads(context_id, sends)
            fut.add_done_callback(lambda _: work.put(None))
            limit = _limit()
            deadline = time.monotonic() + limit
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise rrefrt.RpcTimeoutError(
                        f"distributed backward of autograd context {context_id} from worker "
                        f"{rrefrt.get_worker_info().name!r} did not finish within {limit:.1f}s"
                    )
                try:
                    item = work.get(timeout=left)
                except queue.Empty:
                    continue
                if item is not None:
                    _run_handed(context_id, *item)
            fut.result(0)
    finally:
        if own:
            reg.detach_root(context_id)
            while True:
                try:
                    item = work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _run_handed(context_id, *item)
        reg.end_pass(context_id)
    log.debug("backward of context %d took %.3fs", context_id, time.monotonic() - t0)


def rref_backward(rref: Any, context_id: int, retain_graph: bool) -> None:
    """``RRef.backward``: the RRef's value (a scalar tensor) is the root. With a context id,
    a distributed backward of that context run from the owner; with -1, a local
    ``value.backward()`` on the owner (user RRefs need a context id)."""
    if rref.is_owner():
        _backward_on_owner(rref, context_id, retain_graph)
        return
    if context_id == -1:
        raise ArgumentError(
            f"User RRefs require 'dist_autograd_ctx_id' to be specified: {rref!r} is owned by "
            f"{rref.owner_name()!r}; pass the distributed autograd context id to rref.backward()"
        )
    with _hooks.suspended():
        rrefrt.rpc_sync(rref.owner(), _backward_on_owner, args=(rref, context_id, retain_graph))


def _backward_on_owner(rref: Any, context_id: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(
            f"RRef should contain a tensor for .backward(): {rref!r} holds a {type(value).__name__}"
        )
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        backward(context_id, [value], retain_graph)


def _leaves(outputs: Sequence[torch.Tensor], nodes: dict[int, Any] | None = None) -> list[torch.Tensor]:
    """Every leaf that requires grad reachable from ``outputs`` (outputs that are leaves
    themselves included), each once; ``nodes`` (when given) gets id(leaf) -> its
    AccumulateGrad node, for the leaves reached through one."""
    leaves: list[torch.Tensor] = []
    seen_leaf: set[int] = set()
    seen: set[Any] = set()
    stack: list[Any] = []
    for t in outputs:
        if t.grad_fn is None:
            if t.requires_grad and id(t) not in seen_leaf:
                seen_leaf.add(id(t))
                leaves.append(t)
        else:
            stack.append(t.grad_fn)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:  # AccumulateGrad
            if id(var) not in seen_leaf:
                seen_leaf.add(id(var))
                leaves.append(var)
                if nodes is not None:
                    nodes[id(var)] = fn
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves


def _post_hooks(node: Any) -> list[Callable[..., Any]]:
    """The Python post hooks registered on an AccumulateGrad node (``node.register_hook``).
    torch has no accessor for them; registering a hook returns a handle whose
    ``hooks_dict_ref()`` is the node's dict of hooks."""
    handle = node.register_hook(_no_hook)
    hooks = handle.hooks_dict_ref()
    handle.remove()
    return list(hooks.values()) if hooks is not None else []


def _no_hook(grad_inputs: Any, grad_outputs: Any) -> None:
    return None


def _storage_key(g: torch.Tensor) -> int | None:
    try:
        if g.layout == torch.strided:
            return g.untyped_storage().data_ptr()
        if g.layout == torch.sparse_coo:
            return g._values().untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        pass
    return None


def _stealable(g: torch.Tensor) -> bool:
    """Whether ``g`` can be kept as the context's gradient without a copy (torch's rule:
    nothing else holds it; approximated: it owns its whole storage, laid out densely)."""
    if g.layout == torch.strided:
        return g.is_contiguous() and g.storage_offset() == 0 and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    if g.layout == torch.sparse_coo:
        return g._indices().is_contiguous() and g._values().is_contiguous()
    return False


def _owned(g: torch.Tensor, shared: set[int]) -> torch.Tensor:
    """``g``, or a copy of it where it could be shared (see NOTE [Backward, FAST mode])."""
    key = _storage_key(g)
    if key is not None and key not in shared and _stealable(g):
        return g
    if g.layout == torch.strided:
        return g.clone(memory_format=torch.contiguous_format)
    return g.clone()


def _local_pass(ctx: AutogradContext, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """Backward through this worker's graph from ``pairs`` (tensor, gradient); accumulate
    leaf gradients in ``ctx``; return the gradients to send, per peer: [(edge id, grad)]."""
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t, g in pairs:
        old = merged.get(id(t))
        merged[id(t)] = (t, g if old is None else old[1] + g)
    outs = [t for t, _ in merged.values()]
    grads_out = [g for _, g in merged.values()]
    nodes: dict[int, Any] = {}
    leaves = _leaves(outs, nodes)
    if not leaves:
        return {}
    try:
        grads = torch.autograd.grad(outs, leaves, grads_out, retain_graph=True, allow_unused=True)
    except RpcError:
        raise
    except Exception as e:
        me = rrefrt.get_worker_info()
        raise DistBackwardError(
            f"Error on Node {me.id}: {e} ({type(e).__name__} raised by the autograd computation of the "
            f"distributed backward of context {ctx.context_id} on worker {me.name!r})",
            e,
        ) from e
    sends: dict[int, list[tuple[int, torch.Tensor]]] = {}
    local: list[tuple[torch.Tensor, torch.Tensor]] = []
    for leaf, g in zip(leaves, grads):
        if g is None:
            continue
        edge = ctx.recv_edge(leaf)
        if edge is not None:
            sends.setdefault(edge.peer, []).append((edge.edge_id, g))
        else:
            local.append((leaf, g))
    keys = collections.Counter(_storage_key(g) for _, g in local)
    shared = {k for k, n in keys.items() if n > 1 and k is not None}
    for leaf, g in local:
        ctx.accumulate(leaf, _owned(g, shared))
        node = nodes.get(id(leaf))
        if node is not None:
            for hook in _post_hooks(node):
                hook((), (g,))
    return sends


def _send_grads(context_id: int, sends: dict[int, list[tuple[int, torch.Tensor]]]) -> Future[Any]:
    return _all([_call(peer, _on_grads, (context_id, items)) for peer, items in sends.items()])


def _run_handed(context_id: int, items: list[tuple[int, torch.Tensor]], out: Future[Any]) -> None:
    """Run a gradient message handed to the root's thread; complete ``out`` as
    ``_on_grads`` would have."""
    try:
        ctx = _known(context_id)
        me = rrefrt.get_worker_info().name
        sends = _local_pass(ctx, [(ctx.send_tensor(eid, me), g) for eid, g in items])
        sub = _send_grads(context_id, sends)
    except Exception as e:
        out.set_exception(e)
        return
    sub.add_done_callback(lambda f: _complete(out, f.wait))


@async_execution
def _on_grads(context_id: int, items: list[tuple[int, torch.Tensor]]) -> Future[Any]:
    """Gradients for send edges of this worker: run the local pass from them and pass the
    results on; answers when everything downstream has answered."""
    handed: Future[Any] = Future()
    if registry().offer_root(context_id, (items, handed)):  # NOTE [The root runs its own passes]
        return handed
    ctx = _known(context_id)
    me = rrefrt.get_worker_info().name
    reg = registry()
    reg.begin_pass(context_id)
    try:
        sends = _local_pass(ctx, [(ctx.send_tensor(eid, me), g) for eid, g in items])
        fut = _send_grads(context_id, sends)
    except BaseException:
        reg.end_pass(context_id)
        raise
    fut.add_done_callback(lambda _: reg.end_pass(context_id))
    return fut


_hooks.register_interceptor(wrap_call)  # the call path reaches the engine only through the seam
_hooks.register_backward(rref_backward)
