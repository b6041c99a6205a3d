"""The one process-global of rrefrt: the current runtime (set by init_rpc, reset by
shutdown). Everything else is passed explicitly. Leaf module (imports errors only).

NOTE [Runtime binding]: a thread may be bound to a runtime (``bound(rt)``): then
``current()`` is that runtime while it is open. Each runtime binds the threads that run
user code for it (its user pool tasks, its callback pool, its event loop), so that several
runtimes can live in one process (unit tests over transport/inproc.py): user code on
worker B's pool that calls the API, or uses an RRef, reaches B, not whichever runtime
init_rpc made current. With one runtime per process (always, outside tests) a binding
names the current runtime itself, and a closed one falls back to the process-global.

NOTE [Fork safety]: the runtime records the pid that created it. A forked child inherits
the variable but not the I/O thread, and may inherit locks held by threads that do not
exist in it, so ``current()`` compares pids before anything else and never takes a lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING, Iterator

from rrefrt.errors import ShutdownError

if TYPE_CHECKING:  # the types only: this leaf imports nothing above it at run time
    from rrefrt.runtime.core import WorkerCore
    from rrefrt.runtime.root import Runtime

_runtime: "Runtime | None" = None
#: this process's pid, kept current in a forked child: ``os.getpid()`` is a system call, and
#: every call asks whether the runtime was inherited (NOTE [Fork safety])
pid = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
_bound = threading.local()  #: .rt: the runtime this thread works for (NOTE [Runtime binding])


def _here() -> Runtime | None:
    rt = getattr(_bound, "rt", None)
    if rt is None or rt.closed or rt.pid != pid:  # unbound, closed, or inherited
        return _runtime
    return rt


@contextlib.contextmanager
def bound(rt: WorkerCore) -> Iterator[None]:
    """Run a block as a thread of ``rt`` (NOTE [Runtime binding])."""
    prev = getattr(_bound, "rt", None)
    _bound.rt = rt
    try:
        yield
    finally:
        _bound.rt = prev


def current() -> Runtime:
    rt = _here()
    if rt is None:
        raise ShutdownError(NOT_RUNNING)
    if rt.pid != pid:
        raise ShutdownError(FORKED)
    return rt


#: starts with torch's phrase and contains its agent phrase: torch programs match on both
NOT_RUNNING = (
    "RPC has not been initialized on this process, or it was shut down: call rrefrt.init_rpc() "
    "first (Current RPC agent is not set! Did you initialize the RPC framework?)"
)

FORKED = (
    "this process was forked from an rrefrt worker: the inherited runtime cannot be used "
    "in the child; call rrefrt.init_rpc() afresh in the child to join a new group"
)


def inherited() -> bool:
    """True in a forked child that inherited its parent's runtime (and has no own one)."""
    rt = _here()
    return rt is not None and rt.pid != pid


def current_or_none() -> Runtime | None:
    rt = _here()
    if rt is None or rt.pid != pid:
        return None
    return rt


def set_current(rt: Runtime | None) -> None:
    global _runtime
    _runtime = rt
