"""Remote functions and workloads for bench_rpc.py.

Everything here is backend-agnostic: `rpc` is either `torch.distributed.rpc` or `rrefrt`,
and both run exactly the same code. The remote functions live in this importable module
(not in __main__) so every worker can unpickle them. This module imports neither torch nor
rrefrt at the top: a worker's init clock starts before either is imported (worker_main).

Groups (one set of worker processes each, see bench_rpc.py):
    p2p    2 workers: w0 calls, w1 serves and owns (every point-to-point workload)
    forks  3 workers: w0 passes RRefs owned by w1 to w2
    life4  4 workers: import + init + graceful shutdown, nothing else
    fan8   8 workers: w0 fans calls out to the 7 others (only on request: oversubscribed)
    warm   2 workers: one call of each kind, results thrown away (fills the bytecode cache)
"""
import gc
import json
import logging
import os
import resource
import statistics
import sys
import time
from collections import deque

#: group -> world size
GROUPS = {"p2p": 2, "forks": 3, "life4": 4, "fan8": 8, "warm": 2}

# (key, label, unit, which direction is better, group); every key a workload can report
METRICS = [
    ("sync_p50_us", "rpc_sync no-op p50", "us", "lower", "p2p"),
    ("sync_p99_us", "rpc_sync no-op p99", "us", "lower", "p2p"),
    ("sync_cpu_us", "rpc_sync no-op CPU per call (both sides)", "us", "lower", "p2p"),
    ("async_calls_per_s", "rpc_async throughput, 1000 in flight", "calls/s", "higher", "p2p"),
    ("async_cpu_us", "rpc_async CPU per call (both sides)", "us", "lower", "p2p"),
    ("tensor_4kb_p50_ms", "4 KB tensor round trip p50", "ms", "lower", "p2p"),
    ("tensor_4kb_cpu_us", "4 KB tensor round trip CPU per call", "us", "lower", "p2p"),
    ("tensor_1mb_p50_ms", "1 MB tensor round trip p50", "ms", "lower", "p2p"),
    ("tensor_1mb_cpu_us", "1 MB tensor round trip CPU per call", "us", "lower", "p2p"),
    ("tensor_16mb_p50_ms", "16 MB tensor round trip p50", "ms", "lower", "p2p"),
    ("tensor_16mb_cpu_us", "16 MB tensor round trip CPU per call", "us", "lower", "p2p"),
    ("tensor_64mb_p50_ms", "64 MB tensor round trip p50", "ms", "lower", "p2p"),
    ("tensor_64mb_cpu_us", "64 MB tensor round trip CPU per call", "us", "lower", "p2p"),
    ("remote_to_here_p50_us", "remote().to_here() p50", "us", "lower", "p2p"),
    ("remote_to_here_p99_us", "remote().to_here() p99", "us", "lower", "p2p"),
    ("remote_cpu_us", "remote().to_here() CPU per call (both sides)", "us", "lower", "p2p"),
    ("drain_ms", "owner drain after a drop", "ms", "lower", "p2p"),
    ("forks_per_s", "user->user RRef forks", "forks/s", "higher", "forks"),
    ("forks_cpu_us", "user->user fork CPU per fork (3 workers)", "us", "lower", "forks"),
    ("life4_s", "import + init + graceful shutdown, 4 workers", "s", "lower", "life4"),
    ("import4_s", "  of which import (torch + backend)", "s", "lower", "life4"),
    ("initrpc4_s", "  of which init_rpc", "s", "lower", "life4"),
    ("shutdown4_s", "  of which shutdown", "s", "lower", "life4"),
    ("fanout_calls_per_s", "fan-out calls/s at 8 workers", "calls/s", "higher", "fan8"),
]

#: tensor round trips: (size label, bytes, parameter with the number of timed calls)
TENSORS = [("4kb", 4 * 1024, "t4k"), ("1mb", 1 << 20, "t1"), ("16mb", 16 << 20, "t16"), ("64mb", 64 << 20, "t64")]

FULL = dict(sync=2000, sync_warm=200, async_n=5000, window=1000, t4k=1000, t1=100, t16=20, t64=8,
            remote=1000, remote_warm=100, drain=1000, forks=1000, fan=4000)
QUICK = dict(sync=200, sync_warm=30, async_n=2000, window=1000, t4k=50, t1=8, t16=2, t64=1,
             remote=150, remote_warm=15, drain=150, forks=150, fan=800)
WARM = dict(sync=3, sync_warm=1, async_n=10, window=5, t4k=1, t1=1, t16=0, t64=0,
            remote=3, remote_warm=1, drain=3, forks=0, fan=0)


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
    """The owner's count of RRefs it owns, the same way on both sides: the private helper
    that reads the RRef context's counters alone (torch's harness polls it)."""
    if backend.startswith("torch"):
        from torch.distributed import rpc
    else:
        import rrefrt as rpc
    return int(rpc._rref_context_get_debug_info()["num_owner_rrefs"])


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


def _p99(lat):
    s = sorted(lat)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


class GroupCpu:
    """CPU time of every worker of the group (caller and callees) over a measured window:
    each peer's process CPU is read with one rpc_sync before and after (those few calls are
    counted too: at most 2 per peer against hundreds of measured calls)."""

    def __init__(self, rpc, peers):
        self.rpc, self.peers = rpc, peers

    def _now(self):
        return process_cpu() + sum(self.rpc.rpc_sync(w, process_cpu) for w in self.peers)

    def __enter__(self):
        self.start = self._now()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.used = self._now() - self.start

    def per_call_us(self, calls):
        return self.used / calls * 1e6


def _wait_owner_count(rpc, backend, pred, limit=60.0):
    t0 = time.perf_counter()
    while not pred(rpc.rpc_sync("w1", owner_rrefs, args=(backend,))) and time.perf_counter() - t0 < limit:
        time.sleep(0.002)
    return time.perf_counter() - t0


# ---- workloads (run on rank 0) ------------------------------------------------

def bench_sync(rpc, p, backend):
    assert rpc.rpc_sync("w1", noop, args=(7,)) == 7
    for _ in range(p["sync_warm"]):
        rpc.rpc_sync("w1", noop, args=(1,))
    with GroupCpu(rpc, ["w1"]) as cpu:
        lat = _latencies(lambda: rpc.rpc_sync("w1", noop, args=(1,)), p["sync"], 0)
    return {"sync_p50_us": statistics.median(lat) * 1e6, "sync_p99_us": _p99(lat) * 1e6,
            "sync_cpu_us": cpu.per_call_us(p["sync"])}


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
    with GroupCpu(rpc, ["w1"]) as cpu:
        t0 = time.perf_counter()
        run(p["async_n"])
        dt = time.perf_counter() - t0
    return {"async_calls_per_s": p["async_n"] / dt, "async_cpu_us": cpu.per_call_us(p["async_n"])}


def bench_tensors(rpc, p, backend):
    import torch
    res = {}
    for label, nbytes, param in TENSORS:
        n = p[param]
        if not n:
            continue
        t = torch.rand(nbytes // 4)
        assert torch.equal(rpc.rpc_sync("w1", identity, args=(t,)), t)
        rpc.rpc_sync("w1", identity, args=(t,))  # warm-up
        with GroupCpu(rpc, ["w1"]) as cpu:
            lat = _latencies(lambda: rpc.rpc_sync("w1", identity, args=(t,)), n, 0)
        res[f"tensor_{label}_p50_ms"] = statistics.median(lat) * 1e3
        res[f"tensor_{label}_cpu_us"] = cpu.per_call_us(n)
        del t
    return res


def bench_remote(rpc, p, backend):
    assert rpc.remote("w1", noop, args=(7,)).to_here() == 7
    for _ in range(p["remote_warm"]):
        rpc.remote("w1", noop, args=(1,)).to_here()
    with GroupCpu(rpc, ["w1"]) as cpu:
        lat = _latencies(lambda: rpc.remote("w1", noop, args=(1,)).to_here(), p["remote"], 0)
    return {"remote_to_here_p50_us": statistics.median(lat) * 1e6, "remote_to_here_p99_us": _p99(lat) * 1e6,
            "remote_cpu_us": cpu.per_call_us(p["remote"])}


def bench_drain(rpc, p, backend):
    """N RRefs owned by w1, held by w0, dropped at once: the time until the owner holds
    none of them (bounded)."""
    gc.collect()
    base = rpc.rpc_sync("w1", owner_rrefs, args=(backend,))
    rrefs = [rpc.remote("w1", noop, args=(i,)) for i in range(p["drain"])]
    _wait_owner_count(rpc, backend, lambda c: c >= base + p["drain"])  # every creation done
    del rrefs
    gc.collect()
    return {"drain_ms": _wait_owner_count(rpc, backend, lambda c: c <= base) * 1e3}


def bench_forks(rpc, p, backend):
    rrefs = [rpc.remote("w1", noop, args=(i,)) for i in range(p["forks"])]
    for r in rrefs[:10]:  # warm-up
        rpc.rpc_sync("w2", consume, args=(r,))
    with GroupCpu(rpc, ["w1", "w2"]) as cpu:
        t0 = time.perf_counter()
        for r in rrefs:
            rpc.rpc_sync("w2", consume, args=(r,))
        dt = time.perf_counter() - t0
    return {"forks_per_s": p["forks"] / dt, "forks_cpu_us": cpu.per_call_us(p["forks"])}


def bench_fanout(rpc, p, backend, world_size=8):
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


#: group -> its workloads in order; a workload's name is the function's without "bench_"
WORKLOADS = {
    "p2p": [bench_sync, bench_async, bench_tensors, bench_remote, bench_drain],
    "forks": [bench_forks],
    "life4": [],
    "fan8": [bench_fanout],
    "warm": [bench_sync, bench_async, bench_tensors, bench_remote, bench_drain],
}


def workload_names(group):
    return [wl.__name__[len("bench_"):] for wl in WORKLOADS[group]]


def run_all(rpc, params, backend, group, only=None):
    results, errors = {}, {}
    for wl in WORKLOADS[group]:
        name = wl.__name__[len("bench_"):]
        if only and name not in only:
            continue
        print(f"[rank0] {name} ...", flush=True)  # the log tail then shows where a hang is
        try:
            results.update(wl(rpc, params, backend))
        except Exception as e:  # record and go on: one broken workload must not hide the rest
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"[rank0] {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        gc.collect()
    return {"results": results, "errors": errors}


# ---- worker entry point -------------------------------------------------------

def import_backend(backend):
    """What a PyTorch program does before init_rpc: ``import torch``, then the rpc module
    (rrefrt on its own does not import torch; a program that passes tensors does)."""
    t0 = time.perf_counter()
    import torch  # noqa: F401
    t1 = time.perf_counter()
    if backend.startswith("torch"):
        from torch.distributed import rpc
    elif backend.startswith("rrefrt"):
        import rrefrt as rpc
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return rpc, t1 - t0, time.perf_counter() - t1


def backend_options(rpc, backend, port):
    """torch (TensorPipe at its best: shm and cma channels on one host), torch-tcp (TensorPipe
    forced to TCP), rrefrt (defaults), rrefrt-secret (a job secret, as rrefrt-run sets on one
    node), rrefrt-tcp (same-host paths off: tcp only); the last two differ by environment."""
    init = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"  # --netns: rank 0's veth address
    if backend.startswith("torch"):
        kw = dict(_transports=["uv"], _channels=["basic"]) if backend == "torch-tcp" else {}
        return rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120, init_method=init, **kw)
    return rpc.RpcBackendOptions(init_method=init, rpc_timeout=120)


def compiled_since(t_ns):
    """Modules whose bytecode file was written at or after t_ns (wall clock): compiled
    from source inside the measured window, which the precompile step should have spared."""
    out = []
    for name, mod in list(sys.modules.items()):
        spec = getattr(mod, "__spec__", None)
        cached = getattr(spec, "cached", None) if spec else None
        if not cached or name == "__main__":
            continue
        try:
            if os.stat(cached).st_mtime_ns >= t_ns:
                out.append(name)
        except OSError:  # none written (a read-only tree): compiled from source at every start
            if spec.origin and spec.origin.endswith(".py"):
                out.append(name + " (no bytecode file)")
    return sorted(out)


def worker_main(backend, rank, world_size, port, out, params, group, only=None):
    # warnings (a peer declared dead, a connection closed) go to the rank's log, which the
    # bench prints when a group fails; RREFRT_BENCH_LOG=INFO (or DEBUG) says more
    logging.basicConfig(level=os.environ.get("RREFRT_BENCH_LOG", "WARNING"),
                        format=f"[rank{rank}] %(name)s %(levelname)s %(message)s")
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # rank r on core r (round robin past the last)
    # the init clock runs from before `import torch` to init_rpc returned, as a user sees it:
    # rrefrt's lazy imports (runtime, zmq, msgpack) resolve inside init_rpc and count there
    wall0 = time.time_ns()
    rpc, import_torch_s, import_backend_s = import_backend(backend)
    t0 = time.perf_counter()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=backend_options(rpc, backend, port))
    init_rpc_s = time.perf_counter() - t0
    compiled = compiled_since(wall0)
    report = run_all(rpc, params, backend, group, only) if rank == 0 else {"results": {}, "errors": {}}
    t0 = time.perf_counter()
    rpc.shutdown()
    report.update(import_torch_s=import_torch_s, import_backend_s=import_backend_s, init_rpc_s=init_rpc_s,
                  shutdown_s=time.perf_counter() - t0, compiled_at_init=compiled)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(report, f)
    print(f"[rank{rank}] import {import_torch_s + import_backend_s:.2f}s (torch {import_torch_s:.2f}s), "
          f"init_rpc {init_rpc_s:.2f}s, shutdown {report['shutdown_s']:.2f}s"
          + (f"; compiled during init: {', '.join(compiled)}" if compiled else ""), flush=True)
