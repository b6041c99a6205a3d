"""A graceful shutdown whose steps all succeed, but after its deadline, raises (the
protocol did not complete within its timeout). Logic only: a fake runtime and rendezvous."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rrefrt.errors import ShutdownError
from rrefrt.lifecycle import _graceful

pytestmark = pytest.mark.timeout(30)


class _Rendezvous:
    """Every barrier is met at once; one step takes ``slow`` seconds."""

    server = None

    def __init__(self, slow: float) -> None:
        self.slow = slow

    def barrier(self, phase: str, rank: int, world_size: int, deadline: float, dead: object) -> list[int]:
        if phase == "drained":
            end = time.monotonic() + self.slow
            while time.monotonic() < end:  # a step that runs late (the fake's own work, not a wait)
                pass
        return []

    def arrive(self, phase: str, rank: int) -> None:
        pass


def _runtime() -> SimpleNamespace:
    return SimpleNamespace(
        info=SimpleNamespace(id=1, name="w1"), transport=SimpleNamespace(dead_peers=set), workers_by_id={},
        accepting=True, wait_idle=lambda deadline: True, release_rrefs=lambda deadline: [],
        ctx=SimpleNamespace(leaks=list), options=SimpleNamespace(strict_rref_leaks=False),
    )


def test_steps_that_end_past_the_deadline_raise():
    err = _graceful(_runtime(), _Rendezvous(slow=0.05), 2, time.monotonic() + 0.01)
    assert isinstance(err, ShutdownError) and "did not complete within its timeout" in str(err), err


def test_steps_within_the_deadline_return_no_error():
    assert _graceful(_runtime(), _Rendezvous(slow=0.0), 2, time.monotonic() + 10) is None
