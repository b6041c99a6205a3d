"""Close campaign (issue 11 item 2): N rounds of a W-process transport mesh that joins,
exchanges a little traffic and then closes everywhere at once; counts processes that died
of SIGABRT (libzmq's ``Assertion failed: !_io_error``), other failures and hangs.

    PYTHONPATH=. python scripts/zmq_close_campaign.py --rounds 5 --workers 32 [--workers 64]

Each worker is ``tests/transport_helpers/peer.py`` (only ``transport`` imported). CPU heavy:
every round starts W Python processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "transport_helpers" / "peer.py"
HB = {"heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}  # generous: a loaded box starts slowly


def _read_event(p: subprocess.Popen, event: str, deadline: float) -> dict:
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {p.pid} exited before {event!r}")
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise RuntimeError(msg["error"])
        if msg.get("event") == event:
            return msg
    raise RuntimeError(f"worker {p.pid}: no {event!r} in time")


def one_round(workers: int, timeout: float = 120.0) -> dict[str, int]:
    """Run one mesh of ``workers`` processes; return counts of exit outcomes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    procs = []
    deadline = time.monotonic() + timeout
    try:
        for i in range(workers):
            cfg = {"id": i, "name": f"w{i}", "options": HB, "connect_timeout": timeout / 2}
            procs.append(subprocess.Popen([sys.executable, str(PEER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                          start_new_session=True))
        hellos = [_read_event(p, "hello", deadline) for p in procs]
        table = json.dumps([{k: h[k] for k in ("id", "name", "incarnation", "address")} for h in hellos])
        for p in procs:
            p.stdin.write(table + "\n")
            p.stdin.flush()
        for p in procs:
            _read_event(p, "ready", deadline)
        for i, p in enumerate(procs):  # a little traffic in flight while everyone closes
            p.stdin.write(json.dumps({"cmd": "request", "dest": (i + 1) % workers, "kind": 16, "size": 1 << 16}) + "\n")
            p.stdin.flush()
        for p in procs:
            p.stdin.close()  # every worker closes its transport now
        out = {"ok": 0, "abort": 0, "failed": 0, "hung": 0}
        for p in procs:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out["hung"] += 1
                continue
            err = p.stderr.read()
            if rc == -signal.SIGABRT or "Assertion failed" in err:
                out["abort"] += 1
                print(f"  worker {p.pid}: rc {rc}: {err.strip()[-300:]}", file=sys.stderr)
            elif rc == 0:
                out["ok"] += 1
            else:
                out["failed"] += 1
                print(f"  worker {p.pid}: rc {rc}: {err.strip()[-300:]}", file=sys.stderr)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, action="append", help="mesh size (repeatable; default 32 and 64)")
    args = ap.parse_args()
    total: dict[str, int] = {}
    for w in args.workers or [32, 64]:
        for r in range(args.rounds):
            t0 = time.monotonic()
            res = one_round(w)
            print(f"{w} workers, round {r + 1}/{args.rounds}: {res} in {time.monotonic() - t0:.1f}s", flush=True)
            for k, v in res.items():
                total[k] = total.get(k, 0) + v
    print(f"total: {total}")
    return 0 if total.get("abort", 0) == total.get("failed", 0) == total.get("hung", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
