"""NOTE [Own reads] in transport/unix/receiver.py: a thread blocked in rpc_sync or to_here()
reads its answer from the same-host socket itself. The results must be those of the
plain path under concurrent callers, nested calls back to the waiting worker, remote()
creations, timeouts and errors.

One group (this process is w0, w1 serves in a subprocess) runs every check.
"""

from __future__ import annotations

import threading
import time

import pytest

import rrefrt
from tests.support import inline_fns as fns
from tests.support import Workers, free_port

WITHIN = 10.0


def _own_reads() -> int:
    return int(rrefrt.get_debug_info()["agent.own_reads"])


def _square(x: int) -> int:
    return x * x


def _fail(x: int) -> int:
    raise ValueError(f"bad {x}")


def _join(workers: Workers) -> None:
    """This process joins as w0 with w1 in a subprocess (``workers``)."""
    port = free_port()
    opts = {"rpc_timeout": 60.0, "shutdown_timeout": 30.0}
    workers.start({"name": "w1", "rank": 1, "world_size": 2, "port": port, "options": opts})
    rrefrt.init_rpc("w0", rank=0, world_size=2,
                    rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **opts))


@pytest.mark.timeout(120)
def test_callers_that_read_their_own_answers_get_the_same_results() -> None:
    workers = Workers()
    try:
        _join(workers)
        before = _own_reads()
        for i in range(50):  # (a wait that finds the loop reading the socket leaves it the answer)
            assert rrefrt.rpc_sync("w1", _square, args=(i,)) == i * i
            if _own_reads() > before:
                break
        assert _own_reads() > before

        # concurrent callers: each gets its own answers (read by itself, or by another
        # reader and handed to it), sync calls, async calls and to_here() mixed
        errors: list[BaseException] = []

        def caller(t: int) -> None:
            try:
                for i in range(60):
                    x = t * 1000 + i
                    assert rrefrt.rpc_sync("w1", _square, args=(x,)) == x * x
                    assert rrefrt.remote("w1", _square, args=(x,)).to_here() == x * x
                    fut = rrefrt.rpc_async("w1", _square, args=(x + 1,))
                    assert rrefrt.rpc_sync("w1", _square, args=(x + 2,)) == (x + 2) ** 2
                    assert fut.wait() == (x + 1) ** 2
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors[:3]
        assert not any(th.is_alive() for th in threads)

        # a nested call back to this worker while its caller reads its own answer: the
        # call goes to the loop and is served (A -> B -> A)
        for _ in range(5):
            back, _outer = rrefrt.rpc_sync("w1", fns.call_back, args=("w0", 1), timeout=WITHIN)
            assert back.startswith("rrefrt-"), back

        # remote errors and timeouts through the same path
        with pytest.raises(ValueError, match="bad 3"):
            rrefrt.rpc_sync("w1", _fail, args=(3,))
        rrefrt.rpc_sync("w1", fns.reset_gate)
        t0 = time.monotonic()
        with pytest.raises(rrefrt.RpcTimeoutError):
            rrefrt.rpc_sync("w1", fns.wait_gate, args=(30.0,), timeout=0.5)
        assert time.monotonic() - t0 < 5.0
        rrefrt.rpc_sync("w1", fns.open_gate)
        assert rrefrt.rpc_sync("w1", _square, args=(3,)) == 9

        rrefrt.shutdown()
        assert workers.wait_all(30)[0][0] == 0
    finally:
        workers.kill_all()


def _spin_hits() -> int:
    return int(rrefrt.get_debug_info()["agent.rx_spin_hits"])


@pytest.mark.timeout(120)
def test_a_callees_loop_catches_a_ping_pong_in_its_spin() -> None:
    """NOTE [Receiver spin] in transport/unix/receiver.py: with the default settings the
    callee's loop, about to sleep after a call, polls long enough that the caller's next
    request (sent one caller's turn after the answer) reaches it without waking it."""
    workers = Workers()
    try:
        _join(workers)
        for i in range(50):  # warm: the same-host channel is up, the code paths are hot
            assert rrefrt.rpc_sync("w1", _square, args=(i,)) == i * i
        # a quiet machine catches nearly every one (2188 of 2194 spins in 2000 calls), one
        # beside 2 CPU burners a tenth to a third; a 50 us spin that caught only bursts
        # caught none of a ping-pong. Up to 3 tries of 400 calls, for a loaded machine.
        n, caught = 400, []
        for _ in range(3):
            before = rrefrt.rpc_sync("w1", _spin_hits)
            for i in range(n):
                assert rrefrt.rpc_sync("w1", _square, args=(i,)) == i * i
            caught.append(rrefrt.rpc_sync("w1", _spin_hits) - before)
            if caught[-1] >= n // 10:
                break
        assert caught[-1] >= n // 10, caught
        rrefrt.shutdown()
        assert workers.wait_all(30)[0][0] == 0
    finally:
        workers.kill_all()
