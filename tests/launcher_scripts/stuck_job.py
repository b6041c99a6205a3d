"""A job with a stuck handler, for the job-wide dump test (tests/cluster/test_stuck.py).

worker0 calls ``tests.support.stuck_fns.stuck`` on worker1 (it blocks in time.sleep), writes
``<outdir>/ready`` and waits for ``<outdir>/go``; then it releases the handler and both
shut down. ``python stuck_job.py OUTDIR``, under rrefrt-run with two workers.
"""

import json
import os
import sys
import time

import rrefrt
from tests.support import stuck_fns


def main() -> int:
    outdir = sys.argv[1]
    rank = int(os.environ["RANK"])
    rrefrt.init_rpc(f"worker{rank}", rpc_backend_options=rrefrt.RpcBackendOptions(shutdown_timeout=60))
    if rank == 0:
        fut = rrefrt.rpc_async("worker1", stuck_fns.stuck, args=(60,), timeout=0)
        deadline = time.monotonic() + 30
        while not rrefrt.rpc_sync("worker1", stuck_fns.entered) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(os.path.join(outdir, "job.env.tmp"), "w") as f:  # for `python -m rrefrt.debug dump`
            f.write(json.dumps({k: os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "RREFRT_SECRET")}))
        os.replace(os.path.join(outdir, "job.env.tmp"), os.path.join(outdir, "job.env"))
        open(os.path.join(outdir, "ready"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(outdir, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)  # the test's go: a file, re-checked with a bounded deadline
        rrefrt.rpc_sync("worker1", stuck_fns.release)
        print(f"worker0: {fut.wait()}", flush=True)
    rrefrt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
