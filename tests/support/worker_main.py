"""A worker process for tests: ``python tests/support/worker_main.py '<json spec>'``.

spec: name, rank, world_size, port, options (RpcBackendOptions kwargs), and optionally
``addr`` (the rendezvous address, 127.0.0.1 by default), ``scenario`` - the name of a
function in ``module`` (tests.support.scenarios by default) to run after init_rpc (its return
value is printed as JSON on a line starting with RESULT). Without a scenario the
worker serves calls until the group shuts down. Exit code 0 on success.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {os.getpid()} %(name)s %(levelname)s %(message)s")

import rrefrt  # noqa: E402


def main() -> int:
    spec = json.loads(sys.argv[1])
    addr = spec.get("addr", "127.0.0.1")
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://{addr}:{spec['port']}", **spec.get("options", {}))
    rrefrt.init_rpc(spec["name"], rank=spec["rank"], world_size=spec["world_size"], rpc_backend_options=opts)
    scenario = spec.get("scenario")
    if scenario:
        import importlib

        module = importlib.import_module(spec.get("module", "tests.support.scenarios"))
        result = getattr(module, scenario)(spec)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    rrefrt.shutdown(graceful=spec.get("graceful", True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
