"""Distributed autograd, DistributedOptimizer and RemoteModule over real worker processes.

Every gradient test builds the same model twice: split over w0 (this process), w1 and w2,
and whole on this process; the gradients must agree to floating tolerance (float64).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import rrefrt
import rrefrt.autograd as dist_autograd
from tests.support import autograd_fns as fns
from tests.support import ROOT, Workers, env_for, free_port, poll_for

pytestmark = pytest.mark.timeout(120)

Layer = fns.Layer


def _x(seed: int = 0, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64).requires_grad_(True)


def _fwd(rref: rrefrt.RRef, x: torch.Tensor) -> torch.Tensor:
    return fns.remote_method(Layer.forward, rref, x)


def _remote_grads(rref: rrefrt.RRef, cid: int) -> list[torch.Tensor]:
    return rrefrt.rpc_sync(rref.owner(), fns.param_grads, args=(rref, cid))


def _assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is not None, "no gradient recorded"
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def _no_contexts_anywhere() -> None:
    assert dist_autograd.current_context_id() is None
    for w in ("w0", "w1", "w2"):
        poll_for(lambda w=w: rrefrt.rpc_sync(w, fns.context_ids) == [], 10, f"contexts released on {w}")


# ------------------------------------------------------------------ examples
# (first in the file: they load the machine, so they run before the shared cluster starts)
def _run_example(script: str, nproc: int, backend: str, steps: int) -> str:
    """Run an example as users do: rrefrt through the launcher; torch by hand (its own
    store binds MASTER_PORT, which the launcher's store already holds)."""
    args = [str(ROOT / "examples" / script), "--steps", str(steps), "--backend", backend]
    if backend == "rrefrt":
        proc = subprocess.run(
            [sys.executable, "-m", "rrefrt.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args],
            cwd=ROOT, env=env_for(), capture_output=True, text=True, timeout=100,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout
    port = free_port()
    procs = Workers()
    try:
        for rank in range(nproc):
            procs.procs.append(subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=env_for({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(nproc)}),
                start_new_session=True,
            ))
        outs = procs.wait_all(100)
    finally:
        procs.kill_all()
    assert all(code == 0 for code, _ in outs), outs
    return outs[0][1]


def _losses(out: str) -> list[str]:
    return [ln.split("loss ")[-1] for ln in out.splitlines() if "step " in ln and "loss" in ln]


#: the output of each example's run on rrefrt (5 steps), shared by the two tests below: a
#: step's loss does not depend on how many steps follow (the data comes from one seeded
#: generator, drawn step by step), so torch's 3 steps compare with the first 3 of these
_RREFRT_RUNS: dict[str, str] = {}


def _rrefrt_run(script: str, nproc: int) -> str:
    if script not in _RREFRT_RUNS:
        _RREFRT_RUNS[script] = _run_example(script, nproc, "rrefrt", 5)
    return _RREFRT_RUNS[script]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script, nproc", [("rnn_model_parallel.py", 2), ("pipeline_model_parallel.py", 3)])
def test_example_trains_on_rrefrt(script, nproc):
    out = _rrefrt_run(script, nproc)
    assert "example: OK" in out, out
    assert len(_losses(out)) == 5


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script, nproc", [("rnn_model_parallel.py", 2), ("pipeline_model_parallel.py", 3)])
def test_example_is_a_torch_rpc_program_with_the_same_losses(script, nproc):
    """The same file on torch.distributed.rpc (imports swapped by --backend) prints the same
    loss at every step as on rrefrt."""
    torch_out = _run_example(script, nproc, "torch", 3)
    assert "example: OK" in torch_out, torch_out
    assert len(_losses(torch_out)) == 3 and _losses(torch_out) == _losses(_rrefrt_run(script, nproc))[:3]


@pytest.fixture
def mods(cluster):
    """Layer A on w1, layer B on w2, and local copies of both."""
    a = rrefrt.remote("w1", Layer, args=(1,))
    b = rrefrt.remote("w2", Layer, args=(2,))
    yield a, b, Layer(1), Layer(2)
    _no_contexts_anywhere()


def test_chain(mods):
    a, b, la, lb = mods
    x = _x()
    with dist_autograd.context() as cid:
        loss = _fwd(b, _fwd(a, x)).pow(2).sum()
        dist_autograd.backward(cid, [loss])
        ga, gb = _remote_grads(a, cid), _remote_grads(b, cid)
        gx = dist_autograd.get_gradients(cid)[x]
        assert rrefrt.rpc_sync("w1", fns.validate_contexts) and rrefrt.rpc_sync("w2", fns.validate_contexts)
    assert x.grad is None  # the context holds gradients, not .grad
    xl = x.detach().clone().requires_grad_(True)
    lb(la(xl)).pow(2).sum().backward()
    _assert_close(ga, [p.grad for p in la.parameters()])
    _assert_close(gb, [p.grad for p in lb.parameters()])
    _assert_close([gx], [xl.grad])


def test_nested_chain_through_three_workers(mods):
    """w0 calls w1, which calls w2 from inside the call: the context travels along."""
    a, b, la, lb = mods
    x = _x(1)
    with dist_autograd.context() as cid:
        out = rrefrt.rpc_sync("w1", fns.forward_then, args=(a, b, x))
        dist_autograd.backward(cid, [out.sum()])
        ga, gb, gx = _remote_grads(a, cid), _remote_grads(b, cid), dist_autograd.get_gradients(cid)[x]
    xl = x.detach().clone().requires_grad_(True)
    (lb(la(xl)) * 2.0).sum().backward()
    _assert_close(ga + gb + [gx], [p.grad for p in la.parameters()] + [p.grad for p in lb.parameters()] + [xl.grad])


def test_fan_out_and_fan_in(mods):
    """x goes to w1 and w2 (fan-out); both results meet on w1 (fan-in); async calls."""
    a, b, la, lb = mods
    x = _x(2)
    with dist_autograd.context() as cid:
        fa = rrefrt.rpc_async("w1", fns.call_method, args=(Layer.forward, a, x))
        fb = rrefrt.rpc_async("w2", fns.call_method, args=(Layer.forward, b, x))
        z = rrefrt.rpc_sync("w1", fns.combine, args=(fa.wait(), fb.wait()))
        dist_autograd.backward(cid, [z.sum()])
        ga, gb, gx = _remote_grads(a, cid), _remote_grads(b, cid), dist_autograd.get_gradients(cid)[x]
    xl = x.detach().clone().requires_grad_(True)
    fns.combine(la(xl), lb(xl)).sum().backward()
    _assert_close(ga + gb + [gx], [p.grad for p in la.parameters()] + [p.grad for p in lb.parameters()] + [xl.grad])


def test_worker_used_twice_and_several_roots(mods):
    """A on w1 is applied twice (before and after B on w2); two roots; a local parameter."""
    a, b, la, lb = mods
    x = _x(3)
    w = torch.nn.Parameter(torch.full((4,), 0.5, dtype=torch.float64))
    with dist_autograd.context() as cid:
        h = _fwd(a, x * w)
        assert h.grad_fn is not None  # received tensors are not leaves (as torch's)
        h.mul_(1.0)  # so in-place operations on them are allowed
        k = _fwd(a, _fwd(b, h))
        dist_autograd.backward(cid, [k.sum(), (h * h).mean()])
        grads = dist_autograd.get_gradients(cid)
        ga, gb, gx, gw = _remote_grads(a, cid), _remote_grads(b, cid), grads[x], grads[w]
    xl = x.detach().clone().requires_grad_(True)
    wl = torch.nn.Parameter(w.detach().clone())
    hl = la(xl * wl)
    (la(lb(hl)).sum() + (hl * hl).mean()).backward()
    _assert_close(ga + gb + [gx, gw], [p.grad for p in la.parameters()] + [p.grad for p in lb.parameters()] + [xl.grad, wl.grad])


def test_rref_proxies_and_parameters_sent_as_arguments(mods):
    """RRef proxy calls (rpc_sync/rpc_async) are recorded; w0's own parameter travels as an
    argument and its gradient comes back; a call returns two tensors needing grad; a
    call to self."""
    a, b, la, lb = mods
    x = _x(4)
    w = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=torch.float64))
    with dist_autograd.context() as cid:
        h = a.rpc_sync().forward(x)
        k = b.rpc_async().forward(h * w).wait()
        y, s = rrefrt.rpc_sync("w1", fns.scale_by_param, args=(a, k))
        y2 = rrefrt.rpc_sync("w0", fns.combine, args=(y, y))
        dist_autograd.backward(cid, [y2.sum() + s])
        grads = dist_autograd.get_gradients(cid)
        ga, gb, gx, gw = _remote_grads(a, cid), _remote_grads(b, cid), grads[x], grads[w]
    xl = x.detach().clone().requires_grad_(True)
    wl = torch.nn.Parameter(w.detach().clone())
    kl = lb(la(xl) * wl)
    yl = la(kl)
    (fns.combine(yl, yl).sum() + (kl * la.b).sum()).backward()
    _assert_close(ga + gb + [gx, gw], [p.grad for p in la.parameters()] + [p.grad for p in lb.parameters()] + [xl.grad, wl.grad])


def test_remote_records_arguments(mods):
    """remote() inside a context: the owner keeps the result with its graph; a later call
    on the owner uses it, and the gradient reaches w0's argument."""
    a, b, la, lb = mods
    x = _x(5)
    with dist_autograd.context() as cid:
        r = rrefrt.remote("w1", fns.call_method, args=(Layer.forward, a, x))
        y = rrefrt.rpc_sync("w1", fns.forward_held, args=(a, r))
        dist_autograd.backward(cid, [y.sum()])
        gx = dist_autograd.get_gradients(cid)[x]
        ga = _remote_grads(a, cid)
    del r
    xl = x.detach().clone().requires_grad_(True)
    la(la(xl)).sum().backward()
    _assert_close(ga + [gx], [p.grad for p in la.parameters()] + [xl.grad])


def test_async_execution_function_inside_a_context(mods):
    a, b, la, lb = mods
    x = _x(8)
    with dist_autograd.context() as cid:
        y = rrefrt.rpc_sync("w1", fns.async_forward, args=(b, x))
        dist_autograd.backward(cid, [y.pow(2).sum()])
        gb, gx = _remote_grads(b, cid), dist_autograd.get_gradients(cid)[x]
    xl = x.detach().clone().requires_grad_(True)
    (lb(xl * 2.0) + xl).pow(2).sum().backward()
    _assert_close(gb + [gx], [p.grad for p in lb.parameters()] + [xl.grad])


def test_concurrent_contexts_on_two_threads(mods):
    """Contexts are per thread: two threads train at once, each sees only its own gradients."""
    import threading

    a, b, la, lb = mods
    results: dict[int, list] = {}

    def train(seed: int) -> None:
        x = _x(seed)
        with dist_autograd.context() as cid:
            loss = _fwd(b, _fwd(a, x)).sum() * seed
            dist_autograd.backward(cid, [loss])
            results[seed] = _remote_grads(a, cid) + [dist_autograd.get_gradients(cid)[x]]

    threads = [threading.Thread(target=train, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for seed in (1, 2):
        la.zero_grad()
        xl = _x(seed).detach().requires_grad_(True)
        (lb(la(xl)).sum() * seed).backward()
        _assert_close(results[seed], [p.grad for p in la.parameters()] + [xl.grad])


def test_gradients_accumulate_over_two_backwards_and_contexts_are_separate(mods):
    a, b, la, lb = mods
    x = _x(6)
    with dist_autograd.context() as c1:
        loss = _fwd(a, x).sum()
        dist_autograd.backward(c1, [loss], retain_graph=True)
        dist_autograd.backward(c1, [loss])
        g1 = _remote_grads(a, c1)
        with pytest.raises(dist_autograd.AutogradContextError, match="do not nest"):
            with dist_autograd.context():
                pass
    with dist_autograd.context() as c2:
        assert c2 != c1
        dist_autograd.backward(c2, [_fwd(a, x).sum()])
        g2 = _remote_grads(a, c2)
    _assert_close(g1, [2 * g for g in g2])
    with pytest.raises(dist_autograd.AutogradContextError, match="not known"):
        dist_autograd.get_gradients(c1)
    with pytest.raises(RuntimeError, match="scalars"):
        with dist_autograd.context() as c3:
            dist_autograd.backward(c3, [_fwd(a, x)])


def test_remote_error_in_forward_keeps_its_type(cluster):
    with dist_autograd.context():
        with pytest.raises(ValueError, match="boom"):
            rrefrt.rpc_sync("w1", fns.raise_in_forward, args=(_x(), "boom"))
    _no_contexts_anywhere()


def test_no_recording_outside_a_context(cluster):
    x = _x()
    y = rrefrt.rpc_sync("w1", fns.combine, args=(x, x))
    assert y.requires_grad and y.grad_fn is None  # a leaf: no graph crosses without a context
    assert dist_autograd.current_context_id() is None


@pytest.mark.timeout(90)
def test_death_during_backward_is_a_typed_error_within_bounds(workers: Workers):
    """x -> w1 -> w2 (nested); w2 dies inside its backward: w1 relays the failure, w0's
    backward raises WorkerUnavailableError within the liveness bound, no hang."""
    port = free_port()
    opts = {"rpc_timeout": 30.0, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.5, "shutdown_timeout": 60.0}
    base = {"world_size": 3, "port": port, "options": opts, "module": "tests.support.autograd_fns"}
    p0 = workers.start({**base, "name": "w0", "rank": 0, "scenario": "death_during_backward"})
    for r in (1, 2):
        workers.start({**base, "name": f"w{r}", "rank": r})
    out, _ = p0.communicate(timeout=60)
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not line:
        workers.kill_all()
        others = "\n".join(p.communicate(timeout=5)[0] or "" for p in workers.procs[1:])
        raise AssertionError(f"no result from w0:\n{out}\nothers:\n{others}")
    res = json.loads(line[-1][len("RESULT "):])
    assert res["error"] == "WorkerUnavailableError", res
    assert "w2" in res["message"], res
    assert res["took"] < 1.5 + 5.0, res
    assert res["contexts_left_here"] == 0 and res["contexts_left_w1"] == 0, res


# ------------------------------------------------------------------ DistributedOptimizer
@pytest.mark.parametrize("optim_cls, kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.05})], ids=["sgd", "adam"])
def test_distributed_optimizer_steps_equal_the_local_optimizer(mods, optim_cls, kw):
    from rrefrt.optim import DistributedOptimizer

    a, b, la, lb = mods
    w = torch.nn.Parameter(torch.full((4,), 0.3, dtype=torch.float64))  # a parameter on w0 too
    params = rrefrt.rpc_sync("w1", fns.param_rrefs, args=(a,)) + rrefrt.rpc_sync("w2", fns.param_rrefs, args=(b,))
    params.append(rrefrt.RRef(w))
    opt = DistributedOptimizer(optim_cls, params, **kw)
    wl = torch.nn.Parameter(w.detach().clone())
    local = optim_cls(list(la.parameters()) + list(lb.parameters()) + [wl], **kw)
    for step in range(3):
        x = _x(10 + step).detach()
        with dist_autograd.context() as cid:
            loss = _fwd(b, _fwd(a, x * w)).pow(2).sum()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        local.zero_grad()
        lb(la(x * wl)).pow(2).sum().backward()
        local.step()
    got = rrefrt.rpc_sync("w1", fns.param_values, args=(a,)) + rrefrt.rpc_sync("w2", fns.param_values, args=(b,)) + [w.detach()]
    _assert_close(got, [p.detach() for p in list(la.parameters()) + list(lb.parameters())] + [wl.detach()])


# ------------------------------------------------------------------ RemoteModule
def test_remote_module_forward_backward_and_optimizer(cluster):
    from rrefrt.nn import RemoteModule
    from rrefrt.optim import DistributedOptimizer

    rm = RemoteModule("w1/cpu", Layer, args=(5,), kwargs={"n_out": 2})
    rm2 = RemoteModule("rank:2", torch.nn.Linear, args=(2, 1), kwargs={"dtype": torch.float64})
    assert rm.get_module_rref().owner_name() == "w1"
    local, local2 = Layer(5, n_out=2), torch.nn.Linear(2, 1, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(local2.parameters(), rrefrt.rpc_sync("w2", fns.param_values, args=(rm2.get_module_rref(),))):
            p.copy_(q)
    x = _x(20).detach()
    torch.testing.assert_close(rm(x), local(x).detach())
    opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters() + rm2.remote_parameters(), lr=0.5)
    with dist_autograd.context() as cid:
        out = rm2(rm.forward_async(x).wait())
        loss = out.pow(2).sum()
        dist_autograd.backward(cid, [loss])
        g = _remote_grads(rm.get_module_rref(), cid)
        opt.step(cid)
    loss_l = local2(local(x)).pow(2).sum()
    loss_l.backward()
    _assert_close(g, [p.grad for p in local.parameters()])
    with torch.no_grad():
        for p in list(local.parameters()) + list(local2.parameters()):
            p -= 0.5 * p.grad
    with dist_autograd.context():
        torch.testing.assert_close(rm2(rm(x)), local2(local(x)).detach())
    with pytest.raises(ValueError, match="nn.Module"):
        RemoteModule("w1/cpu", dict)
    _no_contexts_anywhere()


def test_to_here_inside_a_context_is_recorded(mods):
    """torch's pipeline pattern: a stage returns an RRef (remote()), the next one fetches it
    with to_here(); the gradient flows back through the fetch."""
    a, b, la, lb = mods
    x = _x(7)
    with dist_autograd.context() as cid:
        r = rrefrt.remote("w1", fns.call_method, args=(Layer.forward, a, x))
        y = rrefrt.rpc_sync("w2", fns.forward_fetched, args=(b, r))
        h = r.to_here()
        dist_autograd.backward(cid, [y.sum() + h.sum()])
        ga, gb, gx = _remote_grads(a, cid), _remote_grads(b, cid), dist_autograd.get_gradients(cid)[x]
    del r, h
    xl = x.detach().clone().requires_grad_(True)
    hl = la(xl)
    (lb(hl).sum() + hl.sum()).backward()
    _assert_close(ga + gb + [gx], [p.grad for p in la.parameters()] + [p.grad for p in lb.parameters()] + [xl.grad])


# ------------------------------------------------------------------ torch's names and behaviour
SEND = "torch::distributed::autograd::SendRpcBackward"
RECV = "torch::distributed::autograd::RecvRpcBackward"


def test_introspection_shows_the_send_and_recv_functions_of_each_worker(cluster):
    t1 = torch.ones(3, requires_grad=True)
    t2 = torch.zeros(3, requires_grad=True)
    with dist_autograd.context() as cid:
        ret = rrefrt.rpc_sync("w1", fns.combine, args=(t1, t2))
        ctx = dist_autograd._current_context()
        assert ctx._context_id() == cid and dist_autograd._retrieve_context(cid) is ctx
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        assert len(sends) == 1 and len(recvs) == 1
        send = next(iter(sends.values()))
        assert send.name() == SEND
        assert [(n.variable, nr) for n, nr in send.next_functions] == [(t1, 0), (t2, 0)]
        assert ret.grad_fn is next(iter(recvs.values())) and ret.grad_fn.name() == RECV
        assert ctx._known_worker_ids() == {rrefrt.get_worker_info("w1").id}
        # w1 received one message (its recv function) and sent the result back from combine's graph
        remote = rrefrt.rpc_sync("w1", fns.graph_summary, args=(cid,))
        assert remote["sends"] == [SEND] and remote["recvs"] == [RECV], remote
        assert remote["send_next"] == [["AddBackward0"]] and remote["workers"] == [0], remote
        info = dist_autograd._get_debug_info()
        assert set(info) == {"num_current_backward_passes", "num_autograd_contexts"}
        assert info["num_current_backward_passes"] == "0" and int(info["num_autograd_contexts"]) >= 1
        assert dist_autograd._get_max_id() == (1 << 48) - 1  # w0's worker id (0) in the top 16 bits
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd._retrieve_context(cid)
    with pytest.raises(RuntimeError, match="Current thread doesn't have a valid autograd context"):
        dist_autograd._current_context()
    ctx = dist_autograd._new_context()  # a context without a with block: current until released
    assert dist_autograd.current_context_id() == ctx._context_id()
    rrefrt.rpc_sync("w1", fns.combine, args=(t1, t2))
    assert rrefrt.rpc_sync("w1", fns.context_ids) == [ctx._context_id()]
    dist_autograd._release_context(ctx._context_id())
    assert dist_autograd.current_context_id() is None
    _no_contexts_anywhere()


def test_errors_carry_torchs_phrases(cluster):
    t = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        with pytest.raises(dist_autograd.AutogradContextError, match="Already have an autograd context id for this thread.*do not nest"):
            with dist_autograd.context():
                pass
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(cid, None)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(None, None)
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(cid, [torch.rand(3)])
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(cid, [t * 2])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(cid, [torch.rand(1, requires_grad=True)])
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100 "):
        dist_autograd.backward(100, [(t * 2).sum()])


def test_a_backward_function_error_is_error_on_node(cluster):
    """torch's 'Error on Node N: <message>' (a RuntimeError), carrying the original."""
    x = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rrefrt.rpc_sync("w1", fns.raise_in_backward, args=(x,))
        with pytest.raises(RuntimeError, match=f"Error on Node {rrefrt.get_worker_info('w1').id}: boom in backward") as err:
            dist_autograd.backward(cid, [y.sum()])
    assert isinstance(err.value, dist_autograd.DistBackwardError)
    assert isinstance(err.value.original, ValueError) and "w1" in str(err.value)
    _no_contexts_anywhere()


def test_rref_backward_on_owner_and_user(cluster):
    x = torch.rand(4, requires_grad=True)
    rrefrt.RRef((x * 2).sum()).backward()  # -1: a local backward on the owner
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    with dist_autograd.context() as cid:
        y = rrefrt.rpc_sync("w1", fns.combine, args=(x, x))  # x * x + x
        rrefrt.RRef(y.sum()).backward(cid)
        torch.testing.assert_close(dist_autograd.get_gradients(cid)[x], 2 * x.detach() + 1)
    with dist_autograd.context() as cid:
        rref = rrefrt.remote("w1", fns.total, args=(x,))
        rref.backward(cid, retain_graph=True)
        rref.backward(cid)
        assert torch.equal(dist_autograd.get_gradients(cid)[x], torch.full((4,), 2.0))
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
            rref.backward()
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
            rrefrt.remote("w1", fns.context_ids).backward(cid)
    _no_contexts_anywhere()


def test_post_hooks_run_and_gradients_are_not_copied_needlessly(cluster):
    calls = []
    t = torch.rand(5, 6, requires_grad=True)
    a = t + t
    acc = a.grad_fn.next_functions[0][0]
    acc.register_hook(lambda grad_inputs, grad_outputs: calls.append(len(grad_outputs)))
    ptrs = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            ptrs["g"] = g.data_ptr()
            return g

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            ptrs["g2"] = g.data_ptr()
            return g, g

    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [a.sum()])
        assert calls == [1] and t.grad is None  # the hook ran once; .grad untouched
    s = torch.rand(5, 6, requires_grad=True)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [Keep.apply(t)[1][0]])
        assert dist_autograd.get_gradients(cid)[t].data_ptr() == ptrs["g"]  # stolen, not copied
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [Twice.apply(t, s)[1][0]])
        g = dist_autograd.get_gradients(cid)
        assert len({g[t].data_ptr(), g[s].data_ptr(), ptrs["g2"]}) == 3  # one buffer for two leaves: copies


def test_profiler_records_the_send_and_recv_functions_on_the_root(cluster):
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = rrefrt.rpc_sync("w1", torch.add, args=(t1, t2)).sum()
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(cid, [loss])
    names = [e.name for e in prof.function_events]
    assert sum(SEND in n and "evaluate_function" not in n for n in names) == 1, names
    assert sum(RECV in n and "evaluate_function" not in n for n in names) == 1, names
    assert "torch::distributed::autograd::backward" in names


def test_torchscript_function_annotated_rref_compiles():
    """A module that compiles a TorchScript function annotated RRef[T] still imports (torch's
    dist_autograd_test does this at import); TorchScript sees torch's RRef type."""

    def add_rref(r: rrefrt.RRef[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return torch.add(r.to_here(), t)

    scripted = torch.jit.script(add_rref)
    assert "RRef" in str(scripted.graph)


# ------------------------------------------------------------------ unit tests (no processes)
def test_registry_rules_unit():
    from collections import namedtuple

    from rrefrt.autograd._context import AutogradContextError, Registry
    from rrefrt.autograd._engine import _leaves, _map

    reg = Registry(worker_id=3)
    cid = reg.new_context_id()
    ctx = reg.create(cid)
    assert ctx.initiator == 3 and reg.get_or_create(cid) is ctx and reg.ids() == [cid]
    with pytest.raises(AutogradContextError):
        reg.create(cid)
    leaf = torch.ones(2, requires_grad=True)
    ctx.add_recv(leaf, peer=1, edge_id=reg.new_edge_id())
    assert ctx.recv_edge(leaf).peer == 1 and ctx.recv_edge(torch.ones(2, requires_grad=True)) is None
    ctx.accumulate(leaf, torch.ones(2))
    ctx.accumulate(leaf, torch.ones(2))
    assert torch.equal(ctx.gradients()[leaf], torch.full((2,), 2.0))
    reg.validate()
    with pytest.raises(AutogradContextError, match="no send edge"):
        ctx.send_tensor(99, "w3")
    assert reg.pop(cid) is ctx and reg.get(cid) is None and reg.pop(cid) is None
    with pytest.raises(AutogradContextError, match="already released"):
        reg.get_or_create(cid)  # a late call does not bring a released context back

    P = namedtuple("P", "a b")
    t = torch.zeros(1)
    data = [1, (t, {"k": P(t, 2)})]
    out = _map(data, lambda o: "T" if o is t else o)
    assert out == [1, ("T", {"k": P("T", 2)})] and type(out[1][1]["k"]) is P
    same = [1, (2, {"k": 3})]
    assert _map(same, lambda o: o) is same

    w = torch.nn.Parameter(torch.ones(3))
    h = w * 2
    diamond = (h * h + h.exp()).sum()  # w reached along several paths: listed once
    assert [id(x) for x in _leaves([diamond])] == [id(w)]
    assert _leaves([w]) == [w]
