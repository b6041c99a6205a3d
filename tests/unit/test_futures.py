"""rrefrt.Future without processes: torch.futures interop, torch's semantics and error
types, the stdlib contract, lazy results, and ``import rrefrt`` staying free of torch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import gc
import subprocess
import sys
import threading
import weakref

import pytest

import rrefrt
from rrefrt import functions
from rrefrt.futures import Future, FutureAlreadyCompletedError, FutureCallbackError
from rrefrt.pool import WorkerPool
from tests.support import env_for

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(60)


class UserError(Exception):
    def __init__(self, a: str, b: int) -> None:
        super().__init__(a)
        self.b = b


def done_with(value=None, exc=None) -> Future:
    f: Future = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(value)
    return f


# ---------------------------------------------------------------- import and types
def test_import_rrefrt_does_not_import_torch():
    code = "import rrefrt, sys; f = rrefrt.Future(); print('torch' in sys.modules, type(f).__mro__[1].__module__)"
    out = subprocess.run([sys.executable, "-c", code], env=env_for(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "concurrent.futures._base"]


def test_future_is_a_torch_future_once_torch_is_imported():
    f = Future()
    assert isinstance(f, torch.futures.Future) and isinstance(f, torch._C.Future)
    assert isinstance(f, rrefrt.Future) and isinstance(f, concurrent.futures.Future)
    assert type(f).__name__ == "_TorchFuture" and type(f) is type(Future())  # one class, built once
    assert isinstance(f.then(lambda x: 1), torch.futures.Future)


def test_subclasses_of_rrefrt_future_stay_plain():
    class Mine(Future):
        pass

    m = Mine()
    m.set_result(3)
    assert type(m) is Mine and m.wait() == 3 and not isinstance(m, torch._C.Future)


# ---------------------------------------------------------------- torch.futures interop
def test_torch_wait_all_and_collect_all_accept_rrefrt_futures():
    a, b = Future(), Future()
    collected = torch.futures.collect_all([a, b])
    assert not collected.done()
    a.set_result(1)
    t = threading.Thread(target=b.set_result, args=(torch.ones(2),))
    t.start()
    t.join(10)
    got = collected.wait()
    assert [f.wait() for f in got][0] == 1
    assert torch.equal(torch.futures.wait_all([a, b])[1], torch.ones(2))


def test_torch_wait_all_raises_the_error_of_a_failed_rrefrt_future():
    ok, bad = done_with(1), done_with(exc=ValueError("Expected error"))
    with pytest.raises(ValueError, match="Expected error"):
        torch.futures.wait_all([ok, bad])
    with pytest.raises(ValueError, match="Expected error"):  # and again: the same error
        torch.futures.wait_all([ok, bad])
    assert bad.exception().args == ("Expected error",)  # the stored error did not change


def test_torch_collect_all_of_futures_completed_lazily_and_on_a_callback_pool():
    pool = WorkerPool("test-callbacks", 2)
    try:
        futs = []
        for i in range(20):
            f: Future = Future()
            f._callback_pool = pool
            futs.append(f)
        collected = torch.futures.collect_all(futs)
        for i, f in enumerate(futs):
            f._complete_lazy(lambda i=i: i * 10)
        assert [x.wait() for x in collected.wait()] == [i * 10 for i in range(20)]
        failed: Future = Future()
        failed._callback_pool = pool

        def boom():
            raise KeyError("remote")

        failed._complete_lazy(boom)
        with pytest.raises(KeyError):
            torch.futures.wait_all([failed])
    finally:
        pool.stop()


def test_torch_then_on_collect_all_does_not_run_on_the_completing_io_thread():
    pool = WorkerPool("test-callbacks", 2)
    try:
        f: Future = Future()
        f._callback_pool = pool
        ran_on = []
        chained = torch.futures.collect_all([f]).then(lambda _: ran_on.append(threading.current_thread().name))
        io = threading.Thread(target=f._complete_lazy, args=(lambda: 5,), name="fake-io-thread")
        io.start()
        io.join(10)
        chained.wait()
        assert ran_on and ran_on[0].startswith("test-callbacks")
    finally:
        pool.stop()


def test_async_execution_accepts_torch_and_rrefrt_futures_and_rejects_others():
    @functions.async_execution
    def returns(x):
        return x

    assert returns(Future()) is not None and returns(torch.futures.Future()) is not None
    assert returns(concurrent.futures.Future()) is not None
    with pytest.raises(RuntimeError, match=r"Functions decorated with @rpc\.async_function must return a torch\.futures\.Future object,") as ei:
        returns(torch.zeros(2))
    assert isinstance(ei.value, rrefrt.RpcError) and isinstance(ei.value, TypeError)

    def torch_marked():
        return 1

    torch_marked._wrapped_async_rpc_function = torch_marked
    assert functions.is_async_execution(torch_marked) and functions.is_async_execution(returns)
    assert not functions.is_async_execution(len)


def test_when_future_done_settles_every_kind_of_future():
    results = []

    def done(value, exc):
        results.append((value, type(exc).__name__ if exc else None))

    for make in (Future, concurrent.futures.Future, torch.futures.Future):
        f = make()
        functions.when_future_done(f, make, done)
        f.set_result(7)
    failing = torch.futures.Future()
    functions.when_future_done(failing, None, done)
    failing.set_exception(ValueError("x"))
    functions.when_future_done(42, len, done)
    assert results[:3] == [(7, None)] * 3
    assert results[3] == (None, "ValueError")
    assert results[4] == (None, "AsyncExecutionTypeError")


# ---------------------------------------------------------------- torch's semantics
@pytest.mark.parametrize("bad", [None, 1, "callback"])
def test_then_and_add_done_callback_reject_non_callables_at_once(bad):
    f = Future()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        f.then(bad)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        f.add_done_callback(bad)
    f.set_result(1)  # nothing was registered
    assert f.wait() == 1


def test_error_in_then_callback_is_a_runtime_error_and_keeps_its_type():
    f = done_with(1)
    derived = f.then(lambda x: x + 1)  # x is the Future: TypeError
    with pytest.raises(RuntimeError, match=r"unsupported operand type\(s\) for \+") as ei:
        derived.wait()
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, FutureCallbackError)
    assert "Got the following error when running the callback: TypeError" in str(ei.value)
    assert isinstance(ei.value.__cause__, TypeError)

    def my_function(a, b, c):
        return a

    with pytest.raises(RuntimeError, match=r"my_function\(\) missing 2 required positional arguments"):
        f.then(my_function).wait()


def test_error_from_a_failed_source_future_inside_then():
    src = done_with(exc=UserError("remote says no", 3))
    derived = src.then(lambda s: s.wait())
    with pytest.raises(UserError) as ei:
        derived.wait()
    assert isinstance(ei.value, RuntimeError) and ei.value.b == 3 and "remote says no" in str(ei.value)
    assert src.exception().args == ("remote says no",)  # the source's error is untouched


def test_runtime_errors_in_then_keep_their_own_type():
    def cb(_):
        raise rrefrt.RpcTimeoutError("nested call timed out")

    with pytest.raises(rrefrt.RpcTimeoutError, match="nested call timed out"):
        done_with(1).then(cb).wait()

    def cb2(_):
        raise RuntimeError("Another expected error")

    with pytest.raises(RuntimeError, match="Another expected error"):
        done_with(1).then(cb2).wait()


def test_an_error_type_that_cannot_be_combined_is_still_a_runtime_error():
    def cb(_):
        raise OSError("disk")

    with pytest.raises(RuntimeError, match="OSError: disk") as ei:
        done_with(1).then(cb).wait()
    assert isinstance(ei.value, FutureCallbackError) and isinstance(ei.value.__cause__, OSError)


def test_callback_errors_survive_pickling_with_both_types():
    err = done_with(1).then(lambda _: {}["missing"]).exception()
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, KeyError) and isinstance(back, RuntimeError) and "missing" in str(back)


@pytest.mark.parametrize("second", ["set_result", "set_exception"])
def test_marking_a_future_twice_raises_torchs_error(second):
    f = done_with(1)
    arg = 2 if second == "set_result" else ValueError("late")
    with pytest.raises(RuntimeError, match="Future can only be marked completed once") as ei:
        getattr(f, second)(arg)
    assert isinstance(ei.value, concurrent.futures.InvalidStateError)  # the stdlib's type too
    assert isinstance(ei.value, FutureAlreadyCompletedError) and f.wait() == 1


def test_set_exception_requires_an_exception():
    with pytest.raises(AssertionError, match="not an Exception"):
        Future().set_exception("not an error")


def test_waiting_twice_returns_the_same_value_or_raises_the_same_error():
    value = object()
    f = done_with(value)
    assert f.wait() is value and f.wait() is value and f.value() is value
    lazy: Future = Future()
    calls = []

    def decode():
        calls.append(1)
        raise ValueError("Expected error")

    lazy._complete_lazy(decode)
    for _ in range(3):
        with pytest.raises(ValueError, match="Expected error"):
            lazy.wait()
    assert calls == [1] and lazy.done()


def test_value_of_a_pending_future_raises_instead_of_blocking():
    with pytest.raises(RuntimeError, match="not completed yet"):
        Future().value()


def test_add_done_callback_runs_inline_when_done_and_gets_the_future_itself():
    f = Future()
    seen = []
    f.add_done_callback(lambda x: seen.append(x is f))
    f.set_result(0)
    f.add_done_callback(lambda x: seen.append(x.value()))
    assert seen == [True, 0]


def test_add_done_callback_errors_are_logged_not_raised(caplog):
    f = Future()

    def cb(_):
        raise ValueError("in callback")

    f.add_done_callback(cb)
    f.set_result(1)  # does not raise
    assert f.wait() == 1 and "in callback" in caplog.text


def test_then_chain_and_callbacks_on_already_done_futures():
    f = Future()
    chained = f
    for _ in range(20):
        chained = chained.then(lambda x: x.wait() + 1)
    f.set_result(0)
    assert chained.wait(5) == 20
    assert done_with(2).then(lambda x: x.value() * 3).wait() == 6


def _chain_of_then(first: Future, n: int, ran: list) -> Future:
    chained = first
    for i in range(n):
        chained = chained.then(lambda x, i=i: (ran.append(i), x.wait() + 1)[1])
    return chained


@pytest.mark.parametrize("kind", ["torch", "plain"])
@pytest.mark.parametrize("how", ["set_result", "pool"])
def test_a_chain_of_2000_then_on_a_pending_future_completes_in_order(kind, how, caplog):
    # torch completes such a chain at once, each callback once, in order (NOTE [Callback chains])
    first: Future = Future() if kind == "torch" else _PlainFuture()
    pool = WorkerPool("test-chain", 1) if how == "pool" else None
    try:
        if pool is not None:
            first._callback_pool = pool
        ran: list = []
        last = _chain_of_then(first, 2000, ran)
        if pool is None:
            first.set_result(0)
        else:
            first._complete_lazy(lambda: 0)
        assert last.wait(10) == 2000
        assert ran == list(range(2000))
        assert "RecursionError" not in caplog.text
    finally:
        if pool is not None:
            pool.stop()


def test_a_failed_source_fails_a_2000_long_then_chain_to_its_end():
    first: Future = Future()
    ran: list = []
    last = _chain_of_then(first, 2000, ran)
    first.set_exception(KeyError("source"))
    with pytest.raises(KeyError, match="source"):
        last.wait(10)
    assert ran == list(range(2000))


def test_a_chain_of_callbacks_each_completing_the_next_future_completes():
    futs = [Future() for _ in range(3000)]
    for a, b in zip(futs, futs[1:]):
        a.add_done_callback(lambda f, b=b: b.set_result(f.wait() + 1))
    futs[0].set_result(0)
    assert futs[-1].wait(10) == 2999


def test_a_callback_that_completes_another_future_sees_its_callbacks_run():
    # shallow nesting stays inline, as in torch: set_result returns after the callbacks ran
    other: Future = Future()
    seen: list = []
    other.add_done_callback(lambda f: seen.append("other's callback"))
    first: Future = Future()

    def complete_other(f: Future) -> None:
        other.set_result(1)
        seen.append("after set_result")

    first.add_done_callback(complete_other)
    first.set_result(0)
    assert seen == ["other's callback", "after set_result"]


def test_futures_cannot_be_pickled_with_torchs_phrase():
    with pytest.raises(RuntimeError, match="Can not pickle torch.futures.Future"):
        pickle.dumps(Future())


# ---------------------------------------------------------------- stdlib and asyncio
def test_stdlib_contract_wait_and_as_completed():
    a, b = Future(), Future()
    b.set_result(2)
    done, pending = concurrent.futures.wait([a, b], timeout=0.1)
    assert done == {b} and pending == {a}
    a.set_exception(ValueError("a"))
    assert [f is a or f is b for f in concurrent.futures.as_completed([a, b], timeout=1)] == [True, True]
    assert isinstance(a.exception(), ValueError)
    with pytest.raises(concurrent.futures.TimeoutError):
        Future().result(timeout=0.01)


def test_await_a_future_and_an_error():
    async def main():
        f, g = Future(), Future()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, f.set_result, 5)
        loop.call_later(0.01, g.set_exception, ValueError("g"))
        v = await f
        with pytest.raises(ValueError):
            await g
        return v

    assert asyncio.run(main()) == 5


def test_rrefrt_wait_all_and_collect_all_take_torch_futures_too():
    t = torch.futures.Future()
    t.set_result(3)
    assert rrefrt.futures.wait_all([done_with(1), t]) == [1, 3]
    collected = rrefrt.futures.collect_all([t, done_with(exc=ValueError("x"))])
    first, second = collected.wait(1)
    assert first.wait() == 3 and isinstance(second.exception(), ValueError)


def test_a_failed_torch_side_future_does_not_keep_itself_alive():
    """The C++ side holds its error where gc cannot see it; if that were the stored error,
    whose traceback holds a frame holding the future, the future (and the RRefs in it)
    would never be freed."""
    import gc
    import weakref

    def fail_and_wait():
        f = Future()
        f.set_exception(ValueError("x"))
        try:
            f.wait()  # the stored error's traceback now holds this frame, which holds f
        except ValueError:
            pass
        return weakref.ref(f)

    ref = fail_and_wait()
    gc.collect()
    assert ref() is None


def test_collect_all_and_then_leave_no_cycle_through_the_torch_side():
    import gc
    import weakref

    def chain():
        a, b = Future(), Future()
        out = rrefrt.futures.collect_all([a, b])  # out's value is [a, b]; a and b held out
        derived = a.then(lambda f: f)  # derived's value is a itself
        a.set_result(1)
        b.set_result(2)
        assert out.wait(1) == [a, b] and derived.wait(1) is a
        return weakref.ref(a), weakref.ref(out), weakref.ref(derived)

    refs = chain()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


# ---------------------------------------------------------------- no cycle through a raised error
def _remote_error() -> None:
    raise ValueError("raised when the payload is decoded (a remote error)")


class _PlainFuture(Future):
    """A user subclass stays plain: no torch side, so its first reader decodes."""


@pytest.mark.parametrize("read", ["wait", "result", "value", "exception"])
@pytest.mark.parametrize("how", ["torch-side-decodes", "reader-decodes", "failed"])
def test_a_failed_future_is_freed_without_gc_after_its_error_was_raised(read, how):
    """NOTE [No cycle through a raised error]: reading a failed future must not leave a
    frame holding it in the stored error's traceback (a cycle only gc frees; an RRef in
    the caller's frames then outlives ``del``)."""
    gc.collect()
    gc.disable()
    try:
        if how == "torch-side-decodes":  # no callback pool: _mark_torch runs inline, decodes
            fut: Future = Future()
            fut._complete_lazy(_remote_error)
            assert torch._C.Future.done(fut)
        elif how == "reader-decodes":
            fut = _PlainFuture()
            fut._complete_lazy(_remote_error)
        else:
            fut = Future()
            fut._fail(ValueError("stored"))
        for _ in range(2):  # twice: the second read raises the same stored error again
            try:
                got = getattr(fut, read)()
            except ValueError:
                pass
            else:
                assert read == "exception" and isinstance(got, ValueError)
                del got
        probe = weakref.ref(fut)
        del fut
        assert probe() is None, gc.get_referrers(probe())
    finally:
        gc.enable()


def test_the_torch_side_of_a_runtime_completed_future_is_completed_only_when_torch_asks():
    """NOTE [torch interop]: an RPC future read only through wait() costs no callback-pool
    task; torch's readers (wait_all, collect_all, torch.jit.wait) still see it complete."""
    pool = WorkerPool("test-callbacks", 2)
    try:
        futs = []
        for i in range(3):
            f: Future = Future()
            f._callback_pool = pool
            f._complete_lazy(lambda i=i: i + 10)
            futs.append(f)
        assert futs[0].wait() == 10
        assert not any(torch._C.Future.done(f) for f in futs)  # nothing on torch's side yet
        assert pool.stats()["wakes"] == 0 and pool.stats()["threads"] == 0  # and no task for it
        assert torch.futures.wait_all(futs[:2]) == [10, 11]
        # (torch.jit.wait, deprecated, holds the GIL while it blocks: only on a done future)
        assert torch._C.Future.done(futs[1]) and torch._C.wait(futs[2]) == 12  # torch.jit.wait
        late: Future = Future()
        late._callback_pool = pool
        collected = torch.futures.collect_all([late])  # asked before it completes
        late._complete_lazy(lambda: "late")
        assert collected.wait()[0].wait() == "late" and torch._C.Future.done(late)
    finally:
        pool.stop()


# ---------------------------------------------------------------- NOTE [Lazy condition]
def test_a_future_read_when_done_never_builds_its_condition_and_waiters_still_wake():
    """The Condition is built only for a thread that waits: a future completed by the
    runtime and read after its completion (rpc_async's usual life) costs none. Waiters that
    race with the completion - blocked ones, ones arriving while it completes, stdlib wait()
    - are all woken, whatever the interleaving (many rounds, several threads each)."""
    f = Future()
    f._callback_pool = WorkerPool("test-cb", 1)  # as the runtime's futures (no inline torch side)
    try:
        f._complete_lazy(lambda a, b: a + b, 2, 3)
        assert f.done() and f.result() == 5 and f.wait() == 5 and f.exception() is None
        assert f._cond is None
    finally:
        f._callback_pool.stop()  # type: ignore[union-attr]

    for _ in range(200):
        g: Future = Future()
        got: list = []
        start = threading.Barrier(4)

        def reader() -> None:
            start.wait(5)
            got.append(g.result(timeout=10))

        def stdlib_waiter() -> None:
            start.wait(5)
            done, _ = concurrent.futures.wait([g], timeout=10)
            got.append(g.result(0) if g in done else "not woken")

        threads = [threading.Thread(target=reader), threading.Thread(target=reader), threading.Thread(target=stdlib_waiter)]
        for t in threads:
            t.start()
        start.wait(5)
        g._finish(7, None)
        for t in threads:
            t.join(15)
        assert got == [7, 7, 7]


def test_racing_readers_of_a_lazily_failing_future_all_raise_its_error():
    """The lock-free read of a finished future reads ``_result`` before ``_exception`` and the
    decode writes them the other way round: a reader racing the decoding thread never takes
    the failed future for one that returned None."""
    for _ in range(100):
        f: Future = Future()
        f._callback_pool = object()  # never used: no callbacks, torch side not wanted
        outcomes: list = []
        start = threading.Barrier(4)

        def decode() -> None:
            raise ValueError("bad payload")

        def read() -> None:
            start.wait(5)
            try:
                outcomes.append(("value", f.result(0)))
            except ValueError as e:
                outcomes.append(("error", str(e)))

        f._complete_lazy(decode)
        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert outcomes == [("error", "bad payload")] * 4


def test_cancel_and_callbacks_keep_the_stdlib_contract_without_an_eager_condition():
    f: Future = Future()
    seen: list = []
    f.add_done_callback(lambda fut: seen.append(("before", fut.cancelled())))
    assert f.cancel() and f.cancelled() and f.done()
    f.add_done_callback(lambda fut: seen.append(("after", fut.cancelled())))  # inline once done
    assert seen == [("before", True), ("after", True)]
    with pytest.raises(concurrent.futures.CancelledError):
        f.result(0)
    f._finish(1, None)  # the runtime's completion of a cancelled future is a no-op
    assert f.cancelled()
    with pytest.raises(FutureAlreadyCompletedError):
        f.set_result(2)
