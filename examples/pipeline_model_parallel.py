"""Pipeline model parallelism with RemoteModule and distributed autograd (after the classic
torch RPC pipeline example).

A two-stage model: stage 1 lives on worker1, stage 2 on worker2, each a RemoteModule; the
master splits every batch into micro-batches and keeps both stages busy (stage 1 works on
micro-batch i+1 while stage 2 works on micro-batch i). The distributed backward runs
through both stages; DistributedOptimizer steps each stage's parameters where they live.
The task (regress a random linear teacher on a random batch) is learnable: the loss goes down.

The same program runs on torch.distributed.rpc: only the imports below differ, chosen by
``--backend torch|rrefrt`` (or RREFRT_EXAMPLE_BACKEND). Run it with three processes::

    rrefrt-run --nproc-per-node 3 examples/pipeline_model_parallel.py --steps 10
    torchrun --nproc-per-node 3 examples/pipeline_model_parallel.py --backend torch
"""

import argparse
import os
import threading

import torch
import torch.nn as nn


def _backend() -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--backend", default=os.environ.get("RREFRT_EXAMPLE_BACKEND", "rrefrt"), choices=["torch", "rrefrt"])
    return p.parse_known_args()[0].backend


if _backend() == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
else:
    import rrefrt as rpc
    import rrefrt.autograd as dist_autograd
    from rrefrt.nn import RemoteModule
    from rrefrt.optim import DistributedOptimizer


class Stage(nn.Module):
    """One shard of the model. Micro-batches may arrive concurrently: one at a time here."""

    def __init__(self, seed, n_in, n_out, last=False):
        super().__init__()
        layers = [nn.Linear(n_in, n_out)] + ([] if last else [nn.ReLU(), nn.Linear(n_out, n_out), nn.ReLU()])
        self.net = nn.Sequential(*layers)
        g = torch.Generator().manual_seed(seed)  # private: the global RNG may be shared by RPC threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self._lock = threading.Lock()

    def forward(self, x):
        with self._lock:
            return self.net(x)


class Pipeline(nn.Module):
    def __init__(self, split_size, n_in, n_hidden, n_out):
        super().__init__()
        self.split_size = split_size
        self.stage1 = RemoteModule("worker1/cpu", Stage, args=(1, n_in, n_hidden))
        self.stage2 = RemoteModule("worker2/cpu", Stage, args=(2, n_hidden, n_out), kwargs={"last": True})

    def forward(self, xs):
        # every micro-batch enters stage 1 at once; each goes on to stage 2 as soon as it is
        # out of stage 1, so both stages work at the same time
        first = [self.stage1.forward_async(x) for x in xs.split(self.split_size)]
        second = [self.stage2.forward_async(f.wait()) for f in first]
        return torch.cat([f.wait() for f in second])

    def parameter_rrefs(self):
        return self.stage1.remote_parameters() + self.stage2.remote_parameters()


def train(steps, batch=32, split_size=8, n_in=16, n_hidden=32, n_out=4):
    model = Pipeline(split_size, n_in, n_hidden, n_out)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(n_in, n_out, generator=g) / 4
    x = torch.randn(batch, n_in, generator=g)  # one random batch, seen every step
    y = x @ teacher
    losses = []
    for step in range(steps):
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(model(x), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=os.environ.get("RREFRT_EXAMPLE_BACKEND", "rrefrt"), choices=["torch", "rrefrt"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc("master" if rank == 0 else f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        losses = train(args.steps)
        first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        print(f"loss {first:.4f} -> {last:.4f}", flush=True)
        assert last < first, losses
        print("pipeline example: OK", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
