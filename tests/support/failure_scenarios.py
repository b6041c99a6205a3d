"""Scenarios of the failure tests, run inside worker processes
(``tests/support/worker_main.py`` with ``"module": "tests.support.failure_scenarios"``).

Timestamps are ``time.monotonic()``: CLOCK_MONOTONIC is one clock for every process of a
host (network namespaces included), so the test process can compare them with its own.
"""

from __future__ import annotations

import gc
import json
import os
import select
import sys
import threading
import time
from typing import Any, Callable

import rrefrt
from tests.support import failure_fns as ff, zmq_transport
from tests.support import workerfns as fns


def _wait_for_file(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.01)  # paces the re-check of a condition
    return True


def _timed_shutdown(timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        rrefrt.shutdown(timeout=timeout)
        return {"error": None, "took": time.monotonic() - t0, "at": time.monotonic()}
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "took": time.monotonic() - t0,
                "at": time.monotonic()}


# ---------------------------------------------------------------------------- shutdown
def ready_then_shutdown_on_go(spec: dict) -> dict:
    """Say READY, wait for the go file (the test kills or stops a peer first), then shut
    down gracefully with ``shutdown_timeout``; the test also times the process exit."""
    print("READY", flush=True)
    if not _wait_for_file(spec["go"], 60):
        return {"error": "no go file"}
    return _timed_shutdown(spec["shutdown_timeout"])


# ---------------------------------------------------------------------------- partition
def partition_observer(spec: dict) -> dict:
    """A pending call to ``peer`` and a pending to_here() of an RRef it owns; READY; then
    report when and how each failed (the test cuts the link meanwhile), and shut down."""
    peer = spec["peer"]
    fut = rrefrt.rpc_async(peer, ff.mark_then_wait, args=(os.devnull, "partition", 60), timeout=0)
    rref = rrefrt.remote(peer, ff.mark_then_wait, args=(os.devnull, "partition-rref", 60))
    fetch = rref.to_here_async()
    failed: dict[str, Any] = {}

    def on_done(name: str) -> Callable[[Any], None]:
        def done(f: Any) -> None:
            failed[name] = time.monotonic()
        return done

    fut.add_done_callback(on_done("call"))
    fetch.add_done_callback(on_done("to_here"))
    print("READY", flush=True)
    out: dict[str, Any] = {}
    for name, f in (("call", fut), ("to_here", fetch)):
        try:
            f.wait(spec.get("wait", 30))
            out[name] = {"error": None}
        except rrefrt.RpcError as e:
            out[name] = {"error": type(e).__name__, "message": str(e), "at": failed.get(name, time.monotonic())}
        except TimeoutError:
            out[name] = {"error": "still pending (a hang)"}
    t0 = time.monotonic()
    try:
        rrefrt.rpc_sync(peer, fns.add, args=(1, 2))
        out["next_call"] = {"error": None}
    except rrefrt.RpcError as e:
        out["next_call"] = {"error": type(e).__name__, "took": time.monotonic() - t0}
    out["dead"] = ff.agent_info()["dead"]
    del rref
    out["shutdown"] = _timed_shutdown(spec["shutdown_timeout"])
    return out


# ---------------------------------------------------------------------------- fork safety
def _child_checks(rt: Any, user_rref: Any, owned: Any, peer: str, full: bool) -> dict:
    """In a forked child: every use of the inherited runtime must fail at once with a clear
    error, and dropping inherited RRefs must send nothing."""
    out: dict[str, Any] = {"checks": {}}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            fn()
            res = "no error"
        except Exception as e:
            res = f"{type(e).__name__}: {e}"
        out["checks"][name] = {"result": res, "took": time.monotonic() - t0}

    timed("rpc_sync", lambda: rrefrt.rpc_sync(peer, fns.add, args=(1, 2)))
    timed("to_here of an inherited user RRef", lambda: user_rref.to_here())
    if full:
        timed("rpc_async", lambda: rrefrt.rpc_async(peer, fns.add, args=(1, 2)))
        timed("remote", lambda: rrefrt.remote(peer, fns.add, args=(1, 2)))
        timed("get_worker_info", lambda: rrefrt.get_worker_info())
        timed("get_debug_info", lambda: rrefrt.get_debug_info())
        timed("to_here of an inherited owner RRef", lambda: owned.to_here())
        timed("local_value", lambda: owned.local_value())
        timed("proxy rpc_sync", lambda: user_rref.rpc_sync().get())
        timed("proxy remote", lambda: user_rref.remote().get())
        timed("RRef(value)", lambda: rrefrt.RRef(1))
        timed("shutdown", lambda: rrefrt.shutdown())
        timed("shutdown(graceful=False)", lambda: rrefrt.shutdown(graceful=False))
    # every way out of the inherited runtime records instead of sending
    # the transport's sending methods (the only way out of the runtime) and the control
    # thread's real queue record what reaches them instead of sending it
    sent: list[str] = []
    tr = rt.transport
    for how in ("request", "send", "respond"):
        setattr(tr, how, lambda dest, *a, _how=how, **k: sent.append(f"transport.{_how} to {dest}"))
    rt.enqueue_drop = lambda fid: sent.append(f"drop {fid}")

    class Recorder:
        def put(self, item: Any) -> None:
            sent.append(f"control: {type(item).__name__}")

    rt.control.queue = Recorder()  # type: ignore[assignment]
    t0 = time.monotonic()
    del user_rref, owned
    gc.collect()
    out["gc_took"] = time.monotonic() - t0
    out["sent"] = sent
    return out


def _report(wfd: int, data: dict) -> None:
    raw = json.dumps(data).encode()
    view = memoryview(raw)
    while view:
        n = os.write(wfd, view)
        view = view[n:]
    os.close(wfd)


def _fresh_group(spec: dict) -> dict:
    """In a forked child: join a new group with init_rpc and use it."""
    t0 = time.monotonic()
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{spec['fresh_port']}", init_timeout=20,
                                    shutdown_timeout=10)
    rrefrt.init_rpc("n0", rank=0, world_size=2, rpc_backend_options=opts)
    init_took = time.monotonic() - t0
    value = rrefrt.rpc_sync("n1", fns.add, args=(20, 22))
    rref = rrefrt.remote("n1", ff.Tracked, args=("fresh",))
    tag = rref.rpc_sync().get()
    del rref
    rrefrt.shutdown()
    return {"init_took": init_took, "value": value, "tag": tag}


def _collect_child(pid: int, rfd: int, timeout: float) -> dict:
    """Read a child's report and reap it, both bounded; a child that hangs is killed."""
    deadline = time.monotonic() + timeout
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if not ready:
            break
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(rfd)
    pidfd = os.pidfd_open(pid)
    try:
        exited = bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(pidfd)
    if not exited:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks)) if chunks else {}
    report["exit"] = os.waitstatus_to_exitcode(status) if exited else "hung (killed)"
    report["exit_within"] = time.monotonic() - (deadline - timeout)
    return report


def fork_checks(spec: dict) -> dict:
    peer = spec["peer"]
    rt = rrefrt.state.current()
    user_rref = rrefrt.remote(peer, ff.Tracked, args=("user",))
    assert user_rref.to_here().tag == "user"
    owned = rrefrt.RRef(ff.Tracked("owned"))
    rrefrt.rpc_sync(peer, ff.keep, args=(owned,))
    result: dict[str, Any] = {"forks": []}

    # 1. fork while the I/O thread holds the RRef context's lock and the outbox lock, and
    #    another thread holds the API's init/shutdown lock (as a shutdown() in progress does)
    held, api_held, release = threading.Event(), threading.Event(), threading.Event()

    def hold_locks() -> None:  # runs on the I/O thread
        with rt.ctx._lock, zmq_transport(rt.transport)._loop._lock:  # the zmq data loop's outbox lock
            held.set()
            release.wait(2.0)

    def hold_api_lock() -> None:
        with rrefrt.api._init_lock:
            api_held.set()
            release.wait(2.0)

    zmq_transport(rt.transport)._call_soon(hold_locks)
    threading.Thread(target=hold_api_lock, daemon=True).start()
    assert held.wait(5) and api_held.wait(5), "the lock holders never ran"
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: no finally blocks above this point run in it (os._exit)
        try:
            os.close(rfd)
            report = _child_checks(rt, user_rref, owned, peer, full=True)
            try:
                report["fresh_group"] = _fresh_group(spec)
            except Exception as e:
                report["fresh_group"] = {"error": f"{type(e).__name__}: {e}"}
            _report(wfd, report)
        finally:
            os._exit(0)
    fork_took = time.monotonic() - t0
    release.set()
    os.close(wfd)
    first = _collect_child(pid, rfd, 15)
    first["fork_took"] = fork_took
    result["locked_fork"] = first

    # 2. fork in a loop while traffic flows (RPCs, RRef creation and deletion)
    stop = threading.Event()
    traffic = {"rounds": 0, "errors": []}

    def pump() -> None:
        while not stop.is_set():
            try:
                futs = [rrefrt.rpc_async(peer, fns.add, args=(i, 1)) for i in range(8)]
                r = rrefrt.remote(peer, ff.Tracked, args=("t",))
                rrefrt.futures.wait_all(futs, 10)
                r.to_here(10)
                del r
                traffic["rounds"] += 1
            except Exception as e:
                traffic["errors"].append(repr(e))
                return

    pumps = [threading.Thread(target=pump, daemon=True) for _ in range(2)]
    for p in pumps:
        p.start()
    n = spec.get("forks", 30)
    for i in range(n):
        rfd, wfd = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            report = _child_checks(rt, user_rref, owned, peer, full=False)
            _report(wfd, report)
            if i % 2:
                os._exit(0)
            sys.exit(0)  # a normal interpreter exit: atexit, finalizers, the inherited zmq context
        took = time.monotonic() - t0
        os.close(wfd)
        rep = _collect_child(pid, rfd, 10)
        rep["fork_took"] = took
        rep["exit_mode"] = "os._exit" if i % 2 else "sys.exit"
        result["forks"].append(rep)
    stop.set()
    for p in pumps:
        p.join(15)
    result["traffic"] = traffic
    # the parent keeps working, and its RRefs are intact
    t0 = time.monotonic()
    result["after"] = {
        "add": rrefrt.rpc_sync(peer, fns.add, args=(1, 2)),
        "user_rref": user_rref.to_here().tag,
        "owned": owned.local_value().tag,
        "peer_counts": rrefrt.rpc_sync(peer, ff.counts),
        "took": time.monotonic() - t0,
    }
    rrefrt.rpc_sync(peer, ff.drop_kept)
    del user_rref, owned
    result["shutdown"] = _timed_shutdown(20)
    return result
