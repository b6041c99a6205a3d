"""Join scaling (issue 22): how long init_rpc takes and how many descriptors a worker holds,
for N workers started by rrefrt-run on this node, each calling only its neighbour.

    python bench/scale_join.py 8 32 64 128        # the curve (niced)
    python bench/scale_join.py 64 --burners 2 --repeat 5   # beside 2 CPU burners, 5 jobs
    RREFRT_CONNECT=eager python bench/scale_join.py 64   # the full mesh, for comparison

Each worker prints one line ``SCALE {json}``: its init time (from entering init_rpc to its
return), its open descriptors after init and after its calls, and the peers its zmq
transport has a data pipe with. The driver prints the median and maximum per N.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _connected(rt: object) -> int:
    t = getattr(rt, "transport", None)
    inner = getattr(t, "inner", t)
    peers = getattr(inner, "connected_peers", None)
    return len(peers()) if peers is not None else -1


def worker() -> int:
    import rrefrt as rpc
    from rrefrt import state
    from rrefrt.run.env import resolve_env

    env = resolve_env(os.environ)
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    t0 = time.monotonic()
    rpc.init_rpc(f"worker{rank}")
    init_s = time.monotonic() - t0
    rt = state.current_or_none()
    fds_init, pipes_init = _fds(), _connected(rt)
    assert rpc.rpc_sync(f"worker{(rank + 1) % size}", max, args=(rank, 0)) == rank
    fds_calls, pipes_calls = _fds(), _connected(rt)
    print("SCALE " + json.dumps({"rank": rank, "init_s": round(init_s, 3), "fds_init": fds_init,
                                 "fds_calls": fds_calls, "pipes_init": pipes_init, "pipes_calls": pipes_calls}), flush=True)
    rpc.shutdown()
    return 0


def drive(sizes: list[int], burners: int = 0, repeat: int = 1) -> int:
    failed = 0
    for n in [n for n in sizes for _ in range(repeat)]:
        # CPU burners beside the job (busy loops at the job's priority), ended by their pid
        burn = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                ["nice", "-n", "10", sys.executable, "-m", "rrefrt.run", "--nproc-per-node", str(n), __file__, "--worker"],
                capture_output=True, text=True, timeout=900,
            )
        finally:
            for b in burn:
                b.kill()
                b.wait()
        wall = time.monotonic() - t0
        failed += proc.returncode != 0
        rows = [json.loads(line.split("SCALE ", 1)[1]) for line in proc.stdout.splitlines() if "SCALE " in line]
        if not rows:
            print(f"N={n}: exit {proc.returncode}, no worker reported\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            continue

        def stat(key: str) -> str:
            vals = [r[key] for r in rows]
            return f"{statistics.median(vals):g} / {max(vals):g}"

        print(f"N={n}{f' with {burners} burners' if burners else ''}: exit {proc.returncode}, {len(rows)}/{n} "
              f"reported, job {wall:.1f}s; median / max: "
              f"init {stat('init_s')} s, fds after init {stat('fds_init')}, after calls {stat('fds_calls')}, "
              f"data pipes after init {stat('pipes_init')}, after calls {stat('pipes_calls')}", flush=True)
        if proc.returncode:
            print(failure_paragraph(proc.stderr), flush=True)
    print(f"{failed} of {len(sizes) * repeat} jobs failed")
    return 1 if failed else 0


def failure_paragraph(stderr: str, limit: int = 6000) -> str:
    """The launcher's "job failed" report (the failing rank, how it ended, its output's
    tail, every worker's outcome) rather than the last lines of stderr, which are the
    launcher stopping the other workers; the tail when there is no such report."""
    start = stderr.find("rrefrt-run: job failed")
    if start < 0:
        return stderr[-1500:]
    return stderr[start : start + limit]


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker())
    import argparse

    ap = argparse.ArgumentParser(description="init time and descriptors of N workers that call their neighbour")
    ap.add_argument("sizes", nargs="*", type=int, default=[8, 32, 64, 128])
    ap.add_argument("--burners", type=int, default=0, help="CPU burners beside each job")
    ap.add_argument("--repeat", type=int, default=1, help="jobs per size")
    a = ap.parse_args()
    sys.exit(drive(a.sizes, a.burners, a.repeat))
