"""The one seam between rrefrt's call path and distributed autograd.

Owns: the thread-local "current autograd context" and ``wrap_call``, which the API calls
(``rpc_sync``, ``rpc_async``, ``remote`` and RRef proxies) only when ``active()`` is true.
Imports only the standard library at import time (importing rrefrt must not import torch);
the engine, which imports torch, is loaded on the first wrapped call.

The call sites read::

    if _ag_hooks.active():
        func, args, kwargs, unwrap = _ag_hooks.wrap_call(to, func, args, kwargs)
        # ... make the call as usual; rpc_sync: return unwrap(result)
        # rpc_async: return fut.then(lambda f: unwrap(f.value()))
        # remote: pass remote=True (the result stays on the owner; unwrap is the identity)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = [
    "active", "current_context_id", "set_current", "suspended", "traced_call", "wrap_call", "fetch_value", "rref_backward",
]

class _Local(threading.local):
    ctx: int | None = None  #: the context id active on this thread (None: no context)


_tls = _Local()


def current_context_id() -> int | None:
    """The id of the autograd context active on this thread, or None."""
    return _tls.ctx


def active() -> bool:
    """True when calls made on this thread must carry an autograd context (cheap)."""
    return _tls.ctx is not None


def set_current(context_id: int | None) -> int | None:
    """Make ``context_id`` this thread's context; return the previous one."""
    prev = _tls.ctx
    _tls.ctx = context_id
    return prev


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Calls made inside are not recorded (the engine's own gradient and release calls)."""
    prev = set_current(None)
    try:
        yield
    finally:
        set_current(prev)


def wrap_call(
    dest: Any, func: Callable[..., Any], args: Any, kwargs: Any, remote: bool = False
) -> tuple[Callable[..., Any], tuple, dict, Callable[[Any], Any]]:
    """Record a call made inside the current context: tensors that require grad in
    ``args``/``kwargs`` become send edges, ``func`` is wrapped in a picklable trampoline that
    carries the context to the callee, and ``unwrap_result`` turns the tensors of the reply
    that required grad on the callee into receive edges here."""
    from . import _engine

    cid = current_context_id()
    assert cid is not None, "wrap_call outside an autograd context"
    return _engine.wrap_call(cid, dest, func, args, kwargs, remote)


def traced_call(how: str, call: Callable[..., Any], to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float) -> Any:
    """Make ``call(to, func, args, kwargs, timeout)`` (the runtime's rpc_sync, rpc_async or
    remote, named by ``how``) as a recorded call of the current context. The whole hook at a
    call site is::

        if _autograd.active():
            return _autograd.traced_call("rpc_sync", rt.rpc_sync, to, func, args, kwargs, timeout)
    """
    func, args, kwargs, unwrap = wrap_call(to, func, args, kwargs, remote=how == "remote")
    result = call(to, func, args, kwargs, timeout)
    if how == "rpc_async":
        return result.then(lambda f: unwrap(f.wait()))
    return unwrap(result)


def fetch_value(rref: Any) -> Any:
    """Runs on an RRef's owner: ``to_here()`` inside a context fetches the value with a
    recorded call, so tensors of the value that require grad stay connected (as torch)."""
    return rref.local_value()


def rref_backward(rref: Any, context_id: int, retain_graph: bool) -> None:
    """``RRef.backward``: see ``_engine.rref_backward`` (loaded here, on first use)."""
    from . import _engine

    _engine.rref_backward(rref, context_id, retain_graph)
