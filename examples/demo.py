"""The rrefrt demo: a small multi-worker job (run it with ``rrefrt-run``).

Rank 0 farms work out to every other worker with rpc_async, keeps a shared accumulator
owned by worker 1 behind an RRef, hands that RRef to the other workers (user -> user
forks), and checks that the owner frees it once everyone drops it.
"""

import gc
import os
import time

import torch

import rrefrt


class Accumulator:
    def __init__(self):
        self.total = torch.zeros(4)
        self.updates = 0

    def add(self, t):
        self.total += t
        self.updates += 1
        return self.updates

    def state(self):
        return self.total.clone(), self.updates


def work(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n, generator=g).matmul(torch.randn(n, n, generator=g)).trace()


def contribute(acc, rank):
    return acc.rpc_sync().add(torch.full((4,), float(rank)))


def owner_counts():
    gc.collect()
    info = rrefrt.get_debug_info()
    return info["num_owner_rrefs"], info["num_forks"]


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    rrefrt.init_rpc(f"worker{rank}")
    if rank == 0:
        others = [f"worker{r}" for r in range(1, world)]
        t0 = time.perf_counter()
        futs = [rrefrt.rpc_async(others[i % len(others)], work, args=(i, 64)) for i in range(200)]
        traces = rrefrt.futures.wait_all(futs)
        print(f"200 matmul tasks on {len(others)} workers in {time.perf_counter() - t0:.2f}s "
              f"(checksum {sum(float(t) for t in traces):.3f})")
        acc = rrefrt.remote(others[0], Accumulator)
        updates = rrefrt.futures.wait_all([rrefrt.rpc_async(w, contribute, args=(acc, r + 1)) for r, w in enumerate(others)])
        total, n = acc.rpc_sync().state()
        print(f"accumulator on {acc.owner_name()}: {n} updates from {len(others)} users, total {total.tolist()}")
        assert sorted(updates) == list(range(1, len(others) + 1))
        del acc
        deadline = time.monotonic() + 5
        while rrefrt.rpc_sync(others[0], owner_counts) != (0, 0):
            assert time.monotonic() < deadline, "the owner did not free the accumulator"
            time.sleep(0.05)
        print(f"owner {others[0]} freed the accumulator once every user dropped it")
        print("demo: OK")
    rrefrt.shutdown()


if __name__ == "__main__":
    main()
