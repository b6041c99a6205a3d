"""Calls between real worker processes: arguments, results, errors, timeouts, futures."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

import rrefrt
from tests.support import workerfns as fns

pytestmark = pytest.mark.timeout(120)

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]


def _tensor(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> list[int]:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).tolist() if t.numel() else []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_bit_exact(cluster, dtype):
    for shape in [(), (0,), (3, 0, 2), (5,), (4, 7)]:
        t = _tensor(dtype, shape)
        out = rrefrt.rpc_sync("w1", fns.identity, args=(t,))
        assert out.dtype == t.dtype and out.shape == t.shape
        assert _bits(out) == _bits(t)


def test_tensor_strides_and_views(cluster):
    base = torch.arange(4 * 6 * 5, dtype=torch.float64).reshape(4, 6, 5)
    cases = [base.transpose(0, 2), base[:, ::2, 1:], base[1], base.expand(2, 4, 6, 5)[1], base[2, 3, 4]]
    for t in cases:
        out = rrefrt.rpc_sync("w2", fns.identity, args=(t,))
        assert torch.equal(out, t) and out.shape == t.shape
    p = torch.nn.Parameter(torch.ones(3))
    out = rrefrt.rpc_sync("w1", fns.identity, args=(p,))
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad


@pytest.mark.parametrize("mb", [0, 1, 16, 64])
def test_large_tensors_bit_exact(cluster, mb):
    n = mb * (1 << 20) // 4
    t = torch.randn(n, generator=torch.Generator().manual_seed(mb))
    t0 = time.perf_counter()
    out = rrefrt.rpc_sync("w1", fns.identity, args=(t,))
    print(f"{mb} MB round trip: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert torch.equal(out, t)


def test_nested_containers_and_kwargs(cluster):
    t = torch.arange(6).reshape(2, 3)
    value = {"a": [1, (2.5, "x", None), {"t": t, 3: b"bytes"}], "b": {1, 2}, "c": (t[0], [t.T])}
    out = rrefrt.rpc_sync("w2", fns.identity, args=(value,))
    assert out["a"][0] == 1 and out["a"][1] == (2.5, "x", None) and out["b"] == {1, 2}
    assert torch.equal(out["a"][2]["t"], t) and out["a"][2][3] == b"bytes"
    assert torch.equal(out["c"][0], t[0]) and torch.equal(out["c"][1][0], t.T)
    args, kwargs = rrefrt.rpc_sync("w1", fns.echo_kwargs, args=(1, 2), kwargs={"k": [3], "t": t})
    assert args == (1, 2) and kwargs["k"] == [3] and torch.equal(kwargs["t"], t)


def test_torch_ops_and_builtins(cluster):
    assert torch.equal(rrefrt.rpc_sync("w1", torch.add, args=(torch.ones(2), 3)), torch.full((2,), 4.0))
    assert rrefrt.rpc_sync("w2", max, args=([3, 9, 1],)) == 9
    assert rrefrt.rpc_async("w1", fns.Counter.static_add, args=(2, 3)).wait() == 5


def test_a_torch_operator_whose_arguments_match_no_schema_raises_both_types(cluster):
    """torch raises RuntimeError with its phrase; the operator itself raised TypeError: both."""
    for call in (lambda: rrefrt.rpc_sync("w1", torch.add, args=()),
                 lambda: rrefrt.rpc_async("w2", torch.mm, args=(torch.ones(2),)).wait(),
                 lambda: rrefrt.remote("w1", torch.add, args=("x", None)).to_here()):
        with pytest.raises(rrefrt.OperatorSchemaError) as e:
            call()
        assert isinstance(e.value, TypeError) and isinstance(e.value, RuntimeError)
        text = str(e.value)
        assert text.startswith("Overloaded torch operator invoked from Python failed to match any schema: "), text
        assert "received an invalid combination of arguments" in text or "argument" in text, text
        assert e.value.remote_type == "builtins.TypeError" and e.value.worker in ("w1", "w2")
    with pytest.raises(TypeError) as e:  # a Python function's TypeError stays what it was
        rrefrt.rpc_sync("w1", fns.add, args=(1,))
    assert type(e.value) is TypeError


def test_targets_by_name_rank_and_workerinfo(cluster):
    info = rrefrt.get_worker_info("w2")
    assert info.name == "w2" and info.id == 2 and info == rrefrt.get_worker_info("w2")
    assert rrefrt.get_worker_info().name == "w0"
    assert rrefrt.rpc_sync(info, fns.worker_name) == "w2"
    assert rrefrt.rpc_sync(1, fns.worker_name) == "w1"
    assert rrefrt.get_rpc_timeout() == 30.0
    with pytest.raises(rrefrt.WorkerUnavailableError, match="nope"):
        rrefrt.rpc_sync("nope", fns.add, args=(1, 2))


def test_remote_exceptions_keep_their_type(cluster):
    with pytest.raises(ValueError, match="bad input") as e:
        rrefrt.rpc_sync("w1", fns.raise_value_error, args=("bad input",))
    assert "w1" in str(e.value) and "raise_value_error" in str(e.value)  # worker and traceback
    with pytest.raises(fns.UserDefinedError, match="custom failure"):
        rrefrt.rpc_async("w2", fns.raise_user_error).wait()
    with pytest.raises(fns.NeedsTwoArgs):  # cannot be rebuilt from a message: the original
        rrefrt.rpc_sync("w2", fns.raise_two_args)
    with pytest.raises(fns.UserDefinedError):
        rrefrt.remote("w1", fns.raise_user_error).to_here()
    # let through nested calls (w1 -> w2 -> w1 -> w2): the innermost text and traceback
    # once, the workers it passed named (NOTE [Errors over hops]); it used to double per hop
    with pytest.raises(fns.UserDefinedError) as e:
        rrefrt.rpc_sync("w1", fns.relay_error, args=(["w2", "w1", "w2"],))
    msg = str(e.value)
    assert msg.startswith("innermost failure (raised on worker 'w2'; passed on by 'w1' -> 'w2' -> 'w1')"), msg
    assert msg.count("Remote traceback:") == 1 and msg.count("UserDefinedError: innermost failure") == 1, msg


def test_unpicklable_rejected_before_sending(cluster):
    sent = rrefrt.get_debug_info()["agent.messages_sent"]
    with pytest.raises(rrefrt.SerializationError, match="lambda"):
        rrefrt.rpc_sync("w1", lambda: 1)

    def local_closure():
        return 2

    with pytest.raises(TypeError, match="local_closure"):
        rrefrt.rpc_async("w1", local_closure)
    with pytest.raises(rrefrt.SerializationError):
        rrefrt.rpc_sync("w1", fns.identity, args=(lambda: 3,))
    assert rrefrt.get_debug_info()["agent.messages_sent"] == sent


#: (to, func, args, kwargs, timeout) with one bad part, the error and a phrase naming it
BAD_CALLS = [
    ((None, fns.add, (1, 2), None, -1.0), rrefrt.WorkerUnavailableError, "'to' is None"),  # ran on the caller
    (("w1", 5, None, None, -1.0), rrefrt.ArgumentError, "func must be callable"),
    (("w1", fns.add, (1, 2), None, math.nan), rrefrt.ArgumentError, "timeout must be a finite number"),
    (("w1", fns.add, (1, 2), None, math.inf), rrefrt.ArgumentError, "timeout must be a finite number"),
    (("w1", fns.add, (1, 2), None, -math.inf), rrefrt.ArgumentError, "timeout must be a finite number"),
    (("w1", fns.add, (1, 2), None, "5"), rrefrt.ArgumentError, "timeout must be a number of seconds"),
    (("w1", fns.add, (1, 2), None, True), rrefrt.ArgumentError, "timeout must be a number of seconds"),
    (("w1", fns.identity, "ab", None, -1.0), rrefrt.ArgumentError, "args must be a tuple or list"),  # ran f('a', 'b')
    (("w1", fns.identity, 5, None, -1.0), rrefrt.ArgumentError, "args must be a tuple or list"),
    (("w1", fns.identity, {"x": 1}, None, -1.0), rrefrt.ArgumentError, "args must be a tuple or list"),
    (("w1", dict, None, [("a", 1)], -1.0), rrefrt.ArgumentError, "kwargs must be a dict"),
    (("w1", dict, None, {1: 2}, -1.0), rrefrt.ArgumentError, "kwargs must have str keys"),
]


@pytest.mark.parametrize("call", [rrefrt.rpc_sync, rrefrt.rpc_async, rrefrt.remote], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad, error, phrase", BAD_CALLS, ids=lambda x: repr(x)[:40])
def test_a_bad_call_argument_is_refused_before_anything_is_sent(cluster, call, bad, error, phrase):
    sent = rrefrt.get_debug_info()["agent.messages_sent"]
    with pytest.raises(error, match=phrase):
        call(*bad)
    assert rrefrt.get_debug_info()["agent.messages_sent"] == sent


def test_a_bad_timeout_of_an_rref_use_is_refused(cluster):
    remote_ref = rrefrt.remote("w1", fns.Counter, args=(1,))
    local_ref = rrefrt.RRef(fns.Counter(1))
    for rref in (remote_ref, local_ref):
        for use in (rref.to_here, rref.to_here_async, rref.rpc_sync, rref.rpc_async, rref.remote):
            with pytest.raises(rrefrt.ArgumentError, match="timeout must be a finite number"):
                use(math.nan)
    assert remote_ref.rpc_sync(timeout=5).increment() == 2 and local_ref.to_here(0).value == 1


@pytest.mark.parametrize("timeout", [0.3, 1.0])
def test_timeout_within_bound(cluster, timeout):
    t0 = time.monotonic()
    with pytest.raises(rrefrt.RpcTimeoutError) as e:
        # the handlers sleep 1.5 s past the timeout (enough to outlast it; longer kept the
        # module's shutdown waiting for them, ~3.5 s)
        rrefrt.rpc_sync("w1", fns.sleep_for, args=(timeout + 1.5,), timeout=timeout)
    took = time.monotonic() - t0
    print(f"timeout {timeout}s surfaced after {took:.3f}s (bound [{timeout}, {timeout + 0.5}])")
    assert isinstance(e.value, TimeoutError) and "w1" in str(e.value)
    assert timeout <= took <= timeout + 0.5
    fut = rrefrt.rpc_async("w2", fns.sleep_for, args=(timeout + 1.5,), timeout=timeout)
    with pytest.raises(rrefrt.RpcTimeoutError):
        fut.wait()


def test_call_to_self_and_nested_call_back_to_blocked_caller(cluster):
    assert rrefrt.rpc_sync("w0", fns.add, args=(1, 2)) == 3
    assert rrefrt.rpc_sync("w1", fns.call_back, args=("w0", 20, 22)) == 42
    assert rrefrt.rpc_sync("w1", fns.call_back, args=("w1", 1, 1)) == 2  # w1 calls itself


def test_many_concurrent_async_calls_among_three_workers(cluster):
    t0 = time.monotonic()
    futs = [rrefrt.rpc_async(f"w{1 + i % 2}", fns.add, args=(i, 1)) for i in range(1000)]
    futs += [rrefrt.rpc_async("w1", fns.fan_out, args=(["w0", "w2"], 500))]
    futs += [rrefrt.rpc_async("w2", fns.fan_out, args=(["w0", "w1"], 500))]
    values = rrefrt.futures.wait_all(futs)
    assert values[:1000] == [i + 1 for i in range(1000)]
    assert values[1000] == values[1001] == sum(i + 1 for i in range(500))
    print(f"2,000 concurrent calls in {time.monotonic() - t0:.2f}s")


def test_future_api(cluster):
    fut = rrefrt.rpc_async("w1", fns.add, args=(2, 3))
    chained = fut.then(lambda f: f.value() * 2)
    assert chained.wait() == 10 and fut.done() and fut.value() == 5
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.value()))
    assert seen == [5]
    bad = rrefrt.rpc_async("w1", fns.add, args=(2, 3)).then(lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    all_done = rrefrt.futures.collect_all([rrefrt.rpc_async("w2", fns.raise_user_error), rrefrt.rpc_async("w2", fns.add, args=(1, 1))])
    first, second = all_done.wait(10)
    assert isinstance(first.exception(), fns.UserDefinedError) and second.value() == 2
    with pytest.raises(fns.UserDefinedError):
        rrefrt.futures.wait_all([rrefrt.rpc_async("w2", fns.raise_user_error)])
    local = rrefrt.Future()
    local.set_result(7)
    assert local.wait() == 7


def test_async_execution_and_async_def(cluster):
    assert rrefrt.rpc_sync("w1", fns.async_exec_add, args=("w2", 1, 2)) == 30
    with pytest.raises(fns.UserDefinedError, match="set_exception"):
        rrefrt.rpc_sync("w2", fns.async_exec_fail)
    assert rrefrt.rpc_sync("w2", fns.async_add, args=(4, 5)) == 9


@pytest.mark.asyncio
async def test_await_futures_without_blocking_the_loop(cluster):
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    start_ticks = ticks
    slow = await rrefrt.rpc_async("w1", fns.sleep_for, args=(0.5,))
    fast = await asyncio.gather(*(rrefrt.rpc_async("w2", fns.add, args=(i, i)) for i in range(50)))
    rref = rrefrt.remote("w1", fns.identity, args=(41,))
    value = await rref.to_here_async()
    stop.set()
    await task
    assert slow == 0.5 and fast == [2 * i for i in range(50)] and value == 41
    assert ticks - start_ticks >= 20, f"the loop was blocked: only {ticks - start_ticks} ticks in 0.5 s"


def test_debug_info_counters(cluster):
    info = rrefrt.get_debug_info()
    for key in ("num_owner_rrefs", "num_forks", "num_pending_users", "num_pending_children", "num_confirmed_users",
                "agent.messages_sent", "agent.messages_received", "agent.bytes_sent", "agent.bad_frames_dropped",
                "agent.pending_futures.w1"):
        assert isinstance(info[key], int), key
    assert info["agent.messages_sent"] > 0
