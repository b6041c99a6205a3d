"""rrefrt: remote calls and remote references (RRefs) for Python and PyTorch.

A drop-in for ``torch.distributed.rpc`` (``import rrefrt as rpc``) that never hangs: every
wait is bounded and every failure is a typed error naming the worker. Importing rrefrt does
not import torch; torch is imported when a tensor first crosses.
"""

from __future__ import annotations

import logging

from . import functions, futures
from .api import (
    get_debug_info,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .errors import (
    AuthenticationError,
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
from .futures import Future
from .options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from .rref import RRef

logging.getLogger("rrefrt").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_rpc_timeout",
    "get_debug_info",
    "RRef",
    "Future",
    "WorkerInfo",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "BackendType",
    "RpcError",
    "RpcTimeoutError",
    "WorkerUnavailableError",
    "OwnerDiedError",
    "RRefLeakError",
    "RRefCreationError",
    "SerializationError",
    "ShutdownError",
    "RemoteError",
    "RemoteSerializationError",
    "AuthenticationError",
    "functions",
    "futures",
]
