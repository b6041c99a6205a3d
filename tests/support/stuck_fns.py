"""Handlers that get stuck, for tests/cluster/test_stuck.py (importable on every worker)."""

from __future__ import annotations

import threading
import time

_release = threading.Event()
_entered = threading.Event()


def stuck(limit: float = 60.0, flag: str = "") -> str:
    """Blocks in time.sleep until ``release()`` (or ``limit`` seconds); creates the file
    ``flag`` (if given) once it runs."""
    _entered.set()
    if flag:
        open(flag, "w").close()
    deadline = time.monotonic() + limit
    while not _release.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    return "released"


def entered() -> bool:
    return _entered.is_set()


def release() -> None:
    _release.set()


def rearm() -> None:
    _release.clear()
    _entered.clear()


def quick() -> int:
    return 1


def hold_the_gil(n: int) -> int:
    """A long C loop that never lets another thread of its process run."""
    return sum(range(n))


class StuckBox:
    def stuck(self, limit: float = 60.0) -> str:
        return stuck(limit)
