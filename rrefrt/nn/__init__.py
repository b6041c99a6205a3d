"""``rrefrt.nn.RemoteModule``: torch.distributed.nn's RemoteModule on rrefrt.

Owns: creating an ``nn.Module`` on a remote worker and calling it. Imports torch, the public
rrefrt API; nothing in rrefrt imports it.

``RemoteModule("worker1/cpu", nn.Linear, args=(4, 2))`` creates the module on ``worker1``
(with ``.to(device)``); ``forward(*a, **kw)`` runs it there with ``rpc_sync`` and
``forward_async`` with ``rpc_async`` (so inside a ``rrefrt.autograd.context()`` both are
recorded for the distributed backward); ``remote_parameters()`` gives RRefs of its
parameters for ``DistributedOptimizer``; ``get_module_rref()`` the RRef of the module.
On a CUDA device, tensor arguments are moved to the module's device and tensor results
back to the CPU (torch does the same when no device map is set).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

import rrefrt

__all__ = ["RemoteModule"]


def _create_module(module_cls: Callable[..., Any], args: tuple, kwargs: dict, device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"RemoteModule expects module_cls(*args, **kwargs) to return an nn.Module, got {type(module).__name__}")
    return module.to(device)


def _ready(module_rref: rrefrt.RRef) -> bool:
    module_rref.local_value()  # raises the creation error, if any
    return True


def _param_rrefs(module_rref: rrefrt.RRef, recurse: bool) -> list[rrefrt.RRef]:
    return [rrefrt.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _remote_forward(module_rref: rrefrt.RRef, device: str, *args: Any, **kwargs: Any) -> Any:
    module = module_rref.local_value()
    if not device.startswith("cuda"):
        return module(*args, **kwargs)
    to_dev = lambda t: t.to(device)  # noqa: E731
    out = module(*_map_tensors(args, to_dev), **_map_tensors(kwargs, to_dev))
    return _map_tensors(out, lambda t: t.cpu())


def _parse(remote_device: str) -> tuple[Any, str]:
    if not isinstance(remote_device, str) or not remote_device:
        raise ValueError(f'remote_device must be a string like "worker1/cpu" or "rank:1/cuda:0", got {remote_device!r}')
    worker, _, device = remote_device.partition("/")
    device = device or "cpu"
    torch.device(device)  # raises on a malformed device
    if worker.startswith("rank:"):
        return int(worker[5:]), device
    return worker, device


class RemoteModule(nn.Module):
    """An ``nn.Module`` that lives on another worker (torch.distributed.nn.RemoteModule)."""

    def __init__(
        self, remote_device: str, module_cls: Callable[..., nn.Module], args: tuple | None = None, kwargs: dict | None = None
    ) -> None:
        super().__init__()
        worker, self.device = _parse(remote_device)
        self.on = rrefrt.get_worker_info(worker) if isinstance(worker, str) else worker
        self.module_rref: rrefrt.RRef = rrefrt.remote(
            self.on, _create_module, args=(module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        )
        rrefrt.rpc_sync(self.on, _ready, args=(self.module_rref,))  # creation errors surface here

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return rrefrt.rpc_sync(self.on, _remote_forward, args=(self.module_rref, self.device, *args), kwargs=kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Any:
        return rrefrt.rpc_async(self.on, _remote_forward, args=(self.module_rref, self.device, *args), kwargs=kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[rrefrt.RRef]:
        """RRefs of the remote module's parameters (for DistributedOptimizer)."""
        return rrefrt.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rrefrt.RRef:
        return self.module_rref

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        raise ValueError("RemoteModule has no local parameters: use remote_parameters() for RRefs to them")

    def extra_repr(self) -> str:
        return f"on={self.on.name if hasattr(self.on, 'name') else self.on}, device={self.device}"
