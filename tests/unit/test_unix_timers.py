"""The receiver loop's timers and request deadline slices (transport/unix/timers.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rrefrt_transport.unix.timers import Pending, Timers

pytestmark = pytest.mark.timeout(30)


def _pending(deadline: float) -> Pending:
    return Pending(dest=1, deadline=deadline, timeout=0.02, on_done=lambda *a: None)


def test_an_answer_taken_on_a_callers_thread_while_its_slice_expires_loses_no_other_timeout() -> None:
    """A caller that reads its own answer disarms its request on its own thread while the
    loop may be expiring the same slice: either the request leaves the slice first, or
    the loop takes the slice whole; the others in it still time out (the slice used to be
    changed under the loop's iteration: the rest of it never timed out). The caller is
    switched out for at most 0.5 s: with the timer lock held there, the loop cannot reach
    the slice meanwhile, and the wait ends at its bound."""
    expired: list[int] = []
    loop_iterating = threading.Event()
    got = threading.Event()
    caller: list[threading.Thread] = []

    def expire(p: Pending, msg_id: int) -> None:
        expired.append(msg_id)
        if msg_id == 1:  # the loop is inside the slice now: let the caller go on
            loop_iterating.set()
            caller[0].join(5)

    timers = Timers(lambda: None, expire)

    class SwitchAfterGet(dict):
        """The caller's thread is switched out right after it looked its slice up."""

        def get(self, key: Any, default: Any = None) -> Any:
            found = super().get(key, default)
            if caller and threading.current_thread() is caller[0]:
                got.set()
                loop_iterating.wait(0.5)
            return found

    timers.buckets = SwitchAfterGet()
    due = time.monotonic() - 1.0  # already due: the loop's next run expires the slice
    pendings = {i: _pending(due) for i in (1, 2, 3, 4)}
    for i, p in pendings.items():
        timers.arm(p, i)
    assert len({p.bucket for p in pendings.values()}) == 1, "one slice"
    caller.append(threading.Thread(target=timers.disarm, args=(pendings[2], 2)))
    caller[0].start()
    assert got.wait(5)
    timers.run_due()
    caller[0].join(5)
    assert sorted(expired) == [1, 3, 4], expired
