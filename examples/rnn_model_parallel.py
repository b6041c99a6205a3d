"""RNN model parallelism with distributed autograd (after the classic torch RPC example).

The embedding table and the decoder live on a parameter server ("ps"); the LSTM lives on
the trainer. The trainer runs the forward through all three, the distributed backward
sends gradients back to the parameter server, and DistributedOptimizer steps every
parameter where it lives. The task (predict the next token of a counting sequence) is
random but learnable, so the loss goes down.

The same program runs on torch.distributed.rpc: only the imports below differ, chosen by
``--backend torch|rrefrt`` (or RREFRT_EXAMPLE_BACKEND). Run it with two processes::

    rrefrt-run --nproc-per-node 2 examples/rnn_model_parallel.py --steps 20
    torchrun --nproc-per-node 2 examples/rnn_model_parallel.py --backend torch
"""

import argparse
import os

import torch
import torch.nn as nn


def _backend() -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--backend", default=os.environ.get("RREFRT_EXAMPLE_BACKEND", "rrefrt"), choices=["torch", "rrefrt"])
    return p.parse_known_args()[0].backend


if _backend() == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
else:
    import rrefrt as rpc
    import rrefrt.autograd as dist_autograd
    from rrefrt.optim import DistributedOptimizer


# ------------------------------------------------------------------ helpers (as in torch's example)
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref, *args], kwargs=kwargs)


def _parameter_rrefs(module):
    return [rpc.RRef(p) for p in module.parameters()]


# ------------------------------------------------------------------ the model
def _seeded_init(module, seed):
    """Deterministic initial weights from a private generator (modules may be built on
    several RPC threads at once, so the global RNG would race)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        _seeded_init(self, 1)

    def forward(self, tokens):
        return self.encoder(tokens)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid):
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        _seeded_init(self, 2)

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp))
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        _seeded_init(self.rnn, 3)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid))

    def forward(self, tokens, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, tokens)
        output, hidden = self.rnn(emb, hidden)
        return _remote_method(Decoder.forward, self.decoder_rref, output), hidden

    def parameter_rrefs(self):
        return (
            _remote_method(_parameter_rrefs, self.emb_table_rref)
            + _parameter_rrefs(self.rnn)
            + _remote_method(_parameter_rrefs, self.decoder_rref)
        )


def train(steps, ntoken=10, ninp=8, nhid=16, nlayers=1, seq=6, batch=4):
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        start = torch.randint(0, ntoken, (1, batch), generator=g)
        tokens = (start + torch.arange(seq).unsqueeze(1)) % ntoken  # counting sequences
        target = (tokens + 1) % ntoken
        hidden = (torch.zeros(nlayers, batch, nhid), torch.zeros(nlayers, batch, nhid))
        with dist_autograd.context() as context_id:
            output, hidden = model(tokens, hidden)
            loss = criterion(output.reshape(-1, ntoken), target.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=os.environ.get("RREFRT_EXAMPLE_BACKEND", "rrefrt"), choices=["torch", "rrefrt"])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc("trainer" if rank == 0 else "ps", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        losses = train(args.steps)
        first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        print(f"loss {first:.4f} -> {last:.4f}", flush=True)
        assert last < first, losses
        print("rnn example: OK", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
