"""Distributed autograd engine: recording calls made inside a context, the distributed
backward pass, and the release of contexts on every worker that took part.

Owns: the wire markers (``_Edge``, the ``_Traced`` trampoline), the local backward pass,
and the handlers ``_on_grads`` / ``_on_release`` that peers call. Imports torch, the public
rrefrt API (``rrefrt.rpc_async``, futures, errors) and ``_context``/``_hooks``; it must not
import rrefrt's runtime internals (the call path reaches it only through ``_hooks``).

NOTE [Recording a call]: inside ``with context() as cid`` the API hands every call to
``wrap_call``. Each tensor argument that requires grad is registered as a *send edge* on
the caller (it keeps the caller's graph alive, Rule 3) and travels as ``_Edge(edge_id,
tensor.detach())``. ``func`` travels wrapped in ``_Traced(cid, caller, func)``; on the
callee it opens (or joins) context ``cid``, turns each ``_Edge`` into a fresh leaf that
requires grad and records it as a *receive edge* (peer, edge id), runs ``func`` with
``cid`` current on its thread (so nested calls are recorded too), and treats its result
the same way in reverse: result tensors that require grad become send edges on the callee
and receive edges on the caller (``unwrap_result``). ``remote()`` records its arguments;
its result stays on the owner with its graph intact.

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

NOTE [Release]: when ``with context()`` exits, the context is popped here and a release is
sent to every peer it exchanged calls with; each peer pops its own and forwards to its
peers (a worker that no longer has it answers at once). The exit waits, bounded by the rpc
timeout, for that tree to answer; failures (a dead peer) are logged, not raised.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

import rrefrt
from rrefrt.functions import async_execution
from rrefrt.futures import Future

from rrefrt import hooks as _hooks
from rrefrt.autograd._context import AutogradContext, AutogradContextError, registry

log = logging.getLogger("rrefrt.autograd")

__all__ = ["context", "backward", "get_gradients", "wrap_call"]


# ---------------------------------------------------------------------------- wire markers
class _Edge:
    """A tensor that required grad on its sender, travelling with the sender's edge id."""

    __slots__ = ("edge_id", "tensor")

    def __init__(self, edge_id: int, tensor: torch.Tensor) -> None:
        self.edge_id, self.tensor = edge_id, tensor

    def __reduce__(self) -> Any:
        return (_Edge, (self.edge_id, self.tensor))


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
        args = _map(args, lambda o: _receive(ctx, o, self.src))
        kwargs = _map(kwargs, lambda o: _receive(ctx, o, self.src))
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


def _send_out(ctx: AutogradContext, obj: Any, peer: int) -> Any:
    """Register each tensor of ``obj`` that requires grad as a send edge to ``peer``."""

    return _map(obj, lambda o: _send_out_one(ctx, o, peer))


def _receive(ctx: AutogradContext, obj: Any, peer: int) -> Any:
    """Turn each ``_Edge`` from ``peer`` into a leaf recorded as a receive edge; the program
    gets a non-leaf copy of it (as torch's, its received tensors have a grad_fn, so in-place
    operations on them are allowed)."""
    if isinstance(obj, _Edge):
        leaf = obj.tensor.detach().requires_grad_(True)
        ctx.add_recv(leaf, peer, obj.edge_id)
        return leaf.clone()
    return obj


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
    args = _map(tuple(args) if args is not None else (), lambda o: _send_out_one(ctx, o, peer))
    kwargs = _map(dict(kwargs) if kwargs is not None else {}, lambda o: _send_out_one(ctx, o, peer))
    traced = _Traced(context_id, rrefrt.get_worker_info().id, func, not remote)
    if remote:
        return traced, args, kwargs, _identity
    return traced, args, kwargs, lambda result: _map(result, lambda o: _receive(ctx, o, peer))


def _send_out_one(ctx: AutogradContext, o: Any, peer: int) -> Any:
    if isinstance(o, torch.Tensor) and o.requires_grad:
        eid = registry().new_edge_id()
        ctx.add_send(eid, o, peer)
        return _Edge(eid, o.detach())
    return o


def _identity(x: Any) -> Any:
    return x


# ---------------------------------------------------------------------------- contexts
def _known(context_id: int) -> AutogradContext:
    ctx = registry().get(context_id)
    if ctx is None:
        raise AutogradContextError(
            f"autograd context {context_id} is not known on worker {rrefrt.get_worker_info().name!r}: "
            "it was never opened here or was already released (use it inside its `with context()` block)"
        )
    return ctx


class context:
    """``with context() as context_id:`` - every rpc_sync/rpc_async/remote made on this
    thread inside the block records its tensors for a distributed backward; on exit the
    context is released on every worker that took part."""

    def __init__(self) -> None:
        self._id: int | None = None
        self._prev: int | None = None

    def __enter__(self) -> int:
        if _hooks.active():
            raise AutogradContextError(
                f"an autograd context ({_hooks.current_context_id()}) is already active on this thread; "
                "distributed autograd contexts do not nest"
            )
        reg = registry()
        self._id = reg.new_context_id()
        reg.create(self._id)
        self._prev = _hooks.set_current(self._id)
        return self._id

    def __exit__(self, *exc: Any) -> None:
        _hooks.set_current(self._prev)
        assert self._id is not None
        fut = _release(self._id)
        limit = _limit()
        try:
            fut.result(limit)
        except Exception as e:  # a dead or slow peer: its copy goes with it
            log.warning("release of autograd context %d did not complete everywhere: %s", self._id, e)


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


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars); returns once every
    worker's part is done. Raises the first error of any worker (typed, e.g.
    ``WorkerUnavailableError`` when one died), or ``RpcTimeoutError`` past the rpc timeout."""
    ctx = _known(context_id)
    roots = list(roots)
    if not roots:
        raise ValueError("backward() needs at least one root tensor")
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"root {i} is not a tensor: {type(r).__name__}")
        if r.numel() != 1:
            raise RuntimeError(f"root {i} has {r.numel()} elements; the roots of a distributed backward must be scalars")
        if not r.requires_grad:
            raise RuntimeError(f"root {i} does not require grad and has no grad_fn")
    t0 = time.monotonic()
    sends = _local_pass(ctx, [(r, torch.ones_like(r)) for r in roots])
    fut = _send_grads(context_id, sends)
    limit = _limit()
    try:
        fut.result(limit)
    except TimeoutError:
        if fut.done():
            raise
        raise rrefrt.RpcTimeoutError(
            f"distributed backward of autograd context {context_id} from worker "
            f"{rrefrt.get_worker_info().name!r} did not finish within {limit:.1f}s"
        ) from None
    log.debug("backward of context %d took %.3fs", context_id, time.monotonic() - t0)


def _leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf that requires grad reachable from ``outputs`` (outputs that are leaves
    themselves included), each once."""
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
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves


def _local_pass(ctx: AutogradContext, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """Backward through this worker's graph from ``pairs`` (tensor, gradient); accumulate
    leaf gradients in ``ctx``; return the gradients to send, per peer: [(edge id, grad)]."""
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t, g in pairs:
        old = merged.get(id(t))
        merged[id(t)] = (t, g if old is None else old[1] + g)
    outs = [t for t, _ in merged.values()]
    grads_out = [g for _, g in merged.values()]
    leaves = _leaves(outs)
    if not leaves:
        return {}
    grads = torch.autograd.grad(outs, leaves, grads_out, retain_graph=True, allow_unused=True)
    sends: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for leaf, g in zip(leaves, grads):
        if g is None:
            continue
        edge = ctx.recv_edge(leaf)
        if edge is not None:
            sends.setdefault(edge.peer, []).append((edge.edge_id, g))
        else:
            ctx.accumulate(leaf, g)
    return sends


def _send_grads(context_id: int, sends: dict[int, list[tuple[int, torch.Tensor]]]) -> Future[Any]:
    return _all([_call(peer, _on_grads, (context_id, items)) for peer, items in sends.items()])


@async_execution
def _on_grads(context_id: int, items: list[tuple[int, torch.Tensor]]) -> Future[Any]:
    """Gradients for send edges of this worker: run the local pass from them and pass the
    results on; answers when everything downstream has answered."""
    ctx = _known(context_id)
    me = rrefrt.get_worker_info().name
    sends = _local_pass(ctx, [(ctx.send_tensor(eid, me), g) for eid, g in items])
    return _send_grads(context_id, sends)


_hooks.register_interceptor(wrap_call)  # the call path reaches the engine only through the seam
