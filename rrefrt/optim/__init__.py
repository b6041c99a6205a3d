"""``rrefrt.optim.DistributedOptimizer``: torch.distributed.optim's DistributedOptimizer on
rrefrt (``from rrefrt.optim import DistributedOptimizer`` is the only change).

Owns: the local optimizers that live on parameter owners, and stepping them with the
gradients of a distributed autograd context. Imports torch, the public rrefrt API and
``rrefrt.autograd``; nothing in rrefrt imports it.

Theory of operation: the constructor groups the parameter RRefs by owner and creates, on
each owner, one ``_LocalOptimizer`` (``optimizer_class`` over the owner's own parameter
objects, reached with ``local_value()``), holding an RRef to each. ``step(context_id)``
calls every local optimizer at once; each sets ``param.grad`` to the gradient that
``rrefrt.autograd.get_gradients(context_id)`` holds for it on that owner (None where the
context has none) and runs ``optimizer.step()``. ``step`` returns when all have stepped and
raises the first error (typed: a dead owner gives ``WorkerUnavailableError``).

Invariants: steps of one local optimizer never overlap (its lock is held across setting
the gradients and stepping, and only there; no rrefrt call is made under it); a parameter
is stepped only by the local optimizer on its owner.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

import rrefrt
import rrefrt.autograd as dist_autograd

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameter owner: ``optimizer_class`` over that owner's parameters."""

    def __init__(self, optim_cls: Any, param_rrefs: Sequence[rrefrt.RRef], *args: Any, **kwargs: Any) -> None:
        self.params: list[torch.Tensor] = [r.local_value() for r in param_rrefs]
        self.optim = optim_cls(self.params, *args, **kwargs)
        self.lock = threading.Lock()

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with self.lock:  # one step at a time on this optimizer (torch: a global lock)
            for p in self.params:
                p.grad = grads.get(p)
            self.optim.step()


def _new_local_optimizer(optim_cls: Any, param_rrefs: Sequence[rrefrt.RRef], *args: Any, **kwargs: Any) -> rrefrt.RRef:
    return rrefrt.RRef(_LocalOptimizer(optim_cls, param_rrefs, *args, **kwargs))


def _local_optimizer_step(optim_rref: rrefrt.RRef, context_id: int) -> None:
    optim_rref.local_value().step(context_id)


def _wait_all(futs: Sequence[Any]) -> list[Any]:
    """Every result, or the first error once all have finished (each future is bounded by
    the rpc timeout or peer-death detection)."""
    limit = rrefrt.get_rpc_timeout()
    out: list[Any] = []
    error: BaseException | None = None
    for f in futs:
        try:
            out.append(f.result(limit + 5.0 if limit > 0 else None))
        except Exception as e:
            out.append(e)
            error = error or e
    if error is not None:
        raise error
    return out


class DistributedOptimizer:
    """Apply ``optimizer_class(params, *args, **kwargs)`` on the owner of each parameter in
    ``params_rref`` (RRefs to local or remote parameters), with the gradients of a
    distributed autograd context: ``step(context_id)``."""

    def __init__(self, optimizer_class: Any, params_rref: Sequence[rrefrt.RRef], *args: Any, **kwargs: Any) -> None:
        per_owner: dict[Any, list[rrefrt.RRef]] = {}
        for p in params_rref:
            per_owner.setdefault(p.owner(), []).append(p)
        futs = [
            rrefrt.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, *args), kwargs=kwargs)
            for owner, rrefs in per_owner.items()
        ]
        self.remote_optimizers: list[rrefrt.RRef] = _wait_all(futs)

    def step(self, context_id: int) -> None:
        """One step of every local optimizer, concurrently, with the gradients of
        ``context_id`` on each owner; returns when all are done."""
        futs = [
            rrefrt.rpc_async(o.owner(), _local_optimizer_step, args=(o, context_id)) for o in self.remote_optimizers
        ]
        _wait_all(futs)
