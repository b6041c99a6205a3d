"""Scenarios run inside worker processes (tests/support/worker_main.py ``scenario``)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import rrefrt
from tests.support import workerfns as fns


def shutdown_only(spec: dict) -> dict:
    t0 = time.monotonic()
    try:
        rrefrt.shutdown(timeout=spec.get("shutdown_timeout", 0))
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "took": time.monotonic() - t0}
    return {"error": None, "took": time.monotonic() - t0}


def after_shutdown_call(spec: dict) -> dict:
    try:  # an unknown destination first, while the group runs
        rrefrt.get_worker_info("no-such-worker")
        unknown = None
    except rrefrt.WorkerUnavailableError as e:
        unknown = str(e)
    rrefrt.shutdown()
    try:
        rrefrt.rpc_sync("w0", fns.add, args=(1, 2))
    except rrefrt.ShutdownError as e:
        return {"error": type(e).__name__, "message": str(e), "unknown": unknown}
    return {"error": None, "unknown": unknown}


def hold_rrefs_at_shutdown(spec: dict) -> dict:
    """A torch-style program: creates RRefs and still holds them at shutdown."""
    held = []
    if spec["rank"] == 0:
        held = [rrefrt.remote("w1", fns.Counter, args=(i,)) for i in range(5)]
        held.append(rrefrt.rpc_sync("w1", fns.make_rref, args=(99,)))
        assert [r.rpc_sync().get() for r in held[:5]] == list(range(5))
    t0 = time.monotonic()
    try:
        rrefrt.shutdown()
        result = {"error": None}
    except rrefrt.RpcError as e:
        result = {"error": type(e).__name__, "message": str(e), "leaks": getattr(e, "leaks", [])}
    result["took"] = time.monotonic() - t0
    if held:
        try:
            held[0].to_here()
            result["after"] = "no error"
        except rrefrt.ShutdownError:
            result["after"] = "ShutdownError"
    return result


def owner_counts_after_drop(spec: dict) -> dict:
    gc.collect()
    return fns.owner_counts()


def block_forever(spec: dict) -> dict:
    """A stuck peer: never calls shutdown (the test kills it)."""
    import threading

    threading.Event().wait(60)
    return {}


def leak_by_dropped_delete(spec: dict) -> dict:
    """w0's deletes never reach the owner (dropped by a fault plan, retries exhausted)."""
    from rrefrt import faults

    if spec["rank"] == 0:
        faults.install(faults.FaultPlan([faults.Rule("RREF_USER_DELETE", "drop")], control_retry_interval=0.02))
        rref = rrefrt.remote("w1", fns.identity, args=(7,))
        assert rref.to_here() == 7
        del rref
        gc.collect()
    try:
        rrefrt.shutdown()
        return {"error": None}
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "leaks": getattr(e, "leaks", [])}


def chaos_worker(spec: dict) -> dict:
    """One worker of a chaos run (tests/support/chaos.py): faults installed, rank 0 drives."""
    import random

    from rrefrt import faults
    from tests.support.chaos import plan_for

    rank, seed = spec["rank"], spec["seed"]
    disruption, marks = spec.get("disruption", "none"), spec.get("marks", "")
    faults.install(plan_for(seed, rank))
    trace_dir = os.environ.get("RREFRT_PTRACE_DIR")
    if trace_dir:  # tests/support/ptrace.py: a protocol trace for the diagnosis of a leak
        from tests.support import ptrace

        ptrace.install(os.path.join(trace_dir, f"w{rank}.jsonl"))
    if marks:  # tells tests/support/chaos.py that this worker is in the group (it may stop us now)
        open(os.path.join(marks, f"w{rank}.ready"), "w").close()
    errors: dict[str, int] = {}
    samples: list[str] = []

    def note(e: BaseException) -> None:
        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
        if len(samples) < 5:
            samples.append(f"{type(e).__name__}: {str(e)[:200]}")

    if rank == 0:
        rng = random.Random(seed)
        held: list = []
        end = time.monotonic() + spec["duration"]
        while time.monotonic() < end:
            op = rng.randrange(6)
            target = f"w{rng.randrange(3)}"
            try:
                if op == 0 or not held:
                    held.append(rrefrt.remote(target, fns.identity, args=(rng.randrange(100),), timeout=2))
                elif op == 1:
                    rrefrt.rpc_sync(target, fns.rref_value, args=(rng.choice(held),), timeout=2)
                elif op == 2:
                    rng.choice(held).to_here(timeout=2)
                elif op == 3:
                    rrefrt.rpc_sync(target, fns.rref_pass_on, args=(rng.choice(held), f"w{rng.randrange(3)}"), timeout=3)
                elif op == 4:
                    rrefrt.futures.wait_all([rrefrt.rpc_async(target, fns.add, args=(i, 1), timeout=2) for i in range(5)])
                else:
                    held.pop(rng.randrange(len(held)))
            except Exception as e:  # every failure must be a documented, typed error
                note(e)
        held.clear()
    extra: dict = {}
    if disruption == "large" and rank == 0:
        extra["large"] = _large_call(spec, note)
    if disruption == "stop_near":
        extra["membership"], extra["probe"] = _settled_membership(spec, note)
    if marks and rank == 0:  # the others count what they own once the driver is done
        open(os.path.join(marks, "w0.done"), "w").close()
    elif marks:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(marks, "w0.done")) and time.monotonic() < deadline:
            threading_event_wait(0.02)
    gc.collect()
    faults.clear()  # the end of the run is checked on a clean network
    left = {}
    try:
        # let drops, retries and deletes settle (bounded), then count what is still owned
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            gc.collect()
            left = fns.owner_counts()
            if left["num_owner_rrefs"] == 0 and left["num_pending_users"] == 0 and left["num_pending_children"] == 0:
                break
            threading_event_wait(0.05)
        if left.get("num_owner_rrefs"):  # for the diagnosis of a leak: who holds the forks, who is dead
            from rrefrt import state

            ctx = state.current().ctx
            holders = [h for fs in list(ctx.forks.values()) for h in list(fs.values())]
            left["fork_holders"] = {str(h): holders.count(h) for h in set(holders)}
            left["dead"] = sorted(ctx.dead)
        if trace_dir:
            left["state"] = _protocol_state()
        rrefrt.shutdown()
    except Exception as e:
        note(e)
    if trace_dir:
        ptrace.dump()
    return {"errors": errors, "samples": samples, "owner_rrefs_left": left.get("num_owner_rrefs", 0), "counts": left,
            **extra}


def _protocol_state() -> dict:
    """The RRef context's maps on this worker, ids as text (for the diagnosis of a leak)."""
    from rrefrt import state
    from tests.support.ptrace import _text

    ctx = state.current().ctx
    with ctx._lock:
        return {
            "owners": _text(list(ctx.owners.values())), "forks": _text(ctx.forks),
            "pending_users": _text(list(ctx.pending_users.values())),
            "confirmed_users": _text(list(ctx.confirmed_users.values())),
            "deleting_users": _text(list(ctx.deleting_users.values())),
            "pending_children": {_text(k): [_text(p.fork_id), c] for k, (p, c) in ctx.pending_children.items()},
            "dead": sorted(ctx.dead),
        }


def _large_call(spec: dict, note: Any) -> dict:
    """Chaos "large": one result of ``large_size`` bytes from w2, whose transfer outlasts the
    heartbeat timeout; tests/support/chaos.py may SIGSTOP w2 while it is on its way (a stall)."""
    size = spec["large_size"]
    t0 = time.monotonic()
    try:
        data = rrefrt.rpc_sync("w2", fns.big_result, args=(size, os.path.join(spec["marks"], "big.sent")), timeout=120)
        return {"ok": len(data) == size, "took": time.monotonic() - t0, "hb_timeout": spec["options"]["heartbeat_timeout"]}
    except Exception as e:
        note(e)
        return {"ok": False, "error": type(e).__name__, "message": str(e)[:300], "failed_at": time.monotonic(),
                "took": time.monotonic() - t0}


def _settled_membership(spec: dict, note: Any) -> tuple[dict, dict]:
    """Chaos "stop_near": once w2 was resumed (tests/support/chaos.py touches ``resumed``) and the
    membership had time to settle, who does this worker think is dead, was it fenced, and
    does a call from w2 fail fast (fenced) or succeed (not fenced)?"""
    flag = os.path.join(spec["marks"], "resumed")
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        threading_event_wait(0.02)
    # DEAD_NOTICE goes out at once and FENCED is retried every 0.2 s: 2 s is ample to settle
    threading_event_wait(2.0)
    seen = fns.membership()
    probe: dict = {}
    if spec["rank"] == 2:
        t0 = time.monotonic()
        try:
            rrefrt.rpc_sync("w0", fns.add, args=(1, 2), timeout=5)
            probe = {"ok": True, "took": time.monotonic() - t0}
        except Exception as e:
            note(e)
            probe = {"ok": False, "error": type(e).__name__, "took": time.monotonic() - t0}
    return seen, probe


def threading_event_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)  # paces the re-check of a bounded condition


def hold_many_rrefs_at_shutdown(spec: dict) -> dict:
    """10,000 live RRefs (owned by w1, held by w0) at graceful shutdown."""
    held = []
    if spec["rank"] == 0:
        held = [rrefrt.remote("w1", fns.identity, args=(i,)) for i in range(10_000)]
        assert held[-1].to_here() == 9_999
    t0 = time.monotonic()
    try:
        rrefrt.shutdown()
        error = None
    except rrefrt.RpcError as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "took": time.monotonic() - t0, "held": len(held)}


def fenced_owner(spec: dict) -> dict:
    """w1 owns values that w0 holds; tests/failure/test_chaos.py stops w1 past the heartbeat
    timeout and resumes it (touching ``resumed``): the fenced w1 must free them."""
    rank, marks = spec["rank"], spec["marks"]
    out: dict = {}
    held = []
    if rank == 0:
        held = [rrefrt.remote("w1", fns.identity, args=(i,)) for i in range(5)]
        out["values"] = [r.to_here() for r in held]
    open(os.path.join(marks, f"w{rank}.ready"), "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(marks, "resumed")) and time.monotonic() < deadline:
        threading_event_wait(0.02)
    if rank == 1:
        t0 = time.monotonic()
        deadline = t0 + 4
        while time.monotonic() < deadline:  # learning it was fenced and freeing take a moment
            gc.collect()
            out["membership"], out["counts"] = fns.membership(), fns.owner_counts()
            if out["membership"]["fenced"]:
                out.setdefault("fenced_after", time.monotonic() - t0)
                if out["counts"]["num_owner_rrefs"] == 0:
                    out["freed_after"] = time.monotonic() - t0
                    break
            threading_event_wait(0.02)
        open(os.path.join(marks, "w1.done"), "w").close()
    else:  # w0 stays until w1 has counted (its leaving would look like a death to w1)
        deadline = time.monotonic() + 15
        while not os.path.exists(os.path.join(marks, "w1.done")) and time.monotonic() < deadline:
            threading_event_wait(0.02)
    try:
        rrefrt.shutdown()
    except rrefrt.RpcError as e:
        out["shutdown"] = type(e).__name__
    return out
