"""The worker pool without processes: compensation of blocked threads, its cap, and the
typed refusal at the cap (issue 11 item 12: 3021 threads at nesting depth 8000)."""

from __future__ import annotations

import threading

import pytest

import rrefrt
from rrefrt.futures import Future
from rrefrt.pool import PoolExhaustedError, WorkerPool, current_pool
from tests.support import poll_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool():
    p = WorkerPool("test-pool", 2, max_threads=6)
    yield p
    p.stop()


def blocked_task(release: threading.Event, started: list) -> None:
    """What a nested rpc_sync does: tell the pool, then wait (bounded)."""
    p = current_pool()
    assert p is not None
    with p.blocking():
        started.append(1)
        release.wait(30)


def test_blocked_threads_are_compensated_up_to_the_cap_and_no_further(pool):
    release, started = threading.Event(), []
    try:
        for _ in range(50):
            pool.submit(blocked_task, release, started)
        poll_for(lambda: len(started) == 6, 10, "six blocked tasks")
        s = pool.stats()
        assert s["threads"] == 6 and s["blocked"] == 6 and s["queued"] == 44, s
        assert s["peak_threads"] == 6 and s["max_threads"] == 6
    finally:
        release.set()
    poll_for(lambda: len(started) == 50, 10, "every queued task ran once threads were released")
    poll_for(lambda: pool.stats()["threads"] <= 2, 10, "extra threads leave once idle")
    assert pool.stats()["peak_threads"] == 6


def test_at_the_cap_with_every_thread_blocked_a_new_call_is_refused(pool):
    release, started = threading.Event(), []
    try:
        for _ in range(6):
            pool.submit(blocked_task, release, started)
        poll_for(lambda: len(started) == 6, 10, "six blocked tasks")
        with pytest.raises(PoolExhaustedError, match="exhausted") as ei:
            pool.submit(print, "never", reject_when_exhausted=True)
        assert isinstance(ei.value, rrefrt.RpcError) and "nested" in str(ei.value)
        assert pool.stats()["rejected"] == 1 and pool.stats()["queued"] == 0
        ran = threading.Event()
        pool.submit(ran.set)  # the plain submit queues (callbacks wait for a thread)
        assert pool.stats()["queued"] == 1
    finally:
        release.set()
    assert ran.wait(10)


def test_busy_but_not_blocked_threads_queue_instead_of_refusing():
    p = WorkerPool("busy", 1, max_threads=1)
    gate, done = threading.Event(), threading.Event()
    try:
        p.submit(gate.wait, 30)
        poll_for(lambda: p.stats()["queued"] == 0 and p.stats()["threads"] == 1, 10)
        p.submit(done.set, reject_when_exhausted=True)  # running, not blocked: queued
        assert p.stats()["queued"] == 1
        gate.set()
        assert done.wait(10)
    finally:
        p.stop()


def test_a_future_waited_on_in_a_pool_thread_counts_as_blocked(pool):
    fut: Future = Future()
    inner_ran = threading.Event()
    outer_done = threading.Event()

    def outer():
        pool.submit(lambda: (inner_ran.set(), fut.set_result(1)))
        fut.result(10)  # would deadlock a pool of busy threads without compensation
        outer_done.set()

    pool.submit(outer)
    pool.submit(outer)  # both base threads now wait on fut
    assert outer_done.wait(10) and inner_ran.is_set()


def test_default_cap_is_bounded():
    p = WorkerPool("default", 16)
    try:
        assert 16 < p.max_threads <= 4096
    finally:
        p.stop()


def test_stopped_pool_refuses_work(pool):
    pool.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.submit(print)


def test_submit_batched_drains_a_burst_in_few_tasks(pool):
    gate = threading.Event()
    drained: list = []
    batches: list = []

    def drain(items):
        gate.wait(10)
        batches.append(len(items))
        drained.extend(items)

    for i in range(100):
        pool.submit_batched(i, drain)
    gate.set()
    poll_for(lambda: len(drained) == 100, 10, "every batched item drained")
    assert sorted(drained) == list(range(100)) and len(batches) <= 3
    pool.submit_batched(100, drain)  # a new burst schedules a new drain
    poll_for(lambda: len(drained) == 101, 10)


def test_a_burst_of_quick_tasks_wakes_one_runner_not_a_thread_per_task():
    """NOTE [One runner under load]: the thread running tasks takes the next one itself; a
    burst costs one wake-up (plus the watcher), not one thread per task."""
    p = WorkerPool("burst", 8, max_queue_wait=5.0)  # the watcher never steps in here
    ran_on: set = set()
    done = threading.Event()
    try:
        for i in range(200):
            p.submit(lambda i=i: (ran_on.add(threading.current_thread().name), i == 199 and done.set()))
        assert done.wait(10)
        s = p.stats()
        assert s["peak_threads"] <= 2 and len(ran_on) == 1, (s, ran_on)  # was: 8 threads
    finally:
        p.stop()


def test_a_task_queued_behind_a_long_one_starts_within_the_bound():
    """A long task that never says it blocks must not hold the queue: the watcher (a task
    queued right behind it) and submit (a task queued once it has run a while) start
    another thread."""
    p = WorkerPool("long", 4, max_queue_wait=0.05)
    gate, first, second = threading.Event(), threading.Event(), threading.Event()
    try:
        p.submit(gate.wait, 30)
        p.submit(first.set)  # right behind it: the watcher's case
        assert first.wait(10) and not gate.is_set()
        poll_for(lambda: p.stats()["active"] == 1, 10, "the second thread went idle")
        p.submit(second.set)  # long after it started: submit wakes a thread at once
        assert second.wait(10) and not gate.is_set()
        assert p.stats()["threads"] <= 3
    finally:
        gate.set()
        p.stop()


def test_every_thread_is_accounted_for_after_nested_waits_between_two_pools():
    """Threads idle, watching, running or blocked add up to the threads alive (a thread
    woken twice before it ran once was counted idle twice: a lost wake-up, a hung call)."""
    a, b = WorkerPool("a", 2, max_threads=200), WorkerPool("b", 2, max_threads=200)

    def nested(depth: int, here: WorkerPool, there: WorkerPool) -> None:
        if depth:
            f: Future = Future()
            there.submit(lambda: (nested(depth - 1, there, here), f.set_result(1)))
            f.result(30)

    try:
        for _ in range(3):
            outs = []
            for i in range(60):
                out: Future = Future()
                a.submit(lambda out=out, i=i: (nested(i % 5, a, b), out.set_result(i)))
                outs.append(out)
            assert [o.result(30) for o in outs] == list(range(60))
            for p in (a, b):
                poll_for(lambda: p.stats()["active"] == p.stats()["blocked"] == p.stats()["queued"] == 0, 10)
                s = p.stats()
                assert s["threads"] == s["idle"] + s["watching"], s
    finally:
        a.stop()
        b.stop()
