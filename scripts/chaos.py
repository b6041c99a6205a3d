#!/usr/bin/env python3
"""Long chaos campaigns: ``python scripts/chaos.py --runs 500 [--start 1000] [--duration 2]``.

Each run is tests/chaos.py's ``run_one(seed)``: 3 workers doing RRef work under seeded
message drops, delays, duplicates and reordering, with a SIGKILL or SIGSTOP of one worker
in half of the runs. Prints one line per run and a summary; exits 1 if any run violated a
pass criterion (hang, orphan, leaked OwnerRRef without a death, undocumented error).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.chaos import check, run_one  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--duration", type=float, default=1.2, help="seconds of workload per run")
    ap.add_argument("--json", help="write every run's facts to this file")
    args = ap.parse_args()
    failures, results, t0 = 0, [], time.monotonic()
    for seed in range(args.start, args.start + args.runs):
        result = run_one(seed, args.duration)
        problems = check(result)
        failures += bool(problems)
        results.append(result | {"problems": problems})
        status = "FAIL " + "; ".join(problems) if problems else "ok"
        print(f"seed {seed:6d} {result['disruption']:5s} {result.get('took', 0):5.1f}s {status}", flush=True)
    print(f"{args.runs - failures} passed, {failures} failed in {time.monotonic() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
