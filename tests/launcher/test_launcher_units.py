"""Unit tests of the launcher's parts, in process: device plans, configuration, the command
line, the node rendezvous, the output pump and the worker bootstrap's guards."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrefrt.run import main
from rrefrt.run.cli import parse_config
from rrefrt.run.config import LaunchError, UsageError
from rrefrt.run.devices import parse_cuda_visible_devices, plan_devices, visible_gpus
from rrefrt.run.output import Console, OutputPump, tail_of_file
from rrefrt.run.nodes import NodeInfo, rendezvous, secret_fingerprint
from rrefrt.run.workers import BOOTSTRAP_PATH
from rrefrt.group.store import StoreClient, StoreServer
from tests.launcher_scripts.harness import WORKER, alive, poll_for


def _plan(nproc, visible, gpus=None, k=1, threads=None, cores=8, environ=None):
    return plan_devices(nproc, tuple(visible), gpus=gpus, max_workers_per_gpu=k,
                        cpu_threads=threads, cores=cores, environ=environ or {})


# ---- devices ------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_round_robin_one_per_gpu_then_cpu():
    plan = _plan(5, ["0", "1", "2"])
    assert [w.device for w in plan.workers] == ["cuda:0"] * 3 + ["cpu"] * 2
    assert [w.cuda_visible_devices for w in plan.workers] == ["0", "1", "2", "", ""]
    assert plan.warnings == () and "2 of 5 worker(s) overflow to CPU" in plan.notes[0]


@pytest.mark.timeout(10)
def test_k_workers_per_gpu_round_robin():
    plan = _plan(6, ["0", "1"], k=2)
    assert [w.gpu for w in plan.workers] == ["0", "1", "0", "1", None, None]
    assert plan.workers[2].environ()["CUDA_VISIBLE_DEVICES"] == "0"
    assert plan.workers[5].environ()["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.workers[5].environ()["RREFRT_DEVICE"] == "cpu"


@pytest.mark.timeout(10)
def test_respects_cuda_visible_devices_ids_and_uuids():
    visible, source = visible_gpus({"CUDA_VISIBLE_DEVICES": "3,GPU-aa11,5",
                                    "RREFRT_FAKE_GPU_COUNT": "8"})
    assert visible == ("3", "GPU-aa11", "5") and source == "CUDA_VISIBLE_DEVICES"
    plan = _plan(3, visible)
    assert [w.cuda_visible_devices for w in plan.workers] == ["3", "GPU-aa11", "5"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value, expected", [
    ("", ()), ("-1", ()), ("0,1", ("0", "1")), ("0,x,1", ("0",)), ("1,1,2", ("1",)),
    (" 2 , 3 ", ("2", "3")), ("MIG-abc/1/2", ("MIG-abc/1/2",)),
])
def test_cuda_visible_devices_parsing(value, expected):
    assert parse_cuda_visible_devices(value) == expected


@pytest.mark.timeout(10)
def test_fake_gpu_count_and_no_gpus():
    assert visible_gpus({"RREFRT_FAKE_GPU_COUNT": "3"}) == (("0", "1", "2"),
                                                         "RREFRT_FAKE_GPU_COUNT")
    assert visible_gpus({}, use_nvidia_smi=False)[0] == ()
    with pytest.raises(ValueError, match="RREFRT_FAKE_GPU_COUNT"):
        visible_gpus({"RREFRT_FAKE_GPU_COUNT": "two"})


@pytest.mark.timeout(10)
def test_explicit_impossible_gpus_is_a_warning():
    plan = _plan(4, ["0", "1"], gpus=4)
    assert len(plan.warnings) == 1 and "--gpus 4 asked for 4 GPU(s) but only 2" in plan.warnings[0]
    assert [w.gpu for w in plan.workers] == ["0", "1", None, None]


@pytest.mark.timeout(10)
def test_gpus_zero_hides_cuda_and_auto_without_gpus_leaves_it():
    assert [w.cuda_visible_devices for w in _plan(2, ["0"], gpus=0).workers] == ["", ""]
    assert [w.cuda_visible_devices for w in _plan(2, []).workers] == [None, None]
    assert "CUDA_VISIBLE_DEVICES" not in _plan(1, []).workers[0].environ()


@pytest.mark.timeout(10)
def test_cpu_threads():
    assert _plan(3, [], cores=8).workers[0].environ()["OMP_NUM_THREADS"] == "2"
    assert _plan(16, [], cores=8).workers[0].cpu_threads == 1
    user = _plan(2, [], environ={"OMP_NUM_THREADS": "5"}).workers[0]
    assert user.cpu_threads == 5 and "OMP_NUM_THREADS" not in user.environ()  # kept as set
    explicit = _plan(4, [], threads=4, cores=8)
    assert explicit.workers[0].environ()["MKL_NUM_THREADS"] == "4"
    assert "oversubscribes" in explicit.warnings[0]


@pytest.mark.timeout(30)
@settings(max_examples=200, deadline=None)
@given(nproc=st.integers(1, 40), ngpus=st.integers(0, 8), k=st.integers(1, 4),
       gpus=st.one_of(st.none(), st.integers(0, 10)))
def test_device_plan_properties(nproc, ngpus, k, gpus):
    visible = [str(i) for i in range(ngpus)]
    plan = _plan(nproc, visible, gpus=gpus, k=k)
    used = visible if gpus is None else visible[:gpus]
    per_gpu = {g: sum(w.gpu == g for w in plan.workers) for g in used}
    assert all(n <= k for n in per_gpu.values())
    on_gpu = [w for w in plan.workers if w.gpu is not None]
    assert len(on_gpu) == min(nproc, len(used) * k)
    assert on_gpu == list(plan.workers[: len(on_gpu)])  # GPU workers first, in order
    assert [w.gpu for w in on_gpu] == [used[i % len(used)] for i in range(len(on_gpu))]
    assert all(w.device == "cpu" for w in plan.workers[len(on_gpu):])
    assert bool(plan.warnings) == (gpus is not None and gpus > ngpus)


# ---- configuration and command line -----------------------------------------------------------

@pytest.mark.timeout(10)
def test_script_arguments_pass_through_untouched():
    cfg, _ = parse_config(["--nproc-per-node", "2", "train.py", "--nproc-per-node", "9", "-m", "x"])
    assert cfg.script == "train.py" and cfg.nproc_per_node == 2
    assert cfg.script_args == ("--nproc-per-node", "9", "-m", "x")
    cfg, _ = parse_config(["--nproc_per_node=3", "-m", "pkg.mod", "a"])
    assert cfg.module and cfg.script == "pkg.mod" and cfg.script_args == ("a",)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("args, message", [
    (["--max-workers-per-gpu", "0", WORKER], "--max-workers-per-gpu must be at least 1"),
    (["--gpus", "-1", WORKER], "--gpus must be at least 0"),
    (["--grace-period", "-1", WORKER], "--grace-period must be a number of seconds >= 0"),
    (["--rdzv-timeout", "0", WORKER], "--rdzv-timeout must be a positive number"),
    (["--master-port", "70000", WORKER], "--master-port 70000 is not a TCP port"),
    (["--cpu-threads-per-worker", "0", WORKER], "--cpu-threads-per-worker must be at least 1"),
    (["-m", "not a module"], "is not a module name"),
])
def test_bad_values(args, message):
    cfg, _ = parse_config(args)
    with pytest.raises(UsageError, match=message):
        cfg.validate()


@pytest.mark.timeout(10)
def test_log_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg, _ = parse_config(["--log-dir", str(blocker / "sub"), WORKER])
    with pytest.raises(UsageError, match="cannot be created"):
        cfg.validate()


@pytest.mark.timeout(10)
def test_main_returns_2_on_usage_errors(capsys):
    assert main(["--nproc-per-node", "0", WORKER]) == 2
    assert "--nproc-per-node must be at least 1" in capsys.readouterr().err
    assert main(["--no-such-flag", WORKER]) == 2


# ---- rendezvous -----------------------------------------------------------------------

@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0)
    clients: list[StoreClient] = []

    def client() -> StoreClient:
        c = StoreClient("127.0.0.1", server.port, connect_timeout=5)
        clients.append(c)
        return c
    yield client
    for c in clients:
        c.close()
    server.close()


def _info(node, nnodes=2, nproc=2, secret=None):
    return NodeInfo(node, nnodes, nproc, f"host{node}", 1000 + node, secret_fingerprint(secret))


def _in_thread(fn):
    box: dict[str, object] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.timeout(20)
def test_rendezvous_ranks_nodes_with_different_sizes(store):
    t, box = _in_thread(lambda: rendezvous(store(), _info(1, nproc=3), "here", 10))
    world0 = rendezvous(store(), _info(0, nproc=2), "here", 10)
    t.join(10)
    world1 = box["value"]
    assert world0.world_size == world1.world_size == 5
    assert (world0.rank_offset, world1.rank_offset) == (0, 2)


@pytest.mark.timeout(20)
def test_rendezvous_rejects_a_duplicate_node_rank(store):
    t, box = _in_thread(lambda: rendezvous(store(), _info(1), "here", 3))
    poll_for(lambda: store().check(["launcher/node/1"]), time.monotonic() + 5, "node 1")
    with pytest.raises(LaunchError, match="node rank 1 was already claimed by another launcher "
                                          r"\(host host1, pid 1001\)"):
        rendezvous(store(), _info(1), "here", 3)
    t.join(10)


@pytest.mark.timeout(20)
def test_rendezvous_names_missing_nodes(store):
    with pytest.raises(LaunchError, match=r"node\(s\) 1, 2 of 3 never arrived"):
        rendezvous(store(), _info(0, nnodes=3), "here", 0.3)


@pytest.mark.timeout(20)
def test_rendezvous_disagreement_on_nnodes(store):
    t, box = _in_thread(lambda: rendezvous(store(), _info(1, nnodes=3), "here", 5))
    with pytest.raises(LaunchError, match="nodes disagree on --nnodes"):
        rendezvous(store(), _info(0, nnodes=2), "here", 5)
    t.join(10)
    assert isinstance(box.get("error"), LaunchError)


@pytest.mark.timeout(20)
def test_rendezvous_secret_on_some_nodes_only(store):
    t, box = _in_thread(lambda: rendezvous(store(), _info(1, secret="s"), "here", 5))
    with pytest.raises(LaunchError, match=r"set on node\(s\) \[1\] but not on node\(s\) \[0\]"):
        rendezvous(store(), _info(0), "here", 5)
    t.join(10)


@pytest.mark.timeout(20)
def test_rendezvous_fails_on_a_launcher_refused_for_its_secret(store):
    """Node 0's store authenticates with the secret: a launcher it refused (another secret,
    or none) fails node 0's rendezvous at once, named; other refused clients do not."""
    refused = ["worker 'x' (rank 3)"]
    t, box = _in_thread(lambda: rendezvous(store(), _info(0, secret="s"), "here", 5, lambda: refused))
    poll_for(lambda: store().check(["launcher/node/0"]), time.monotonic() + 5, "node 0")
    refused.append("rrefrt-run node 1 (host h1, pid 7)")
    t.join(10)
    err = box.get("error")
    assert isinstance(err, LaunchError) and "different RREFRT_SECRET values" in str(err), box
    assert "rrefrt-run node 1 (host h1, pid 7) was refused" in str(err)


# ---- output -------------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_output_pump_prefixes_lines_and_keeps_tails():
    out, err = io.BytesIO(), io.BytesIO()
    pump = OutputPump(Console(out, err, live=False), tail_lines=2)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pump.add(4, r1, to_stderr=False)
    pump.add(4, r2, to_stderr=True)
    pump.start()
    os.write(w1, b"one\ntw")
    os.write(w2, b"warn\n")
    os.write(w1, b"o\nthree-no-newline")
    os.close(w1)
    os.close(w2)
    assert pump.wait_drained(4, 5)
    pump.stop(5)
    os.close(r1)
    os.close(r2)
    assert out.getvalue() == b"[rank 4] one\n[rank 4] two\n[rank 4] three-no-newline\n"
    assert err.getvalue() == b"[rank 4] warn\n"
    assert pump.tail(4)[-1] == "three-no-newline" and len(pump.tail(4)) == 2


@pytest.mark.timeout(10)
def test_tail_of_file(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_text("".join(f"line {i}\n" for i in range(10000)))
    assert tail_of_file(str(path), 3) == ["line 9997", "line 9998", "line 9999"]
    assert tail_of_file(str(tmp_path / "missing"), 3) == []


# ---- the bootstrap's guards ---------------------------------------------------------------

@pytest.mark.timeout(20)
def test_bootstrap_kills_its_group_when_the_launcher_pipe_closes(tmp_path):
    """The watchdog alone (the parent, this test, stays alive; only the pipe closes)."""
    r, w = os.pipe()
    script = tmp_path / "sleeper.py"
    script.write_text("import subprocess, sys, time\n"
                      "c = subprocess.Popen([sys.executable, '-c',\n"
                      "                      'import time; time.sleep(60)'])\n"
                      "print(c.pid, flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, "RREFRT_RUN_WATCHDOG": f"{os.getpid()}:{r}"}
    p = subprocess.Popen([sys.executable, BOOTSTRAP_PATH, str(script)], env=env, pass_fds=(r,),
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        os.close(r)
        child = int(p.stdout.readline())
        assert alive(child)
        os.close(w)
        w = -1
        p.wait(timeout=5)
        assert p.returncode == -9
        poll_for(lambda: not alive(child), time.monotonic() + 5, "the worker's child to die")
        assert b"watchdog pipe closed" in p.stderr.read()
    finally:
        if w >= 0:
            os.close(w)
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=5)


@pytest.mark.timeout(20)
def test_bootstrap_refuses_to_run_when_the_launcher_is_already_gone(tmp_path):
    r, w = os.pipe()
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "RREFRT_RUN_WATCHDOG": f"1:{r}"}  # pid 1 is not our parent
    p = subprocess.run([sys.executable, BOOTSTRAP_PATH, str(script)], env=env, pass_fds=(r,),
                       start_new_session=True, capture_output=True, timeout=10)
    os.close(r)
    os.close(w)
    assert p.returncode == -9 and not marker.exists()
    assert b"exited before this worker started" in p.stderr


@pytest.mark.timeout(20)
def test_bootstrap_parent_death_signal_alone(tmp_path):
    """The launcher dies but its pipe stays open (this test holds the write end): only
    PR_SET_PDEATHSIG tells the worker, and it must still take its whole group down."""
    r, w = os.pipe()
    script = tmp_path / "sleeper.py"
    pidfile = tmp_path / "child.pid"
    script.write_text("import os, subprocess, sys, time\n"
                      "c = subprocess.Popen([sys.executable, '-c',\n"
                      "                      'import time; time.sleep(60)'])\n"
                      f"open({str(pidfile) + '.tmp'!r}, 'w').write(str(c.pid))\n"
                      f"os.rename({str(pidfile) + '.tmp'!r}, {str(pidfile)!r})\n"
                      "time.sleep(60)\n")
    errlog = tmp_path / "worker.err"
    middle = (  # stands in for the launcher: spawns the worker, then gets SIGKILLed
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, RREFRT_RUN_WATCHDOG=f'{{os.getpid()}}:{r}')\n"
        f"p = subprocess.Popen([sys.executable, {BOOTSTRAP_PATH!r}, {str(script)!r}], env=env,\n"
        f"    pass_fds=({r},), start_new_session=True, stderr=open({str(errlog)!r}, 'wb'))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", middle], pass_fds=(r,),
                                stdout=subprocess.PIPE)
    os.close(r)
    pids: list[int] = []
    try:
        pids.append(int(launcher.stdout.readline()))
        poll_for(pidfile.exists, time.monotonic() + 10, "the worker's child")
        pids.append(int(pidfile.read_text()))
        assert all(alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait(timeout=5)
        poll_for(lambda: not any(alive(pid) for pid in pids), time.monotonic() + 5,
                 "the worker and its child to die")
        assert b"parent-death signal" in errlog.read_bytes()
    finally:
        os.close(w)
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=5)
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
