"""Run torch's RPC test classes against rrefrt and record every outcome (not part of CI).

    PYTHONPATH=$PWD .venv/bin/python -m tests.torch_compat.run_all \
        --cls RpcTest --slice 0:40 --out /tmp/compat-RpcTest-0.jsonl [-k substring]

One test at a time (each spawns 4 workers), one JSON line per test, appended to --out as it
finishes, so a slice can be resumed (tests already in the file are skipped). The table in
docs/compatibility.md is made from these files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cls", default="RpcTest", choices=["RpcTest", "TensorPipeAgentRpcTest"])
    p.add_argument("--slice", default=":", help="start:stop over the sorted test names")
    p.add_argument("-k", default="", help="only names containing this substring")
    p.add_argument("--out", required=True)
    p.add_argument("--list", action="store_true", help="print the test names and exit")
    args = p.parse_args(argv)

    from tests.torch_compat import suite

    cls = suite.CLASSES[args.cls]
    names = [n for n in suite.test_names(cls) if args.k in n]
    if args.list:
        print("\n".join(names))
        return 0
    start, _, stop = args.slice.partition(":")
    names = names[int(start) if start else None : int(stop) if stop else None]
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {json.loads(line)["test"] for line in out.read_text().splitlines() if line.strip()}
    for name in names:
        if name in done:
            continue
        o = suite.run_case(cls, name)
        rec = {"cls": args.cls, "test": name, "status": o.status, "seconds": round(o.seconds, 1),
               "detail": o.detail[-3000:]}
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{o.status:5s} {o.seconds:6.1f}s {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
