"""NOTE [Inline calls] in transport/unix/lead.py: on the same-host plane the thread that read
a call runs it (no pool hand-off), and the reading role passes to a standby thread when a
call blocks, so other calls to that worker keep being served and liveness holds.

One group (this process is w0, w1 serves in a subprocess) runs every check.
"""

from __future__ import annotations

import time

import pytest

import rrefrt
from tests.support import inline_fns as fns
from tests.support import Workers, free_port, poll_for

#: generous: only a hang (no takeover: the second call waits for the first's 60 s) fails it
SERVED_WITHIN = 10.0


@pytest.mark.timeout(120)
def test_inline_calls_and_takeover(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RREFRT_INLINE", "1")  # off by default for now (NOTE [Inline calls] (6))
    workers = Workers()
    port = free_port()
    opts = {"rpc_timeout": 60.0, "shutdown_timeout": 30.0}
    try:
        workers.start({"name": "w1", "rank": 1, "world_size": 2, "port": port, "options": opts},
                      {"RREFRT_INLINE": "1"})
        rrefrt.init_rpc("w0", rank=0, world_size=2,
                        rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **opts))
        # 1. a quick call runs on the thread that read it (the unix receiver or its standby),
        # not on a pool thread: no wake-up per call. (On a loaded machine a no-op may take
        # over 2 ms and lose the loop; the next calls go to the pool until it returns: so
        # "some", not "all".)
        names = [rrefrt.rpc_sync("w1", fns.thread_name) for _ in range(20)]
        assert any(n.startswith("rrefrt-unix-w1") for n in names), names
        assert rrefrt.rpc_sync("w1", fns.transport_stats)["inline_calls"] >= 1

        # 2. A -> B -> A: nested calls; a nested wait on an inline thread hands the reading
        # role on at once (its answer must be read while it waits)
        for _ in range(5):
            back, outer = rrefrt.rpc_sync("w1", fns.call_back, args=("w0", 1))
            assert back.startswith("rrefrt-"), back
            if outer.startswith("rrefrt-unix-w1"):
                assert rrefrt.rpc_sync("w1", fns.transport_stats).get("inline_handoffs", 0) >= 1
                break

        # 3. a call blocking inline (on an Event with a deadline) loses the loop to the
        # standby: other calls to w1 are served meanwhile, and inline again once it returns
        for attempt in range(5):
            before = rrefrt.rpc_sync("w1", fns.transport_stats).get("inline_takeovers", 0)
            rrefrt.rpc_sync("w1", fns.reset_gate)
            blocked = rrefrt.rpc_async("w1", fns.wait_gate, args=(60.0,))
            where = poll_for(lambda: rrefrt.rpc_sync("w1", fns.entered), SERVED_WITHIN)
            t0 = time.monotonic()
            for _ in range(5):
                assert rrefrt.rpc_sync("w1", fns.thread_name, timeout=SERVED_WITHIN)
            assert time.monotonic() - t0 < SERVED_WITHIN and not blocked.done()
            inline = where.startswith("rrefrt-unix-w1")
            if inline:
                assert rrefrt.rpc_sync("w1", fns.transport_stats)["inline_takeovers"] > before
            rrefrt.rpc_sync("w1", fns.open_gate)
            assert blocked.wait(SERVED_WITHIN)[0]
            if inline:
                break
        else:
            pytest.fail("the blocking function never ran inline in 5 attempts")
        poll_for(lambda: rrefrt.rpc_sync("w1", fns.thread_name).startswith("rrefrt-unix-w1"), SERVED_WITHIN)

        # 4. the same for a function that computes (holds the GIL between switches)
        rrefrt.rpc_sync("w1", fns.reset_gate)
        spinning = rrefrt.rpc_async("w1", fns.spin, args=(3.0,))
        poll_for(lambda: rrefrt.rpc_sync("w1", fns.entered), SERVED_WITHIN)
        assert rrefrt.rpc_sync("w1", fns.thread_name, timeout=SERVED_WITHIN)
        spinning.wait(SERVED_WITHIN)

        # 5. a burst (calls that arrive together) goes to the pool, one wake-up for all
        # (NOTE [Inline calls] (7)); every call of it is answered
        before = rrefrt.rpc_sync("w1", fns.transport_stats).get("inline_bursts", 0)
        for _ in range(5):
            futs = [rrefrt.rpc_async("w1", fns.thread_name) for _ in range(200)]
            names = [f.wait(SERVED_WITHIN) for f in futs]
            if rrefrt.rpc_sync("w1", fns.transport_stats).get("inline_bursts", 0) > before:
                break
        else:
            pytest.fail("200 calls in flight never arrived two or more in one read")
        assert any(not n.startswith("rrefrt-unix-w1") for n in names), "a burst ran on the reading thread"

        rrefrt.shutdown()
        assert workers.wait_all(30)[0][0] == 0
    finally:
        workers.kill_all()
