"""A worker for the launcher tests: plain Python that reads the environment (no runtime).

    worker.py OUTDIR [--exit-rank R --code C] [--kill-self-rank R] [--hold S]
                     [--on-term] [--ignore-term] [--children] [--connect-store]

At start it writes OUTDIR/rank<R>.json (atomically): the environment contract, its pid and
pgid, sys.argv, __name__ and sys.path[0]; the tests wait for these files.
--exit-rank R --code C   rank R prints a few lines, then sys.exit(C)
--hold S                 every other rank sleeps up to S seconds, then exits 0
--on-term                on SIGTERM, write OUTDIR/term<R> (time.monotonic()) and exit 0
--ignore-term            ignore SIGTERM (the launcher must escalate to SIGKILL)
--note-term              on SIGTERM, write OUTDIR/term<R> and carry on (ignore it)
--children               start descendants first (a child ignoring SIGTERM that starts a
                         grandchild, and a forked multiprocessing child, like a DataLoader),
                         recording their pids in the json
--connect-store          connect a TCP socket to MASTER_ADDR:MASTER_PORT (the hosted store), then
                         a store client without the secret (refused) and one with it
--wait-peers             the --exit-rank waits until every rank has written its json
                         (so the others' signal handlers exist before anyone fails)
"""

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "RREFRT_STORE_HOSTED", "RREFRT_SECRET", "CUDA_VISIBLE_DEVICES",
        "RREFRT_DEVICE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RREFRT_CPU_THREADS",
        "RREFRT_RUN_WATCHDOG", "PYTHONUNBUFFERED")

CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(g.pid))
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.rename(path + ".tmp", path)


def _wait_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--exit-rank", type=int, default=-1)
    p.add_argument("--code", type=int, default=3)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--hold-ranks", default="", help="comma list: only these ranks hold (default: all)")
    p.add_argument("--on-term", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--note-term", action="store_true")
    p.add_argument("--children", action="store_true")
    p.add_argument("--connect-store", action="store_true")
    p.add_argument("--wait-peers", action="store_true")
    args, extra = p.parse_known_args()
    rank = int(os.environ["RANK"])

    if args.on_term or args.note_term:
        def on_term(signum, frame):
            with open(os.path.join(args.outdir, f"term{rank}"), "w") as f:
                f.write(repr(time.monotonic()))
            if args.on_term:
                sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    info = {"env": {k: os.environ.get(k) for k in KEYS}, "pid": os.getpid(),
            "pgid": os.getpgrp(), "argv": sys.argv, "extra": extra, "name": __name__,
            "path0": sys.path[0], "descendants": []}
    if args.connect_store:
        with socket.create_connection((os.environ["MASTER_ADDR"],
                                       int(os.environ["MASTER_PORT"])), timeout=5):
            info["store_reachable"] = True
        # the launcher's store authenticates with the job secret (issue 11 item 13)
        from rrefrt.group.store import StoreAuthError, StoreClient

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            StoreClient(addr, port, 5, identity=f"rank {rank} without the secret").check(["launcher/node/0"])
            info["store_without_secret"] = "accepted"
        except StoreAuthError as e:
            info["store_without_secret"] = f"refused: {e}"
        with_secret = StoreClient(addr, port, 5, os.environ["RREFRT_SECRET"])
        info["store_with_secret"] = with_secret.check(["launcher/node/0"])
        with_secret.close()
    if args.children:
        gfile = os.path.join(args.outdir, f"grandchild{rank}")
        child = subprocess.Popen([sys.executable, "-c", CHILD, gfile])
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
        forked.start()
        info["descendants"] = [child.pid, forked.pid, int(_wait_file(gfile, 20))]
    print(f"worker rank {rank} up, pid {os.getpid()}", flush=True)
    _write_json(os.path.join(args.outdir, f"rank{rank}.json"), info)

    if rank == args.exit_rank:
        if args.wait_peers:
            for r in range(int(os.environ["WORLD_SIZE"])):
                _wait_file(os.path.join(args.outdir, f"rank{r}.json"), 20)
        for i in range(3):
            print(f"rank {rank} line {i}")
        print(f"rank {rank} exiting with code {args.code}", file=sys.stderr)
        _write_json(os.path.join(args.outdir, f"exit{rank}.json"), {"at": time.monotonic()})
        sys.exit(args.code)
    if args.hold and (not args.hold_ranks or str(rank) in args.hold_ranks.split(",")):
        time.sleep(args.hold)  # (a worker that takes this long: what the tests are about)


if __name__ == "__main__":
    main()
