"""Worker-side functions and models for tests/cluster/test_autograd.py (importable on every worker)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

import rrefrt
import rrefrt.autograd as dist_autograd
from rrefrt.autograd import _context


class Layer(nn.Module):
    """A small deterministic layer: tanh(x @ W + b)."""

    def __init__(self, seed: int, n_in: int = 4, n_out: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(n_in, n_out, generator=g, dtype=torch.float64) * 0.5)
        self.b = nn.Parameter(torch.randn(n_out, generator=g, dtype=torch.float64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w + self.b)


def call_method(method: Any, rref: rrefrt.RRef, *args: Any, **kwargs: Any) -> Any:
    """torch's classic ``_call_method``: run ``method`` on the object an RRef holds."""
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: rrefrt.RRef, *args: Any) -> Any:
    return rrefrt.rpc_sync(rref.owner(), call_method, args=[method, rref, *args])


def forward_then(rref_a: rrefrt.RRef, rref_b: rrefrt.RRef, x: torch.Tensor) -> torch.Tensor:
    """Nested: apply the local module A, then (from here) the module B on its owner."""
    h = rref_a.local_value()(x)
    return remote_method(Layer.forward, rref_b, h) * 2.0


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + a


def scale_by_param(rref: rrefrt.RRef, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two results from one call: both require grad."""
    m = rref.local_value()
    return m(x), (x * m.b).sum()


def param_grads(rref: rrefrt.RRef, context_id: int) -> list[Any]:
    """The context's gradients of the module's parameters on this (its owner) worker."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in rref.local_value().parameters()]


def param_values(rref: rrefrt.RRef) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rref.local_value().parameters()]


def param_rrefs(rref: rrefrt.RRef) -> list[rrefrt.RRef]:
    return [rrefrt.RRef(p) for p in rref.local_value().parameters()]


def context_ids() -> list[int]:
    """Live autograd contexts on this worker."""
    return _context.registry().ids()


def validate_contexts() -> bool:
    _context.registry().validate()
    return True


def slow_identity(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)  # the callee is busy, not synchronising anything
    return x * 1.0


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        os._exit(17)  # the worker dies in the middle of the distributed backward


def die_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _DieInBackward.apply(x) * 3.0


def relay_to_dier(x: torch.Tensor, dier: str) -> torch.Tensor:
    """On the middle worker: forward to the worker that dies in backward."""
    return rrefrt.rpc_sync(dier, die_in_backward, args=(x * 2.0,)) + 1.0


# ------------------------------------------------------------------ scenarios (tests/support/worker_main.py)
def death_during_backward(spec: dict) -> dict:
    """Rank 0 of a 3-worker group: x -> w1 -> w2 (nested); w2 dies in its backward."""
    x = torch.ones(3, requires_grad=True)
    result: dict[str, Any] = {}
    with dist_autograd.context() as cid:
        y = rrefrt.rpc_sync("w1", relay_to_dier, args=(x, "w2"))
        t0 = time.monotonic()
        try:
            dist_autograd.backward(cid, [y.sum()])
            result["error"] = None
        except rrefrt.RpcError as e:
            result["error"] = type(e).__name__
            result["message"] = str(e)
        result["took"] = time.monotonic() - t0
    result["contexts_left_here"] = len(context_ids())
    result["contexts_left_w1"] = len(rrefrt.rpc_sync("w1", context_ids))
    rrefrt.shutdown(graceful=False)
    return result


def raise_in_forward(x: torch.Tensor, msg: str) -> None:
    raise ValueError(msg)


def forward_held(rref: rrefrt.RRef, held: rrefrt.RRef) -> torch.Tensor:
    """Apply the module to a value an RRef holds on this same worker."""
    return rref.local_value()(held.local_value())


def forward_fetched(rref: rrefrt.RRef, held: rrefrt.RRef) -> torch.Tensor:
    """Apply the module to the value of an RRef owned elsewhere (fetched with to_here)."""
    return rref.local_value()(held.to_here())


@rrefrt.functions.async_execution
def async_forward(rref: rrefrt.RRef, x: torch.Tensor) -> Any:
    """@async_execution inside a context: the nested call is recorded, and so is the result
    of the Future this returns."""
    return rrefrt.rpc_async(rref.owner(), call_method, args=(Layer.forward, rref, x * 2.0)).then(lambda f: f.wait() + x)


# ------------------------------------------------------------------ torch's names and behaviour
def graph_summary(context_id: int) -> dict[str, Any]:
    """What this worker recorded for the context, through torch's introspection names."""
    ctx = dist_autograd._retrieve_context(context_id)
    sends = list(ctx._send_functions().values())
    return {
        "sends": [n.name() for n in sends],
        "send_next": [[nxt.name() for nxt, _ in n.next_functions] for n in sends],
        "recvs": [n.name() for n in ctx._recv_functions().values()],
        "workers": sorted(ctx._known_worker_ids()),
    }


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in backward")


def raise_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _RaiseInBackward.apply(x) * 2.0


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()
