"""Run torch's RPC test classes (tests/torch_compat/suite.py) against rrefrt and record every outcome (not part of CI).

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
    p.add_argument("--cls", default="RpcTest",
                   help="a class of suite.CLASSES, or a family of suite.FAMILIES (RpcTest's is RpcTest alone; "
                        "'family:RpcTest' adds TensorPipeAgentRpcTest, 'family:RemoteModuleTest' the three RemoteModule classes)")
    p.add_argument("--slice", default=":", help="start:stop over the sorted test names")
    p.add_argument("-k", default="", help="only names containing this substring")
    p.add_argument("--out", required=True)
    p.add_argument("--names", default="", help="comma-separated Class.test list (overrides --cls/-k/--slice)")
    p.add_argument("--list", action="store_true", help="print the test names and exit")
    args = p.parse_args(argv)

    from tests.torch_compat import suite

    if args.names:
        todo = [tuple(n.split(".", 1)) for n in args.names.split(",") if n]
    else:
        classes = suite.FAMILIES[args.cls[7:]] if args.cls.startswith("family:") else (args.cls,)
        names = [(c, n) for c in classes for n in suite.test_names(suite.CLASSES[c]) if args.k in n]
        start, _, stop = args.slice.partition(":")
        todo = names[int(start) if start else None : int(stop) if stop else None]
    if args.list:
        print("\n".join(f"{c}.{n}" for c, n in todo))
        return 0
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {(r["cls"], r["test"]) for r in map(json.loads, out.read_text().splitlines()) if r}
    for cls_name, name in todo:
        if (cls_name, name) in done:
            continue
        o = suite.run_case(suite.CLASSES[cls_name], name)
        rec = {"cls": cls_name, "test": name, "status": o.status, "seconds": round(o.seconds, 1),
               "detail": o.detail if len(o.detail) < 12000 else o.detail[:8000] + "\n...\n" + o.detail[-4000:]}
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{o.status:5s} {o.seconds:6.1f}s {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
