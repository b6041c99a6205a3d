"""A torch.distributed.rpc program, moved to rrefrt by changing one import.

The original first line was ``import torch.distributed.rpc as rpc``; nothing else changed.
Run it with the launcher (``rrefrt-run --nproc-per-node 3 examples/torch_rpc_migration.py``)
or by hand with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set for each process.
"""

import os

import torch

import rrefrt as rpc  # was: import torch.distributed.rpc as rpc


class ParameterServer:
    def __init__(self, dim):
        self.weights = torch.zeros(dim)

    def push(self, grad):
        self.weights -= 0.1 * grad
        return self.weights.clone()

    def pull(self):
        return self.weights.clone()


def square(t):
    return t * t


@rpc.functions.async_execution
def delayed_sum(to, a, b):
    return rpc.rpc_async(to, torch.add, args=(a, b)).then(lambda f: f.value().sum())


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        # builtin torch ops and user functions, sync and async
        added = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        squared = rpc.rpc_async("worker2", square, args=(x,)).wait()
        total = rpc.rpc_sync("worker1", delayed_sum, args=("worker2", x, x))
        # remote references: a parameter server owned by worker1, used from here and worker2
        ps = rpc.remote("worker1", ParameterServer, args=(3,))
        for _ in range(3):
            ps.rpc_sync().push(torch.ones(3))
        pulled = rpc.rpc_sync("worker2", _pull_through, args=(ps,))
        print(f"add: {added.tolist()}")
        print(f"square: {squared.tolist()}")
        print(f"sum of x + x: {total.item()}")
        print(f"parameter server weights seen from worker2: {pulled.tolist()}")
        assert torch.equal(added, x + 1) and torch.equal(squared, x * x) and total.item() == 30.0
        assert torch.allclose(pulled, torch.full((3,), -0.3))
        print("migration example: OK")
    rpc.shutdown()


def _pull_through(ps_rref):
    return ps_rref.rpc_sync().pull()


if __name__ == "__main__":
    main()
