"""Futures and RRef details across three real worker processes: torch.futures over RPC
futures, @async_execution through RRef proxies, torch's error types and phrases, and
RRef._get_type/_get_future."""

from __future__ import annotations

import gc
import pickle

import pytest

import rrefrt
from tests.support import workerfns as fns
from tests.support import poll_for

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

TORCH_ASYNC_PHRASE = r"Functions decorated with @rpc\.async_function must return a torch\.futures\.Future object,"


def run_in_mode(to, fn, mode, args=()):
    if mode == "sync":
        return rrefrt.rpc_sync(to, fn, args=args)
    if mode == "async":
        return rrefrt.rpc_async(to, fn, args=args).wait()
    return rrefrt.remote(to, fn, args=args).to_here()


# ---------------------------------------------------------------- torch.futures over RPC
def test_torch_wait_all_and_collect_all_over_rpc_futures(cluster):
    futs = [rrefrt.rpc_async("w1", torch.add, args=(torch.ones(2, 2), i)) for i in range(10)]
    values = torch.futures.wait_all(futs)
    assert all(torch.equal(v, torch.ones(2, 2) + i) for i, v in enumerate(values))
    collected = torch.futures.collect_all([rrefrt.rpc_async("w2", fns.add, args=(i, i)) for i in range(5)]).wait()
    assert [f.wait() for f in collected] == [0, 2, 4, 6, 8]
    chained = torch.futures.collect_all([rrefrt.rpc_async("w1", fns.add, args=(1, 2))]).then(lambda f: f.wait()[0].wait() * 2)
    assert chained.wait() == 6


def test_torch_wait_all_raises_the_remote_error(cluster):
    futs = [rrefrt.rpc_async("w1", fns.add, args=(1, 1)) for _ in range(5)]
    futs.append(rrefrt.rpc_async("w1", fns.raise_value_error, args=("Expected error",)))
    with pytest.raises(ValueError, match="Expected error"):
        torch.futures.wait_all(futs)


def test_torch_wait_all_on_a_callee(cluster):
    assert rrefrt.rpc_sync("w1", fns.torch_wait_all_on_callee, args=("w2", 4)) == [1, 2, 3, 4, 2, 3, 4, 5]


def test_rpc_future_semantics_like_torch(cluster):
    fut = rrefrt.rpc_async("w1", fns.add, args=(1, 1))
    assert fut.wait() == 2 and fut.wait() == 2
    with pytest.raises(RuntimeError, match="Future can only be marked completed once"):
        fut.set_result(1)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        rrefrt.rpc_async("w1", fns.add, args=(1, 1)).then(None)
    failed = rrefrt.rpc_async("w1", fns.raise_value_error, args=("Expected error",))
    for _ in range(2):
        with pytest.raises(ValueError, match="Expected error"):
            failed.wait()
    wrong = rrefrt.rpc_async("w1", fns.add, args=(1, 1)).then(lambda x: x + 1)
    with pytest.raises(RuntimeError, match=r"unsupported operand type\(s\) for \+"):
        wrong.wait()


def test_error_in_a_then_callback_on_the_callee_keeps_both_types(cluster):
    with pytest.raises(KeyError) as ei:
        rrefrt.rpc_sync("w1", fns.async_then_raises, args=("w2",))
    assert isinstance(ei.value, RuntimeError) and "missing" in str(ei.value)


# ---------------------------------------------------------------- @async_execution
@pytest.mark.parametrize("mode", ["sync", "async", "remote"])
def test_async_execution_wrong_return_type_gives_torchs_error(cluster, mode):
    with pytest.raises(RuntimeError, match=TORCH_ASYNC_PHRASE):
        run_in_mode("w1", fns.async_wrong_type, mode)


@pytest.mark.parametrize("mode", ["sync", "async", "remote"])
def test_async_execution_methods_through_rref_proxies(cluster, mode):
    rref = rrefrt.remote("w1", fns.AsyncExecutionClass, args=(100,))
    x, y = torch.ones(2, 2), torch.ones(2, 2) + 1
    names = ("static_async_add", "class_async_add", "bound_async_add")
    if mode == "sync":
        got = [getattr(rref.rpc_sync(), n)("w2", x, x, y) for n in names]
    elif mode == "async":
        got = [getattr(rref.rpc_async(), n)("w2", x, x, y).wait() for n in names]
    else:
        got = [getattr(rref.remote(), n)("w2", x, x, y).to_here() for n in names]
    assert torch.equal(got[0], 4 * x) and torch.equal(got[1], 4 * x) and torch.equal(got[2], 4 * x + 100)
    del rref


@pytest.mark.parametrize("how", ["rpc_sync", "rpc_async", "remote"])
def test_proxy_errors_wrong_type_raise_and_torch_futures(cluster, how):
    rref = rrefrt.remote("w1", fns.AsyncExecutionClass, args=(10,))

    def call(name, *args):
        r = getattr(getattr(rref, how)(), name)(*args)
        if how == "rpc_async":
            return r.wait()
        if how == "remote":
            return r.to_here()
        return r

    with pytest.raises(RuntimeError, match=TORCH_ASYNC_PHRASE):
        call("wrong_type")
    with pytest.raises(RuntimeError, match=TORCH_ASYNC_PHRASE):
        call("torch_marked_wrong_type")
    with pytest.raises(ValueError, match="Expected error"):
        call("async_raise", "w2")
    assert call("torch_future_add", "w2", 1, 2) == 13
    assert call("plain", 5) == 15
    with pytest.raises(RuntimeError, match="Can not pickle torch.futures.Future"):
        call("returns_future")
    del rref


def test_proxy_to_a_method_that_does_not_exist_raises_attribute_error(cluster):
    rref = rrefrt.remote("w2", fns.add, args=(torch.ones(2, 2), 1))
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.rpc_sync().non_exist()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.rpc_async().non_exist().wait()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        rref.remote().non_exist()  # at once: remote() checks the type first
    assert torch.equal(rref.remote().view(1, 4).to_here(), (torch.ones(2, 2) + 1).view(1, 4))
    local = rrefrt.RRef(fns.Counter(1))
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        local.remote().non_exist()
    assert local.remote().increment(2).to_here() == 3


# ---------------------------------------------------------------- RRef details
def test_local_value_on_a_user_and_pickling_an_rref_raise_like_torch(cluster):
    rref = rrefrt.remote("w1", fns.add, args=(1, 1))
    with pytest.raises(RuntimeError, match=r"can't call localValue\(\) on user WorkerInfo\(id=0, name=w0\)\. Call it on owner WorkerInfo\(id=1, name=w1\)"):
        rref.local_value()
    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
        pickle.dumps(rrefrt.RRef(35))


def test_get_type_cached_and_non_blocking(cluster):
    rref = rrefrt.remote("w1", fns.Counter, args=(0,))
    assert rref._get_type() is fns.Counter
    fut = rref._get_type(blocking=False)
    assert fut is rref._get_type(blocking=False) and fut.wait() is fns.Counter
    assert rrefrt.RRef(torch.ones(2))._get_type() is torch.Tensor
    assert rrefrt.RRef(5)._get_type(blocking=False).wait() is int
    assert rrefrt.rpc_sync("w2", fns.rref_type_name, args=(rref,)) == "Counter"
    failed = rrefrt.remote("w1", fns.raise_value_error, args=("Expected error",))
    with pytest.raises(ValueError, match="Expected error"):
        failed._get_type(blocking=False).wait()
    with pytest.raises(ValueError, match="Expected error"):
        failed._get_type()


def test_get_future_completes_with_the_creation(cluster):
    rref = rrefrt.remote("w1", fns.sleep_for, args=(0.2,))
    fut = rref._get_future()
    assert isinstance(fut, torch._C.Future) and fut is rref._get_future()
    assert fut.wait() is None and rref.to_here() == 0.2
    assert rref._get_profiling_future().wait() is None
    slow = rrefrt.remote("w1", fns.sleep_for, args=(2.0,), timeout=0.2)
    with pytest.raises(rrefrt.RpcTimeoutError):
        slow._get_future().wait()
    assert rrefrt.RRef(1)._get_future().wait() is None
    failed = rrefrt.remote("w2", fns.raise_value_error, args=("Expected error",))
    with pytest.raises(ValueError, match="Expected error"):
        failed._get_future().wait()
    del rref, slow, failed
    gc.collect()


def test_a_late_creation_fails_the_rref_for_good(cluster):
    late = rrefrt.remote("w1", fns.sleep_for, args=(1.0,), timeout=0.2)
    with pytest.raises(rrefrt.RpcTimeoutError):
        late._get_future().wait()
    poll_for(late.confirmed_by_owner, 10, "the creation finishes on the owner")
    with pytest.raises(RuntimeError, match="RRef creation timed out"):  # torch's phrase
        late.to_here()
    del late
    gc.collect()
    poll_for(lambda: rrefrt.rpc_sync("w1", fns.owner_counts)["num_owner_rrefs"] == 0, 10, "the late value is freed")


def test_rref_received_from_a_user_can_wait_until_confirmed(cluster):
    rref = rrefrt.remote("w2", fns.add, args=(torch.zeros(2, 2), 1))  # w0 holds a user of w2's value
    assert rrefrt.rpc_sync("w1", fns.rref_confirmed_after_wait, args=(rref,)) is True


@pytest.mark.parametrize("mode", ["sync", "remote"])
def test_user_rrefs_confirmed_when_the_function_runs(cluster, mode):
    rref = rrefrt.remote("w2", fns.add, args=(torch.zeros(2, 2), 1))
    assert run_in_mode("w1", fns.rref_confirmed, mode, args=(rref,)) is True


def test_function_with_torchs_async_execution_marker(cluster):
    assert rrefrt.rpc_sync("w1", fns.torch_marked_add, args=("w2", 1, 2)) == 3


# ---------------------------------------------------------------- the pool cap
def test_nested_calls_past_the_pool_cap_fail_with_a_typed_error(cluster):
    olds = [rrefrt.rpc_sync(w, fns.set_pool_cap, args=(20,)) for w in ("w1", "w2")]
    try:
        assert rrefrt.rpc_sync("w1", fns.ping_pong, args=("w2", "w1", 10)) == 10  # within the cap
        refused = rrefrt.rpc_sync("w1", fns.ping_pong, args=("w2", "w1", 200), timeout=60)
        assert isinstance(refused, str) and refused.startswith("PoolExhaustedError") and "exhausted" in refused
        for w in ("w1", "w2"):
            assert rrefrt.rpc_sync(w, fns.pool_stats)["peak_threads"] <= 20
        assert rrefrt.rpc_sync("w1", fns.ping_pong, args=("w2", "w1", 10)) == 10  # and it recovers
    finally:
        for w, old in zip(("w1", "w2"), olds):
            rrefrt.rpc_sync(w, fns.set_pool_cap, args=(old,))
