"""Functions the GPU tests call remotely (importable on every worker; torch with CUDA)."""

from __future__ import annotations

import threading
from typing import Any

import torch

#: about 0.25 s of GPU time at H200 clocks: long enough that a missing wait shows
SLEEP_CYCLES = 500_000_000


def where(t: Any) -> dict:
    """Where the argument landed and what the call runs under."""
    return {
        "device": str(t.device),
        "current_device": torch.cuda.current_device(),
        "pool_stream": torch.cuda.current_stream() != torch.cuda.default_stream(),
    }


def context() -> dict:
    """The device and stream a call with no tensor runs under."""
    return {
        "current_device": torch.cuda.current_device(),
        "pool_stream": torch.cuda.current_stream() != torch.cuda.default_stream(),
    }


def total(t: Any) -> float:
    """The sum of what arrived (synchronises: tells whether the argument was complete)."""
    return float(t.sum().item())


def slow_scale(t: Any, k: float, cycles: int = SLEEP_CYCLES) -> Any:
    """Return ``t * k`` computed behind a long kernel, without waiting for it."""
    out = torch.empty_like(t)
    torch.cuda._sleep(cycles)
    torch.mul(t, k, out=out)
    return out


def slow_full(n: int, value: float, cycles: int = SLEEP_CYCLES) -> Any:
    """A new CUDA tensor of ``n`` x ``value``, filled behind a long kernel (for remote())."""
    out = torch.zeros(n, device="cuda")
    torch.cuda._sleep(cycles)
    out.fill_(value)
    return out


def identity(t: Any) -> Any:
    return t


def cpu_ones(n: int) -> Any:
    return torch.ones(n)


def on_cuda1(n: int) -> Any:
    return torch.ones(n, device="cuda:1")


def value_device(rref: Any) -> str:
    return str(rref.local_value().device)


def hold(t: Any, seconds: float, marker: str) -> float:
    """Keep the argument (a GPU tensor) alive for a while (a call in flight); ``marker``
    is created once the call holds it."""
    with open(marker, "w"):
        pass
    threading.Event().wait(seconds)
    return float(t.sum().item())
