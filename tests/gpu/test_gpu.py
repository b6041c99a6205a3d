"""CUDA semantics between real worker processes (issue 10): device maps, placement, the
inverse map for replies, owner-side streams, remote() values on the owner's GPU, and a
worker killed with GPU tensors in flight. One GPU is enough; every test skips with the
reason where CUDA is absent. ``scripts/gpu_check.sh`` runs exactly this file.

Group of the class tests: this process is g0 (devices cuda:0, map to g1 cuda:0 -> cuda:0),
g1 uses cuda:0 and has NO map of its own (its replies to g0 must use the inverse of g0's
map), g2 is a CPU-only worker no map names.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine (the GPU tests need one GPU)", allow_module_level=True)

import rrefrt  # noqa: E402
from rrefrt.payload.buffers import DeviceMapError  # noqa: E402
from rrefrt.errors import RpcError  # noqa: E402
from tests.support import gpu_fns as fns  # noqa: E402
from tests.support import Workers, free_port, poll_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CUDA0 = torch.device("cuda", 0)
N = 1 << 22  # 16 MB of float32
BASE = {"rpc_timeout": 60.0, "shutdown_timeout": 30.0}


def start_group(workers: Workers, peers: dict[str, dict], g0_options: dict) -> None:
    """This process is g0; ``peers`` maps name -> options of serving subprocesses."""
    world = 1 + len(peers)
    for attempt in range(3):
        port = free_port()
        procs = [workers.start({"name": name, "rank": r, "world_size": world, "port": port,
                                "options": BASE | opts})
                 for r, (name, opts) in enumerate(peers.items(), start=1)]
        opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **(BASE | g0_options))
        try:
            rrefrt.init_rpc("g0", rank=0, world_size=world, rpc_backend_options=opts)
            return
        except OSError as e:  # the free port was taken meanwhile
            if "already in use" not in str(e) or attempt == 2:
                raise
            for p in procs:
                workers.kill(p)


def stop_group(workers: Workers) -> None:
    """Leave at once (a peer may be dead) and kill every child."""
    if rrefrt.state.current_or_none() is not None:
        rrefrt.shutdown(graceful=False)
    workers.kill_all()


@pytest.fixture(scope="class")
def gpu_group():
    workers = Workers()
    try:
        start_group(workers, {"g1": {"devices": ["cuda:0"]}, "g2": {}},
                    {"devices": ["cuda:0"], "device_maps": {"g1": {"cuda:0": "cuda:0"}}})
        yield workers
        gc.collect()
        rrefrt.shutdown(timeout=30)
        for code, out in workers.wait_all(30):
            assert code == 0, out
    finally:
        stop_group(workers)


@pytest.mark.usefixtures("gpu_group")
class TestGpuGroup:
    def test_argument_lands_on_mapped_device_and_runs_in_owner_scope(self):
        t = torch.arange(1000, dtype=torch.float32, device=CUDA0)
        got = rrefrt.rpc_sync("g1", fns.where, args=(t,))
        assert got == {"device": "cuda:0", "current_device": 0, "pool_stream": True}

    def test_call_without_tensors_runs_on_the_workers_device_and_a_pool_stream(self):
        assert rrefrt.rpc_sync("g1", fns.context) == {"current_device": 0, "pool_stream": True}

    def test_reply_uses_the_inverse_of_the_callers_map(self):
        # g1 has no map to g0: only the inverse of g0's map can place this reply
        t = torch.randn(1000, 33, device=CUDA0)
        out = rrefrt.rpc_sync("g1", fns.identity, args=(t,))
        assert out.device == CUDA0 and torch.equal(out, t)
        assert out.data_ptr() != t.data_ptr()

    def test_non_contiguous_and_empty_cuda_tensors(self):
        t = torch.randn(64, 48, device=CUDA0).t()[::2]
        out = rrefrt.rpc_sync("g1", fns.identity, args=(t,))
        assert out.device == CUDA0 and torch.equal(out, t)
        p = torch.randn(8, 16, device=CUDA0).t()  # dense, transposed: strides kept
        out = rrefrt.rpc_sync("g1", fns.identity, args=(p,))
        assert torch.equal(out, p) and out.stride() == p.stride()
        e = torch.empty(0, 3, device=CUDA0)
        out = rrefrt.rpc_sync("g1", fns.identity, args=(e,))
        assert out.device == CUDA0 and out.shape == (0, 3)

    def test_large_tensor_round_trip(self):
        t = torch.randn(16 * N, device=CUDA0)  # 256 MB
        out = rrefrt.rpc_sync("g1", fns.identity, args=(t,))
        assert out.device == CUDA0 and torch.equal(out, t)

    def test_cpu_tensors_stay_on_the_cpu(self):
        assert rrefrt.rpc_sync("g1", fns.cpu_ones, args=(4,)).device.type == "cpu"
        assert rrefrt.rpc_sync("g1", fns.identity, args=(torch.ones(3),)).device.type == "cpu"

    def test_unmapped_destination_fails_at_the_call_site(self):
        t = torch.ones(3, device=CUDA0)
        for call in (rrefrt.rpc_sync, rrefrt.rpc_async, rrefrt.remote):
            with pytest.raises(DeviceMapError) as e:
                call("g2", fns.identity, args=(t,))
            assert isinstance(e.value, RpcError)
            assert "cuda:0" in str(e.value) and "'g2'" in str(e.value)
        assert rrefrt.rpc_sync("g2", fns.identity, args=(1,)) == 1  # the group is fine

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    def test_reply_on_a_device_the_inverse_map_lacks_fails_the_call(self):
        with pytest.raises(DeviceMapError, match="cuda:1"):
            rrefrt.rpc_sync("g1", fns.on_cuda1, args=(4,))
        assert rrefrt.rpc_sync("g1", fns.context)["current_device"] == 0  # g1 is fine

    def test_reply_waits_for_the_owners_kernels(self):
        x = torch.arange(N, dtype=torch.float32, device=CUDA0)
        expect = x * 3
        for _ in range(3):
            y = rrefrt.rpc_sync("g1", fns.slow_scale, args=(x, 3.0))
            assert y.device == CUDA0 and torch.equal(y, expect)

    def test_arguments_wait_for_the_callers_kernels(self):
        for k in (5.0, 7.0):
            x = torch.ones(N, device=CUDA0)
            torch.cuda._sleep(fns.SLEEP_CYCLES)
            x.mul_(k)  # queued behind the sleep: not done when the call is made
            assert rrefrt.rpc_sync("g1", fns.total, args=(x,)) == k * N

    def test_remote_value_lives_on_the_owners_gpu(self):
        rref = rrefrt.remote("g1", fns.slow_full, args=(N, 7.0))
        assert rrefrt.rpc_sync("g1", fns.value_device, args=(rref,)) == "cuda:0"
        v = rref.to_here()
        assert v.device == CUDA0 and bool((v == 7.0).all())
        s = rref.rpc_sync().sum()  # a proxy call: the owner's value, the reply on g0's cuda:0
        assert s.device == CUDA0 and float(s) == 7.0 * N
        del rref, v

    def test_remote_with_gpu_argument(self):
        x = torch.full((N,), 2.0, device=CUDA0)
        rref = rrefrt.remote("g1", fns.slow_scale, args=(x, 4.0))
        v = rref.to_here()
        assert v.device == CUDA0 and bool((v == 8.0).all())
        assert rrefrt.rpc_sync("g1", fns.value_device, args=(rref,)) == "cuda:0"
        del rref, v

    def test_many_async_calls_in_flight(self):
        xs = [torch.full((1 << 16,), float(i), device=CUDA0) for i in range(32)]
        futs = [rrefrt.rpc_async("g1", fns.slow_scale, args=(x, 2.0, 1_000_000)) for x in xs]
        for i, f in enumerate(futs):
            out = f.wait(60)
            assert out.device == CUDA0 and bool((out == 2.0 * i).all())


HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 0.6}


def test_worker_killed_with_gpu_tensors_in_flight(tmp_path):
    """Calls in flight to a worker holding our GPU tensors fail typed when it is
    SIGKILLed; nothing hangs, and this process's GPU memory comes back."""
    workers = Workers()
    try:
        start_group(workers, {"v1": {"devices": ["cuda:0"], **HB}},
                    {"devices": ["cuda:0"], "device_maps": {"v1": {"cuda:0": "cuda:0"}}, **HB})
        torch.cuda.synchronize()
        gc.collect()
        base = torch.cuda.memory_allocated()
        xs = [torch.ones(N, device=CUDA0) for _ in range(4)]
        markers = [str(tmp_path / f"holding{i}") for i in range(4)]
        futs = [rrefrt.rpc_async("v1", fns.hold, args=(x, 30.0, m)) for x, m in zip(xs, markers)]
        poll_for(lambda: all(os.path.exists(m) for m in markers), 60, "v1 holding every tensor")
        victim = workers.procs[0]
        os.killpg(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for f in futs:
            with pytest.raises(RpcError):
                f.wait(20)
        elapsed = time.monotonic() - t0
        print(f"in-flight calls failed {elapsed:.2f}s after SIGKILL")
        assert elapsed < 10.0
        del xs, futs
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        leaked = torch.cuda.memory_allocated() - base
        print(f"GPU memory after the failure: {leaked} bytes above the start")
        assert leaked <= 4 * N * 4, leaked
        assert float(torch.ones(10, device=CUDA0).sum()) == 10.0  # the GPU still works here
    finally:
        stop_group(workers)
