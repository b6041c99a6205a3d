"""Distributed autograd over rrefrt, with torch.distributed.autograd's names and semantics::

    import rrefrt.autograd as dist_autograd

    with dist_autograd.context() as context_id:
        loss = rrefrt.rpc_sync("worker1", model_part, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {leaf tensor: grad} on this worker

Theory of operation (details in ``_engine``'s NOTEs and docs/autograd.md):

* Forward: inside a context, every rpc_sync/rpc_async/remote (and RRef proxy call) made on
  the thread carries the context id. A tensor argument or result that requires grad is a
  *send edge* on its sender and arrives as a fresh leaf, a *receive edge*, on its receiver,
  which remembers (sender, edge id). The callee runs the function with the context current
  on its thread, so calls it makes in turn are recorded too.
* Backward (torch's FAST mode): the worker that calls ``backward`` runs its local graph
  from the roots (torch's engine counts the dependencies inside it); gradients reaching
  ordinary leaves are summed into the context, gradients reaching receive edges are sent
  to their senders, which continue from the matching send edges. Every hop answers after
  its downstream hops did, so ``backward`` returns when every worker's part is done, and
  any failure comes back as a typed error.
* Release: leaving the ``with`` block releases the context here and on every worker it
  reached (transitively).

Invariants: see the Rules of ``rrefrt/autograd/_context.py``.

This package imports no torch until a context is used: ``_hooks`` (the seam the API calls)
is standard library only; ``context``, ``backward`` and ``get_gradients`` load the engine.
"""

from __future__ import annotations

from typing import Any, Sequence

from rrefrt.hooks import current_context_id

__all__ = ["context", "backward", "get_gradients", "current_context_id", "AutogradContextError"]


def __getattr__(name: str) -> Any:
    if name == "context":
        from rrefrt.autograd._engine import context

        return context
    if name == "AutogradContextError":
        from rrefrt.autograd._context import AutogradContextError

        return AutogradContextError
    raise AttributeError(f"module 'rrefrt.autograd' has no attribute {name!r}")


def backward(context_id: int, roots: Sequence[Any], retain_graph: bool = False) -> None:
    """Run the distributed backward pass of ``context_id`` from the scalar ``roots``;
    returns once every worker's part of it is done."""
    from rrefrt.autograd._engine import backward as run

    run(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[Any, Any]:
    """{tensor: gradient} of the leaves on this worker accumulated in ``context_id``
    (``.grad`` is never touched)."""
    from rrefrt.autograd._engine import get_gradients as get

    return get(context_id)
