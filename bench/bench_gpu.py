#!/usr/bin/env python3
"""GPU tensor round trips, rrefrt beside torch.distributed.rpc: cuda:0 -> cuda:0 between
two processes, 1 MB to 256 MB; prints p50 per size and the ratio rrefrt / torch.

Runs only where CUDA is present (exits 0 with a line saying so otherwise). Each backend
gets a fresh pair of processes (this script in ``--worker`` mode): b0 times
``rpc_sync("b1", identity, args=(t,))`` with ``t`` on cuda:0 and a device map
cuda:0 -> cuda:0 (the reply comes back by the inverse map), synchronising the GPU after
each call; b1 uses cuda:0 and has no map of its own.

    python bench/bench_gpu.py [--quick] [--backends torch,rrefrt] [--sizes 1,16,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES_MB = (1, 4, 16, 64, 256)


def identity(t):
    return t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(name: str, rank: int, port: int, device: str):
    init = f"tcp://127.0.0.1:{port}"
    if device == "cpu":  # a dry run of this script on a machine without CUDA
        if name == "torch":
            from torch.distributed import rpc

            return rpc, rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120, init_method=init)
        import rrefrt

        return rrefrt, rrefrt.RpcBackendOptions(init_method=init, rpc_timeout=120)
    if name == "torch":
        from torch.distributed import rpc

        opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120, init_method=init, devices=[0])
        if rank == 0:
            opts.set_device_map("b1", {0: 0})
        return rpc, opts
    import rrefrt as rpc

    maps = {"b1": {"cuda:0": "cuda:0"}} if rank == 0 else {}
    return rpc, rpc.RpcBackendOptions(init_method=init, rpc_timeout=120, devices=["cuda:0"], device_maps=maps)


def _worker(name: str, rank: int, port: int, out: str, sizes: list[int], quick: bool, device: str) -> None:
    import torch

    import bench_gpu  # this file as a module: b1 unpickles bench_gpu.identity

    rpc, opts = _backend(name, rank, port, device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    rpc.init_rpc(f"b{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        results = {}
        for mb in sizes:
            n = mb * (1 << 20) // 4
            t = torch.randn(n, device=device)
            out_t = rpc.rpc_sync("b1", bench_gpu.identity, args=(t,))
            if out_t.device != t.device or not torch.equal(out_t, t):
                raise AssertionError(f"{name}: {mb} MB round trip came back wrong (on {out_t.device})")
            del out_t
            reps = (5 if mb <= 16 else 3) if quick else (30 if mb <= 16 else 10)
            samples = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                r = rpc.rpc_sync("b1", bench_gpu.identity, args=(t,))
                sync()
                samples.append(time.perf_counter() - t0)
                del r
            results[str(mb)] = statistics.median(samples)
            del t
            if device != "cpu":
                torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(results, f)
    rpc.shutdown()


def run_backend(name: str, sizes: list[int], quick: bool, timeout: float, device: str) -> tuple[dict | None, str | None]:
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_gpu_{name}_"))
    out = tmp / "b0.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "bench"),
                                                                    os.environ.get("PYTHONPATH")])),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = []
    for rank in (0, 1):
        log = open(tmp / f"b{rank}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--rank", str(rank), "--port",
               str(port), "--out", str(out), "--sizes", ",".join(map(str, sizes)), "--device", device] + (["--quick"] if quick else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    deadline = time.monotonic() + timeout
    problem = None
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout:.0f}s"
            break
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    if problem is None and any(p.returncode != 0 for p in procs):
        problem = "exit codes " + ", ".join(f"b{r}={p.returncode}" for r, p in enumerate(procs))
    if problem:
        for rank in (0, 1):
            text = (tmp / f"b{rank}.log").read_text(errors="replace").splitlines()[-15:]
            print(f"--- {name} b{rank} log:\n" + "\n".join("    " + line for line in text))
    report = json.loads(out.read_text()) if out.exists() else None
    shutil.rmtree(tmp, ignore_errors=True)
    return report, problem


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="torch,rrefrt")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MB)))
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)  # "cpu": a dry run without CUDA
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    if a.worker:
        _worker(a.worker, a.rank, a.port, a.out, sizes, a.quick, a.device)
        return 0
    import torch

    if a.device != "cpu" and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available here; nothing to measure")
        return 0
    reports, failed = {}, False
    for name in a.backends.split(","):
        report, problem = run_backend(name, sizes, a.quick, a.timeout, a.device)
        if problem:
            print(f"{name}: FAILED ({problem})")
            failed = True
        reports[name] = report or {}
    where = torch.cuda.get_device_name(0) if a.device != "cpu" else "CPU dry run"
    print(f"GPU round trip {a.device} -> {a.device} -> {a.device}, p50 ({where})")
    print(f"{'size':>8} {'torch ms':>10} {'rrefrt ms':>10} {'rrefrt GB/s':>12} {'rrefrt/torch':>13}")
    for mb in sizes:
        t, r = reports.get("torch", {}).get(str(mb)), reports.get("rrefrt", {}).get(str(mb))
        gbps = f"{2 * mb / 1024 / r:.2f}" if r else "-"
        ratio = f"{r / t:.2f}x" if (r and t) else "-"
        print(f"{mb:>6}MB {t * 1e3 if t else float('nan'):>10.2f} {r * 1e3 if r else float('nan'):>10.2f} "
              f"{gbps:>12} {ratio:>13}")
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
