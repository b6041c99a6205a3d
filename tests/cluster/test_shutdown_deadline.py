"""A graceful shutdown whose steps all succeed, but after its deadline, raises (the
protocol did not complete within its timeout). Logic only: a fake runtime and rendezvous."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rrefrt.errors import ShutdownError
from rrefrt.runtime.shutdown import _graceful

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
        accepting=True, lifecycle=SimpleNamespace(wait_idle=lambda deadline: True, release_rrefs=lambda deadline: [],
                                                  in_use=lambda: (0, False)),
        ctx=SimpleNamespace(leaks=list), options=SimpleNamespace(strict_rref_leaks=False, rpc_timeout=60.0),
        inflight=SimpleNamespace(incoming={}, outgoing={}),
    )


def test_steps_that_end_past_the_deadline_raise():
    err = _graceful(_runtime(), _Rendezvous(slow=0.05), 2, [time.monotonic() + 0.01], 0.01)
    assert isinstance(err, ShutdownError) and "did not complete within its timeout" in str(err), err


def test_steps_within_the_deadline_return_no_error():
    assert _graceful(_runtime(), _Rendezvous(slow=0.0), 2, [time.monotonic() + 10], 10) is None


def test_a_worker_that_gave_up_its_shutdown_is_missing_not_dead():
    """A worker whose shutdown failed (it arrived at "failed") and closed: another worker's
    barrier reports it as missing at its deadline instead of counting it as dead (a death
    completes a barrier; a shutdown that gave up must not complete the others')."""
    from rrefrt.group.rendezvous import GroupSpec, Record, Rendezvous
    from tests.support import free_port

    port = free_port()
    host = Rendezvous(GroupSpec("127.0.0.1", port, 0, 2), 10)
    other = Rendezvous(GroupSpec("127.0.0.1", port, 1, 2), 10)
    import threading

    t = threading.Thread(target=lambda: other.join(Record("w1", 1, 2, 1, {}, {}), time.monotonic() + 10))
    t.start()
    host.join(Record("w0", 0, 2, 0, {}, {}), time.monotonic() + 10)
    t.join(10)
    try:
        other.arrive("enter", 1)
        other.arrive("failed", 1)
        assert host.barrier("enter", 0, 2, time.monotonic() + 5, {1}) == []  # it did arrive there
        assert host.barrier("drained", 0, 2, time.monotonic() + 0.3, {1}) == [1]
    finally:
        other.close()
        host.close()


class _NeverEntered(_Rendezvous):
    """The other worker never reaches the enter barrier."""

    def barrier(self, phase: str, rank: int, world_size: int, deadline: float, dead: object) -> list[int]:
        time.sleep(max(0.0, deadline - time.monotonic()))  # (the fake barrier's wait for its deadline)
        return [0] if phase == "enter" else []


def test_a_call_stuck_in_flight_holds_the_shutdown_back_for_its_rpc_timeout_only():
    """NOTE [Shutdown while in use] (2.): a call that never ends counts as use for
    rpc_timeout from its start; then the shutdown gives up ``limit`` later."""
    rt = _runtime()
    started = time.monotonic()
    rt.lifecycle.in_use = lambda: (7, started)  # no call event, one call in flight for good
    rt.options.rpc_timeout = 0.6
    t0 = time.monotonic()
    err = _graceful(rt, _NeverEntered(slow=0.0), 2, [t0 + 0.3], 0.3)
    took = time.monotonic() - t0
    assert isinstance(err, ShutdownError) and "never reached shutdown" in str(err), err
    assert "since the last call from or to this worker" in str(err), err
    assert 0.6 + 0.3 <= took <= 0.6 + 0.3 + 0.5 + 0.5, took  # + one poll + slack
