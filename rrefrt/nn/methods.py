"""The two methods every ``RemoteModule`` carries as instance attributes, ``forward_async``
and ``forward``, and the owner-side half they call.

Owns: running the remote module's ``forward`` on the worker that owns it. They are
module-level functions (torch generates the same pair from a template), so that a
RemoteModule sent over RPC carries them by reference (``generated_methods``) and re-binds
them on the receiver; both call the module's owner, ``module_rref.owner()``, not the
worker named at construction (a RemoteModule made by ``init_from_module_rref`` names
another worker than the owner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

import rrefrt

if TYPE_CHECKING:
    from rrefrt.nn import RemoteModule

__all__ = ["forward_async", "forward", "GENERATED_METHODS"]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def remote_forward(module_rref: rrefrt.RRef, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any) -> Any:
    """On the owner: run the module. On a CUDA device, tensor arguments move to it, and
    without a device map to the caller the tensor results come back on the CPU (torch's
    rule)."""
    module = module_rref.local_value()
    if not device.startswith("cuda"):
        return module(*args, **kwargs)
    to_dev = lambda t: t.to(device)  # noqa: E731
    out = module(*_map_tensors(args, to_dev), **_map_tensors(kwargs, to_dev))
    return out if is_device_map_set else _map_tensors(out, lambda t: t.cpu())


def forward_async(self: RemoteModule, *args: Any, **kwargs: Any) -> rrefrt.Future:
    """Run the remote module's forward; a Future of its result."""
    rref = self.module_rref
    return rrefrt.rpc_async(rref.owner(), remote_forward, args=(rref, self.device, self.is_device_map_set, *args),
                            kwargs=kwargs)


def forward(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
    """Run the remote module's forward and return its result."""
    rref = self.module_rref
    return rrefrt.rpc_sync(rref.owner(), remote_forward, args=(rref, self.device, self.is_device_map_set, *args),
                           kwargs=kwargs)


#: what a RemoteModule binds to itself, in torch's order (its pickled ``generated_methods``)
GENERATED_METHODS: tuple[Callable[..., Any], ...] = (forward_async, forward)
