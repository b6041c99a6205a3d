"""A worker for the rendezvous tests: ``python -m tests.support.rdzv_worker <mode> [name]``.

Rank, world size and MASTER_ADDR/PORT come from the environment (env://, no launcher).
Prints ``RESULT <json>`` and exits 0 on success; an error escapes (exit 1) with its text.

Modes: ``reinit`` (init, call, shutdown, three times), ``join`` (init, shutdown),
``with_pg`` (gloo init_process_group, then init_rpc on the same MASTER_PORT),
``file`` (init_method=file://$RDZV_FILE), ``remote_error`` (rank 0 calls a function of
rank 1 that raises an exception whose class cannot be rebuilt).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import rrefrt  # noqa: E402


class NeedsTwoArgs(Exception):
    """An exception whose constructor needs more than its message: pickle cannot rebuild it."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code


def raise_needs_two_args() -> None:
    raise NeedsTwoArgs(7, "cannot be rebuilt")


def add(a: int, b: int) -> int:
    return a + b


def _opts(**kw: object) -> rrefrt.RpcBackendOptions:
    return rrefrt.RpcBackendOptions(init_timeout=float(os.environ.get("RDZV_INIT_TIMEOUT", "60")), **kw)


def main() -> int:
    from tests.support import rdzv_worker as m  # pickled by module name, not as __main__

    # a worker still running after RDZV_DUMP_S prints every thread's stack and exits: a hang
    # shows where it is instead of being killed silently by the test
    faulthandler.dump_traceback_later(float(os.environ.get("RDZV_DUMP_S", "50")), exit=True)

    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = sys.argv[2] if len(sys.argv) > 2 else f"w{rank}"
    peer = f"w{(rank + 1) % world}"
    out: dict = {"rank": rank}
    if mode == "reinit":
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            rrefrt.init_rpc(name, rpc_backend_options=_opts())
            took.append(time.monotonic() - t0)
            assert rrefrt.rpc_sync(peer, m.add, args=(rank, 1)) == rank + 1
            rrefrt.shutdown()
        out["init_s"] = took
    elif mode == "join":
        rrefrt.init_rpc(name, rpc_backend_options=_opts())
        rrefrt.shutdown()
    elif mode == "hold":  # stay in the group until the file $RDZV_RELEASE exists (bounded)
        rrefrt.init_rpc(name, rpc_backend_options=_opts())
        print("JOINED", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["RDZV_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls for the test's signal
        rrefrt.shutdown()
    elif mode == "with_pg":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
        rrefrt.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=_opts())
        out["rpc"] = rrefrt.rpc_sync(peer, m.add, args=(rank, 10))
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)
        out["allreduce"] = t.tolist()
        rrefrt.shutdown()
        dist.destroy_process_group()
    elif mode == "file":
        opts = _opts()
        opts.init_method = "file://" + os.environ["RDZV_FILE"]  # the constructor's check is H3's to widen
        rrefrt.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
        out["rpc"] = rrefrt.rpc_sync(peer, m.add, args=(rank, 20))
        rrefrt.shutdown()
    elif mode == "remote_error":
        rrefrt.init_rpc(name, rpc_backend_options=_opts())
        if rank == 0:
            try:
                rrefrt.rpc_sync(peer, m.raise_needs_two_args)
            except rrefrt.RemoteError as e:
                out.update(type=type(e).__name__, remote_type=e.remote_type, worker=e.worker,
                           traceback=e.remote_traceback, message=str(e))
        rrefrt.shutdown()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
