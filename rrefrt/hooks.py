"""The call-interceptor seam: the one place where rrefrt's call path meets distributed autograd.

Owns: the thread-local "current autograd context" and ``wrap_call``, which the API calls
(``rpc_sync``, ``rpc_async``, ``remote`` and RRef proxies) only when ``active()`` is true,
and the interceptor behind it. The distributed autograd engine (rrefrt/autograd/_engine.py,
a layer above the public API) registers itself here when it is imported
(``register_interceptor``); this module imports only the standard library and never the
engine, so the call path depends on nothing above it. A context can only be made current
by the engine, so whenever ``active()`` is true the interceptor is registered.

The call sites read::

    if _ag_hooks.active():
        func, args, kwargs, unwrap = _ag_hooks.wrap_call(to, func, args, kwargs)
        # ... make the call as usual; rpc_sync: return unwrap(result)
        # rpc_async: return fut.then(lambda f: unwrap(f.value()))
        # remote: pass remote=True (the result stays on the owner; unwrap is the identity)
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Callable, Iterator

__all__ = [
    "register_interceptor", "active", "current_context_id", "set_current", "suspended", "traced_call", "wrap_call",
    "fetch_value", "rref_backward", "register_backward",
]

class _Local(threading.local):
    ctx: int | None = None  #: the context id active on this thread (None: no context)


_tls = _Local()

#: Interceptor = (context_id, dest, func, args, kwargs, remote) -> (func, args, kwargs, unwrap)
Interceptor = Callable[[int, Any, Callable[..., Any], Any, Any, bool], "tuple[Callable[..., Any], tuple, dict, Callable[[Any], Any]]"]

#: the distributed autograd engine's ``wrap_call``, set when the engine is imported
_interceptor: Interceptor | None = None


def register_interceptor(fn: Interceptor) -> None:
    """Called once by the distributed autograd engine at import: calls made inside a
    context go through ``fn``."""
    global _interceptor
    _interceptor = fn


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
    cid = current_context_id()
    assert cid is not None, "wrap_call outside an autograd context"
    if _interceptor is None:  # only the engine sets a context, and it registers first
        raise RuntimeError("an autograd context is active but no call interceptor is registered")
    return _interceptor(cid, dest, func, args, kwargs, remote)


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


#: the engine's ``rref_backward``, set when the engine is imported
_backward: Callable[[Any, int, bool], None] | None = None


def register_backward(fn: Callable[[Any, int, bool], None]) -> None:
    """Called once by the distributed autograd engine at import: ``RRef.backward`` runs ``fn``."""
    global _backward
    _backward = fn


def rref_backward(rref: Any, context_id: int, retain_graph: bool) -> None:
    """``RRef.backward`` (see the engine's ``rref_backward``). Unlike a recorded call, this
    can be the first use of distributed autograd in a process, so the engine is loaded by
    name here if it has not registered yet: a plug-in load at run time (the engine imports
    torch), not an import of this module."""
    if _backward is None:
        importlib.import_module("rrefrt.autograd._engine")  # registers itself
    assert _backward is not None
    _backward(rref, context_id, retain_graph)
