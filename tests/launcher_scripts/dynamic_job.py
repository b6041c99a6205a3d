"""A worker of tests/cluster/test_dynamic.py's launcher test: ``dynamic_job.py host|joiner``.

The host (started by ``rrefrt-run --dynamic``) waits, bounded, until two joiners (started
later by ``rrefrt-run --join``) have called it, calls each back, and leaves; each joiner
calls the host right after init_rpc, waits until the host called it back, and leaves."""

import os
import sys
import threading

import rrefrt
from tests.support import poll_for

WAIT_S = 60.0
_called = threading.Event()
_hellos: list = []


def hello(who: str) -> bool:
    _hellos.append(who)
    return "WORLD_SIZE" not in os.environ


def call_back() -> str:
    _called.set()
    return rrefrt.get_worker_info().name


def main() -> int:
    role = sys.argv[1]
    name = f"{role}{os.environ['RANK']}"
    rrefrt.init_rpc(name)
    if role == "host":
        poll_for(lambda: len(_hellos) >= 2, WAIT_S, "two joiners called the host")
        names = sorted(rrefrt.rpc_sync(j, call_back) for j in sorted(_hellos))
        print("HOST", name, "called back", names, flush=True)
    else:
        dynamic = rrefrt.rpc_sync("host0", hello, args=(name,))
        print("JOINER", name, "dynamic", dynamic, "called back", _called.wait(WAIT_S), flush=True)
    rrefrt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
