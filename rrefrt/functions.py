"""``@rrefrt.functions.async_execution`` and the callee side of it. Never imports torch (torch's futures are recognised once torch is
imported: rrefrt/payload/torchimport.py's ``loaded()``).

NOTE [async_execution]: a decorated function returns a Future (rrefrt's, the stdlib's or
torch's); the callee replies when that Future completes, without holding a worker thread
while it waits. The runtime asks ``is_async_execution(func)`` (rrefrt's marker or torch's
``_wrapped_async_rpc_function``, so functions decorated with torch's own decorator work
too) and hands the returned object to ``when_future_done``. A decorated function that
returns anything else fails the call with ``AsyncExecutionTypeError``, whose message starts
with torch's phrase (torch programs match on it).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable, TypeVar

from rrefrt.payload import torchimport
from rrefrt.errors import RpcError

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["async_execution", "AsyncExecutionTypeError", "is_async_execution", "is_future", "when_future_done"]


class AsyncExecutionTypeError(RpcError, TypeError):
    """An ``@async_execution`` function returned something that is not a Future (torch
    raises a RuntimeError, earlier rrefrt a TypeError: this is both)."""


def async_execution(fn: F) -> F:
    """Mark a remote function that returns a Future (rrefrt's, concurrent.futures' or
    torch's): the callee replies when that Future completes, without holding a worker
    thread while it waits. ``set_exception`` on it makes the caller raise. Works for
    functions, static, class and bound methods, also through RRef proxies.

    As in torch, put it innermost when combined with ``@staticmethod``/``@classmethod``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if not is_future(result):
            raise wrong_return_type(fn, result)
        return result

    wrapper._rrefrt_async_execution = True  # type: ignore[attr-defined]
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]  (torch's marker)
    return wrapper  # type: ignore[return-value]


def is_async_execution(func: Any) -> bool:
    """Whether ``func`` (a function, a bound method) carries rrefrt's or torch's marker."""
    return bool(getattr(func, "_rrefrt_async_execution", False)) or hasattr(func, "_wrapped_async_rpc_function")


def is_future(obj: Any) -> bool:
    if isinstance(obj, concurrent.futures.Future):
        return True
    torch = torchimport.loaded()  # a torch future exists only once torch is imported
    c_future = getattr(getattr(torch, "_C", None), "Future", None) if torch is not None else None
    return c_future is not None and isinstance(obj, c_future)


def wrong_return_type(func: Any, result: Any) -> AsyncExecutionTypeError:
    name = getattr(func, "__qualname__", repr(func))
    return AsyncExecutionTypeError(
        f"Functions decorated with @rpc.async_function must return a torch.futures.Future object, but got "
        f"{type(result)} (rrefrt: @async_execution function {name!r} must return an rrefrt.Future, a "
        f"concurrent.futures.Future or a torch.futures.Future)"
    )


def when_future_done(result: Any, func: Any, done: Callable[[Any, BaseException | None], None]) -> None:
    """Callee side of an ``@async_execution`` call: ``done(value, None)`` or
    ``done(None, error)`` once the Future ``result`` completes (at once for a wrong type)."""
    if isinstance(result, concurrent.futures.Future):
        result.add_done_callback(lambda f: _settle(f.result, done))
    elif is_future(result):  # torch's: its callback runs on the thread completing it
        result.add_done_callback(lambda f: _settle(f.wait, done))
    else:
        done(None, wrong_return_type(func, result))


def _settle(get: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
    try:
        value = get()
    except BaseException as e:
        done(None, e)
        return
    done(value, None)
