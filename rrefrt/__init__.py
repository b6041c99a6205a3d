"""rrefrt: remote calls and remote references (RRefs) for Python and PyTorch.

A drop-in for ``torch.distributed.rpc`` (``import rrefrt as rpc``) that never hangs: every
wait is bounded and every failure is a typed error naming the worker.

NOTE [Lazy package]: importing ``rrefrt`` (and so any subpackage, the launcher
``rrefrt.run`` included) loads nothing but this file: the public names below are resolved
on first use through the module ``__getattr__`` (PEP 562). So ``rrefrt-run`` and
``import rrefrt.run`` load neither zmq, msgpack, torch nor the runtime
(tests/cluster/test_imports.py checks it), and torch is imported only when a tensor first crosses.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger("rrefrt").addHandler(logging.NullHandler())

__version__ = "0.1.0"

#: public name -> the submodule that defines it (resolved on first attribute access)
_EXPORTS: dict[str, str] = {
    "init_rpc": "api",
    "shutdown": "api",
    "rpc_sync": "api",
    "rpc_async": "api",
    "remote": "api",
    "get_worker_info": "api",
    "get_worker_infos": "api",
    "get_rpc_timeout": "api",
    "get_debug_info": "api",
    "RRef": "rref",
    "Future": "futures",
    "WorkerInfo": "options",
    "RpcBackendOptions": "options",
    "TensorPipeRpcBackendOptions": "options",
    "BackendType": "options",
    "RpcError": "errors",
    "RpcTimeoutError": "errors",
    "WorkerUnavailableError": "errors",
    "OwnerDiedError": "errors",
    "RRefLeakError": "errors",
    "RRefCreationError": "errors",
    "SerializationError": "errors",
    "ArgumentError": "errors",
    "ShutdownError": "errors",
    "RemoteError": "errors",
    "RemoteSerializationError": "errors",
    "OperatorSchemaError": "errors",
    "AuthenticationError": "errors",
    "DeviceMapError": "payload.buffers",
}
#: submodules reachable as attributes (``rrefrt.functions.async_execution``)
_SUBMODULES = ("functions", "futures")
#: torch's private helpers that torch programs call (``rpc._set_rpc_timeout``, ...), and
#: ``rrefrt.api`` for ``rpc.api._wait_all_workers``: reachable, not in ``__all__``
_PRIVATE: dict[str, str] = {
    "_set_rpc_timeout": "api",
    "_get_debug_info": "api",
    "_rref_context_get_debug_info": "api",
    "_get_current_rpc_agent": "api",
}

__all__ = [*_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _PRIVATE:
        value = getattr(importlib.import_module(f".{_EXPORTS.get(name) or _PRIVATE[name]}", __name__), name)
    elif name in _SUBMODULES or name == "api":
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'rrefrt' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from rrefrt import functions, futures
    from rrefrt.api import (
        get_debug_info, get_rpc_timeout, get_worker_info, get_worker_infos, init_rpc, remote, rpc_async, rpc_sync,
        shutdown,
    )
    from rrefrt.errors import (
        AuthenticationError,
        OperatorSchemaError,
        OwnerDiedError,
        RemoteError,
        RemoteSerializationError,
        RpcError,
        RpcTimeoutError,
        RRefCreationError,
        RRefLeakError,
        SerializationError,
        ShutdownError,
        WorkerUnavailableError,
    )
    from rrefrt.futures import Future
    from rrefrt.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
    from rrefrt.rref import RRef
