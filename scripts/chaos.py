#!/usr/bin/env python3
"""Long chaos campaigns: ``python scripts/chaos.py --runs 500 [--start 1000] [--duration 2]``.

Each run is tests/support/chaos.py's ``run_one(seed)``: 3 workers doing RRef work under seeded
message drops, delays, duplicates and reordering; by seed, no disruption, a SIGKILL or a
SIGSTOP of one worker, a SIGSTOP just under or over the heartbeat timeout followed by
SIGCONT ("stop_near"), or a 200 MB result (stalled by a SIGSTOP in half of those runs).
Prints one line per run and a summary (runs, hangs, orphans, leaks - deaths and stops
included - and failures by kind); exits 1 if any run violated a pass criterion.
``--summarize a.json b.json`` prints the summary of earlier campaigns (batches) together.
``--trace DIR`` keeps, for each failing run, every worker's protocol trace (context events,
protocol messages sent, received and hit by a fault: tests/support/ptrace.py) in
``DIR/seed<N>/w<rank>.jsonl`` and the run's facts in ``DIR/seed<N>/result.json``.
"""

import argparse
import collections
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.chaos import check, run_one  # noqa: E402


def summary(results: list) -> str:
    kinds = collections.Counter(r["disruption"] for r in results)
    failed = [r for r in results if r["problems"]]
    hangs = sum("hang" in r for r in results)
    orphans = sum(len(r.get("orphans") or []) for r in results)
    leaky = [r for r in results if any(w.get("owner_rrefs_left") for w in r.get("workers", {}).values())]
    leaked = sum(w.get("owner_rrefs_left", 0) for r in results for w in r.get("workers", {}).values())
    near = [r for r in results if r["disruption"] == "stop_near" and "w2" in r.get("workers", {})]
    fenced = sum(bool((r["workers"]["w2"].get("membership") or {}).get("fenced")) for r in near)
    large = [r for r in results if r["disruption"] == "large"]
    stalled = sum("stalled_at" in r for r in large)
    delivered = [(r["workers"].get("w0") or {}).get("large") or {} for r in large if "stalled_at" not in r]
    slow = sum(d.get("ok", False) and d.get("took", 0) > d.get("hb_timeout", 1.5) for d in delivered)
    lines = [
        f"runs {len(results)} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})",
        f"hangs {hangs}, orphans {orphans}, leaks {leaked} OwnerRRefs in {len(leaky)} runs "
        f"({', '.join(f'{k} {n}' for k, n in sorted(collections.Counter(r['disruption'] for r in leaky).items())) or 'none'})",
        f"stop_near: w2 fenced by all in {fenced} of {len(near)} runs, by none in the rest",
        f"large: {len(large) - stalled} not stalled ({slow} delivered in longer than the heartbeat timeout), "
        f"{stalled} stalled by a SIGSTOP",
        f"failures {len(failed)}"
        + "".join(f"\n  seed {r['seed']} {r['disruption']}: {'; '.join(r['problems'])[:600]}" for r in failed),
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--duration", type=float, default=1.2, help="seconds of workload per run")
    ap.add_argument("--json", help="write every run's facts to this file (rewritten after every run)")
    ap.add_argument("--trace", metavar="DIR", help="keep the protocol traces of failing runs in DIR/seed<N>/")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="only summarize earlier campaigns' files")
    args = ap.parse_args()
    if args.summarize:
        results = [r for path in args.summarize for r in json.load(open(path))]
        print(summary(results))
        return 1 if any(r["problems"] for r in results) else 0
    results, t0 = [], time.monotonic()
    for seed in range(args.start, args.start + args.runs):
        trace = os.path.join(args.trace, f"seed{seed}") if args.trace else None
        if trace:
            os.makedirs(trace, exist_ok=True)
        result = run_one(seed, args.duration, trace)
        problems = check(result)
        if trace and problems:
            with open(os.path.join(trace, "result.json"), "w") as f:
                json.dump(result | {"problems": problems}, f, indent=1, default=str)
        elif trace:
            shutil.rmtree(trace, ignore_errors=True)
        results.append(result | {"problems": problems})
        status = "FAIL " + "; ".join(problems) if problems else "ok"
        print(f"seed {seed:6d} {result['disruption']:9s} {result.get('took', 0):5.1f}s {status}", flush=True)
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(results, f, indent=1, default=str)
            os.replace(args.json + ".tmp", args.json)
    print(f"{summary(results)}\nin {time.monotonic() - t0:.0f}s")
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
