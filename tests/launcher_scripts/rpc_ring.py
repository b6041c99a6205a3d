"""An rrefrt program that runs unchanged under rrefrt-run, torchrun, srun and mpirun.

Each worker joins with no rank or world size (init_rpc reads them from the environment),
calls the next worker in the ring with a builtin and with a function defined here (pickled
by reference to __main__, so the bootstrap must run this file as __main__), prints what it
got, and shuts down.
"""

import operator
import os
import sys

import rrefrt as rpc
from rrefrt.run.env import resolve_env


def whoami(tag: str) -> str:
    env = resolve_env(os.environ)
    return f"{tag} handled by rank {env['RANK']} on {os.environ.get('RREFRT_DEVICE', 'cpu')}"


def main() -> int:
    env = resolve_env(os.environ)
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}")
    peer = f"worker{(rank + 1) % size}"
    total = rpc.rpc_sync(peer, operator.add, args=(rank, 100))
    reply = rpc.rpc_sync(peer, whoami, args=(f"call from worker{rank}",))
    print(f"worker{rank}: add -> {total}; {reply}", flush=True)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
