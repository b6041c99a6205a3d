"""Checks of what users pass to the API: options, ranks, call arguments, timeouts.

Rule: a bad argument fails at the call that takes it, with an ``ArgumentError`` (also a
``TypeError`` and a ``ValueError``) naming the argument, what it accepts and what it got -
never later, as a timeout of NaN that never expires, a float rank that makes the rendezvous
wait out ``init_timeout``, or a string of arguments unpacked one character each.

Each check returns the value in its canonical form (``float`` seconds, ``int`` counts).
A ``bool`` is never taken for a number (``True`` is an ``int`` to Python, not to a user).
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

from rrefrt.errors import ArgumentError

__all__ = ["seconds", "integer", "flag", "call_timeout", "call_args", "call_kwargs", "backend_type"]

#: torch's phrase for a constructor argument of the wrong type (torch's tests match it)
_CONSTRUCTOR = "incompatible constructor arguments: "


def seconds(name: str, value: Any, *, positive: bool = False, constructor: bool = False) -> float:
    """A finite number of seconds, ``>= 0`` (``> 0`` when ``positive``), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        prefix = _CONSTRUCTOR if constructor else ""
        raise ArgumentError(f"{prefix}{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise ArgumentError(f"{name} must be a finite number of seconds, got {value!r}")
    if out < 0 or (positive and out == 0):
        raise ArgumentError(f"{name} must be a number of seconds {'> 0' if positive else '>= 0'}, got {value!r}")
    return out


def integer(name: str, value: Any, *, minimum: int, what: str = "", constructor: bool = False) -> int:
    """An ``int`` (or anything with ``__index__``, a numpy integer) ``>= minimum``; never a
    bool or a float, even an integral one. ``what`` replaces the default description."""
    desc = what or f"an int >= {minimum}"
    if isinstance(value, bool):
        raise ArgumentError(f"{_CONSTRUCTOR if constructor else ''}{name} must be {desc}, got {value!r} (a bool)")
    try:
        out = operator.index(value)
    except TypeError:
        raise ArgumentError(
            f"{_CONSTRUCTOR if constructor else ''}{name} must be {desc}, got {value!r} ({type(value).__name__})"
        ) from None
    if out < minimum:
        raise ArgumentError(f"{name} must be {desc}, got {value!r}")
    return out


def flag(name: str, value: Any, *, constructor: bool = True) -> bool:
    """A ``bool`` (``0``/``1`` too); a string such as ``"false"`` is refused, not taken as true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    prefix = _CONSTRUCTOR if constructor else ""
    raise ArgumentError(f"{prefix}{name} must be True or False, got {value!r} ({type(value).__name__})")


_INF = math.inf

#: what a call's timeout means, for its messages
_CALL_TIMEOUT = "pass -1 for the default rpc_timeout, 0 for none (a call is still bounded by the death of its destination)"


def call_timeout(value: Any, *, name: str = "timeout", meaning: str = _CALL_TIMEOUT) -> float | None:
    """The ``timeout`` of a call (``rpc_sync``, ``to_here``, ...): None or a negative number
    means the default (returned as None), 0 no timeout, else finite seconds. ``shutdown``
    passes its own ``meaning`` for the messages."""
    if value is None:
        return None
    if type(value) is float and -_INF < value < _INF:  # the common case, quickly
        return None if value < 0 else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__}); {meaning}")
    out = float(value)
    if not math.isfinite(out):
        raise ArgumentError(f"{name} must be a finite number of seconds, got {value!r}; {meaning}")
    return None if out < 0 else out


def call_args(args: Any) -> tuple[Any, ...]:
    """The positional arguments of a call: None or any iterable of them but a string, bytes
    or a mapping (``args=("x")`` is a string, not a tuple: it would be unpacked one character
    at a time)."""
    if args is None:
        return ()
    if isinstance(args, tuple):
        return args
    if isinstance(args, (str, bytes, bytearray, Mapping)):
        hint = " (a tuple of one needs a comma: (x,))" if isinstance(args, (str, bytes, bytearray)) else ""
        raise ArgumentError(f"args must be a tuple or list of positional arguments, got {type(args).__name__} {args!r:.80}{hint}")
    try:
        return tuple(args)
    except TypeError:
        raise ArgumentError(
            f"args must be a tuple or list of positional arguments, got {type(args).__name__} {args!r:.80}"
        ) from None


def call_kwargs(kwargs: Any) -> dict[str, Any]:
    """The keyword arguments of a call: None or a mapping with string keys."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ArgumentError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__} {kwargs!r:.80}")
    out = dict(kwargs)
    for key in out:
        if not isinstance(key, str):
            raise ArgumentError(f"kwargs must have str keys (argument names), got {key!r}")
    return out


def backend_type(value: Any) -> None:
    """``init_rpc(backend=...)``: None or TENSORPIPE - rrefrt's ``BackendType`` member or
    torch's (any enum member of that name); rrefrt has one backend. A string is refused
    as torch refuses it."""
    if value is None or (isinstance(value, enum.Enum) and value.name == "TENSORPIPE"):
        return
    raise ArgumentError(  # torch's phrase, which its tests match
        f"Argument backend must be a member of BackendType: rrefrt.BackendType.TENSORPIPE or None "
        f"(rrefrt has one backend), got {value!r}"
    )
