"""``@rrefrt.functions.async_execution``. Leaf module."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["async_execution"]


def async_execution(fn: F) -> F:
    """Mark a remote function that returns a Future (rrefrt's, concurrent.futures' or
    torch's): the callee replies when that Future completes, without holding a worker
    thread while it waits. ``set_exception`` on it makes the caller raise.

    As in torch, put it innermost when combined with ``@staticmethod``/``@classmethod``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._rrefrt_async_execution = True  # type: ignore[attr-defined]
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]  (torch's marker)
    return wrapper  # type: ignore[return-value]
