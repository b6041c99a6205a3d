#!/usr/bin/env python3
"""Memory soak: ``python scripts/soak.py --minutes 10 [--workers 3] [--interval 60]``.

Starts a real job of W workers through the launcher (``python -m rrefrt.run
--nproc-per-node W scripts/soak.py --worker ...``). Every worker runs, at a small rate
(``--rate`` operations per second; it measures memory, not speed), a seeded mix of:
rpc_sync and rpc_async calls with small (64 floats) and medium (512 KiB, over shared memory
between workers of one host) tensors; remote() + to_here(); RRefs returned by their owner
(owner -> user); RRefs passed to a third worker (user -> user forks) and back to their owner
(user -> owner); proxy calls (``rref.rpc_sync().sum()``, ``rref.remote()``); an
``async def`` and an ``@async_execution`` function; a remote exception (1 operation in 56)
and a call that times out before its answer arrives (1 in 224); and drops of held RRefs
(at most ``HELD`` held).

Every ``--interval`` seconds each worker reports its RSS, OS threads, open fds, live RRefs
(owners, forks, pending users and children), glibc's bytes in use and free, its gc-tracked
objects, the sizes of the runtime's tables keyed by fork, RRef or call id, and the
operations and errors so far; the driver prints two lines per worker and sample. At the end
it fits a line to each worker's RSS after ``--warmup`` minutes (least squares, MB per
minute; also shown without the free space inside glibc's heaps) and exits 1 if a slope is
above ``--max-slope`` (see ``MAX_SLOPE``), if a worker failed, if an operation raised
something other than what the mix asks for, or if pending users or children remain at the
end. docs/performance.md ("Memory soak") has a 20-minute run.

``--tracemalloc DIR`` also traces Python allocations on every worker (slower; 1 frame per
allocation unless ``--frames``): a snapshot after warm-up and one at the end, and the top
growing allocation sites between them written to ``DIR/rank<N>.txt``.

    python scripts/soak.py --minutes 20                    # the long run
    python scripts/soak.py --workers 2 --minutes 4 --interval 30 --tracemalloc /tmp/soak-tm --frames 6
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Default threshold of the RSS slope after warm-up, in MB/min. Leak-free workers measured
#: here (docs/performance.md, "Memory soak"; 20 minutes, 3 workers): slopes of -0.14 to
#: +0.33, each with a standard error of about 0.1 (RSS swings by 2-4 MB between samples as
#: glibc keeps the medium tensors' freed memory in its heaps and returns it in steps;
#: without that free space the slopes are -0.08 to +0.11). The leak this script was
#: written to catch grew 1.9 MB/min. 0.5 MB/min is above every leak-free run and a quarter
#: of that leak: 30 MB an hour, which a long-running job would notice.
MAX_SLOPE = 0.5
HELD = 32  #: RRefs a worker holds at most; older ones are dropped
SMALL = 64  #: floats in a small tensor
MEDIUM = 128 * 1024  #: floats in a medium tensor (512 KiB: above the shared-memory threshold)
LINE = "SOAK "  #: a worker's report lines start with this


# ---------------------------------------------------------------------------- remote functions
# (run on every worker: the launcher runs this file as __main__ in each, so a function
# pickled as __main__.<name> is found on the other side)
def tensor_sum(t: Any) -> float:
    return float(t.sum())


def scale(t: Any, k: float) -> Any:
    return t * k


def make_tensor(n: int, value: float) -> Any:
    import torch

    return torch.full((n,), value)


def own_tensor(n: int, value: float) -> Any:
    """An RRef owned here, returned to the caller (owner -> user)."""
    import rrefrt

    return rrefrt.RRef(make_tensor(n, value))


def fetch_sum(rref: Any) -> float:
    """Given an RRef (a fork from its holder): fetch it and sum it."""
    return float(rref.to_here().sum())


def pass_on(rref: Any, to: str) -> float:
    """Pass a received RRef on to ``to`` (a second user -> user fork)."""
    import rrefrt

    return float(rrefrt.rpc_sync(to, fetch_sum, args=(rref,)))


def local_sum(rref: Any) -> float:
    """On the RRef's owner (user -> owner)."""
    return float(rref.local_value().sum())


async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def chained(to: str, n: int) -> Any:
    """An @async_execution function (decorated in ``_decorate``): the answer is sent when a
    nested call completes."""
    import rrefrt

    return rrefrt.rpc_async(to, make_tensor, args=(n, 1.0)).then(lambda f: float(f.value().sum()))


def fail(msg: str) -> None:
    raise ValueError(msg)


def slow(seconds: float) -> float:
    threading.Event().wait(seconds)  # the delay is the point: the caller has timed out by then
    return seconds


def _decorate() -> None:
    import rrefrt

    globals()["chained"] = rrefrt.functions.async_execution(chained)


# ---------------------------------------------------------------------------- worker
def _proc_status() -> dict[str, int]:
    out = {"rss_kb": 0, "threads": 0}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kb"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir("/proc/self/fd"))
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc() -> dict[str, int]:
    """glibc's own account (mallinfo2), in kB: bytes malloc'd and still in use (C and
    Python objects above 512 bytes, torch storages, msgpack buffers), bytes free inside
    its heaps (fragmentation), and bytes in separate mmaps. Empty where unavailable."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"malloc_used_kb": (m.uordblks + m.hblkhd) // 1024, "malloc_free_kb": m.fordblks // 1024}


class Mix:
    """One worker's operations (seeded by rank); counts what ran and what failed."""

    EXPECTED = {"ValueError", "RpcTimeoutError"}  #: raised on purpose by the mix

    def __init__(self, rank: int, world: int) -> None:
        self.rng = random.Random(rank)
        self.me = f"soak{rank}"
        self.peers = [f"soak{r}" for r in range(world) if r != rank]
        self.everyone = [f"soak{r}" for r in range(world)]
        self.held: list[Any] = []
        self.ops = 0
        self.errors: dict[str, int] = {}
        self.samples: list[str] = []

    def step(self) -> None:
        import rrefrt
        import torch

        rng = self.rng
        peer = rng.choice(self.peers)
        op = rng.randrange(14)
        self.ops += 1
        try:
            if op == 0:
                rrefrt.rpc_sync(peer, tensor_sum, args=(torch.ones(SMALL),))
            elif op == 1:
                futs = [rrefrt.rpc_async(p, scale, args=(torch.ones(SMALL), 2.0)) for p in self.peers]
                rrefrt.futures.wait_all(futs)
            elif op == 2:
                rrefrt.rpc_async(peer, scale, args=(torch.ones(MEDIUM), 0.5)).wait()
            elif op in (3, 4):
                rref = rrefrt.remote(peer, make_tensor, args=(SMALL if op == 3 else MEDIUM, 1.0))
                rref.to_here()
                self.held.append(rref)
            elif op == 5:
                self.held.append(rrefrt.rpc_sync(peer, own_tensor, args=(SMALL, 2.0)))
            elif op == 6 and self.held:  # user -> user: to a worker that is neither owner nor us
                rref = rng.choice(self.held)
                third = [w for w in self.everyone if w not in (self.me, rref.owner_name())]
                rrefrt.rpc_sync(rng.choice(third) if third else peer, fetch_sum, args=(rref,))
            elif op == 7 and self.held:  # user -> user -> user
                rref = rng.choice(self.held)
                rrefrt.rpc_sync(peer, pass_on, args=(rref, rng.choice(self.everyone)))
            elif op == 8 and self.held:
                rref = rng.choice(self.held)
                if rref.is_owner():
                    rref.to_here()
                else:
                    rrefrt.rpc_sync(rref.owner(), local_sum, args=(rref,))
            elif op == 9 and self.held:
                rref = rng.choice(self.held)
                rref.rpc_sync().sum()
                self.held.append(rref.remote().mul(2.0))
            elif op == 10:
                rrefrt.rpc_sync(peer, async_add, args=(1, 2))
                rrefrt.rpc_sync(peer, chained, args=(rng.choice(self.everyone), SMALL))
            elif op == 11:
                if rng.randrange(4) == 0:
                    rrefrt.rpc_sync(peer, fail, args=("on purpose",))
                elif rng.randrange(12) == 0:
                    rrefrt.rpc_sync(peer, slow, args=(0.3,), timeout=0.05)
            elif self.held:  # 12, 13: drops
                self.held.pop(rng.randrange(len(self.held)))
            while len(self.held) > HELD:
                self.held.pop(0)
        except Exception as e:
            name = type(e).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
            if name not in self.EXPECTED and len(self.samples) < 5:
                self.samples.append(f"{name}: {str(e)[:300]}")


def _tables() -> dict[str, int]:
    """Sizes of the runtime's tables that are keyed by call, fork or RRef id (internals read
    for diagnosis only; a table missing in this version reads -1)."""
    from rrefrt import state

    rt = state.current()
    probes = {
        "tombstones": lambda: len(rt.ctx.deleted_forks),
        "released": lambda: len(rt.ctx.released),
        "known_owned": lambda: len(rt.ctx.known_owned),
        "seen_calls": lambda: sum(len(seen) for seen in rt.callee._seen_calls.values()),
        "creating": lambda: len(rt.creation.creating),
        "accepts": lambda: len(rt.creation.accepts),
        "fetches": lambda: len(rt.creation.fetches),
        "timers": lambda: len(rt.transport.local._timers),
    }
    out = {}
    for name, probe in probes.items():
        try:
            out[name] = int(probe())
        except Exception:
            out[name] = -1
    return out


def _report(rank: int, t0: float, mix: Mix, phase: str) -> None:
    import rrefrt

    info = rrefrt.get_debug_info()
    sample = {
        "rank": rank, "t": round(time.monotonic() - t0, 1), "phase": phase, **_proc_status(), **_malloc(),
        "owners": info.get("num_owner_rrefs", 0), "forks": info.get("num_forks", 0),
        "pending_users": info.get("num_pending_users", 0), "pending_children": info.get("num_pending_children", 0),
        "confirmed_users": info.get("num_confirmed_users", 0), "held": len(mix.held), "ops": mix.ops,
        "errors": dict(mix.errors), "samples": list(mix.samples), "objects": len(gc.get_objects()),
        "tables": _tables(),
    }
    print(LINE + json.dumps(sample), flush=True)


def _tracemalloc_diff(path: str, first: Any, last: Any, top: int = 40) -> None:
    with open(path, "w") as f:
        for key in ("lineno", "traceback"):
            stats = last.compare_to(first, key)
            grew = sum(s.size_diff for s in stats)
            f.write(f"== by {key}: total {grew / 1e6:+.3f} MB, {sum(s.count_diff for s in stats):+d} blocks\n")
            for s in stats[:top]:
                f.write(f"{s.size_diff / 1e3:+10.1f} kB {s.count_diff:+8d} blocks  now {s.size / 1e3:9.1f} kB\n")
                for line in s.traceback.format()[-12:]:
                    f.write(f"      {line}\n")
            f.write("\n")


def worker(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import rrefrt
    import torch

    _decorate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rrefrt.init_rpc(f"soak{rank}", rpc_backend_options=rrefrt.RpcBackendOptions(rpc_timeout=30.0))
    rrefrt.rpc_sync(f"soak{(rank + 1) % world}", tensor_sum, args=(torch.ones(1),))  # torch loaded there too
    if args.tracemalloc:  # after the imports: only growth matters, and tracing an import is slow
        import tracemalloc

        tracemalloc.start(args.frames)
    mix = Mix(rank, world)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60.0
    warm = t0 + args.warmup * 60.0
    next_report = t0
    period = 1.0 / args.rate
    pace = threading.Event()  # never set: its wait paces the operations
    first_snapshot = None
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_report:
            _report(rank, t0, mix, "run")
            next_report += args.interval
        if args.tracemalloc and first_snapshot is None and now >= warm:
            import tracemalloc

            gc.collect()
            first_snapshot = tracemalloc.take_snapshot()
        mix.step()
        pace.wait(max(0.0, period - (time.monotonic() - now)))
    mix.held.clear()
    gc.collect()
    # let the drops and deletes of the last RRefs settle (bounded): the other workers are
    # still finishing their own last operations
    settle = time.monotonic() + 10.0
    while time.monotonic() < settle:
        info = rrefrt.get_debug_info()
        if not (info.get("num_pending_users") or info.get("num_pending_children")):
            break
        pace.wait(0.1)
    _report(rank, t0, mix, "end")
    if args.tracemalloc and first_snapshot is not None:
        import tracemalloc

        gc.collect()
        _tracemalloc_diff(os.path.join(args.tracemalloc, f"rank{rank}.txt"), first_snapshot, tracemalloc.take_snapshot())
    rrefrt.shutdown()
    return 0


# ---------------------------------------------------------------------------- driver
def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, MB) points; 0.0 for fewer than two."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def driver(args: argparse.Namespace) -> int:
    if args.tracemalloc:
        os.makedirs(args.tracemalloc, exist_ok=True)
    cmd = [
        sys.executable, "-m", "rrefrt.run", "--nproc-per-node", str(args.workers), "--gpus", "0",
        "--cpu-threads-per-worker", "1", "-q", str(Path(__file__).resolve()), "--worker",
        "--minutes", str(args.minutes), "--interval", str(args.interval), "--warmup", str(args.warmup),
        "--rate", str(args.rate), "--frames", str(args.frames),
    ] + (["--tracemalloc", os.path.abspath(args.tracemalloc)] if args.tracemalloc else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    print(f"soak: {args.workers} workers, {args.minutes:g} min, {args.rate:g} ops/s each, a sample every "
          f"{args.interval:g} s, slope after {args.warmup:g} min (limit {args.max_slope:g} MB/min)", flush=True)
    samples: dict[int, list[dict]] = {r: [] for r in range(args.workers)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            at = line.find(LINE)
            if at < 0:
                print(line, flush=True)
                continue
            s = json.loads(line[at + len(LINE):])
            samples[s["rank"]].append(s)
            print(
                f"t={s['t']:7.1f}s rank {s['rank']} {s['phase']:3s}  rss {s['rss_kb'] / 1024:7.1f} MB  "
                f"threads {s['threads']:3d}  fds {s['fds']:3d}  rrefs owners {s['owners']:3d} forks {s['forks']:3d} "
                f"pending {s['pending_users']}/{s['pending_children']} confirmed {s['confirmed_users']:3d}  "
                f"ops {s['ops']:6d}  errors {sum(s['errors'].values())}  objects {s['objects']}\n"
                f"{'':10s}malloc used {s.get('malloc_used_kb', 0) / 1024:.1f} MB free {s.get('malloc_free_kb', 0) / 1024:.1f} MB  "
                f"tables {' '.join(f'{k} {v}' for k, v in s['tables'].items())}",
                flush=True,
            )
        code = proc.wait(timeout=args.minutes * 60 + 120)
    except BaseException:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its workers
        proc.wait(timeout=30)
        raise
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f, indent=1)
    return verdict(samples, args, code)


def verdict(samples: dict[int, list[dict]], args: argparse.Namespace, code: int) -> int:
    problems = [] if code == 0 else [f"the launcher exited with {code}"]
    print(f"RSS slope after {args.warmup:g} min of warm-up (least squares over the 'run' samples and the end):")
    for rank, ss in sorted(samples.items()):
        pts = [(s["t"] / 60.0, s["rss_kb"] / 1024) for s in ss if s["t"] >= args.warmup * 60.0]
        k = slope(pts)
        held = slope([(s["t"] / 60.0, (s["rss_kb"] - s.get("malloc_free_kb", 0)) / 1024) for s in ss
                      if s["t"] >= args.warmup * 60.0])
        objs = slope([(s["t"] / 60.0, float(s["objects"])) for s in ss if s["t"] >= args.warmup * 60.0 and s["phase"] == "run"])
        first, last = (ss[0], ss[-1]) if ss else ({}, {})
        print(f"  rank {rank}: {k:+.3f} MB/min over {len(pts)} samples ({held:+.3f} without the free space inside "
              f"malloc's heaps); rss {first.get('rss_kb', 0) / 1024:.1f} -> "
              f"{last.get('rss_kb', 0) / 1024:.1f} MB, threads {first.get('threads')} -> {last.get('threads')}, "
              f"fds {first.get('fds')} -> {last.get('fds')}, gc objects {objs:+.0f}/min; tables at the end: "
              f"{' '.join(f'{k} {v}' for k, v in last.get('tables', {}).items())}")
        if len(pts) < 3:
            problems.append(f"rank {rank}: only {len(pts)} samples after warm-up (run longer or sample more often)")
        elif k > args.max_slope:
            problems.append(f"rank {rank}: RSS grows {k:.3f} MB/min after warm-up (limit {args.max_slope:g})")
        if last.get("phase") != "end":
            problems.append(f"rank {rank}: no final report (did it fail?)")
        else:
            bad = set(last["errors"]) - Mix.EXPECTED
            if bad:
                problems.append(f"rank {rank}: unexpected errors {sorted(bad)}: {last['samples']}")
            if last["pending_users"] or last["pending_children"]:
                problems.append(f"rank {rank}: {last['pending_users']} pending users and "
                                f"{last['pending_children']} pending children at the end")
    for p in problems:
        print(f"FAIL {p}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the workload (default 10)")
    ap.add_argument("--workers", type=int, default=3, help="worker processes (2-3 keep it light; default 3)")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples (default 60)")
    ap.add_argument("--warmup", type=float, default=2.0, help="minutes left out of the slope (default 2)")
    ap.add_argument("--rate", type=float, default=10.0, help="operations per second per worker (default 10)")
    ap.add_argument("--max-slope", type=float, default=MAX_SLOPE,
                    help=f"MB/min of RSS growth after warm-up that fails the run (default {MAX_SLOPE})")
    ap.add_argument("--tracemalloc", metavar="DIR", help="trace Python allocations; diffs to DIR/rank<N>.txt")
    ap.add_argument("--frames", type=int, default=1, help="frames kept per traced allocation (default 1)")
    ap.add_argument("--json", help="write every sample to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workers < 2:
        ap.error("--workers must be at least 2")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
