"""Remote functions and workloads for bench_rpc.py.

Everything here is backend-agnostic: `rpc` is either `torch.distributed.rpc` or `rrefrt`,
and both run exactly the same code. The remote functions live in this importable module
(not in __main__) so every worker can unpickle them.

Groups (one set of worker processes each, see bench_rpc.py):
    main   3 workers: w0 calls, w1 serves and owns, w2 receives forks
    life4  4 workers: init + graceful shutdown, nothing else
    fan8   8 workers: w0 fans calls out to the 7 others
"""
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections import deque

import torch

# (key, label, unit, which direction is better, group)
METRICS = [
    ("sync_p50_us", "rpc_sync no-op p50", "us", "lower", "main"),
    ("sync_cpu_us", "rpc_sync no-op CPU per call (both sides)", "us", "lower", "main"),
    ("async_calls_per_s", "rpc_async throughput, 1000 in flight", "calls/s", "higher", "main"),
    ("tensor_1mb_p50_ms", "1 MB tensor round trip p50", "ms", "lower", "main"),
    ("tensor_16mb_p50_ms", "16 MB tensor round trip p50", "ms", "lower", "main"),
    ("tensor_64mb_p50_ms", "64 MB tensor round trip p50", "ms", "lower", "main"),
    ("remote_to_here_p50_us", "remote().to_here() p50", "us", "lower", "main"),
    ("remote_cpu_us", "remote().to_here() CPU per call (both sides)", "us", "lower", "main"),
    ("forks_per_s", "user->user RRef forks", "forks/s", "higher", "main"),
    ("drain_ms", "owner drain after forks dropped", "ms", "lower", "main"),
    ("life4_s", "init + graceful shutdown, 4 workers", "s", "lower", "life4"),
    ("init4_s", "  of which init", "s", "lower", "life4"),
    ("shutdown4_s", "  of which shutdown", "s", "lower", "life4"),
    ("fanout_calls_per_s", "fan-out calls/s at 8 workers", "calls/s", "higher", "fan8"),
]

FULL = dict(sync=2000, sync_warm=200, async_n=5000, window=1000, t1=100, t16=20, t64=8,
            remote=1000, remote_warm=100, forks=1000, fan=4000)
QUICK = dict(sync=300, sync_warm=50, async_n=2000, window=1000, t1=10, t16=3, t64=0,
             remote=200, remote_warm=20, forks=200, fan=800)


# ---- remote functions -------------------------------------------------------

def noop(x):
    return x


def identity(t):
    return t


def consume(rref):
    rref.owner()


def process_cpu():
    """CPU seconds this whole process has used (every thread: busy-polling counts)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def owner_rrefs(backend):
    if backend.startswith("torch"):
        from torch.distributed import rpc
        return int(rpc._rref_context_get_debug_info()["num_owner_rrefs"])
    import rrefrt
    return int(rrefrt.get_debug_info()["num_owner_rrefs"])


# ---- helpers ----------------------------------------------------------------

def _latencies(fn, n, warm):
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- workloads of the main group (run on rank 0) ---------------------------------

def bench_sync(rpc, p, backend):
    assert rpc.rpc_sync("w1", noop, args=(7,)) == 7
    for _ in range(p["sync_warm"]):
        rpc.rpc_sync("w1", noop, args=(1,))
    callee0, mine0 = rpc.rpc_sync("w1", process_cpu), process_cpu()
    lat = _latencies(lambda: rpc.rpc_sync("w1", noop, args=(1,)), p["sync"], 0)
    mine, callee = process_cpu() - mine0, rpc.rpc_sync("w1", process_cpu) - callee0
    return {"sync_p50_us": statistics.median(lat) * 1e6, "sync_cpu_us": (mine + callee) / p["sync"] * 1e6}


def bench_async(rpc, p, backend):
    def run(n):
        window = deque()
        for i in range(n):
            if len(window) >= p["window"]:
                window.popleft().wait()
            window.append(rpc.rpc_async("w1", noop, args=(i,)))
        for f in window:
            f.wait()
    run(p["window"])
    t0 = time.perf_counter()
    run(p["async_n"])
    return {"async_calls_per_s": p["async_n"] / (time.perf_counter() - t0)}


def bench_tensors(rpc, p, backend):
    res = {}
    for mb, n, key in ((1, p["t1"], "tensor_1mb_p50_ms"), (16, p["t16"], "tensor_16mb_p50_ms"),
                       (64, p["t64"], "tensor_64mb_p50_ms")):
        if not n:
            continue
        t = torch.rand(mb * 1024 * 1024 // 4)
        assert torch.equal(rpc.rpc_sync("w1", identity, args=(t,)), t)
        lat = _latencies(lambda: rpc.rpc_sync("w1", identity, args=(t,)), n, 2)
        res[key] = statistics.median(lat) * 1e3
    return res


def bench_remote(rpc, p, backend):
    assert rpc.remote("w1", noop, args=(7,)).to_here() == 7
    for _ in range(p["remote_warm"]):
        rpc.remote("w1", noop, args=(1,)).to_here()
    callee0, mine0 = rpc.rpc_sync("w1", process_cpu), process_cpu()
    lat = _latencies(lambda: rpc.remote("w1", noop, args=(1,)).to_here(), p["remote"], 0)
    mine, callee = process_cpu() - mine0, rpc.rpc_sync("w1", process_cpu) - callee0
    return {"remote_to_here_p50_us": statistics.median(lat) * 1e6,
            "remote_cpu_us": (mine + callee) / p["remote"] * 1e6}


def bench_forks(rpc, p, backend):
    base = rpc.rpc_sync("w1", owner_rrefs, args=(backend,))
    rrefs = [rpc.remote("w1", noop, args=(i,)) for i in range(p["forks"])]
    for r in rrefs[:10]:  # warm-up
        rpc.rpc_sync("w2", consume, args=(r,))
    t0 = time.perf_counter()
    for r in rrefs:
        rpc.rpc_sync("w2", consume, args=(r,))
    res = {"forks_per_s": p["forks"] / (time.perf_counter() - t0)}
    del rrefs, r
    gc.collect()
    t0 = time.perf_counter()  # drain: until the owner holds none of them (bounded)
    while rpc.rpc_sync("w1", owner_rrefs, args=(backend,)) > base and time.perf_counter() - t0 < 60:
        time.sleep(0.002)
    res["drain_ms"] = (time.perf_counter() - t0) * 1e3
    return res


WORKLOADS = [bench_sync, bench_async, bench_tensors, bench_remote, bench_forks]


def bench_fanout(rpc, p, world_size):
    peers = [f"w{r}" for r in range(1, world_size)]
    for w in peers:
        assert rpc.rpc_sync(w, noop, args=(3,)) == 3
    t0 = time.perf_counter()
    window = deque()
    for i in range(p["fan"]):
        if len(window) >= 256:
            window.popleft().wait()
        window.append(rpc.rpc_async(peers[i % len(peers)], noop, args=(i,)))
    for f in window:
        f.wait()
    return {"fanout_calls_per_s": p["fan"] / (time.perf_counter() - t0)}


def run_all(rpc, quick, backend, group, world_size, only=None):
    p = QUICK if quick else FULL
    results, errors = {}, {}
    main = [wl for wl in WORKLOADS if not only or wl.__name__[len("bench_"):] in only.split(",")]
    workloads = main if group == "main" else [lambda rpc, p, b: bench_fanout(rpc, p, world_size)] if group == "fan8" else []
    for wl in workloads:
        name = getattr(wl, "__name__", "workload")
        print(f"[rank0] {name} ...", flush=True)  # the log tail then shows where a hang is
        try:
            results.update(wl(rpc, p, backend))
        except Exception as e:  # record and go on: one broken workload must not hide the rest
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"[rank0] {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        gc.collect()
    return {"params": p, "results": results, "errors": errors}


# ---- worker entry point -------------------------------------------------------

def load_backend(backend, port):
    """backend: torch (TensorPipe at its best: shm and cma channels on one host), torch-tcp
    (TensorPipe forced to TCP), rrefrt (defaults), rrefrt-secret (a job secret, as rrefrt-run
    sets on one node), rrefrt-tcp (same-host paths off: tcp only)."""
    init = f"tcp://127.0.0.1:{port}"
    if backend.startswith("torch"):
        from torch.distributed import rpc
        kw = dict(_transports=["uv"], _channels=["basic"]) if backend == "torch-tcp" else {}
        return rpc, rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120, init_method=init, **kw)
    if backend.startswith("rrefrt"):
        import rrefrt as rpc
        return rpc, rpc.RpcBackendOptions(init_method=init, rpc_timeout=120)
    raise ValueError(f"unknown backend {backend!r}")


def worker_main(backend, rank, world_size, port, out, quick, group, only=None):
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # each worker on its own core (round robin)
    rpc, opts = load_backend(backend, port)
    # rrefrt's package is lazy (PEP 562): resolve init_rpc (importing the runtime, zmq) before
    # the clock starts, as torch's import of torch.distributed.rpc happened in load_backend
    init_rpc = rpc.init_rpc
    t0 = time.perf_counter()
    init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    init_s = time.perf_counter() - t0
    report = run_all(rpc, quick, backend, group, world_size, only) if rank == 0 else {"results": {}, "errors": {}}
    t0 = time.perf_counter()
    rpc.shutdown()
    report["init_s"], report["shutdown_s"] = init_s, time.perf_counter() - t0
    with open(f"{out}.{rank}", "w") as f:
        json.dump(report, f)
    print(f"[rank{rank}] init {init_s:.2f}s, shutdown {report['shutdown_s']:.2f}s", flush=True)
