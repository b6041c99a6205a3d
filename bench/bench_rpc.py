#!/usr/bin/env python3
"""Compare rrefrt with torch.distributed.rpc in one run; print rrefrt/torch ratios.

    python bench/bench_rpc.py [--backends ...] [--groups ...] [--quick] [--repeat K] [--json PATH] [--timeout S]

For each backend and worker group, starts the group's workers as separate processes (this
same script in --worker mode, each pinned to its own core), rank 0 runs the workloads in
bench/_workloads.py, every worker calls rpc.shutdown() and writes JSON. See bench/README.md.
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
GROUPS = {"main": 3, "life4": 4, "fan8": 8}  # group -> world size (see _workloads.py)
#: (variant, its baseline): each variant's ratio is taken against that baseline of the same round
PAIRS = [("rrefrt", "torch"), ("rrefrt-secret", "torch"), ("rrefrt-tcp", "torch-tcp"),
         ("rrefrt-base", "torch"), ("rrefrt", "rrefrt-base")]
VARIANT_ENV = {
    "rrefrt-secret": {"RREFRT_SECRET": "bench-secret"},
    "rrefrt-tcp": {"RREFRT_SAME_HOST": "0", "RREFRT_NO_IPC": "1"},
}


def free_port():
    """A port nothing listens on, picked at random below the kernel's ephemeral range (a
    ``bind(0)`` port is ephemeral: another process's outgoing connection may take it before
    rank 0 binds it); the kernel's choice only if that range is crowded."""
    import random
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    high = max(21000, min(low, 32768))
    for _ in range(200):
        port = random.randrange(20000, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def run_backend(backend, group, quick, timeout, workloads=None):
    """Run one backend's worker group; return (report dict or None, problem str or None)."""
    world_size = GROUPS[group]
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_{backend}_{group}_"))
    out = tmp / "report.json"
    # rrefrt-base: rrefrt imported from the tree $RREFRT_BENCH_BASE (e.g. `git archive` of an
    # older commit) to measure before/after in one interleaved run
    root = os.environ.get("RREFRT_BENCH_BASE", "") if backend == "rrefrt-base" else str(ROOT)
    if backend == "rrefrt-base" and not root:
        return None, "rrefrt-base needs RREFRT_BENCH_BASE (a source tree of the older rrefrt)"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    for k in ("RREFRT_SECRET", "RREFRT_SAME_HOST", "RREFRT_NO_IPC"):
        env.pop(k, None)
    env.update(VARIANT_ENV.get(backend, {}))
    procs, logs = [], []
    for rank in range(world_size):
        log = tmp / f"rank{rank}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--rank", str(rank),
               "--port", str(port), "--out", str(out), "--group", group] + (["--quick"] if quick else []) \
            + (["--workloads", workloads] if workloads else [])
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
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world_size) if Path(f"{out}.{r}").exists()]
    report = None
    if ranks and ranks[0].get("results") is not None:
        report = {"results": dict(ranks[0]["results"]), "errors": dict(ranks[0]["errors"])}
        if group == "life4" and len(ranks) == world_size:
            init, down = max(r["init_s"] for r in ranks), max(r["shutdown_s"] for r in ranks)
            report["results"].update(init4_s=init, shutdown4_s=down, life4_s=init + down)
    if not problem:
        shutil.rmtree(tmp, ignore_errors=True)  # logs are kept only when something went wrong
    return report, problem


def cpu_jiffies():
    """(busy, steal) jiffies of the whole machine so far (/proc/stat; zeros elsewhere): steal is
    time the hypervisor ran something else on our virtual cores - noise no pinning removes."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = f[7] if len(f) > 7 else 0
    return sum(f[:3]) + sum(f[5:7]), steal


def fmt(v):
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def paired_ratios(runs, variant, base, key):
    """Per round, variant / base of the same round (rounds are interleaved, so drifting load
    hits both alike): the median of those ratios and their spread."""
    rs = []
    for a, b in zip(runs.get(variant, []), runs.get(base, [])):
        va, vb = (a or {}).get("results", {}).get(key), (b or {}).get("results", {}).get(key)
        if va and vb:
            rs.append(va / vb)
    if not rs:
        return None
    return statistics.median(rs), min(rs), max(rs), len(rs)


def print_table(runs, metrics, backends):
    medians = {}
    for b in backends:
        reps = [r for r in runs.get(b, []) if r]
        medians[b] = {k: statistics.median(vals) for k in {k for r in reps for k in r["results"]}
                      if (vals := [r["results"][k] for r in reps if k in r["results"]])}
    pairs = [(v, b) for v, b in PAIRS if v in backends and b in backends]
    head = ["metric", *backends, *[f"{v}/{b} (spread)" for v, b in pairs], ""]
    rows, ratios = [], {}
    for key, label, unit, better, _group in metrics:
        row = [f"{label} [{unit}]", *[fmt(medians[b].get(key)) for b in backends]]
        for v, b in pairs:
            pr = paired_ratios(runs, v, b, key)
            if pr is None:
                row.append("-")
                continue
            ratios[f"{v}/{b}:{key}"] = pr[0]
            row.append(f"{pr[0]:.2f}x ({pr[1]:.2f}-{pr[2]:.2f})" if pr[3] > 1 else f"{pr[0]:.2f}x")
        row.append(f"{better} is better")
        rows.append(row)
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        print("  ".join(c.rjust(w) if 0 < i < len(head) - 1 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return medians, ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=None,
                    help="comma list of torch, torch-tcp, rrefrt, rrefrt-secret, rrefrt-tcp, rrefrt-base "
                         "(default: all five; --quick: torch,rrefrt)")
    ap.add_argument("--groups", default=None, help="comma list of main, life4, fan8 (default: all; --quick: main)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    ap.add_argument("--workloads", default=None,
                    help="comma list of main-group workloads to run (sync, async, tensors, remote, forks; default: all)")
    ap.add_argument("--json", metavar="PATH", help="save all results and ratios here")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (backends interleaved); paired medians are reported")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per worker group")
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds of idle between two worker groups (default 0.5, --quick 0): the group "
                         "after a busy-polling one (torch) otherwise starts on a core still paying for it")
    ap.add_argument("--no-rotate", action="store_true",
                    help="keep the --backends order in every round (default: round k starts k places on)")
    ap.add_argument("--worker", metavar="BACKEND", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--group", default="main", help=argparse.SUPPRESS)
    args = ap.parse_args()

    import _workloads  # bench/ is sys.path[0]: this file's directory
    if args.worker:
        _workloads.worker_main(args.worker, args.rank, GROUPS[args.group], args.port, args.out, args.quick,
                               args.group, args.workloads)
        return 0

    default_backends = "torch,rrefrt" if args.quick else "torch,rrefrt,rrefrt-secret,torch-tcp,rrefrt-tcp"
    backends = [b.strip() for b in (args.backends or default_backends).split(",") if b.strip()]
    groups = [g.strip() for g in (args.groups or ("main" if args.quick else "main,life4,fan8")).split(",")]
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f} repeat={args.repeat}"
          f"{' quick' if args.quick else ''} groups={','.join(groups)}", flush=True)
    runs = {b: [] for b in backends}  # backend -> one merged report per round (None if it failed)
    problems = {}
    settle = args.settle if args.settle is not None else (0.0 if args.quick else 0.5)
    first = True
    for rnd in range(args.repeat):  # backends interleaved, so drifting machine load hits both
        # rotated: no backend always runs right after the same one (a group that follows
        # torch's busy-polling threads measured 10-20% slower than the same code a place later)
        k = 0 if args.no_rotate else rnd % len(backends)
        for backend in backends[k:] + backends[:k]:
            merged = {"results": {}, "errors": {}}
            for group in groups:
                if not first and settle > 0:
                    time.sleep(settle)  # pacing the measurement, not synchronisation
                first = False
                print(f"== {backend} {group} (round {rnd + 1}/{args.repeat}): {GROUPS[group]} workers ...", flush=True)
                t0, (busy0, steal0) = time.monotonic(), cpu_jiffies()
                report, problem = run_backend(backend, group, args.quick, args.timeout, args.workloads)
                busy, steal = (b - a for a, b in zip((busy0, steal0), cpu_jiffies()))
                if problem:
                    problems.setdefault(backend, []).append(f"{group}: {problem}")
                    print(f"!! {backend} {group} FAILED: {problem}")
                if report:
                    merged["results"].update(report["results"])
                    merged["errors"].update(report["errors"])
                    for name, err in report["errors"].items():
                        print(f"!! {backend} {name} failed: {err}")
                stolen = f", steal {100 * steal / (busy + steal):.1f}% of busy" if busy + steal else ""
                print(f"   {backend} {group} done in {time.monotonic() - t0:.1f}s{stolen}", flush=True)
            runs[backend].append(merged)

    print()
    metrics = [m for m in _workloads.METRICS if m[4] in groups]
    medians, ratios = print_table(runs, metrics, backends)
    print("\nratio = variant / baseline, paired per round (median, spread over rounds). Latency, CPU and"
          " time rows: < 1 means rrefrt is better; throughput rows: > 1 means rrefrt is better.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"medians": medians, "runs": runs, "problems": problems, "ratios": ratios,
             "cpus": os.cpu_count(), "quick": args.quick, "groups": groups}, indent=2))
        print(f"saved {args.json}")
    return 1 if problems or any(r and r["errors"] for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
