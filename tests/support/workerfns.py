"""Functions the tests call remotely (importable on every worker)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import rrefrt


class UserDefinedError(Exception):
    pass


class NeedsTwoArgs(Exception):
    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a, b)
        self.a, self.b = a, b


def add(a: Any, b: Any) -> Any:
    return a + b


def identity(x: Any) -> Any:
    return x


def echo_kwargs(*args: Any, **kwargs: Any) -> Any:
    return args, kwargs


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def raise_user_error() -> None:
    raise UserDefinedError("custom failure")


def relay_error(path: list) -> Any:
    """Call the next worker of ``path`` with the rest of it; the last one raises."""
    if not path:
        raise UserDefinedError("innermost failure")
    return rrefrt.rpc_sync(path[0], relay_error, args=(path[1:],))


def raise_two_args() -> None:
    raise NeedsTwoArgs(1, 2)


def sleep_for(seconds: float) -> float:
    threading.Event().wait(seconds)  # the duration is what the test measures
    return seconds


def pid() -> int:
    return os.getpid()


def call_back(to: str, a: int, b: int) -> Any:
    return rrefrt.rpc_sync(to, add, args=(a, b))


def fan_out(targets: list[str], n: int) -> int:
    futs = [rrefrt.rpc_async(targets[i % len(targets)], add, args=(i, 1)) for i in range(n)]
    return sum(rrefrt.futures.wait_all(futs))


def debug_info() -> dict:
    return rrefrt.get_debug_info()


def worker_name() -> str:
    return rrefrt.get_worker_info().name


async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0.01)
    return a + b


@rrefrt.functions.async_execution
def async_exec_add(to: str, a: int, b: int) -> rrefrt.Future:
    return rrefrt.rpc_async(to, add, args=(a, b)).then(lambda f: f.value() * 10)


@rrefrt.functions.async_execution
def async_exec_fail() -> rrefrt.Future:
    fut: rrefrt.Future = rrefrt.Future()
    fut.set_exception(UserDefinedError("set_exception on the callee"))
    return fut


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, by: int = 1) -> int:
        self.value += by
        return self.value

    def get(self) -> int:
        return self.value

    @staticmethod
    def static_add(a: int, b: int) -> int:
        return a + b

    @classmethod
    def class_name(cls) -> str:
        return cls.__name__


def make_local_class_instance(start: int) -> Any:
    """A value whose class cannot be pickled (defined in a function): its type cannot be
    sent back, so ``rref.remote().m()`` skips the type check (a SerializationError)."""

    class Local:
        def get(self) -> int:
            return start

    return Local()


# ---- RRef helpers
def make_rref(value: Any) -> rrefrt.RRef:
    """An RRef owned by the worker running this (returned: owner -> caller)."""
    return rrefrt.RRef(value)


def rref_value(rref: rrefrt.RRef) -> Any:
    return rref.to_here()


def rref_local_value(rref: rrefrt.RRef) -> Any:
    return rref.local_value()


def rref_raise_on_owner(rref: rrefrt.RRef) -> None:
    raise UserDefinedError(f"failed with {rref!r}")


def rref_is_owner(rref: rrefrt.RRef) -> bool:
    return rref.is_owner()


def rref_pass_on(rref: rrefrt.RRef, to: str) -> Any:
    """user -> user along a chain: pass the RRef on to ``to`` and read it there."""
    return rrefrt.rpc_sync(to, rref_value, args=(rref,))


def rref_remote_on(to: str, value: Any) -> rrefrt.RRef:
    """An RRef owned by a third worker, returned to the caller."""
    return rrefrt.remote(to, identity, args=(value,))


def rrefs_in_container(refs: dict) -> int:
    return sum(r.to_here() for r in refs["list"]) + refs["one"].to_here()


_kept: list = []


def keep(rrefs: list) -> int:
    _kept.extend(rrefs)
    return len(_kept)


def drop_kept() -> int:
    n = len(_kept)
    _kept.clear()
    return n


def consume(rref: rrefrt.RRef) -> int:
    return 1


def owner_counts() -> dict:
    info = rrefrt.get_debug_info()
    return {k: info[k] for k in ("num_owner_rrefs", "num_forks", "num_pending_users", "num_pending_children", "num_confirmed_users")}


def when_owning_at_most(n: int, timeout: float) -> float:
    """The time.monotonic() (one clock for every process of this host) at which this worker
    first owned at most ``n`` RRefs, checked every millisecond for at most ``timeout``."""
    from tests.support import poll_for

    def seen() -> float:
        return time.monotonic() if int(rrefrt.get_debug_info()["num_owner_rrefs"]) <= n else 0.0

    return poll_for(seen, timeout, f"this worker owning at most {n} RRefs", interval=0.001)


def block_on_event(seconds: float) -> float:
    t0 = time.monotonic()
    threading.Event().wait(seconds)
    return time.monotonic() - t0


_calls = {"n": 0}


def count_call() -> int:
    """Counts its own executions: a duplicated or retried call must not run twice."""
    _calls["n"] += 1
    return _calls["n"]


def calls_made(reset: bool = False) -> int:
    n = _calls["n"]
    if reset:
        _calls["n"] = 0
    return n


def gc_collect() -> int:
    import gc

    return gc.collect()


# ---- futures and async_execution through proxies (H4); torch is imported only inside
def _torch_marked(fn: Any) -> Any:
    """What torch.distributed.rpc.functions.async_execution does: set torch's marker."""
    fn._wrapped_async_rpc_function = fn
    return fn


class AsyncExecutionClass:
    def __init__(self, base: int = 0) -> None:
        self.base = base

    @staticmethod
    @rrefrt.functions.async_execution
    def static_async_add(to: str, x: Any, y: Any, z: Any) -> rrefrt.Future:
        return rrefrt.rpc_async(to, add, args=(x, y)).then(lambda f: f.wait() + z)

    @classmethod
    @rrefrt.functions.async_execution
    def class_async_add(cls, to: str, x: Any, y: Any, z: Any) -> rrefrt.Future:
        out: rrefrt.Future = rrefrt.Future()
        rrefrt.rpc_async(to, add, args=(x, y)).then(lambda f: out.set_result(f.wait() + z))
        return out

    @rrefrt.functions.async_execution
    def bound_async_add(self, to: str, x: Any, y: Any, z: Any) -> rrefrt.Future:
        return rrefrt.rpc_async(to, add, args=(x, y)).then(lambda f: f.wait() + z + self.base)

    @rrefrt.functions.async_execution
    def wrong_type(self) -> Any:
        return 5

    @rrefrt.functions.async_execution
    def async_raise(self, to: str) -> rrefrt.Future:
        return rrefrt.rpc_async(to, raise_value_error, args=("Expected error",)).then(lambda f: f.wait())

    @_torch_marked
    def torch_future_add(self, to: str, x: Any, y: Any) -> Any:
        import torch

        out = torch.futures.Future()
        rrefrt.rpc_async(to, add, args=(x, y)).add_done_callback(lambda f: out.set_result(f.wait() + self.base))
        return out

    @_torch_marked
    def torch_marked_wrong_type(self) -> Any:
        return "not a future"

    def plain(self, x: Any) -> Any:
        return x + self.base

    def returns_future(self) -> Any:
        return rrefrt.Future()


@rrefrt.functions.async_execution
def async_wrong_type() -> Any:
    return 5


@rrefrt.functions.async_execution
def async_then_raises(to: str) -> rrefrt.Future:
    return rrefrt.rpc_async(to, add, args=(1, 1)).then(lambda f: {}["missing"])


@_torch_marked
def torch_marked_add(to: str, x: Any, y: Any) -> Any:
    import torch

    out = torch.futures.Future()
    rrefrt.rpc_async(to, add, args=(x, y)).then(lambda f: out.set_result(f.wait()))
    return out


def torch_wait_all_on_callee(to: str, n: int) -> list:
    """torch.futures.wait_all/collect_all over rrefrt futures inside a worker."""
    import torch

    futs = [rrefrt.rpc_async(to, add, args=(i, 1)) for i in range(n)]
    values = torch.futures.wait_all(futs)
    collected = torch.futures.collect_all([rrefrt.rpc_async(to, add, args=(i, 2)) for i in range(n)]).wait()
    return values + [f.wait() for f in collected]


def rref_confirmed(rref: rrefrt.RRef) -> bool:
    return rref.confirmed_by_owner()


def rref_confirmed_after_wait(rref: rrefrt.RRef) -> bool:
    """A fork received from a user is confirmed once its user waits for it:
    ``wait_received_confirmed`` registers a fork not yet registered (NOTE [Lazy
    registration]) and waits for the owner's ack, well within its deadline; after that
    ``confirmed_by_owner()`` is True."""
    from rrefrt.rref import wait_received_confirmed

    t0 = time.monotonic()
    confirmed = wait_received_confirmed([rref], t0 + 10)
    return confirmed and time.monotonic() - t0 < 5 and rref.confirmed_by_owner()


def rref_type_name(rref: rrefrt.RRef) -> str:
    return rref._get_type().__name__


def set_pool_cap(max_threads: int) -> int:
    """Test hook: lower this worker's user-pool cap (NOTE [Pool cap]); returns the old one."""
    pool = rrefrt.state.current().pool
    old, pool.max_threads = pool.max_threads, max_threads
    return old


def ping_pong(to: str, back: str, depth: int) -> Any:
    """Nested rpc_sync calls back and forth: each level holds one thread on each side.
    Returns the depth, or the text of the first error met (each level passes it up as a
    value: re-raising would nest each level's remote traceback into the next one's)."""
    if depth == 0:
        return 0
    try:
        below = rrefrt.rpc_sync(to, ping_pong, args=(back, to, depth - 1))
    except rrefrt.RpcError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return below if isinstance(below, str) else 1 + below


def pool_stats() -> dict:
    return rrefrt.state.current().pool.stats()


def membership() -> dict:
    """Who this worker considers dead (ranks) and whether it was told it is fenced."""
    from rrefrt import state

    rt = state.current()
    return {"dead": sorted(rt.transport.dead_peers()), "fenced": int(dict(rt.transport.stats).get("fenced", 0)) > 0}


def big_result(size: int, marker: str = "") -> bytes:
    """A result of ``size`` bytes; touches ``marker`` just before returning (the test may
    stop this worker while the result is on its way)."""
    data = bytes(size)
    if marker:
        with open(marker, "w"):
            pass
    return data



def fork_state_at_start(rref: rrefrt.RRef) -> tuple:
    """NOTE [Early run]: whether the received fork was confirmed when this function started
    (read from its record, not through confirmed_by_owner(), which would wait), then its
    value (a fetch of a fork the owner may not know yet)."""
    confirmed_at_start = rref._user_rec.confirmed
    return confirmed_at_start, rref.to_here()


def confirmed_then_value(rref: rrefrt.RRef) -> tuple:
    """confirmed_by_owner() of a received fork (waits for the owner's ack), then to_here();
    an error of the fetch is returned by name (the owner may die meanwhile)."""
    t0 = time.monotonic()
    confirmed = rref.confirmed_by_owner()
    try:
        value: Any = rref.to_here(timeout=10)
    except rrefrt.RpcError as e:
        value = type(e).__name__
    return confirmed, value, time.monotonic() - t0


# ---------------------------------------------------------------------------- lazy same-host connections
_arrivals: list[int] = []


def same_host_connections() -> list[int]:
    """The peers this worker has a same-host (unix) connection with now."""
    local = rrefrt.state.current().transport.local
    return sorted(local.connected_peers()) if local is not None else []


def stream_connections() -> list[int]:
    """The peers this worker has a tcp stream connection with now (transport/auto.py, Rule 8)."""
    stream = getattr(rrefrt.state.current().transport, "stream", None)
    return sorted(stream.connected_peers()) if stream is not None else []


def arrive(i: int) -> int:
    _arrivals.append(i)
    return i


def arrivals() -> list[int]:
    return list(_arrivals)


def burst_then_report(dest: str, n: int) -> dict:
    """``n`` one-way-ish calls to ``dest`` issued at once (the first finds no connection:
    all wait in its channel's queue), then what ``dest`` saw, in order."""
    futs = [rrefrt.rpc_async(dest, arrive, args=(i,)) for i in range(n)]
    got = [f.wait() for f in futs]
    return {"results": got, "seen": rrefrt.rpc_sync(dest, arrivals), "mine": same_host_connections()}


def creation_timers() -> int:
    """Timers of this worker's same-host transport that serve remote() creations (the
    owner's accept sweep and the creator's deadline sweep, NOTE [Deadline sweeps] in
    rrefrt/runtime/sweep.py)."""
    timers = rrefrt.state.current().transport.local._timers
    with timers._lock:
        fns = [entry[2] for entry in timers._heap]
    return sum("DeadlineSweep" in getattr(fn, "__qualname__", "") for fn in fns)
