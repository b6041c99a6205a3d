"""The tcp stream plane (transport/auto.py, Rule 8; NOTE [Tcp stream plane] in
transport/unix/transport.py) under the runtime: with the same-host path off, workers reach
each other over one TCP stream per pair, made on first use, tensors of every size arrive
intact, and a worker killed mid-call fails its callers at once, its death judged by zmq."""

from __future__ import annotations

import time

import pytest
import torch

import rrefrt
from tests.support import poll_for
from tests.support import workerfns as fns


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RREFRT_SAME_HOST", "0")  # the children inherit it
    monkeypatch.setenv("RREFRT_NO_IPC", "1")
    monkeypatch.delenv("RREFRT_SECRET", raising=False)
    monkeypatch.delenv("RREFRT_TCP_STREAM", raising=False)


@pytest.mark.timeout(120)
def test_calls_tensors_and_rrefs_travel_over_the_stream_plane(tcp_only: None, group) -> None:
    group(3)
    t = rrefrt.state.current().transport
    assert t.stream is not None and t.local is None
    assert t.stream.connected_peers() == set(), "init_rpc made no stream connection"
    assert rrefrt.rpc_sync("w1", fns.add, args=(2, 3)) == 5
    assert t.uses_stream_path(1) and t.stream.connected_peers() == {1}
    for n in (4 << 10, 300 << 10, 1 << 20, 40 << 20):  # inline, buffered, heap body, pooled mapping
        x = torch.arange(n // 4, dtype=torch.float32)
        y = rrefrt.rpc_sync("w1", fns.identity, args=(x,))
        assert torch.equal(x, y)
    assert rrefrt.remote("w1", fns.add, args=(1, 1)).to_here() == 2
    # w2 -> w1: the higher id asks w1, through zmq, to connect
    assert rrefrt.rpc_sync("w2", rrefrt.rpc_sync, args=("w1", fns.add, (4, 4))) == 8
    assert rrefrt.rpc_sync("w2", fns.stream_connections) == [0, 1]
    assert rrefrt.rpc_sync("w1", fns.stream_connections) == [0, 2]
    sent = t.stream.stats["messages_sent"]
    assert sent >= 7, t.stream.stats


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_call_fails_its_caller_over_the_stream_at_once(tcp_only: None, group) -> None:
    procs = group(2)
    assert rrefrt.rpc_sync("w1", fns.add, args=(1, 2)) == 3
    assert rrefrt.state.current().transport.uses_stream_path(1)
    fut = rrefrt.rpc_async("w1", fns.sleep_for, args=(60.0,))
    assert rrefrt.rpc_sync("w1", fns.add, args=(1, 1)) == 2  # the long call is running
    t0 = time.monotonic()
    group.workers.kill(procs["w1"])
    with pytest.raises(rrefrt.RpcError) as info:
        fut.wait()
    assert time.monotonic() - t0 < 2.0, "the EOF fails the call, not a timeout"
    assert "w1" in str(info.value)
    assert rrefrt.get_debug_info()["agent.connections_lost"] == 1
    # the zmq transport's liveness then judges the death (within its heartbeat bounds)
    t = rrefrt.state.current().transport
    poll_for(lambda: not t.is_alive(1), 15, "w1 declared dead by the inner transport")
    with pytest.raises(rrefrt.WorkerUnavailableError):
        rrefrt.rpc_sync("w1", fns.add, args=(1, 1))
