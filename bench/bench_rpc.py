#!/usr/bin/env python3
"""Compare rrefrt with torch.distributed.rpc in one run; print rrefrt/torch ratios.

    python bench/bench_rpc.py [--backends torch,rrefrt] [--quick] [--repeat K] [--json PATH] [--timeout S]

For each backend, starts WORLD_SIZE workers as separate processes (this same
script in --worker mode), rank 0 runs the workloads in bench/_workloads.py and
writes JSON, then every worker calls rpc.shutdown(). See bench/README.md.
"""
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

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORLD_SIZE = 3  # rank 0 caller, rank 1 callee/owner, rank 2 fork receiver (idle otherwise)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _tail(path, n=20):
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in lines[-n:])


def run_backend(backend, quick, timeout):
    """Run one backend's worker group; return (report dict or None, problem str or None)."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_{backend}_"))
    out = tmp / "rank0.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        log = tmp / f"rank{rank}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--rank", str(rank),
               "--port", str(port), "--out", str(out)] + (["--quick"] if quick else [])
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(log)

    deadline, failed_at, problem = time.monotonic() + timeout, None, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            problem = f"timed out after {timeout}s" if now > deadline else "a worker failed"
            for p in procs:
                _kill(p)
            break
        time.sleep(0.1)

    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad and problem is None:
        problem = "a worker failed"
    if problem:
        problem += "; exit codes: " + ", ".join(f"rank{r}={rc}" for r, rc in bad)
        shown = set()
        for r, _ in bad:  # identical tails (e.g. the same ImportError on every rank) shown once
            tail = _tail(logs[r])
            print(f"--- {backend} rank{r} log ({logs[r]}):\n" + ("    (same as above)" if tail in shown else tail))
            shown.add(tail)
    report = json.loads(out.read_text()) if out.exists() else None
    if not problem:
        shutil.rmtree(tmp, ignore_errors=True)  # logs are kept only when something went wrong
    return report, problem


def fmt(v):
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def print_table(reports, metrics):
    t, r = reports.get("torch"), reports.get("rrefrt")
    rows, ratios = [], {}
    for key, label, unit, better in metrics:
        tv, rv = (rep and rep["results"].get(key) for rep in (t, r))
        ratio = rv / tv if tv and rv else None
        if ratio is not None:
            ratios[key] = ratio
        if ratio is None:
            verdict = ""
        elif 0.9 <= ratio <= 1.1:
            verdict = "about equal"  # within 10%: below run-to-run noise on a small machine
        else:
            verdict = "rrefrt better" if (ratio < 1) == (better == "lower") else "torch better"
        rows.append([f"{label} [{unit}]", fmt(tv), fmt(rv),
                     "-" if ratio is None else f"{ratio:.2f}x", f"{better} is better", verdict])
    head = ["metric", "torch", "rrefrt", "rrefrt/torch", "", ""]
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        print("  ".join(c.rjust(w) if 0 < i < 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torch,rrefrt")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="save all results and ratios here")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per backend (interleaved); medians are reported")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per backend group")
    ap.add_argument("--worker", metavar="BACKEND", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    import _workloads  # bench/ is sys.path[0]: this file's directory
    if args.worker:
        _workloads.worker_main(args.worker, args.rank, WORLD_SIZE, args.port, args.out, args.quick)
        return 0

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f} repeat={args.repeat}"
          f"{' quick' if args.quick else ''}", flush=True)
    runs, problems = {b: [] for b in backends}, {}
    for rnd in range(args.repeat):  # backends interleaved, so drifting machine load hits both
        for backend in backends:
            print(f"== {backend} (round {rnd + 1}/{args.repeat}): {WORLD_SIZE} workers ...", flush=True)
            t0 = time.monotonic()
            report, problem = run_backend(backend, args.quick, args.timeout)
            if problem:
                problems.setdefault(backend, []).append(problem)
                print(f"!! {backend} FAILED: {problem}" + (" (results were written before it)" if report else ""))
            if report:
                runs[backend].append(report)
                for name, err in report["errors"].items():
                    print(f"!! {backend} {name} failed: {err}")
            print(f"   {backend} done in {time.monotonic() - t0:.1f}s", flush=True)

    # per metric: median over the rounds that produced it
    reports = {}
    for backend, reps in runs.items():
        if reps:
            keys = {k for rep in reps for k in rep["results"]}
            reports[backend] = {"results": {k: statistics.median(rep["results"][k] for rep in reps
                                                                 if k in rep["results"]) for k in keys},
                                "errors": {k: v for rep in reps for k, v in rep["errors"].items()}}

    ratios = {}
    if reports:
        print()
        ratios = print_table(reports, _workloads.METRICS)
    if "torch" in reports and "rrefrt" in reports:
        print("\nratio = rrefrt / torch, same machine, same run. Latency rows: < 1 means rrefrt is faster;"
              " throughput rows: > 1 means rrefrt is faster.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"medians": reports, "runs": runs, "problems": problems, "ratios": ratios,
             "cpus": os.cpu_count(), "quick": args.quick}, indent=2))
        print(f"saved {args.json}")
    return 1 if problems or any(r["errors"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
