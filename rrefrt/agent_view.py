"""``AgentView``: what ``_get_current_rpc_agent()`` returns, the part of torch's RPC agent
that torch programs in the wild read (the list of workers, a worker's info, debug info).

Owns nothing: each method asks the runtime it was made for. Imports from rrefrt: options
(types only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rrefrt.options import WorkerInfo
    from rrefrt.runtime import Runtime

__all__ = ["AgentView"]


class AgentView:
    """torch's ``RpcAgent`` methods that have a meaning in rrefrt; nothing else."""

    def __init__(self, runtime: "Runtime") -> None:
        self._rt = runtime

    def get_worker_infos(self) -> list["WorkerInfo"]:
        """Every worker of the group, this one included."""
        return self._rt.worker_infos()

    def get_worker_info(self, worker_name: str | None = None) -> "WorkerInfo":
        """A worker's info by name; this worker's without a name."""
        return self._rt.worker_info(worker_name)

    def get_debug_info(self) -> dict[str, Any]:
        """rrefrt's counters (``rrefrt.get_debug_info()``) and, under torch's key,
        ``agent.thread_pool_size``: the options' ``num_worker_threads``."""
        info = dict(self._rt.debug_info())
        info.setdefault("agent.thread_pool_size", self._rt.options.num_worker_threads)
        return info

    def __repr__(self) -> str:
        return f"AgentView(worker={self._rt.info!r})"
