"""Close campaign (issue 11 item 2): rounds of a W-process transport mesh that joins, floods
itself with small requests, and then closes in a staggered wave while traffic is still in
flight; counts processes that died of SIGABRT (libzmq's ``Assertion failed: !_io_error``),
other failures and hangs.

    PYTHONPATH=. python scripts/zmq_close_campaign.py --rounds 5 --workers 32 [--workers 64]
    # the same against another checkout (the old agent API is detected):
    python scripts/zmq_close_campaign.py --root /work/main --rounds 5 --workers 32

Each worker is this script in ``--worker`` mode (only ``transport`` imported). CPU heavy:
every round starts W Python processes. The flood starts only once every worker has joined
(a "go" line from the campaign): a mesh that floods its own joiners starves them of CPU on
a small machine, and a joiner starved past the heartbeat timeout is expelled (NOTE [Fenced
while joining] in rrefrt_transport.zmq.agent). The join timeout grows with the mesh (``join_timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: short heartbeats so that libzmq heartbeat timers (old agent) fire often during the close
HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 5.0}
ECHO = 16


def join_timeout(workers: int) -> float:
    """Seconds a worker may take to join a mesh of ``workers``: the join makes about
    workers**2 connections, all on the same (small, loaded) machine."""
    return 30.0 + 1.0 * workers


# ---------------------------------------------------------------------------- worker side
def worker(cfg: dict) -> None:
    import rrefrt_transport as transport
    rng = random.Random(cfg["id"])
    holder: dict[str, Any] = {}

    def on_message(src: int, kind: int, msg_id: int, meta: Any, frames: Any) -> None:
        if msg_id:
            try:
                holder["t"].respond(src, msg_id, meta, list(frames))
            except Exception:  # closing
                pass

    inc = random.SystemRandom().getrandbits(62)
    t = transport.create(transport.TransportConfig(cfg["id"], cfg["name"], inc, **HB), on_message, lambda *a: None)
    address: Any = t.listen().to_wire()
    holder["t"] = t
    t.start()
    print(json.dumps({"event": "hello", "id": cfg["id"], "name": cfg["name"], "incarnation": inc, "address": address}), flush=True)
    table = json.loads(sys.stdin.readline())
    specs = [transport.PeerSpec(p["id"], p["name"], p["incarnation"], transport.PeerAddress.from_wire(p["address"])) for p in table]
    t0 = time.monotonic()
    t.connect_peers(specs, cfg.get("join_s", 60.0))
    print(json.dumps({"event": "ready", "join_s": time.monotonic() - t0}), flush=True)
    if not sys.stdin.readline().strip():  # "go" (every worker is ready), or EOF: stop
        t.close()
        return
    stop = threading.Event()
    others = [p["id"] for p in table if p["id"] != cfg["id"]]

    def flood() -> None:
        payload = bytes(4096)
        while not stop.is_set():
            try:
                t.request(rng.choice(others), ECHO, None, [payload], 2.0, lambda *a: None)
            except Exception:
                return
            stop.wait(0.002)

    threading.Thread(target=flood, daemon=True).start()
    line = sys.stdin.readline()  # {"close_after": s} or EOF
    delay = json.loads(line)["close_after"] if line.strip() else 0.0
    stop.wait(delay)
    t.close()
    stop.set()


# ---------------------------------------------------------------------------- campaign side
def _stderr(p: subprocess.Popen) -> str:
    f = p.stderr_file  # type: ignore[attr-defined]
    f.seek(0)
    return f.read()


def _read_event(p: subprocess.Popen, event: str, deadline: float) -> dict:
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            p.wait(10)
            raise RuntimeError(f"worker {p.pid} exited before {event!r}: {_stderr(p)[-500:]}")
        msg = json.loads(line)
        if msg.get("event") == event:
            return msg
    raise RuntimeError(f"worker {p.pid}: no {event!r} in time")


def one_round(workers: int, root: Path = ROOT, flood_s: float = 1.0, stagger_s: float = 0.5,
              timeout: float | None = None) -> dict[str, int]:
    """Run one mesh of ``workers`` processes; return counts of exit outcomes (ok, abort,
    failed, hung), of workers expelled by a peer (which exit ok), and the slowest join. ``timeout``
    bounds the whole round (default: the join timeout plus two minutes)."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    join_s = join_timeout(workers)
    deadline = time.monotonic() + (timeout if timeout is not None else join_s + 120.0)
    rng = random.Random()
    try:
        for i in range(workers):
            cfg = {"id": i, "name": f"w{i}", "join_s": join_s}
            err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks on it
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                          start_new_session=True))
            procs[-1].stderr_file = err  # type: ignore[attr-defined]
        hellos = [_read_event(p, "hello", deadline) for p in procs]
        table = json.dumps([{k: h[k] for k in ("id", "name", "incarnation", "address")} for h in hellos])
        for p in procs:
            p.stdin.write(table + "\n")
            p.stdin.flush()
        slowest = max(_read_event(p, "ready", deadline).get("join_s", 0.0) for p in procs)
        for p in procs:  # every worker joined: flood now
            p.stdin.write(json.dumps({"go": True}) + "\n")
            p.stdin.flush()
        time.sleep(flood_s)  # let traffic flow everywhere (campaign pacing, not a synchronisation)
        for p in procs:  # a staggered close wave while requests are in flight
            p.stdin.write(json.dumps({"close_after": rng.uniform(0, stagger_s)}) + "\n")
            p.stdin.flush()
        #: "expelled" (informative): workers declared dead by a peer (a CPU-starved mesh)
        out = {"ok": 0, "abort": 0, "failed": 0, "hung": 0, "expelled": 0, "slowest_join_s": round(slowest, 1)}
        for p in procs:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out["hung"] += 1
                continue
            err = _stderr(p)
            out["expelled"] += "expelled from the group" in err
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
            p.stderr_file.close()  # type: ignore[attr-defined]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, action="append", help="mesh size (repeatable; default 32 and 64)")
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout whose transport is tested")
    args = ap.parse_args()
    total: dict[str, int] = {}
    for w in args.workers or [32, 64]:
        for r in range(args.rounds):
            t0 = time.monotonic()
            res = one_round(w, args.root)
            print(f"{w} workers, round {r + 1}/{args.rounds}: {res} in {time.monotonic() - t0:.1f}s", flush=True)
            for k, v in res.items():
                total[k] = max(total.get(k, 0), v) if k == "slowest_join_s" else total.get(k, 0) + v
    print(f"total: {total}")
    return 0 if total.get("abort", 0) == total.get("failed", 0) == total.get("hung", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
