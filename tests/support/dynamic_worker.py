"""A member of a dynamic group for tests/cluster/test_dynamic.py:
``python tests/support/dynamic_worker.py <role> <name> <rank> <port>``.

Roles: ``driver`` (joins first, hosts the store, starts the others in its own process
group and runs the scenario, printing ``RESULT <json>``), ``member`` (joins, calls the
members it found, serves until told to leave), ``dup`` (tries to join with a name or rank
that is taken and prints the error). Every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {os.getpid()} %(name)s %(levelname)s %(message)s")

import rrefrt  # noqa: E402
from tests.support import poll_for  # noqa: E402

WAIT_S = 60.0  #: the bound of every wait in the scenario (generous: a loaded 2-core CI)
_leave = threading.Event()
_hellos: list[str] = []


def hello(who: str) -> str:
    """Called by a joiner on the driver right after its init_rpc returned."""
    _hellos.append(who)
    return rrefrt.get_worker_info().name


def whoami() -> tuple[str, int, list[str]]:
    return rrefrt.get_worker_info().name, os.getpid(), sorted(w.name for w in rrefrt.get_worker_infos())


def call_back(to: str) -> int:
    """A member calls another member from inside a call (both directions in one go)."""
    return rrefrt.rpc_sync(to, operator.add, args=(20, 22), timeout=WAIT_S)


def please_leave() -> bool:
    _leave.set()
    return True


def make_value(x: int) -> list[int]:
    return [x, x]


def _options() -> rrefrt.RpcBackendOptions:
    return rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{PORT}", init_timeout=WAIT_S,
                                    shutdown_timeout=30.0, rpc_timeout=WAIT_S)


def _poll(pred, what: str) -> None:  # noqa: ANN001
    poll_for(pred, WAIT_S, what)


def _names() -> list[str]:
    return sorted(w.name for w in rrefrt.get_worker_infos())


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> list:
    text, _ = p.communicate(timeout=WAIT_S)
    return [p.returncode, text[-3000:]]


def _error_of(fn) -> dict:  # noqa: ANN001
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e), "unavailable": isinstance(e, rrefrt.WorkerUnavailableError),
                "secs": time.monotonic() - t0}
    return {"type": None, "msg": "", "unavailable": False, "secs": time.monotonic() - t0}


def driver() -> dict:
    out: dict = {}
    rrefrt.init_rpc("driver", rank=0, rpc_backend_options=_options())
    out["alone"] = _names()
    # 1. two members join a running group, one after the other; calls go both ways
    w1 = _spawn("member", "w1", "1", str(PORT))
    _poll(lambda: "w1" in _names() and "w1" in _hellos, "w1 joined and called the driver")
    w2 = _spawn("member", "w2", "2", str(PORT))
    _poll(lambda: "w2" in _names() and "w2" in _hellos, "w2 joined and called the driver")
    out["after_joins"] = _names()
    out["to_w1"] = rrefrt.rpc_sync("w1", operator.add, args=(1, 2))
    out["w1_sees"] = rrefrt.rpc_sync("w1", whoami)[2]
    out["w2_via_w1"] = rrefrt.rpc_sync("w2", call_back, args=("w1",))  # a joiner calls an older member
    out["w1_via_w2"] = rrefrt.rpc_sync("w1", call_back, args=("w2",))  # and the reverse
    # 2. a name or a rank that is taken is refused
    for tag, name, rank in (("dup_name", "w1", "7"), ("dup_rank", "w7", "2")):
        p = _spawn("dup", name, rank, str(PORT))
        text, _ = p.communicate(timeout=WAIT_S)
        line = [x for x in text.splitlines() if x.startswith("REFUSED ")]
        out[tag] = json.loads(line[0][8:]) if line else {"output": text[-2000:]}
    out["after_dups"] = _names()
    # 3. w1 leaves: calls to it fail with WorkerUnavailableError naming it; its RRef too
    rref = rrefrt.remote("w1", make_value, args=(5,))
    out["rref_before"] = rref.to_here()
    rrefrt.rpc_sync("w1", please_leave)
    _poll(lambda: "w1" not in _names(), "w1 left")
    out["w1_exit"] = _finish(w1)
    out["call_left"] = _error_of(lambda: rrefrt.rpc_sync("w1", operator.add, args=(1, 1)))
    out["rref_left"] = _error_of(lambda: rref.to_here(timeout=WAIT_S))
    out["w2_sees"] = rrefrt.rpc_sync("w2", whoami)[2]
    # 4. w3 joins after a leave (the log it reads holds a join and a leave)
    w3 = _spawn("member", "w3", "3", str(PORT))
    _poll(lambda: "w3" in _names() and "w3" in _hellos, "w3 joined")
    out["w3_via_w2"] = rrefrt.rpc_sync("w3", call_back, args=("w2",))
    # 5. w2 is SIGKILLed with a call in flight: the call fails fast, w2 is evicted everywhere
    pid = rrefrt.rpc_sync("w2", whoami)[1]
    fut = rrefrt.rpc_async("w2", time.sleep, args=(WAIT_S,))
    os.kill(pid, signal.SIGKILL)
    out["inflight_killed"] = _error_of(fut.wait)
    _poll(lambda: "w2" not in _names(), "w2 evicted here")
    out["call_evicted"] = _error_of(lambda: rrefrt.rpc_sync("w2", operator.add, args=(1, 1)))
    _poll(lambda: "w2" not in rrefrt.rpc_sync("w3", whoami)[2], "w2 evicted on w3")
    out["w3_sees"] = rrefrt.rpc_sync("w3", whoami)[2]
    _finish(w2)
    rrefrt.rpc_sync("w3", please_leave)
    _poll(lambda: _names() == ["driver"], "w3 left")
    out["w3_exit"] = _finish(w3)
    out["debug"] = {k: v for k, v in rrefrt.get_debug_info().items() if k.startswith("num_")}
    rrefrt.shutdown()
    return out


def member(name: str, rank: int) -> int:
    rrefrt.init_rpc(name, rank=rank, rpc_backend_options=_options())
    rrefrt.rpc_sync("driver", hello, args=(name,))  # right after init_rpc returned
    if not _leave.wait(WAIT_S * 3):
        return 2
    rrefrt.shutdown()
    return 0


def dup(name: str, rank: int) -> int:
    try:
        rrefrt.init_rpc(name, rank=rank, rpc_backend_options=_options())
    except rrefrt.RpcError as e:
        print("REFUSED " + json.dumps({"type": type(e).__name__, "msg": str(e)}), flush=True)
        return 0
    rrefrt.shutdown(graceful=False)
    return 1


if __name__ == "__main__":
    role, NAME, RANK, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if role == "driver":
        print("RESULT " + json.dumps(driver()), flush=True)
        sys.exit(0)
    sys.exit(member(NAME, RANK) if role == "member" else dup(NAME, RANK))
