"""Arguments are a snapshot (API.md, "Calls"): once rpc_async returns, mutating a tensor
argument does not change what the callee receives - on the same-host data plane (the
sending thread has written the bytes before it returns) and on the zmq transport (which
copies buffer frames on the calling thread before it hands them to its I/O thread)."""

from __future__ import annotations

import os

import pytest

import rrefrt
from tests.support import Workers, free_port

torch = pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["auto", "zmq"])
def test_arguments_mutated_after_rpc_async_returns_reach_the_callee_unchanged(kind, monkeypatch):
    monkeypatch.setenv("RREFRT_TRANSPORT", kind)
    port = free_port()
    workers = Workers()
    opts = dict(rpc_timeout=30.0, shutdown_timeout=30.0)
    try:
        workers.start({"name": "w1", "rank": 1, "world_size": 2, "port": port, "options": opts},
                      {"RREFRT_TRANSPORT": kind})
        rrefrt.init_rpc("w0", rank=0, world_size=2,
                        rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **opts))
        changed = 0
        for size in (1 << 10, 1 << 20, 4 << 20):  # inline frames and large (shared memory / zero-copy) ones
            for _ in range(10):
                t = torch.ones(size // 4)
                fut = rrefrt.rpc_async("w1", torch.sum, args=(t,))
                t.fill_(7.0)  # right after the call returned
                changed += float(fut.wait()) != float(size // 4)
        assert changed == 0, f"{changed} of 30 calls saw the argument mutated after rpc_async returned ({kind})"
        rrefrt.shutdown(timeout=20)
        for code, out in workers.wait_all(30):
            assert code == 0, out
    finally:
        if rrefrt.state.current_or_none() is not None:
            rrefrt.shutdown(graceful=False)
        workers.kill_all()
        os.environ.pop("RREFRT_TRANSPORT", None)
