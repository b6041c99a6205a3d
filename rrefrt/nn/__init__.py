"""``rrefrt.nn.RemoteModule``: torch.distributed.nn's RemoteModule on rrefrt.

Owns: creating an ``nn.Module`` on a remote worker, calling it, and sending the handle to
other workers. Imports torch, the public rrefrt API (and ``rrefrt.state`` for this
worker's device maps); nothing in rrefrt imports it.

``RemoteModule("worker1/cpu", nn.Linear, args=(4, 2))`` creates the module on ``worker1``
(with ``.to(device)``); ``forward(*a, **kw)`` runs it there with ``rpc_sync`` and
``forward_async`` with ``rpc_async`` (so inside a ``rrefrt.autograd.context()`` both are
recorded for the distributed backward); ``remote_parameters()`` gives RRefs of its
parameters for ``DistributedOptimizer``; ``get_module_rref()`` the RRef of the module;
``train()`` / ``eval()`` set the remote module's mode. On a CUDA device, tensor arguments
are moved to the module's device and tensor results back to the CPU unless a device map
to that worker is set (torch's rule).

As in torch: the instance attributes are ``on`` (the worker name or rank as given),
``device``, ``is_device_map_set``, ``is_scriptable``, ``generated_methods``,
``module_rref`` and the bound ``forward_async`` / ``forward``; a RemoteModule sent as an
argument or result of an rrefrt call carries exactly the first six (``PICKLED_ATTRIBUTES``;
an attribute added later is logged and left behind) and its ``module_rref`` is forked by
the RRef protocol; pickled any other way (``torch.save``, ``pickle.dumps``) it raises.
The methods of ``nn.Module`` that would act on local parameters, buffers, hooks or
submodules raise ``ValueError("Method ``x`` not supported for RemoteModule")``.
Differs from torch: creation errors surface in the constructor (torch: at the first
``forward``), ``train()``/``eval()`` return this RemoteModule (torch returns a copy of the
remote module), and TorchScript (``_module_interface_cls``) is not supported.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, NoReturn

import torch
from torch import nn

import rrefrt
from rrefrt import state
from rrefrt.nn.methods import GENERATED_METHODS

__all__ = ["RemoteModule"]

log = logging.getLogger("rrefrt")

#: what a RemoteModule carries over RPC, in this order (torch's _REMOTE_MODULE_PICKLED_ATTRIBUTES)
PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable", "generated_methods", "module_rref")

#: nn.Module's own state and the bound methods: left behind without a word
_NOT_PICKLED = frozenset({"training", "forward_async", "forward"})

_NOT_SUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu", "cpu", "type",
    "float", "double", "half", "bfloat16", "to", "register_backward_hook", "register_forward_pre_hook",
    "register_forward_hook", "state_dict", "load_state_dict", "named_parameters", "buffers",
    "named_buffers", "children", "named_children", "modules", "named_modules", "requires_grad_",
    "zero_grad", "share_memory", "extra_repr",
)


def _create_module(module_cls: Callable[..., Any], args: tuple, kwargs: dict, device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):  # torch's text, which its tests match
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    return module.to(device)


def _ready(module_rref: rrefrt.RRef) -> bool:
    module_rref.local_value()  # raises the creation error, if any
    return True


def _param_rrefs(module_rref: rrefrt.RRef, recurse: bool) -> list[rrefrt.RRef]:
    return [rrefrt.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: rrefrt.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _parse(remote_device: str) -> tuple[str | int, str]:
    """``"worker1/cuda:0"``, ``"rank:1/cpu"`` or ``"worker1"`` (device cpu) -> (worker, device)."""
    parts = remote_device.split("/") if isinstance(remote_device, str) else []
    if not parts or len(parts) > 2 or not parts[0]:
        raise ValueError(f"Could not parse remote_device: {remote_device}. The valid format is '<workername>/<device>'")
    worker = parts[0]
    device = parts[1] if len(parts) == 2 else "cpu"
    device = str(torch.device(device))  # raises torch's error on a malformed device
    if worker.startswith("rank:"):
        try:
            return int(worker[5:]), device
        except ValueError:
            raise ValueError(f"Could not parse remote_device: {remote_device}. The rank must be an int") from None
    return worker, device


def _device_map_set(on: str | int) -> bool:
    rt = state.current_or_none()
    if rt is None:
        return False
    name = rrefrt.get_worker_info(on).name if isinstance(on, int) else on
    return bool(rt.options.device_maps.get(name))


def _install(module: "RemoteModule") -> None:
    for method in module.generated_methods:
        setattr(module, method.__name__, types.MethodType(method, module))


def _receive(*values: Any) -> "RemoteModule":
    """A RemoteModule that arrived over RPC: the pickled attributes and the bound methods,
    nothing of nn.Module's state (as torch's receiver does)."""
    m = object.__new__(RemoteModule)
    m.__dict__.update(zip(PICKLED_ATTRIBUTES, values))
    _install(m)
    return m


class RemoteModule(nn.Module):
    """An ``nn.Module`` that lives on another worker (torch.distributed.nn.RemoteModule)."""

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple | None = None,
        kwargs: dict | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        if _module_interface_cls is not None:
            raise NotImplementedError("RemoteModule: TorchScript (_module_interface_cls) is not supported by rrefrt")
        self._prepare(remote_device)
        self.module_rref: rrefrt.RRef = rrefrt.remote(
            self.on, _create_module, args=(module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        )
        _install(self)
        rrefrt.rpc_sync(self.on, _ready, args=(self.module_rref,))  # creation errors surface here

    def _prepare(self, remote_device: str) -> None:
        self.on, self.device = _parse(remote_device)
        self.is_device_map_set = _device_map_set(self.on)
        self.is_scriptable = False
        self.generated_methods = GENERATED_METHODS

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rrefrt.RRef, _module_interface_cls: Any = None) -> "RemoteModule":
        """A RemoteModule over an existing module RRef (several RemoteModules can share one
        module). Calls go to the RRef's owner; ``remote_device`` names ``on`` and the device."""
        if _module_interface_cls is not None:
            raise NotImplementedError("RemoteModule: TorchScript (_module_interface_cls) is not supported by rrefrt")
        m = object.__new__(RemoteModule)
        nn.Module.__init__(m)
        m._prepare(remote_device)
        m.module_rref = module_rref
        _install(m)
        return m

    # forward and forward_async are bound per instance (rrefrt/nn/methods.py); these are
    # the class's fallbacks for a subclass that calls them before they are installed
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return GENERATED_METHODS[1](self, *args, **kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Any:
        return GENERATED_METHODS[0](self, *args, **kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[rrefrt.RRef]:
        """RRefs of the remote module's parameters (for DistributedOptimizer)."""
        return rrefrt.rpc_sync(self.module_rref.owner(), _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rrefrt.RRef:
        return self.module_rref

    def train(self, mode: bool = True) -> "RemoteModule":
        """Set the remote module's training mode (and this handle's ``training``)."""
        rrefrt.rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, bool(mode)))
        object.__setattr__(self, "training", bool(mode))
        return self

    def eval(self) -> "RemoteModule":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> NoReturn:  # type: ignore[override]
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead."
        )

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r}, module_rref={self.module_rref!r})"

    # ------------------------------------------------------------------ pickling
    def _rrefrt_rpc_reduce(self) -> tuple[Callable[..., Any], tuple]:
        """How rrefrt's RPC pickler sends a RemoteModule (rrefrt/payload/serialization.py)."""
        for k in self.__dict__:
            if k not in PICKLED_ATTRIBUTES and k not in _NOT_PICKLED and not k.startswith("_"):
                log.warning("the attribute %r of a RemoteModule is not sent over RPC (only %s are)", k,
                            ", ".join(PICKLED_ATTRIBUTES))
        return _receive, tuple(self.__dict__[k] for k in PICKLED_ATTRIBUTES)

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC "
            "(send it as an argument or result of an rrefrt call; to save the module, fetch it with "
            "get_module_rref().to_here())"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
        )


def _not_supported(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")

    method.__name__ = method.__qualname__ = name
    return method


for _name in _NOT_SUPPORTED:
    setattr(RemoteModule, _name, _not_supported(_name))
del _name
