"""Functions run by tests/cluster/test_own_reads.py on a worker (importable by every worker)."""

from __future__ import annotations

import threading
import time
from typing import Any

import rrefrt

_gate = threading.Event()
_entered = threading.Event()
_where: list[str] = []


def thread_name() -> str:
    return threading.current_thread().name


def wait_gate(seconds: float) -> tuple[bool, str]:
    """Block (no sleep: an Event with a deadline) until ``open_gate`` or ``seconds``."""
    _where[:] = [threading.current_thread().name]
    _entered.set()
    opened = _gate.wait(seconds)
    return opened, threading.current_thread().name


def entered() -> str:
    """The thread that runs the blocked function, once it runs ("" before)."""
    return (_where or [""])[0] if _entered.is_set() else ""


def open_gate() -> bool:
    _gate.set()
    return True


def reset_gate() -> bool:
    _gate.clear()
    _entered.clear()
    _where.clear()
    return True


def spin(seconds: float) -> int:
    """Compute (hold the GIL as plain Python code does) for ``seconds``."""
    _where[:] = [threading.current_thread().name]
    _entered.set()
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def call_back(to: str, x: Any) -> tuple[Any, str]:
    """A nested call back to ``to`` from the function (A -> B -> A)."""
    return rrefrt.rpc_sync(to, thread_name), threading.current_thread().name


def transport_stats() -> dict[str, int]:
    st = rrefrt.state.current().transport.stats
    return {k: int(v) for k, v in st.items() if k.startswith("inline_")}
