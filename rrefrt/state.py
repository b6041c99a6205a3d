"""The one process-global of rrefrt: the current runtime (set by init_rpc, reset by
shutdown). Everything else is passed explicitly. Leaf module (imports errors only).

NOTE [Fork safety]: the runtime records the pid that created it. A forked child inherits
the variable but not the I/O thread, and may inherit locks held by threads that do not
exist in it, so ``current()`` compares pids before anything else and never takes a lock.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import ShutdownError

_runtime: Any = None


def current() -> Any:
    rt = _runtime
    if rt is None:
        raise ShutdownError("RPC is not running on this process: call rrefrt.init_rpc() first (or it was shut down)")
    if rt.pid != os.getpid():
        raise ShutdownError(FORKED)
    return rt


FORKED = (
    "this process was forked from an rrefrt worker: the inherited runtime cannot be used "
    "in the child; call rrefrt.init_rpc() afresh in the child to join a new group"
)


def inherited() -> bool:
    """True in a forked child that inherited its parent's runtime (and has no own one)."""
    rt = _runtime
    return rt is not None and rt.pid != os.getpid()


def current_or_none() -> Any:
    rt = _runtime
    if rt is None or rt.pid != os.getpid():
        return None
    return rt


def set_current(rt: Any) -> None:
    global _runtime
    _runtime = rt
