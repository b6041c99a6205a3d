"""RPC calls in torch's legacy autograd profiler (rrefrt/profiling.py, NOTE [RPC profiling]).

One worker calling itself, in this process: the events and their names, node ids, shapes
and nesting do not depend on the peer being another process (torch's own suite checks the
multi-worker cases; tests/compat/test_torch_compat.py runs three of them in CI).
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

import rrefrt  # noqa: E402
from rrefrt import profiling  # noqa: E402
from tests.support import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)

from torch.autograd.profiler_legacy import profile  # noqa: E402


def ops(x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.profiler.record_function("##block##"):
        return torch.relu(x * 2)


@rrefrt.functions.async_execution
def nested(x: torch.Tensor) -> rrefrt.Future:
    return rrefrt.rpc_async("solo", torch.add, args=(x, 1))


def fails() -> None:
    raise ValueError("boom")


@pytest.fixture
def solo():
    rrefrt.init_rpc("solo", rank=0, world_size=1,
                    rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}"))
    try:
        yield
    finally:
        rrefrt.shutdown()


def named(events, text):
    return [e for e in events if text in e.name]


def test_calls_and_their_remote_events_are_recorded(solo):
    x = torch.ones(3, 4)
    assert not profiling.active()
    with profile(record_shapes=True) as prof:
        assert profiling.active()
        assert torch.equal(rrefrt.rpc_sync("solo", ops, args=(x,)), torch.relu(x * 2))
        assert rrefrt.rpc_async("solo", torch.mul, args=(x, 2)).wait().sum().item() == 24
        rref = rrefrt.remote("solo", ops, args=(x,))
        rref._get_profiling_future().wait(30)
        with pytest.raises(ValueError, match="boom"):
            rrefrt.rpc_sync("solo", fails)
        assert rrefrt.rpc_async("solo", nested, args=(x,)).wait().sum().item() == 24
        assert rref.rpc_sync().sum().item() == 24  # a proxy call (torch records those too)
    events = prof.function_events
    assert not named(events, "rrefrt::profiled_rpc")  # the markers are gone
    key = "rpc_sync#ops(solo -> solo)"
    (call,) = [e for e in events if e.name == key]
    assert call.node_id == 0 and not call.is_remote and call.count == 1
    remote = {e.name[len(key + "#remote_op: "):]: e for e in events if e.name.startswith(key + "#remote_op: ")}
    assert {"##block##", "aten::relu", "aten::mul"} <= set(remote)
    assert all(e.is_remote and e.node_id == 0 for e in remote.values())
    assert [list(s) for s in remote["aten::mul"].input_shapes][0] == [3, 4]  # record_shapes on the callee
    for e in remote.values():  # placed inside the call's own event
        assert call.time_range.start <= e.time_range.start <= e.time_range.end <= call.time_range.end
    block = remote["##block##"]
    assert {c.name for c in block.cpu_children} >= {key + "#remote_op: aten::relu"}
    assert named(events, "rpc_async#aten::mul(solo -> solo)#remote_op: aten::mul")
    assert named(events, "rpc_remote#ops(solo -> solo)#remote_op: aten::relu")
    assert [e for e in events if e.name == "rpc_sync#fails(solo -> solo)"]  # a failed call is an event too
    # the nested call of an @async_execution function, made on the callee, comes back too
    outer = "rpc_async#nested(solo -> solo)#remote_op: rpc_async#aten::add(solo -> solo)"
    assert [e for e in events if e.name == outer]
    assert named(events, outer + "#remote_op: aten::add")
    assert named(events, "rpc_sync#_invoke_on_owner(solo -> solo)#remote_op: aten::sum")


def test_no_profiler_no_recording_and_no_torch_import_needed(solo):
    with torch.profiler.profile() as prof:  # kineto: torch records no RPC there either
        assert not profiling.active()
        rrefrt.rpc_sync("solo", torch.add, args=(torch.ones(1), 1))
    assert not [e for e in prof.events() if "rpc_sync#" in e.name]
    rref = rrefrt.remote("solo", torch.add, args=(torch.ones(1), 1))
    assert rref._get_profiling_future() is rref._get_future()
    code = "import rrefrt.profiling as p, sys; print(p.active(), 'torch' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
