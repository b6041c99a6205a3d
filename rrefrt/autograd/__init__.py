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

Introspection, with torch.distributed.autograd's names and meaning (torch's graph tests and
a user debugging a model use them): ``_current_context()`` (this thread's context),
``_retrieve_context(id)``, ``_new_context()`` (opens a context and makes it this thread's),
``_release_context(id)``, ``_get_debug_info()``, ``_get_max_id()``; on a context object
(``DistAutogradContext``): ``_context_id()``, ``_send_functions()`` and ``_recv_functions()``
(the SendRpcBackward / RecvRpcBackward nodes of the graph recorded on this worker, by
message id) and ``_known_worker_ids()``.

Invariants: see the Rules of ``rrefrt/autograd/_context.py``.

This package imports no torch until a context is used: ``_hooks`` (the seam the API calls)
is standard library only; ``context``, ``backward`` and ``get_gradients`` load the engine.
"""

from __future__ import annotations

from typing import Any, Sequence

from rrefrt.errors import ArgumentError
from rrefrt.hooks import current_context_id

__all__ = [
    "context", "backward", "get_gradients", "current_context_id", "AutogradContextError", "DistBackwardError",
    "DistAutogradContext",
]

#: lazily loaded names (they import torch) -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    "context": ("_engine", "context"),
    "AutogradContextError": ("_context", "AutogradContextError"),
    "DistBackwardError": ("_context", "DistBackwardError"),
    "DistAutogradContext": ("_context", "AutogradContext"),
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{where[0]}"), where[1])
    raise AttributeError(f"module 'rrefrt.autograd' has no attribute {name!r}")


def backward(context_id: int, roots: Sequence[Any], retain_graph: bool = False) -> None:
    """Run the distributed backward pass of ``context_id`` from the scalar ``roots``;
    returns once every worker's part of it is done."""
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise ArgumentError(
            f"backward(): incompatible function arguments: context_id must be an int, got {type(context_id).__name__}"
        )
    if not isinstance(roots, (list, tuple)):
        raise ArgumentError(
            f"backward(): incompatible function arguments: roots must be a list of tensors, got {type(roots).__name__}"
        )
    from rrefrt.autograd._engine import backward as run

    run(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[Any, Any]:
    """{tensor: gradient} of the leaves on this worker accumulated in ``context_id``
    (``.grad`` is never touched)."""
    from rrefrt.autograd._engine import get_gradients as get

    return get(context_id)


# ---------------------------------------------------------------------------- introspection
def _current_context() -> Any:
    """This thread's ``DistAutogradContext``; RuntimeError (AutogradContextError) without one."""
    from rrefrt.autograd._engine import current_context

    return current_context()


def _retrieve_context(context_id: int) -> Any:
    """The ``DistAutogradContext`` of ``context_id`` on this worker; RuntimeError
    (AutogradContextError, "Could not find autograd context with id: ...") if it has none."""
    from rrefrt.autograd._engine import retrieve_context

    return retrieve_context(context_id)


def _new_context() -> Any:
    """Open a context and make it this thread's (``context()`` does this on entry); it
    stays until ``_release_context`` releases it."""
    from rrefrt.autograd._engine import new_context

    return new_context()


def _release_context(context_id: int) -> None:
    """Release ``context_id`` on this worker and on every worker it reached."""
    from rrefrt.autograd._engine import release_context

    release_context(context_id)


def _get_debug_info() -> dict[str, str]:
    """{"num_current_backward_passes": .., "num_autograd_contexts": ..} on this worker
    (string values, as torch's)."""
    from rrefrt.autograd._context import registry

    return registry().debug_info()


def _get_max_id() -> int:
    """The largest context id this worker can open: its worker id in the top 16 bits."""
    from rrefrt.autograd._context import registry

    return registry().max_id()
