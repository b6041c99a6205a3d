"""Scenarios run inside worker processes (tests/worker_main.py ``scenario``)."""

from __future__ import annotations

import gc
import time

import rrefrt
from tests import workerfns as fns


def shutdown_only(spec: dict) -> dict:
    t0 = time.monotonic()
    try:
        rrefrt.shutdown(timeout=spec.get("shutdown_timeout", 0))
    except rrefrt.RpcError as e:
        return {"error": type(e).__name__, "message": str(e), "took": time.monotonic() - t0}
    return {"error": None, "took": time.monotonic() - t0}


def after_shutdown_call(spec: dict) -> dict:
    rrefrt.shutdown()
    try:
        rrefrt.rpc_sync("w0", fns.add, args=(1, 2))
    except rrefrt.ShutdownError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


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
