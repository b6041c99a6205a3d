"""Transport-only ping-pong: the same-host unix transport against the ZeroMQ agent.

    python bench/transport_pingpong.py [--quick] [--rounds 3] [--transports unix,unix-copy,unix-inline,zmq]
                                       [--sizes 1M,16M,64M] [--json PATH]

For each round and each transport (interleaved), a fresh pair of processes is started, each
pinned to its own core (os.sched_setaffinity). The server answers every request from the
transport's own thread (no runtime, no pickling); the client measures:

- noop: a request with no frames and its empty response, one at a time; median round trip
- 1 / 16 / 64 MB: a request with one frame of that size echoed back; median round trip and
  the resulting rate (2 x size / round trip)
- CPU per call: user+sys time of the client and of the server over each workload, divided
  by the calls (getrusage), beside latency: a transport that busy-polls shows up here.

Transports: ``unix`` (shared memory from 256 KB, the receiver aliases the segment),
``unix-copy`` (the same, receiver copies out), ``unix-inline`` (no shared memory: every byte
through the socket), ``zmq`` (the ZeroMQ transport, ipc:// between workers of one host, as
the runtime uses it when the same-host paths are off).
Prints the medians over rounds; ``--json PATH`` writes every round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ECHO, CPU = 16, 17


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------- processes
def make(kind: str, wid: int, inc: int, on_message: Any, on_dead: Any) -> tuple[Any, Any]:
    """(transport, publish(address)) for ``kind``; role-independent."""
    from rrefrt_transport.base import TransportConfig

    if kind == "zmq":
        from rrefrt_transport.zmq.agent import ZmqTransport

        return ZmqTransport(TransportConfig(wid, f"w{wid}", inc, kind="zmq"), on_message, on_dead), None
    from rrefrt_transport.unix.transport import UnixTransport

    extra = {"unix": {}, "unix-copy": {"shm_copy_out": True}, "unix-inline": {"shm_threshold": 0},
             "unix-shm64k": {"shm_threshold": 65536}}[kind]
    return UnixTransport(TransportConfig(wid, f"w{wid}", inc, extra=extra), on_message, on_dead), None


def role(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {args.core})
    wid = 0 if args.role == "client" else 1
    inc = random.getrandbits(62)
    holder: dict[str, Any] = {}

    def on_message(src: int, kind: int, msg_id: int, meta: Any, frames: Any) -> None:
        t = holder["t"]
        if kind == ECHO:
            t.respond(src, msg_id, None, list(frames))
        elif kind == CPU:
            t.respond(src, msg_id, _cpu())

    t, _ = make(args.kind, wid, inc, on_message, lambda p, c: None)
    holder["t"] = t
    addr = t.listen().to_wire()
    t.start()
    print(json.dumps({"addr": addr, "inc": inc}), flush=True)
    peer = json.loads(sys.stdin.readline())
    from rrefrt_transport.base import PeerAddress, PeerSpec

    t.connect_peers([PeerSpec(1 - wid, f"w{1 - wid}", peer["inc"], PeerAddress.from_wire(peer["addr"]))], 20)
    if args.role == "server":
        sys.stdin.readline()  # until the client is done
        t.close(2.0)
        return
    print(json.dumps(client(t, args.quick, [_size(x) for x in args.sizes.split(",")])), flush=True)
    t.close(2.0)


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * mult


def client(t: Any, quick: bool, sizes: list[int]) -> dict[str, Any]:
    done = threading.Event()
    box: list[Any] = []

    def on_done(meta: Any, frames: Any, err: Any) -> None:
        box.append((meta, list(frames), err))
        done.set()

    def call(kind: int, frames: list) -> tuple[Any, list, Any]:
        box.clear()
        done.clear()
        t.request(1, kind, None, frames, 60.0, on_done)
        if not done.wait(60):
            raise RuntimeError("no answer within 60 s")
        return box[0]

    out: dict[str, Any] = {}
    def count(n: int) -> int:
        c = 60 if n <= 1 << 20 else 12 if n <= 16 << 20 else 5
        return max(3, c // 3) if quick else c

    work = [("noop", 0, 300 if quick else 2000)] + [
        (f"{n >> 20}MB" if n >= 1 << 20 else f"{n >> 10}KB", n, count(n)) for n in sizes
    ]
    for name, size, count in work:
        frame = os.urandom(size) if size else b""
        frames = [frame] if size else []
        m, f, e = call(ECHO, frames)  # warm-up, and a check that the frame comes back intact
        if e is not None or (size and bytes(f[0]) != frame):
            raise RuntimeError(f"{name}: wrong answer ({e})")
        del f
        for _ in range(3 if size else 100):
            call(ECHO, frames)
        s0 = call(CPU, [])[0]
        c0 = _cpu()
        lat = []
        for _ in range(count):
            t0 = time.perf_counter()
            call(ECHO, frames)
            lat.append(time.perf_counter() - t0)
        c1 = _cpu()
        s1 = call(CPU, [])[0]
        med = statistics.median(lat)
        out[name] = {
            "p50_us": med * 1e6,
            "client_cpu_us": (c1 - c0) / count * 1e6,
            "server_cpu_us": (s1 - s0) / count * 1e6,
            "GBps": (2 * size / med / 1e9) if size else None,
        }
    return out


# ---------------------------------------------------------------------------- driver
def session(kind: str, quick: bool, timeout: float, sizes: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = []
    try:
        for r, core in (("server", 1), ("client", 0)):
            cmd = [sys.executable, __file__, "--role", r, "--kind", kind, "--core", str(core), "--sizes", sizes] + (
                ["--quick"] if quick else [])
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          start_new_session=True))
        hellos = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        for p, other in zip(procs, reversed(hellos)):
            p.stdin.write(json.dumps(other) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        result = {}
        reader = threading.Thread(target=lambda: result.update(json.loads(procs[1].stdout.readline() or "{}")))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        procs[0].stdin.write("done\n")  # type: ignore[union-attr]
        procs[0].stdin.flush()  # type: ignore[union-attr]
        if not result:
            raise RuntimeError(f"{kind}: no result within {timeout}s")
        return result
    finally:
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--kind", default="unix")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transports", default="unix,unix-copy,unix-inline,zmq")
    ap.add_argument("--sizes", default="1M,16M,64M", help="frame sizes, e.g. 64K,256K,1M")
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    if args.role:
        role(args)
        return
    kinds = args.transports.split(",")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else list(reversed(kinds))
        rounds.append({k: session(k, args.quick, args.timeout, args.sizes) for k in order})
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    metrics = list(rounds[0][kinds[0]])
    print(f"{'workload':8} {'transport':12} {'p50 [us]':>10} {'spread':>16} {'GB/s':>6} {'cli CPU/call':>13} {'srv CPU/call':>13}")
    for m in metrics:
        for k in kinds:
            vals = [rd[k][m] for rd in rounds]
            p50 = statistics.median(v["p50_us"] for v in vals)
            lo, hi = min(v["p50_us"] for v in vals), max(v["p50_us"] for v in vals)
            gb = statistics.median(v["GBps"] for v in vals) if vals[0]["GBps"] else None
            cc = statistics.median(v["client_cpu_us"] for v in vals)
            sc = statistics.median(v["server_cpu_us"] for v in vals)
            print(f"{m:8} {k:12} {p50:10.0f} {f'{lo:.0f}-{hi:.0f}':>16} {(f'{gb:.2f}' if gb else '-'):>6} "
                  f"{cc:11.0f}us {sc:11.0f}us")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
