"""Run torch's RPC test classes (tests/torch_compat/suite.py) against rrefrt and record every outcome (not part of CI).

    PYTHONPATH=$PWD .venv/bin/python -m tests.torch_compat.run_all \
        --cls RpcTest --slice 0:40 --out /tmp/compat-RpcTest-0.jsonl [-k substring]

One test at a time (each forks its 4 workers), or ``--jobs N`` at a time (each in a forked
child of this process), one JSON line per test, appended to --out as it finishes, so a
slice can be resumed (tests already in the file are skipped). The table in
docs/compatibility.md is made from these files.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--jobs", type=int, default=1, help="tests run at once, each in a forked child (default 1)")
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
    todo = [t for t in todo if t not in done]
    if args.jobs <= 1:
        for cls_name, name in todo:
            _record(out, cls_name, name, suite.run_case(suite.CLASSES[cls_name], name))
    else:
        _run_forked(out, todo, args.jobs)
    return 0


def _record(out: Path, cls_name: str, name: str, o: "suite.Outcome") -> None:
    rec = {"cls": cls_name, "test": name, "status": o.status, "seconds": round(o.seconds, 1),
           "detail": o.detail if len(o.detail) < 12000 else o.detail[:8000] + "\n...\n" + o.detail[-4000:]}
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{o.status:5s} {o.seconds:6.1f}s {name}", flush=True)


def _run_forked(out: Path, todo: list[tuple[str, str]], jobs: int) -> None:
    """``jobs`` tests at a time, each in a child forked from this process (which imported
    the harness, so a child starts at once); a child sends its Outcome through a pipe, and
    one that dies without a word is recorded as an error, naming how it ended."""
    from tests.torch_compat import suite

    running: dict[int, tuple[str, str, int]] = {}  # pid -> (cls, test, read end)
    queue = list(todo)
    while queue or running:
        while queue and len(running) < jobs:
            cls_name, name = queue.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: run the test, report, leave without running the parent's exit code
                code = 0
                try:
                    os.close(r)
                    o = suite.run_case(suite.CLASSES[cls_name], name)
                    detail = o.detail if len(o.detail) < 12000 else o.detail[:8000] + "\n...\n" + o.detail[-4000:]
                    with os.fdopen(w, "w") as f:  # under the pipe's 64 KB: read after the child ended
                        json.dump([o.status, o.seconds, detail], f)
                except BaseException:  # noqa: BLE001 - reported by the parent as an error
                    code = 1
                finally:
                    os._exit(code)
            os.close(w)
            running[pid] = (cls_name, name, r)
        pid, status = os.wait()
        if pid not in running:  # a grandchild reparented to us would be a bug of the harness
            continue
        cls_name, name, r = running.pop(pid)
        with os.fdopen(r) as f:
            raw = f.read()
        try:
            st, secs, detail = json.loads(raw)
            o = suite.Outcome(st, secs, detail)
        except ValueError:
            o = suite.Outcome("error", 0.0, f"the child running the test ended without a result (wait status {status})")
        _record(out, cls_name, name, o)


if __name__ == "__main__":
    sys.exit(main())
