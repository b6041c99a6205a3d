"""Each worker calls only its neighbour (rank + 1) and reports, as one line ``NEIGHBOUR
{json}``, its init time, its descriptors and the peers its zmq transport has a data pipe
with or watches, after init and after its calls (tests/launcher/test_lazy_join.py)."""

import json
import os
import sys
import time

import rrefrt as rpc
from rrefrt import state
from rrefrt.run.env import resolve_env


def counts() -> dict:
    t = state.current_or_none().transport
    inner = getattr(t, "inner", t)
    local = getattr(t, "local", None)
    stream = getattr(t, "stream", None)
    return {"fds": len(os.listdir("/proc/self/fd")), "pipes": sorted(inner.connected_peers()),
            "watched": int(inner.stats["peers_watched"]),
            "unix": sorted(local.connected_peers()) if local is not None else [],
            "stream": sorted(stream.connected_peers()) if stream is not None else []}


def main() -> int:
    env = resolve_env(os.environ)
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    t0 = time.monotonic()
    rpc.init_rpc(f"worker{rank}")
    init_s = time.monotonic() - t0
    after_init = counts()
    for _ in range(3):
        assert rpc.rpc_sync(f"worker{(rank + 1) % size}", max, args=(rank, -1)) == rank
    print("NEIGHBOUR " + json.dumps({"rank": rank, "size": size, "init_s": init_s, "init": after_init,
                                     "calls": counts()}), flush=True)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
