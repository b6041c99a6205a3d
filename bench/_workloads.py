"""Remote functions and workloads for bench_rpc.py.

Everything here is backend-agnostic: `rpc` is either `torch.distributed.rpc`
or `rrefrt`, and both run exactly the same code. The remote functions live in
this importable module (not in __main__) so every worker can unpickle them.
"""
import gc
import json
import statistics
import sys
import time
from collections import deque

import torch

# (key, label, unit, which direction is better)
METRICS = [
    ("sync_p50_us", "rpc_sync no-op p50", "us", "lower"),
    ("sync_p90_us", "rpc_sync no-op p90", "us", "lower"),
    ("async_calls_per_s", "rpc_async throughput", "calls/s", "higher"),
    ("tensor_1mb_p50_ms", "rpc_sync 1 MB tensor round trip p50", "ms", "lower"),
    ("tensor_16mb_p50_ms", "rpc_sync 16 MB tensor round trip p50", "ms", "lower"),
    ("remote_to_here_p50_us", "remote().to_here() p50", "us", "lower"),
    ("forks_per_s", "user->user RRef forks", "forks/s", "higher"),
]

FULL = dict(sync=2000, sync_warm=200, async_n=5000, window=100, t1=200, t16=30,
            remote=1000, remote_warm=100, forks=1000)
QUICK = dict(sync=300, sync_warm=50, async_n=1000, window=100, t1=30, t16=5,
             remote=200, remote_warm=20, forks=200)


# ---- remote functions -------------------------------------------------------

def noop(x):
    return x


def identity(t):
    return t


def consume(rref):
    rref.owner()


# ---- helpers ----------------------------------------------------------------

def _pct(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _latencies(fn, n, warm):
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- workloads (run on rank 0) ----------------------------------------------

def bench_sync(rpc, p):
    assert rpc.rpc_sync("w1", noop, args=(7,)) == 7
    lat = _latencies(lambda: rpc.rpc_sync("w1", noop, args=(1,)), p["sync"], p["sync_warm"])
    return {"sync_p50_us": statistics.median(lat) * 1e6, "sync_p90_us": _pct(lat, 0.9) * 1e6}


def bench_async(rpc, p):
    def run(n):
        window = deque()
        for i in range(n):
            if len(window) >= p["window"]:
                window.popleft().wait()
            window.append(rpc.rpc_async("w1", noop, args=(i,)))
        for f in window:
            f.wait()
    run(p["window"] * 2)
    t0 = time.perf_counter()
    run(p["async_n"])
    return {"async_calls_per_s": p["async_n"] / (time.perf_counter() - t0)}


def bench_tensors(rpc, p):
    res = {}
    for mb, n, key in ((1, p["t1"], "tensor_1mb_p50_ms"), (16, p["t16"], "tensor_16mb_p50_ms")):
        t = torch.rand(mb * 1024 * 1024 // 4)
        assert torch.equal(rpc.rpc_sync("w1", identity, args=(t,)), t)
        lat = _latencies(lambda: rpc.rpc_sync("w1", identity, args=(t,)), n, 3)
        res[key] = statistics.median(lat) * 1e3
    return res


def bench_remote(rpc, p):
    assert rpc.remote("w1", noop, args=(7,)).to_here() == 7
    lat = _latencies(lambda: rpc.remote("w1", noop, args=(1,)).to_here(),
                     p["remote"], p["remote_warm"])
    return {"remote_to_here_p50_us": statistics.median(lat) * 1e6}


def bench_forks(rpc, p):
    rrefs = [rpc.remote("w1", noop, args=(i,)) for i in range(p["forks"])]
    for r in rrefs[:10]:  # warm-up
        rpc.rpc_sync("w2", consume, args=(r,))
    t0 = time.perf_counter()
    for r in rrefs:
        rpc.rpc_sync("w2", consume, args=(r,))
    elapsed = time.perf_counter() - t0
    del rrefs, r
    gc.collect()
    return {"forks_per_s": p["forks"] / elapsed}


WORKLOADS = [bench_sync, bench_async, bench_tensors, bench_remote, bench_forks]


def run_all(rpc, quick):
    p = QUICK if quick else FULL
    results, errors = {}, {}
    for wl in WORKLOADS:
        print(f"[rank0] {wl.__name__} ...", flush=True)  # the log tail then shows where a hang is
        try:
            results.update(wl(rpc, p))
        except Exception as e:  # record and go on: one broken workload must not hide the rest
            errors[wl.__name__] = f"{type(e).__name__}: {e}"[:500]
            print(f"[rank0] {wl.__name__} failed: {errors[wl.__name__]}", file=sys.stderr, flush=True)
        gc.collect()
    return {"params": p, "results": results, "errors": errors}


# ---- worker entry point -------------------------------------------------------

def load_backend(backend, port):
    init = f"tcp://127.0.0.1:{port}"
    if backend == "torch":
        from torch.distributed import rpc
        return rpc, rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60,
                                                    init_method=init)
    if backend == "rrefrt":
        import rrefrt as rpc
        return rpc, rpc.RpcBackendOptions(init_method=init)
    raise ValueError(f"unknown backend {backend!r}")


def worker_main(backend, rank, world_size, port, out, quick):
    rpc, opts = load_backend(backend, port)
    t0 = time.perf_counter()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    init_s = time.perf_counter() - t0
    if rank == 0:
        report = run_all(rpc, quick)
        report["init_s"] = init_s
        with open(out, "w") as f:
            json.dump(report, f)
    t0 = time.perf_counter()
    rpc.shutdown()
    print(f"[rank{rank}] init {init_s:.2f}s, shutdown {time.perf_counter() - t0:.2f}s", flush=True)
