"""The module alias that points torch's own RPC tests at rrefrt.

``install()`` replaces the *public* names of ``torch.distributed.rpc`` (the ones a torch RPC
program uses: ``init_rpc``, ``rpc_sync``, ``RRef``, ``functions.async_execution``, ...) with
rrefrt's, in the running process. It must run before ``rpc_test`` (or anything that does
``from torch.distributed.rpc import RRef``) is imported; ``tests.torch_compat.suite`` calls it
at import, and the worker processes that torch's ``MultiProcessTestCase`` spawns import that
module to unpickle their test class, so they are aliased too.

It also points ``torch.distributed.autograd`` (``context``, ``backward``, ``get_gradients``
and the introspection helpers ``_current_context``, ``_retrieve_context``, ...: AUTOGRAD_NAMES)
at ``rrefrt.autograd`` and ``torch.distributed.optim.DistributedOptimizer`` at
``rrefrt.optim``'s, so that torch's DistAutogradTest and DistOptimizerTest run on rrefrt.

It also points ``torch.distributed.nn.RemoteModule`` at ``rrefrt.nn.RemoteModule`` (torch's
RemoteModule tests import it by name). torch's private ``_RemoteModule`` (the TorchScript
variant, ``_module_interface_cls``) stays torch's.

It also sets the private helpers rrefrt provides with torch's meaning (``PRIVATE_NAMES``:
``_set_rpc_timeout``, ``_get_debug_info``, ``_get_current_rpc_agent``,
``_rref_context_get_debug_info`` (which torch's harness, ``dist_utils``, polls to wait for the
RRef protocol to settle) - on the module and on its ``api`` submodule where torch has them
there - and ``api._wait_all_workers``).

What the alias does not cover, on purpose: torch's other private helpers (``rpc.api._all_gather``,
``rpc.api._barrier``, ``rpc.internal``, ``rpc.backend_registry``), the TensorPipe agent and the
server-side profiler. Tests that reach for those keep talking to torch's own (uninitialised) RPC
runtime and are listed in docs/compatibility.md as expected to differ.
"""

from __future__ import annotations

#: ``torch.distributed.rpc`` name -> ``rrefrt`` name.
PUBLIC_NAMES: dict[str, str] = {
    "init_rpc": "init_rpc",
    "shutdown": "shutdown",
    "rpc_sync": "rpc_sync",
    "rpc_async": "rpc_async",
    "remote": "remote",
    "get_worker_info": "get_worker_info",
    "get_rpc_timeout": "get_rpc_timeout",
    "RRef": "RRef",
    "WorkerInfo": "WorkerInfo",
    "BackendType": "BackendType",
    "RpcBackendOptions": "RpcBackendOptions",
    "TensorPipeRpcBackendOptions": "TensorPipeRpcBackendOptions",
    "functions": "functions",
}

#: ``torch.distributed.autograd`` names that ``rrefrt.autograd`` provides with the same meaning.
AUTOGRAD_NAMES: tuple[str, ...] = (
    "context",
    "backward",
    "get_gradients",
    "_current_context",
    "_retrieve_context",
    "_new_context",
    "_release_context",
    "_is_valid_context",
    "_get_debug_info",
    "_get_max_id",
    "DistAutogradContext",
)

#: torch's private helpers that torch programs call and rrefrt provides (same meaning),
#: set on ``torch.distributed.rpc`` and, where torch has them there, on its ``api`` module;
#: ``rpc.api._wait_all_workers`` is rrefrt.api's too
PRIVATE_NAMES: dict[str, str] = {
    "_set_rpc_timeout": "_set_rpc_timeout",
    "_get_debug_info": "_get_debug_info",
    "_get_current_rpc_agent": "_get_current_rpc_agent",
    "_rref_context_get_debug_info": "_rref_context_get_debug_info",
}

_installed = False


def install() -> None:
    """Alias ``torch.distributed.rpc``'s public names to rrefrt's in this process (idempotent)."""
    global _installed
    if _installed:
        return
    import torch.distributed.rpc as trpc

    import rrefrt

    for torch_name, ours in PUBLIC_NAMES.items():
        setattr(trpc, torch_name, getattr(rrefrt, ours))

    import torch.distributed.autograd as tdist_autograd
    import torch.distributed.optim as toptim

    import rrefrt.autograd
    import rrefrt.optim

    for name in AUTOGRAD_NAMES:
        if hasattr(rrefrt.autograd, name):
            setattr(tdist_autograd, name, getattr(rrefrt.autograd, name))
    toptim.DistributedOptimizer = rrefrt.optim.DistributedOptimizer  # type: ignore[misc]
    # torch's private helpers that rrefrt provides with the same meaning (rrefrt/api.py)
    import torch.distributed.rpc.api as tapi

    for torch_name, ours in PRIVATE_NAMES.items():
        setattr(trpc, torch_name, getattr(rrefrt, ours))
        if hasattr(tapi, torch_name):
            setattr(tapi, torch_name, getattr(rrefrt, ours))
    tapi._wait_all_workers = rrefrt.api._wait_all_workers  # type: ignore[attr-defined]
    # torch.distributed.nn's RemoteModule (remote_module_test imports it by name)
    import torch.distributed.nn as tnn
    import torch.distributed.nn.api.remote_module as tremote_module

    from rrefrt.nn import RemoteModule

    tnn.RemoteModule = RemoteModule  # type: ignore[attr-defined]
    tremote_module.RemoteModule = RemoteModule  # type: ignore[attr-defined,misc]
    _installed = True
