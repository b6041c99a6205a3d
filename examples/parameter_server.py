"""A parameter server: trainers pull weights from it, compute gradients, push them back.

The classic torch.distributed.rpc program, written for rrefrt, without distributed
autograd: rank 0 ("ps") owns the model inside a ``ParameterServer`` object and hands an RRef
to it to every trainer; each trainer ("trainer1", ...) learns a random linear regression
problem, pulling the weights with ``ps_rref.rpc_sync().get_weights()`` and pushing its
gradients with ``ps_rref.rpc_sync().apply_gradients(...)``. Random data, no downloads.

The same file runs on torch.distributed.rpc: the backend is picked by ``--backend``
(or the environment variable RPC_BACKEND), ``rrefrt`` by default::

    python examples/parameter_server.py                      # 3 processes, rrefrt
    python examples/parameter_server.py --backend torch      # the same, torch.distributed.rpc
    rrefrt-run --nproc-per-node 3 examples/parameter_server.py

Without RANK in the environment it starts ``--world-size`` processes itself
(``torch.multiprocessing.spawn``, as torch's examples do); under a launcher (rrefrt-run,
torchrun) each process is one rank.
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


class ParameterServer:
    """Owns the model; trainers reach it through an RRef."""

    def __init__(self, lr: float) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.updates = 0

    def get_weights(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def apply_gradients(self, grads: list[torch.Tensor]) -> int:
        with self.lock:
            for p, g in zip(self.model.parameters(), grads):
                p.grad = g
            self.optimizer.step()
            self.updates += 1
            return self.updates


def make_problem(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random linear regression problem; every trainer samples the same true weights."""
    g = torch.Generator().manual_seed(1234)
    true_w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
    g.manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    return x, x @ true_w + 0.01 * torch.randn(n, OUT_FEATURES, generator=g)


def run_trainer(ps_rref, steps: int, batch: int) -> tuple[float, float]:
    """Runs on a trainer: pull, compute gradients locally, push. Returns (first, last) loss."""
    rank = rpc.get_worker_info().id
    x, y = make_problem(seed=rank, n=steps * batch)
    model = nn.Linear(IN_FEATURES, OUT_FEATURES)
    losses = []
    for step in range(steps):
        model.load_state_dict(ps_rref.rpc_sync().get_weights())
        model.zero_grad()
        xb, yb = x[step * batch : (step + 1) * batch], y[step * batch : (step + 1) * batch]
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        ps_rref.rpc_sync().apply_gradients([p.grad for p in model.parameters()])
        losses.append(loss.item())
    return losses[0], losses[-1]


def run_ps(world_size: int, args: argparse.Namespace) -> None:
    ps_rref = rpc.RRef(ParameterServer(lr=args.lr))
    futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, args.steps, args.batch))
            for r in range(1, world_size)]
    results = [fut.wait() for fut in futs]
    ps = ps_rref.local_value()
    x, y = make_problem(seed=999, n=256)
    with torch.no_grad():
        final = nn.functional.mse_loss(ps.model(x), y).item()
    first = sum(r[0] for r in results) / len(results)
    print(f"[{BACKEND}] {len(results)} trainers, {ps.updates} updates: "
          f"loss {first:.3f} -> {final:.4f} (held-out)")
    assert ps.updates == len(results) * args.steps, ps.updates
    assert final < 0.5 * first, (first, final)  # the loss at least halves
    print("parameter_server: OK")


def run_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        run_ps(world_size, args)
    rpc.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["rrefrt", "torch"], default=BACKEND)
    p.add_argument("--world-size", type=int, default=3, help="1 server + N-1 trainers")
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
