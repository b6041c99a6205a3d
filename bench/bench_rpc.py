#!/usr/bin/env python3
"""Compare rrefrt with torch.distributed.rpc in one run: one table of rrefrt/torch ratios.

    python bench/bench_rpc.py [--repeat K] [--backends ...] [--groups ...] [--quick] [--json PATH]

For each round, backend and worker group, starts the group's workers as separate processes
(this same script in --worker mode, rank r pinned to core r), rank 0 runs the workloads in
bench/_workloads.py, every worker calls rpc.shutdown() and writes JSON. Point-to-point
workloads run with exactly 2 workers (one core each), forks with 3, init + shutdown with 4.
Bytecode is compiled into a cache before the first round (neither side compiles at import),
one warm-up group per backend runs first and is thrown away, rounds interleave the backends
(order rotated per round) and ratios are paired per round. See bench/README.md.
"""
import argparse
import hashlib
import json
import os
import shlex
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
sys.path.insert(0, str(BENCH))
import _workloads  # noqa: E402  (imports neither torch nor rrefrt)

GROUPS = _workloads.GROUPS
DEFAULT_GROUPS = ["p2p", "forks", "life4"]
ALL_BACKENDS = ["torch", "rrefrt", "rrefrt-secret", "torch-tcp", "rrefrt-tcp"]
#: (variant, its baseline): each variant's ratio is taken against that baseline of the same round
PAIRS = [("rrefrt", "torch"), ("rrefrt-secret", "torch"), ("rrefrt-tcp", "torch-tcp"),
         ("rrefrt-base", "torch"), ("rrefrt", "rrefrt-base")]
VARIANT_ENV = {
    "rrefrt-secret": {"RREFRT_SECRET": "bench-secret"},
    "rrefrt-tcp": {"RREFRT_SAME_HOST": "0", "RREFRT_NO_IPC": "1"},
}
#: the variants' rows need only these (unless --full-variants): the p2p group's calls and tensors
VARIANT_WORKLOADS = {"rrefrt-secret": ("p2p", "sync,tensors"), "torch-tcp": ("p2p", "sync,tensors"),
                     "rrefrt-tcp": ("p2p", "sync,tensors")}

#: the table: (label, (variant, baseline), key, kind, target, CPU key). kind "time": the ratio is
#: variant / baseline of the key (< 1: rrefrt faster); "rate": variant's rate / baseline's,
#: the key a rate; "rate_p50": the key a p50 time, the ratio baseline / variant (a rate ratio).
#: target: (">=" or "<=", value) on that ratio, or None
RT, ST, TT = ("rrefrt", "torch"), ("rrefrt-secret", "torch"), ("rrefrt-tcp", "torch-tcp")
SUMMARY = [
    ("rpc_sync no-op p50", RT, "sync_p50_us", "time", ("<=", 0.8), "sync_cpu_us"),
    ("rpc_sync no-op p99", RT, "sync_p99_us", "time", ("<=", 1.0), "sync_cpu_us"),
    ("rpc_async, 1000 in flight (rate)", RT, "async_calls_per_s", "rate", (">=", 2.5), "async_cpu_us"),
    ("tensor round trip 4 KB (rate)", RT, "tensor_4kb_p50_ms", "rate_p50", (">=", 1.0), "tensor_4kb_cpu_us"),
    ("tensor round trip 1 MB (rate)", RT, "tensor_1mb_p50_ms", "rate_p50", (">=", 1.5), "tensor_1mb_cpu_us"),
    ("tensor round trip 16 MB (rate)", RT, "tensor_16mb_p50_ms", "rate_p50", (">=", 3.0), "tensor_16mb_cpu_us"),
    ("tensor round trip 64 MB (rate)", RT, "tensor_64mb_p50_ms", "rate_p50", (">=", 3.0), "tensor_64mb_cpu_us"),
    ("remote() + to_here() p50", RT, "remote_to_here_p50_us", "time", ("<=", 0.8), "remote_cpu_us"),
    ("remote() + to_here() p99", RT, "remote_to_here_p99_us", "time", ("<=", 1.0), "remote_cpu_us"),
    ("user->user forks/s (3 workers)", RT, "forks_per_s", "rate", (">=", 3.0), "forks_cpu_us"),
    ("owner drain after a drop", RT, "drain_ms", "time", ("<=", 0.5), None),
    ("import + init + shutdown, 4 workers", RT, "life4_s", "time", ("<=", 1.0), None),
    ("  of which import (torch + backend)", RT, "import4_s", "time", None, None),
    ("  of which init_rpc", RT, "initrpc4_s", "time", None, None),
    ("  of which shutdown", RT, "shutdown4_s", "time", None, None),
    ("fan-out calls/s (8 workers)", RT, "fanout_calls_per_s", "rate", None, None),
    ("with a job secret: rpc_sync p50", ST, "sync_p50_us", "time", None, "sync_cpu_us"),
    ("with a job secret: 1 MB (rate)", ST, "tensor_1mb_p50_ms", "rate_p50", (">=", 1.5), "tensor_1mb_cpu_us"),
    ("with a job secret: 64 MB (rate)", ST, "tensor_64mb_p50_ms", "rate_p50", (">=", 3.0), "tensor_64mb_cpu_us"),
    ("tcp only: rpc_sync p50", TT, "sync_p50_us", "time", ("<=", 0.8), "sync_cpu_us"),
    ("tcp only: 1 MB (rate)", TT, "tensor_1mb_p50_ms", "rate_p50", (">=", 1.2), "tensor_1mb_cpu_us"),
    ("tcp only: 64 MB (rate)", TT, "tensor_64mb_p50_ms", "rate_p50", (">=", 1.2), "tensor_64mb_cpu_us"),
]
UNITS = {m[0]: m[2] for m in _workloads.METRICS}


#: --netns: [(namespace, veth device, address)] for rank 0 and rank 1, while they exist
NETNS: list[tuple[str, str, str]] = []
NETNS_ADDRS = ("10.231.0.1", "10.231.0.2")


def _ip(*args):
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


def make_netns():
    """Two network namespaces joined by a veth pair (10.231.0.1 and .2 /24), the closest this
    machine has to two hosts: traffic between them crosses a network device and the kernel's
    whole TCP/IP path, not loopback. Needs root and iproute2; removed by ``drop_netns``."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise SystemExit("--netns needs the 'ip' tool (iproute2) and root (to create network namespaces)")
    tag = os.getpid() % 100000
    names, devs = (f"rrbenchA{tag}", f"rrbenchB{tag}"), (f"rrba{tag}", f"rrbb{tag}")
    try:
        for ns in names:
            _ip("netns", "add", ns)
            NETNS.append((ns, "", ""))
        _ip("link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        for i, (ns, dev, addr) in enumerate(zip(names, devs, NETNS_ADDRS)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            NETNS[i] = (ns, dev, addr)
    except BaseException:
        drop_netns()
        raise


def drop_netns():
    for ns, _, _ in NETNS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # its veth end goes too
    NETNS.clear()


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


def default_pycache():
    """A per-user bytecode cache that outlives the run (the next run reuses what is fresh;
    Python recompiles a module whose source changed)."""
    return os.environ.get("PYTHONPYCACHEPREFIX") or str(
        Path(tempfile.gettempdir()) / f"rrefrt-bench-pycache-{os.getuid()}")


def transport_shim(root):
    """A directory where ``rrefrt_transport`` is ``root``'s transport/ (the installed
    package name of a source tree's transport), so that a tree's rrefrt and its transport
    are imported together; None if ``root`` has no transport/."""
    src = Path(root) / "transport"
    if not src.is_dir():
        return None
    tag = hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:12]
    shim = Path(tempfile.gettempdir()) / f"rrefrt-bench-shim-{tag}"
    shim.mkdir(exist_ok=True)
    link = shim / "rrefrt_transport"
    if not link.exists():
        link.symlink_to(src.resolve(), target_is_directory=True)
    return str(shim)


def worker_env(backend, port, pycache):
    # rrefrt-base: rrefrt and its transport imported from the tree $RREFRT_BENCH_BASE (e.g.
    # `git archive` of an older commit) to measure before/after in one interleaved run
    root = os.environ.get("RREFRT_BENCH_BASE", "") if backend == "rrefrt-base" else str(ROOT)
    shim = transport_shim(root) if backend == "rrefrt-base" and root else None
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPYCACHEPREFIX=pycache,
               PYTHONPATH=os.pathsep.join(filter(None, [root, shim, os.environ.get("PYTHONPATH")])))
    # bytecode comes from the cache filled before the run; what is missing there is written
    # once (PYTHONDONTWRITEBYTECODE would make every worker compile it at every start)
    for k in ("RREFRT_SECRET", "RREFRT_SAME_HOST", "RREFRT_NO_IPC", "PYTHONDONTWRITEBYTECODE"):
        env.pop(k, None)
    env.update(VARIANT_ENV.get(backend, {}))
    return env


def precompile(pycache, backends):
    """Compile rrefrt, rrefrt_transport, torch's rpc modules and the bench into the cache
    (the warm-up group then fills in whatever else a worker imports)."""
    import importlib.util
    dirs = [ROOT / "rrefrt", BENCH]
    if "rrefrt-base" in backends and os.environ.get("RREFRT_BENCH_BASE"):
        dirs += [Path(os.environ["RREFRT_BENCH_BASE"]) / "rrefrt", Path(os.environ["RREFRT_BENCH_BASE"]) / "transport"]
    for pkg, subs in (("rrefrt_transport", [""]), ("torch", ["distributed/rpc", "distributed/autograd"])):
        spec = importlib.util.find_spec(pkg)  # a top-level package: found, not imported
        if spec and spec.submodule_search_locations:
            dirs += [Path(list(spec.submodule_search_locations)[0]) / s for s in subs]
    env = dict(os.environ, PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.monotonic()
    dirs = [d for d in dirs if d.exists()]
    proc = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, dirs)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"!! compileall exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1000:]}")
    print(f"bytecode: compiled into {pycache} in {time.monotonic() - t0:.1f}s "
          f"({', '.join(str(d.relative_to(d.parents[1])) for d in dirs)})", flush=True)


def run_backend(backend, group, params, timeout, pycache, only=None):
    """Run one backend's worker group; return (report dict or None, problem str or None)."""
    world_size = GROUPS[group]
    if backend == "rrefrt-base" and not os.environ.get("RREFRT_BENCH_BASE"):
        return None, "rrefrt-base needs RREFRT_BENCH_BASE (a source tree of the older rrefrt)"
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_{backend}_{group}_"))
    out = tmp / "report.json"
    env = worker_env(backend, port, pycache)
    procs, logs = [], []
    for rank in range(world_size):
        log = tmp / f"rank{rank}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--rank", str(rank),
               "--port", str(port), "--out", str(out), "--group", group, "--params", params] \
            + (["--workloads", only] if only else [])
        rank_env = env
        if NETNS:  # rank r in namespace r; TensorPipe's uv transport picks its device by name
            ns, dev, _ = NETNS[rank]
            cmd = ["ip", "netns", "exec", ns, *cmd]
            rank_env = dict(env, MASTER_ADDR=NETNS[0][2], TP_SOCKET_IFNAME=dev, GLOO_SOCKET_IFNAME=dev)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=f, stderr=subprocess.STDOUT,
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
        report = {"results": dict(ranks[0]["results"]), "errors": dict(ranks[0]["errors"]),
                  "compiled_at_init": sorted({m for r in ranks for m in r.get("compiled_at_init", [])})}
        if group == "life4" and len(ranks) == world_size:
            imp = max(r["import_torch_s"] + r["import_backend_s"] for r in ranks)
            init = max(r["import_torch_s"] + r["import_backend_s"] + r["init_rpc_s"] for r in ranks)
            down = max(r["shutdown_s"] for r in ranks)
            report["results"].update(import4_s=imp, initrpc4_s=max(r["init_rpc_s"] for r in ranks),
                                     shutdown4_s=down, life4_s=init + down)
    if not problem:
        shutil.rmtree(tmp, ignore_errors=True)  # logs are kept only when something went wrong
    return report, problem


def placement(group, ncpu):
    """How the group's workers sit on the cores (rank r on core r mod ncpu)."""
    n = GROUPS[group]
    if n <= ncpu:
        return f"{group}: {n} workers on {ncpu} cores, one core each"
    shared = ", ".join(f"w{r} shares core {r % ncpu} with w{r % ncpu}" for r in range(ncpu, n))
    return f"{group}: {n} workers on {ncpu} cores: {shared}"


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


def paired_ratios(runs, variant, base, key, invert=False):
    """Per round, variant / base of the same round (base / variant with invert: a rate ratio
    from two times); rounds are interleaved, so drifting load hits both alike: the median of
    those ratios, their spread and how many rounds had both."""
    rs = []
    for a, b in zip(runs.get(variant, []), runs.get(base, [])):
        va, vb = (a or {}).get("results", {}).get(key), (b or {}).get("results", {}).get(key)
        if va and vb:
            rs.append(vb / va if invert else va / vb)
    if not rs:
        return None
    return statistics.median(rs), min(rs), max(rs), len(rs)


def medians_of(runs, backends):
    medians = {}
    for b in backends:
        reps = [r for r in runs.get(b, []) if r]
        medians[b] = {k: statistics.median(vals) for k in {k for r in reps for k in r["results"]}
                      if (vals := [r["results"][k] for r in reps if k in r["results"]])}
    return medians


def _ratio_text(pr):
    if pr is None:
        return "-"
    return f"{pr[0]:.2f}x ({pr[1]:.2f}-{pr[2]:.2f})" if pr[3] > 1 else f"{pr[0]:.2f}x"


def _print_rows(head, rows, markdown=True):
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    lines = [head, ["-" * w for w in widths], *rows] if markdown else [head, *rows]
    for row in lines:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells).rstrip())


def summary_table(runs, backends):
    """The table: one row per workload of the issue, its paired ratio, target, torch's own
    value and both sides' CPU per call."""
    medians = medians_of(runs, backends)
    head = ["workload", "rrefrt/torch (spread)", "target", "met", "torch (own value)", "CPU/call rrefrt vs torch"]
    rows, ratios = [], {}
    for label, (var, base), key, kind, target, cpu_key in SUMMARY:
        if var not in backends or base not in backends:
            continue
        if key not in medians[var] and key not in medians[base]:
            continue  # its group or workload was not run
        pr = paired_ratios(runs, var, base, key, invert=(kind == "rate_p50"))
        if pr:
            ratios[f"{var}/{base}:{key}"] = pr[0]
        met = "-"
        if pr and target:
            met = "yes" if (pr[0] >= target[1] if target[0] == ">=" else pr[0] <= target[1]) else "no"
        bv = medians[base].get(key)
        torch_abs = "-" if bv is None else f"{fmt(bv)} {UNITS[key]}"
        cpu = "-"
        if cpu_key:
            cv, cb = medians[var].get(cpu_key), medians[base].get(cpu_key)
            cpr = paired_ratios(runs, var, base, cpu_key)
            if cv is not None or cb is not None:
                cpu = f"{fmt(cv)} vs {fmt(cb)} us" + (f" ({cpr[0]:.2f}x)" if cpr else "")
            if cpr:
                ratios[f"{var}/{base}:{cpu_key}"] = cpr[0]
        rows.append([label, _ratio_text(pr), f"{target[0]} {target[1]:g}" if target else "", met, torch_abs, cpu])
    if rows:
        _print_rows(head, rows)
    else:
        print("(no variant ran with its baseline: nothing to compare)")
    return medians, ratios


def details_table(runs, metrics, backends):
    """Every metric of every backend (medians over rounds) and every pair's paired ratio."""
    medians = medians_of(runs, backends)
    pairs = [(v, b) for v, b in PAIRS if v in backends and b in backends]
    head = ["metric", *backends, *[f"{v}/{b} (spread)" for v, b in pairs]]
    rows = []
    for key, label, unit, better, _group in metrics:
        if not any(key in medians[b] for b in backends):
            continue
        rows.append([f"{label} [{unit}, {better} is better]", *[fmt(medians[b].get(key)) for b in backends],
                     *[_ratio_text(paired_ratios(runs, v, b, key)) for v, b in pairs]])
    _print_rows(head, rows, markdown=False)


def command_line():
    base = os.environ.get("RREFRT_BENCH_BASE")
    return (f"RREFRT_BENCH_BASE={shlex.quote(base)} " if base else "") + shlex.join(
        [Path(sys.executable).name, *sys.argv])


def plan(backends, groups, workloads, full_variants):
    """backend -> [(group, workloads or None)] for one round."""
    out = {}
    for b in backends:
        items = []
        for g in groups:
            only = workloads
            if b in VARIANT_WORKLOADS and not full_variants:
                vgroup, vonly = VARIANT_WORKLOADS[b]
                if g != vgroup:
                    continue
                only = ",".join(w for w in vonly.split(",") if not workloads or w in workloads.split(","))
                if not only:
                    continue
            names = _workloads.workload_names(g)
            if not names:
                only = None  # life4: init and shutdown only
            elif only and not any(w in names for w in only.split(",")):
                continue  # none of this group's workloads asked for
            items.append((g, only))
        out[b] = items
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=None,
                    help="comma list of torch, torch-tcp, rrefrt, rrefrt-secret, rrefrt-tcp, rrefrt-base "
                         "(default: all but rrefrt-base; --quick: torch,rrefrt)")
    ap.add_argument("--groups", default=None,
                    help="comma list of p2p (2 workers), forks (3), life4 (4), fan8 (8) (default: p2p,forks,life4)")
    ap.add_argument("--quick", action="store_true", help="few iterations, one round (smoke test)")
    ap.add_argument("--workloads", default=None,
                    help="comma list of workloads to run: sync, async, tensors, remote, drain (p2p), forks, "
                         "fanout (default: all of each group)")
    ap.add_argument("--full-variants", action="store_true",
                    help="run every group and workload for rrefrt-secret, torch-tcp and rrefrt-tcp too "
                         "(default: the p2p group's sync and tensors, what their rows need)")
    ap.add_argument("--json", metavar="PATH", help="save all results and ratios here")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds (backends interleaved); paired medians are reported (default 3, --quick 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per worker group")
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds of idle between two worker groups (default 0.5, --quick 0): the group "
                         "after a busy-polling one (torch) otherwise starts on a core still paying for it")
    ap.add_argument("--no-rotate", action="store_true",
                    help="keep the --backends order in every round (default: round k starts k places on)")
    ap.add_argument("--pycache", default=None,
                    help="bytecode cache for the workers (PYTHONPYCACHEPREFIX; default: $PYTHONPYCACHEPREFIX "
                         "or rrefrt-bench-pycache-<uid> in the temp dir)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up group per backend")
    ap.add_argument("--netns", action="store_true",
                    help="run the 2 point-to-point workers in two network namespaces joined by a veth pair "
                         "(root): the tcp variants between two 'hosts' (default backends torch-tcp,rrefrt-tcp; "
                         "groups p2p only)")
    ap.add_argument("--details", action="store_true",
                    help="also print every metric of every backend (always with rrefrt-base)")
    ap.add_argument("--worker", metavar="BACKEND", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--group", default="p2p", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="full", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        params = {"full": _workloads.FULL, "quick": _workloads.QUICK, "warm": _workloads.WARM}[args.params]
        only = set(args.workloads.split(",")) if args.workloads else None
        _workloads.worker_main(args.worker, args.rank, GROUPS[args.group], args.port, args.out, params,
                               args.group, only)
        return 0

    default_backends = "torch,rrefrt" if args.quick else ",".join(ALL_BACKENDS)
    if args.netns:
        default_backends = "torch-tcp,rrefrt-tcp"
        if args.groups not in (None, "p2p"):
            ap.error("--netns runs the p2p group only (one worker per namespace)")
        args.groups = "p2p"
    backends = [b.strip() for b in (args.backends or default_backends).split(",") if b.strip()]
    groups = [g.strip() for g in (args.groups or ",".join(DEFAULT_GROUPS)).split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS or g == "warm"]
    if unknown:
        ap.error(f"unknown group(s) {unknown}; choose from p2p, forks, life4, fan8")
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    params = "quick" if args.quick else "full"
    pycache = str(Path(args.pycache or default_pycache()).resolve())
    ncpu = len(os.sched_getaffinity(0))
    todo = plan(backends, groups, args.workloads, args.full_variants)
    print(f"command: {command_line()}")
    print(f"cpus={ncpu} loadavg={os.getloadavg()[0]:.2f} rounds={repeat}{' quick' if args.quick else ''} "
          f"backends={','.join(backends)} groups={','.join(groups)}", flush=True)
    if ncpu < 2:
        print("!! fewer than 2 cores: the 2 point-to-point workers share one; no latency figure here is fair")
    if repeat < 3 and not args.quick:
        print("!! fewer than 3 rounds: not for quoting")
    precompile(pycache, backends)
    if args.netns:
        make_netns()
        print(f"network namespaces: rank 0 in {NETNS[0][0]} ({NETNS[0][2]}), rank 1 in {NETNS[1][0]} "
              f"({NETNS[1][2]}), one veth pair between them", flush=True)
        try:
            return _measure(args, backends, groups, todo, repeat, params, pycache, ncpu)
        finally:
            drop_netns()
    return _measure(args, backends, groups, todo, repeat, params, pycache, ncpu)


def _measure(args, backends, groups, todo, repeat, params, pycache, ncpu):
    """The warm-up groups, the interleaved rounds and the report (main's second half)."""
    problems, compiled = {}, {}
    settle = args.settle if args.settle is not None else (0.0 if args.quick else 0.5)
    if not args.no_warmup:  # imports and first calls of each backend once, results thrown away
        for backend in backends:
            t0 = time.monotonic()
            _, problem = run_backend(backend, "warm", "warm", args.timeout, pycache)
            print(f"== {backend} warm-up: {time.monotonic() - t0:.1f}s" + (f"; FAILED: {problem}" if problem else ""),
                  flush=True)

    runs = {b: [] for b in backends}  # backend -> one merged report per round (None if it failed)
    first = True
    for rnd in range(repeat):  # backends interleaved, so drifting machine load hits both
        # rotated: no backend always runs right after the same one (a group that follows
        # torch's busy-polling threads measured 10-20% slower than the same code a place later)
        k = 0 if args.no_rotate else rnd % len(backends)
        for backend in backends[k:] + backends[:k]:
            merged = {"results": {}, "errors": {}}
            for group, only in todo[backend]:
                if not first and settle > 0:
                    time.sleep(settle)  # pacing the measurement, not synchronisation
                first = False
                print(f"== {backend} {group} (round {rnd + 1}/{repeat}): {GROUPS[group]} workers"
                      + (f", {only}" if only else "") + " ...", flush=True)
                t0, (busy0, steal0) = time.monotonic(), cpu_jiffies()
                report, problem = run_backend(backend, group, params, args.timeout, pycache, only)
                busy, steal = (b - a for a, b in zip((busy0, steal0), cpu_jiffies()))
                if problem:
                    problems.setdefault(backend, []).append(f"{group}: {problem}")
                    print(f"!! {backend} {group} FAILED: {problem}")
                if report:
                    merged["results"].update(report["results"])
                    merged["errors"].update(report["errors"])
                    for name, err in report["errors"].items():
                        print(f"!! {backend} {name} failed: {err}")
                    if report["compiled_at_init"]:
                        compiled.setdefault(backend, set()).update(report["compiled_at_init"])
                stolen = f", steal {100 * steal / (busy + steal):.1f}% of busy" if busy + steal else ""
                print(f"   {backend} {group} done in {time.monotonic() - t0:.1f}s{stolen}", flush=True)
            runs[backend].append(merged)

    print(f"\n{command_line()}\n")
    medians, ratios = summary_table(runs, backends)
    rounds = max((len([r for r in rs if r]) for rs in runs.values()), default=0)
    print(f"\nratio: paired per round, median (min-max) over {rounds} interleaved round(s). Rows marked rate: "
          "rrefrt's rate / torch's, > 1 means rrefrt is faster; times (p50, p99, drain, init): rrefrt's / "
          "torch's, < 1 means rrefrt is faster. torch (own value): torch's median of the row's metric, its "
          "p50 on the tensor rows (the tcp rows: torch-tcp's). CPU/call: user+sys time of every worker of "
          "the group (caller and callees, every thread) over the measured calls, divided by the calls; "
          "medians, and their paired ratio.")
    print("workers: " + "; ".join(placement(g, ncpu) for g in groups) + " (rank r pinned to core r mod cores)"
          + (", each rank in a network namespace of its own, joined by a veth pair." if NETNS else "."))
    if {"rrefrt-secret", "rrefrt-tcp"} & set(backends):
        print("job secret: rrefrt with RREFRT_SECRET against plain torch (torch has none). tcp only: rrefrt with "
              "RREFRT_SAME_HOST=0 RREFRT_NO_IPC=1 against TensorPipe with _transports=['uv'], _channels=['basic'].")
    if "life4" in groups:
        print("init: from before `import torch` (then torch.distributed.rpc or rrefrt) to init_rpc returned, "
              "the slowest of 4 ranks (import: the slowest rank's `import torch` and backend import).")
    print(f"bytecode: precompiled into {pycache}; "
          + ("no warm-up group." if args.no_warmup else "one warm-up group per backend ran before the rounds."))
    for backend, mods in compiled.items():
        print(f"!! {backend}: modules compiled during a measured init: {', '.join(sorted(mods)[:10])}"
              + (" ..." if len(mods) > 10 else ""))
    if args.details or "rrefrt-base" in backends:
        print()
        details_table(runs, [m for m in _workloads.METRICS if m[4] in groups], backends)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": command_line(), "medians": medians, "runs": runs, "problems": problems, "ratios": ratios,
             "cpus": ncpu, "quick": args.quick, "groups": groups, "rounds": repeat, "pycache": pycache,
             "compiled_at_init": {b: sorted(m) for b, m in compiled.items()}}, indent=2))
        print(f"saved {args.json}")
    return 1 if problems or any(r and r["errors"] for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
