"""NOTE [Lazy same-host connections] (transport/unix/transport.py): with init_rpc's defaults
the same-host plane makes no connection at the join; a pair connects when one of them first
sends to the other (the lower id connects; the higher one asks it to through the inner
transport), messages sent meanwhile wait in order, and a worker never called holds none."""

from __future__ import annotations

import threading

import pytest

import rrefrt
from tests.support import workerfns as fns


@pytest.mark.timeout(120)
def test_same_host_connections_are_made_on_first_use_and_keep_order(group):
    # one pool thread on the callees: their calls then run in the order they arrived (a pool
    # of several may start a second runner when the first is held off the GIL for 2 ms,
    # NOTE [One runner under load] in rrefrt/pool.py, so execution order would not show
    # the transport's order); w3's thread that waits in burst_then_report is compensated
    group(4, peer_options={"num_worker_threads": 1})
    t = rrefrt.state.current().transport
    assert t.local is not None and all(t.uses_same_host_path(i) for i in (1, 2, 3)), "the test is about the unix path"
    assert t.local.connected_peers() == set(), "init_rpc made same-host connections"
    # every peer is on this host: the tcp stream plane closed at the join (no thread, no port)
    assert t.stream is None and not any(th.name.startswith("rrefrt-stream") for th in threading.enumerate())
    # w0 -> w3: the lower id connects
    assert rrefrt.rpc_sync("w3", fns.same_host_connections) == [0]
    assert t.local.connected_peers() == {3}
    # w3 -> w1: the higher id asks w1 (through zmq) to connect; 200 calls issued at once wait
    # in w3's channel to w1 meanwhile and arrive in order (w1 runs them on its one pool thread)
    got = rrefrt.rpc_sync("w3", fns.burst_then_report, args=("w1", 200))
    assert got["results"] == list(range(200)) and got["seen"] == list(range(200)), got
    assert got["mine"] == [0, 1], got
    assert rrefrt.rpc_sync("w3", rrefrt.rpc_sync, args=("w1", fns.same_host_connections)) == [3]
    # w2 was never called: it has no same-host connection (and the first call makes one)
    assert rrefrt.rpc_sync("w3", rrefrt.rpc_sync, args=("w2", fns.same_host_connections)) == [3]
    stats = rrefrt.get_debug_info()
    print(f"\nlazy same-host connections: w0 connected to {sorted(t.local.connected_peers())}; "
          f"transport counters {({k: v for k, v in stats.items() if 'connections_' in k})}")
