"""A batch-updating parameter server: one optimizer step per round of all trainers' gradients.

The classic torch.distributed.rpc batch example, written for rrefrt. Each trainer calls
``BatchUpdateParameterServer.update_and_fetch_model`` on the server with its gradients. That
function is ``@rpc.functions.async_execution``: instead of blocking an RPC thread until the
other trainers have reported, it returns a ``torch.futures.Future`` that the *last* trainer
of the round completes with the new weights - so every trainer's call returns together,
after one optimizer step over the summed gradients. The coordinator waits for the trainers
with ``torch.futures.wait_all`` and evaluates them with ``torch.futures.collect_all``, as
torch RPC programs do. Random data, no downloads.

The same file runs on torch.distributed.rpc (``--backend torch`` or RPC_BACKEND=torch)::

    python examples/batch_parameter_server.py [--backend rrefrt|torch] [--world-size 4]
    rrefrt-run --nproc-per-node 4 examples/batch_parameter_server.py

Rank 0 is the server and coordinator ("ps"), ranks 1.. are trainers ("trainer1", ...).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading


def _backend() -> str:
    for i, a in enumerate(sys.argv):
        if a.startswith("--backend="):
            return a.split("=", 1)[1]
        if a == "--backend" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return os.environ.get("RPC_BACKEND", "rrefrt")


BACKEND = _backend()
os.environ["RPC_BACKEND"] = BACKEND  # spawned workers import this module again

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

if BACKEND == "torch":
    import torch.distributed.rpc as rpc
else:
    import rrefrt as rpc

IN_FEATURES, OUT_FEATURES = 16, 4


class BatchUpdateParameterServer:
    def __init__(self, num_trainers: int, lr: float) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.lock = threading.Lock()
        self.num_trainers = num_trainers
        self.pending = 0
        self.steps = 0
        self.future_weights: torch.futures.Future = torch.futures.Future()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads: list[torch.Tensor]) -> torch.futures.Future:
        """Add one trainer's gradients; the last of a round steps the optimizer and completes
        the round's Future (outside the lock) with the new weights for everyone."""
        self = ps_rref.local_value()
        completed = None
        with self.lock:
            fut = self.future_weights
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            self.pending += 1
            if self.pending == self.num_trainers:
                for p in self.model.parameters():
                    p.grad /= self.num_trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.pending = 0
                self.steps += 1
                completed = (fut, self.weights())
                self.future_weights = torch.futures.Future()
        if completed is not None:
            completed[0].set_result(completed[1])
        return fut


def make_problem(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    true_w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
    g.manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    return x, x @ true_w + 0.01 * torch.randn(n, OUT_FEATURES, generator=g)


class Trainer:
    """Lives on a trainer process; ``train`` runs there, called by the coordinator."""

    def __init__(self, ps_rref, steps: int, batch: int) -> None:
        self.ps_rref = ps_rref
        self.steps, self.batch = steps, batch
        self.model = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.x, self.y = make_problem(seed=rpc.get_worker_info().id, n=steps * batch)

    def train(self) -> float:
        weights = self.ps_rref.rpc_sync().weights()
        first = None
        for step in range(self.steps):
            self._load(weights)
            self.model.zero_grad()
            sl = slice(step * self.batch, (step + 1) * self.batch)
            loss = nn.functional.mse_loss(self.model(self.x[sl]), self.y[sl])
            loss.backward()
            first = loss.item() if first is None else first
            weights = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in self.model.parameters()]),
            )
        self._load(weights)
        return first

    def evaluate(self) -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(self.model(self.x), self.y).item()

    def _load(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights):
                p.copy_(w)


def run_coordinator(world_size: int, args: argparse.Namespace) -> None:
    num_trainers = world_size - 1
    ps_rref = rpc.RRef(BatchUpdateParameterServer(num_trainers, lr=args.lr))
    trainers = [rpc.remote(f"trainer{r}", Trainer, args=(ps_rref, args.steps, args.batch))
                for r in range(1, world_size)]
    futs = [t.rpc_async().train() for t in trainers]
    first_losses = torch.futures.wait_all(futs)
    done = torch.futures.collect_all([t.rpc_async().evaluate() for t in trainers]).wait()
    final_losses = [f.value() for f in done]
    ps = ps_rref.local_value()
    first, final = sum(first_losses) / num_trainers, sum(final_losses) / num_trainers
    print(f"[{BACKEND}] {num_trainers} trainers, {ps.steps} batched steps: loss {first:.3f} -> {final:.4f}")
    assert ps.steps == args.steps, ps.steps
    assert final < 0.5 * first, (first, final)  # the loss at least halves
    print("batch_parameter_server: OK")


def run_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        run_coordinator(world_size, args)
    rpc.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["rrefrt", "torch"], default=BACKEND)
    p.add_argument("--world-size", type=int, default=4, help="1 server + N-1 trainers")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    if "RANK" in os.environ:  # one rank of a job started by a launcher
        run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    mp.spawn(run_worker, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
