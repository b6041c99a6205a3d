"""One process of the DDP + RPC pattern (pytorch/examples distributed/rpc/ddp_rpc, CPU, small).

    RANK=r PG_PORT=p RPC_PORT=q python -m tests.support.ddp_rpc_worker

Ranks 0 and 1 are trainers: a gloo process group of their own on PG_PORT (for
DistributedDataParallel) and then init_rpc with an explicit ``tcp://127.0.0.1:RPC_PORT``.
Rank 2 is the master (a RemoteModule EmbeddingBag on the parameter server; it starts the
training on the trainers), rank 3 the parameter server. Neither has a process group: the
rendezvous must happen at RPC_PORT, which rank 2 hosts. Prints ``RESULT {json}`` at the end.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import rrefrt as rpc  # noqa: E402
from rrefrt import autograd as dist_autograd  # noqa: E402
from rrefrt.nn import RemoteModule  # noqa: E402
from rrefrt.optim import DistributedOptimizer  # noqa: E402

NUM_EMBEDDINGS, EMBEDDING_DIM = 50, 8


class HybridModel(torch.nn.Module):
    """A remote embedding (RemoteModule on the parameter server) and a DDP-replicated Linear."""

    def __init__(self, remote_emb_module: RemoteModule) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, 4))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def run_trainer(remote_emb_module: RemoteModule, rank: int) -> float:
    torch.manual_seed(rank)
    model = HybridModel(remote_emb_module)
    params = model.remote_emb_module.remote_parameters() + [rpc.RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    loss_value = 0.0
    for _ in range(5):
        indices = torch.randint(0, NUM_EMBEDDINGS, (12,))
        offsets = torch.tensor([0, 3, 7])
        target = torch.randint(0, 4, (3,))
        with dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
            loss_value = float(loss)
    return loss_value


def main() -> None:
    faulthandler.dump_traceback_later(150, exit=True)
    rank = int(os.environ["RANK"])
    options = rpc.TensorPipeRpcBackendOptions()
    options.init_method = f"tcp://localhost:{os.environ['RPC_PORT']}"  # as the upstream example sets it
    options.init_timeout = float(os.environ.get("INIT_TIMEOUT", "60"))
    out: dict = {"rank": rank}
    if rank <= 1:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://localhost:{os.environ['PG_PORT']}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=4, rpc_backend_options=options)
    elif rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=4, rpc_backend_options=options)
        emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(emb, r)) for r in (0, 1)]
        out["losses"] = [f.wait() for f in futs]
    else:
        rpc.init_rpc("ps", rank=rank, world_size=4, rpc_backend_options=options)
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
