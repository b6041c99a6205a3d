"""rrefrt-run end to end on one host: environment, output, failures, signals, orphans.

Each test starts real launchers (``python -m rrefrt.run``) running tests/launcher_scripts/
worker.py, waits on conditions with deadlines, and kills everything it started by pid.
Measured bounds (DESIGN.md "Failure model") are printed; run with -s to see them.
"""

from __future__ import annotations

import os
import pty
import signal
import socket
import subprocess
import time

import pytest

from tests.launcher_scripts.harness import (REPO, SCRIPTS, WORKER, Procs, alive, finish,
                                            finish_all, free_port, group_alive, launcher_env,
                                            poll_for, read_json, wait_ranks)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def _marker_time(path: str) -> float:
    with open(path) as f:
        return float(f.read())


# ---- the environment contract and output ----------------------------------------------

@pytest.mark.timeout(30)
def test_three_workers_get_the_environment_contract(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "3", WORKER, str(tmp_path), "--connect-store",
                      "--", "--user-flag", "x"])
    rc, out, err = finish(p, 20)
    assert rc == 0, err
    recs = {r: read_json(tmp_path / f"rank{r}.json") for r in range(3)}
    ports = {recs[r]["env"]["MASTER_PORT"] for r in range(3)}
    secrets = {recs[r]["env"]["RREFRT_SECRET"] for r in range(3)}
    assert len(ports) == 1 and len(secrets) == 1
    secret = secrets.pop()
    assert len(secret) == 64 and int(secret, 16) >= 0
    for r in range(3):
        env = recs[r]["env"]
        assert env["RANK"] == str(r) and env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == "3" and env["LOCAL_WORLD_SIZE"] == "3"
        assert env["NODE_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["RREFRT_STORE_HOSTED"] == "1" and env["RREFRT_DEVICE"] == "cpu"
        assert env["RREFRT_RUN_WATCHDOG"] is None  # consumed by the bootstrap
        assert int(env["RREFRT_CPU_THREADS"]) >= 1
        assert env["OMP_NUM_THREADS"] == env["RREFRT_CPU_THREADS"]
        assert recs[r]["store_reachable"] is True
        # the store authenticates with the job secret: without it a client can do nothing
        assert recs[r]["store_without_secret"].startswith("refused: authentication failed"), recs[r]
        assert "needs the job secret" in recs[r]["store_without_secret"]
        assert recs[r]["store_with_secret"] is True
        assert recs[r]["name"] == "__main__"
        assert recs[r]["argv"][0] == WORKER and recs[r]["argv"][-2:] == ["--user-flag", "x"]
        assert recs[r]["path0"] == SCRIPTS
        assert recs[r]["pgid"] == recs[r]["pid"]  # its own process group
        assert f"[rank {r}] worker rank {r} up" in out
    assert "ranks 0-2 of world size 3" in err and "all 3 workers finished successfully" in err


@pytest.mark.timeout(30)
def test_module_mode_and_log_dir(procs, tmp_path):
    logs = tmp_path / "logs"
    p = procs.launch(["--nproc-per-node", "2", "--log-dir", str(logs), "--quiet",
                      "-m", "tests.launcher_scripts.worker", str(tmp_path)])
    rc, out, err = finish(p, 20)
    assert rc == 0, err
    assert out == "" and err == ""  # --quiet, and worker output goes to the files
    for r in range(2):
        rec = read_json(tmp_path / f"rank{r}.json")
        assert rec["name"] == "__main__" and rec["path0"] == REPO
        assert rec["argv"][0].endswith(os.path.join("launcher_scripts", "worker.py"))
        assert f"worker rank {r} up" in (logs / f"rank{r}.log").read_text()


@pytest.mark.timeout(30)
def test_gpu_assignment_with_simulated_gpus(procs, tmp_path):
    env = launcher_env(RREFRT_FAKE_GPU_COUNT="2")
    p = procs.launch(["--nproc-per-node", "5", "--max-workers-per-gpu", "2", "--gpus", "4",
                      "--cpu-threads-per-worker", "3", WORKER, str(tmp_path)], env=env)
    rc, out, err = finish(p, 20)
    assert rc == 0, err
    got = {r: read_json(tmp_path / f"rank{r}.json")["env"] for r in range(5)}
    assert [got[r]["CUDA_VISIBLE_DEVICES"] for r in range(5)] == ["0", "1", "0", "1", ""]
    assert [got[r]["RREFRT_DEVICE"] for r in range(5)] == ["cuda:0"] * 4 + ["cpu"]
    assert all(got[r]["OMP_NUM_THREADS"] == got[r]["MKL_NUM_THREADS"] == "3" for r in range(5))
    assert "warning: --gpus 4 asked for 4 GPU(s) but only 2 are visible" in err
    assert "rank 4 (local 4): cpu (CUDA hidden)" in err
    assert "1 of 5 worker(s) overflow to CPU" in err


@pytest.mark.timeout(30)
def test_live_status_line_on_a_terminal(procs, tmp_path):
    master, slave = pty.openpty()
    try:
        p = procs.launch(["--nproc-per-node", "2", WORKER, str(tmp_path), "--hold", "1.5"],
                         stderr=slave)
        os.close(slave)
        slave = -1
        chunks = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the launcher closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert p.wait(timeout=10) == 0
        text = b"".join(chunks).decode(errors="replace")
        assert "\r\x1b[K" in text and "2 running, 0 finished, 0 failed" in text
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


# ---- failures ---------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_worker_sys_exit_3_stops_the_others_and_is_reported(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "3", WORKER, str(tmp_path), "--exit-rank", "1",
                      "--code", "3", "--hold", "60", "--on-term", "--wait-peers"])
    rc, out, err = finish(p, 20)
    assert rc == 1
    assert "job failed: rank 1 (node 0, local rank 1" in err and "exited with code 3" in err
    assert "| rank 1 line 2" in err and "| rank 1 exiting with code 3" in err
    assert "rank 0 (pid" in err and "stopped by the launcher (SIGTERM)" in err
    exited = read_json(tmp_path / "exit1.json")["at"]
    for r in (0, 2):
        delay = _marker_time(tmp_path / f"term{r}") - exited
        print(f"\nbound: rank {r} got SIGTERM {delay * 1000:.0f} ms after rank 1 exited")
        assert delay < 0.5


@pytest.mark.timeout(30)
def test_worker_killed_with_sigkill(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "3", WORKER, str(tmp_path), "--hold", "60",
                      "--on-term"])
    recs = wait_ranks(str(tmp_path), range(3), time.monotonic() + 20)
    procs.track([rec["pid"] for rec in recs.values()])
    t0 = time.monotonic()
    os.kill(recs[1]["pid"], signal.SIGKILL)
    rc, out, err = finish(p, 20)
    t_exit = time.monotonic()
    assert rc == 1
    assert "rank 1 (node 0, local rank 1" in err
    assert "was killed by SIGKILL (signal 9)" in err and "out-of-memory" in err
    assert "| worker rank 1 up" in err
    for r in (0, 2):
        delay = _marker_time(tmp_path / f"term{r}") - t0
        print(f"\nbound: rank {r} stopped {delay * 1000:.0f} ms after rank 1 was killed")
        assert delay < 0.5
    assert t_exit - t0 < 5.0 + 2.0


@pytest.mark.timeout(30)
def test_workers_ignoring_sigterm_are_killed_after_the_grace_period(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "3", "--grace-period", "1", WORKER, str(tmp_path),
                      "--exit-rank", "0", "--hold", "60", "--ignore-term", "--wait-peers"])
    rc, out, err = finish(p, 20)
    t_exit = time.monotonic()
    assert rc == 1 and "exited with code 3" in err
    took = t_exit - read_json(tmp_path / "exit0.json")["at"]
    print(f"\nbound: launcher exited {took:.2f}s after the failure (grace 1s, bound 3s)")
    assert took < 1.0 + 2.0
    assert "stopped by the launcher (SIGTERM): was killed by SIGKILL" in err
    for r in (1, 2):
        assert not alive(read_json(tmp_path / f"rank{r}.json")["pid"])


@pytest.mark.timeout(40)
def test_launcher_sigkilled_leaves_no_orphans(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "2", WORKER, str(tmp_path), "--hold", "120",
                      "--children"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recs = wait_ranks(str(tmp_path), range(2), time.monotonic() + 25)
    workers = [rec["pid"] for rec in recs.values()]
    descendants = [d for rec in recs.values() for d in rec["descendants"]]
    procs.track(workers + descendants)
    assert len(descendants) == 6 and all(alive(d) for d in descendants)
    t0 = time.monotonic()
    p.kill()
    p.wait(timeout=5)
    poll_for(lambda: not any(alive(w) for w in workers), t0 + 2.0, "workers to die")
    t_workers = time.monotonic() - t0
    poll_for(lambda: not any(alive(d) for d in descendants)
             and not any(group_alive(w) for w in workers), t0 + 10.0, "descendants to die")
    t_all = time.monotonic() - t0
    print(f"\nbound: after SIGKILL of the launcher, workers gone in {t_workers * 1000:.0f} ms "
          f"(bound 2 s), descendants in {t_all * 1000:.0f} ms (bound 10 s)")


@pytest.mark.flaky(reruns=1)  # failed once under full-suite load before its grace was raised
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_launcher_reach_every_worker(procs, tmp_path, sig):
    extra = ["--on-term"] if sig == signal.SIGTERM else []
    # a long grace: on a loaded machine a worker's handler must not lose a race with SIGKILL
    p = procs.launch(["--nproc-per-node", "3", "--grace-period", "15", WORKER, str(tmp_path), "--hold", "60", *extra])
    recs = wait_ranks(str(tmp_path), range(3), time.monotonic() + 20)
    procs.track([rec["pid"] for rec in recs.values()])
    p.send_signal(sig)
    rc, out, err = finish(p, 25)
    assert rc == 128 + sig, err
    assert f"received {signal.Signals(sig).name}" in err
    if sig == signal.SIGTERM:
        assert all((tmp_path / f"term{r}").exists() for r in range(3)), err
    else:  # KeyboardInterrupt in every worker
        assert err.count("KeyboardInterrupt") >= 3


@pytest.mark.timeout(30)
def test_a_second_signal_kills_at_once(procs, tmp_path):
    p = procs.launch(["--nproc-per-node", "2", "--grace-period", "30", WORKER, str(tmp_path),
                      "--hold", "60", "--note-term"])
    recs = wait_ranks(str(tmp_path), range(2), time.monotonic() + 20)
    procs.track([rec["pid"] for rec in recs.values()])
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    poll_for(lambda: all((tmp_path / f"term{r}").exists() for r in range(2)), t0 + 5,
             "the first SIGTERM to reach the workers")
    p.send_signal(signal.SIGTERM)
    rc, out, err = finish(p, 10)
    assert rc == 128 + signal.SIGTERM and time.monotonic() - t0 < 5
    assert "received SIGTERM while stopping: killing every worker now" in err
    assert err.count("was killed by SIGKILL") == 2


# ---- bad arguments and rendezvous errors ---------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", "w.py"], "--nproc-per-node must be at least 1, got 0"),
    (["--nproc-per-node", "2", "no_such_script.py"], "script 'no_such_script.py' not found"),
    (["-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    ([], "no script given"),
    (["--nnodes", "2", WORKER], "--master-addr is required when --nnodes > 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", WORKER],
     "--node-rank 2 is out of range"),
    (["--gpus", "lots", WORKER], "expected a number of GPUs or 'auto'"),
    (["--grace-period", "inf", WORKER], "--grace-period must be a number of seconds >= 0 (got inf)"),
    (["--node-timeout", "nan", WORKER], "--node-timeout must be a positive number of seconds (got nan)"),
    (["--rdzv-timeout", "inf", WORKER], "--rdzv-timeout must be a positive number of seconds (got inf)"),
])
def test_bad_arguments_are_clear_errors(procs, args, message):
    rc, out, err = finish(procs.launch(args), 20)
    assert rc == 2 and message in err, err


@pytest.mark.timeout(30)
def test_port_in_use_is_a_clear_error(procs, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc, out, err = finish(procs.launch(["--master-port", str(port), WORKER, str(tmp_path)]), 20)
    assert rc == 2 and f"--master-port {port}" in err and "already in use" in err
    assert not list(tmp_path.iterdir())  # no worker started


@pytest.mark.timeout(30)
def test_a_node_that_never_arrives_is_named(procs, tmp_path):
    port = free_port()
    p = procs.launch(["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
                      str(port), "--rdzv-timeout", "1", WORKER, str(tmp_path)])
    rc, out, err = finish(p, 20)
    assert rc == 1 and "node(s) 1 of 2 never arrived" in err and f"127.0.0.1:{port}" in err
    p = procs.launch(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                      "--master-port", str(port), "--rdzv-timeout", "1", WORKER, str(tmp_path)])
    rc, out, err = finish(p, 20)
    assert rc == 1 and "node 0 never arrived" in err


# ---- two nodes on one host --------------------------------------------------------------

def _two_nodes(procs, tmp_path, worker_args, env=None, extra=()):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--rdzv-timeout", "20", *extra]
    nodes = [procs.launch([*common, "--node-rank", str(n), WORKER, str(tmp_path), *worker_args],
                          env=env) for n in (0, 1)]
    return finish_all(nodes, 25)


@pytest.mark.timeout(40)
def test_two_nodes_on_one_host(procs, tmp_path):
    results = _two_nodes(procs, tmp_path, [], env=launcher_env(RREFRT_SECRET="s3cret"))
    for rc, _, err in results:
        assert rc == 0, err
    recs = {r: read_json(tmp_path / f"rank{r}.json")["env"] for r in range(4)}
    assert [recs[r]["NODE_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [recs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert all(recs[r]["WORLD_SIZE"] == "4" and recs[r]["RREFRT_SECRET"] == "s3cret"
               for r in range(4))


@pytest.mark.timeout(40)
def test_a_failure_on_one_node_stops_the_other(procs, tmp_path):
    (rc0, _, err0), (rc1, _, err1) = _two_nodes(
        procs, tmp_path, ["--exit-rank", "3", "--hold", "60", "--wait-peers"])
    assert rc1 == 1 and "job failed: rank 3 (node 1, local rank 1" in err1
    assert rc0 == 1 and "job failed on node 1" in err0 and "rank 3 exited with code 3" in err0
    assert "| rank 3 exiting with code 3" in err0  # node 1's tail, carried by the store
    assert "stopped by the launcher (SIGTERM)" in err0


@pytest.mark.timeout(40)
def test_node_0_ends_when_the_other_nodes_ended_before_its_own_workers(procs, tmp_path):
    """Node 1's workers end at once, node 0's 3 s later: node 0 exits 0 as soon as its own
    do (it used to take the other nodes' "done" while its workers ran, ignore it, and then
    wait for it for good)."""
    t0 = time.monotonic()
    results = _two_nodes(procs, tmp_path, ["--hold", "3", "--hold-ranks", "0,1"])
    for rc, _, err in results:
        assert rc == 0, err
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(40)
def test_on_failure_continue_goes_on_and_still_exits_1(procs, tmp_path):
    """--on-failure continue without --dynamic: the other workers run to their end, and the
    launcher exits 1 (it used to exit 0 after reporting the failure); on two nodes, node 0
    exits 1 too and names the node."""
    p = procs.launch(["--nproc-per-node", "2", "--on-failure", "continue", WORKER, str(tmp_path),
                      "--exit-rank", "1", "--hold", "1", "--hold-ranks", "0"])
    rc, _, err = finish(p, 25)
    assert rc == 1 and "rank 1" in err and "exited with code 3" in err, err
    assert read_json(tmp_path / "rank0.json"), "rank 0 ran to its end"
    (rc0, _, err0), (rc1, _, err1) = _two_nodes(procs, tmp_path, ["--exit-rank", "3"],
                                                extra=("--on-failure", "continue"))
    assert rc1 == 1, err1
    assert rc0 == 1 and "node(s) 1 ended with a non-zero code" in err0, err0


@pytest.mark.timeout(60)
def test_the_dynamic_host_waits_for_a_joining_launcher_of_a_job_with_a_secret(procs, tmp_path):
    """With RREFRT_SECRET set (as docs/launcher.md says dynamic jobs should), the --join
    launcher's heartbeat proves the secret like its other store connections, and the
    --dynamic host keeps the store up until the joiner ends (the heartbeat used to be
    refused without a word, and the host ended after --node-timeout, under running workers)."""
    port = free_port()
    env = launcher_env(RREFRT_SECRET="0123456789abcdef0123456789abcdef")
    (tmp_path / "host").mkdir()
    (tmp_path / "joiner").mkdir()
    host = procs.launch(["-q", "--dynamic", "--master-port", str(port), "--node-timeout", "2",
                         WORKER, str(tmp_path / "host"), "--hold", "2"], env=env)  # the joiner arrives meanwhile
    poll_for(lambda: _listening(port) or host.poll() is not None, time.monotonic() + 30, "the --dynamic launcher's store")
    joined_at = time.monotonic()
    joiner = procs.launch(["-q", "--join", f"127.0.0.1:{port}", "--node-timeout", "2",
                           WORKER, str(tmp_path / "joiner"), "--hold", "6"], env=env)
    rc, _, err = finish(host, 40)
    assert rc == 0, err
    # the joiner's worker holds 6 s; without its heartbeat the host ended about 2 s after its own
    # worker (--node-timeout), some 4 s after the joiner started
    assert time.monotonic() - joined_at > 5.5, "the host ended while the joining launcher's worker still ran"
    rc, _, err = finish(joiner, 10)
    assert rc == 0, err


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(60)
def test_a_node_interrupted_during_the_rendezvous_can_be_started_again(procs, tmp_path):
    """Node 1 is interrupted (SIGINT) while it waits for node 2: it gives its node rank back,
    so a launcher started again for node 1 joins the job and all three nodes finish (the
    claim used to stay: the new node 1 was refused as a second claimant, naming the dead
    launcher, and the whole job failed)."""
    from rrefrt.group.store import StoreClient

    port = free_port()
    common = ["--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rdzv-timeout", "30", WORKER, str(tmp_path)]
    node0 = procs.launch(["--node-rank", "0", *common])
    poll_for(lambda: _listening(port) or node0.poll() is not None, time.monotonic() + 30, "node 0's store")
    first = procs.launch(["--node-rank", "1", *common])
    store = StoreClient("127.0.0.1", port, 5.0)
    try:
        poll_for(lambda: store.check(["launcher/node/1"]), time.monotonic() + 30, "node 1 registered")
    finally:
        store.close()
    first.send_signal(signal.SIGINT)
    rc, _, err = finish(first, 20)
    assert rc == 130, err
    again = procs.launch(["--node-rank", "1", *common])
    node2 = procs.launch(["--node-rank", "2", *common])
    for rc, _, err in finish_all([node0, again, node2], 40):
        assert rc == 0, err


@pytest.mark.timeout(40)
def test_nodes_with_different_secrets_refuse_to_start(procs, tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rdzv-timeout", "10", WORKER, str(tmp_path)]
    p0 = procs.launch(["--node-rank", "0", *common], env=launcher_env(RREFRT_SECRET="a"))
    p1 = procs.launch(["--node-rank", "1", *common], env=launcher_env(RREFRT_SECRET="b"))
    for p in (p0, p1):
        rc, out, err = finish(p, 25)
        assert rc == 1 and "different RREFRT_SECRET values" in err, err


@pytest.mark.timeout(40)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_lost_node_stops_the_job(procs, tmp_path, victim):
    """SIGKILL one node's launcher: its workers die with it, and the other node notices
    (node 0 by missing heartbeats after --node-timeout, node 1 by losing the store)."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--node-timeout", "1", "--rdzv-timeout", "20"]
    nodes = {n: procs.launch([*common, "--node-rank", str(n), WORKER, str(tmp_path),
                              "--hold", "60"]) for n in (0, 1)}
    recs = wait_ranks(str(tmp_path), range(2), time.monotonic() + 20)
    procs.track([rec["pid"] for rec in recs.values()])
    t0 = time.monotonic()
    nodes[victim].kill()
    survivor = 1 - victim
    rc, out, err = finish(nodes[survivor], 20)
    took = time.monotonic() - t0
    assert rc == 1
    if victim == 1:
        assert "node 1 was lost: its launcher sent no heartbeat for 1s" in err
    else:
        assert "lost contact with node 0's store" in err
    assert f"rank {survivor} (pid" in err and "stopped by the launcher (SIGTERM)" in err
    assert not alive(recs[victim]["pid"]) and not alive(recs[survivor]["pid"])
    print(f"\nnode {survivor} stopped {took:.2f}s after node {victim}'s launcher was killed")


@pytest.mark.timeout(40)
def test_sigusr1_says_what_node_0_waits_for(procs, tmp_path):
    """Node 0's workers are done, node 1's hold: SIGUSR1 to node 0's launcher prints its
    phase, its workers' ends and the node it still waits for (a stuck job says where)."""
    import threading

    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--rdzv-timeout", "20"]
    node0 = procs.launch([*common, "--node-rank", "0", WORKER, str(tmp_path)])
    procs.launch([*common, "--node-rank", "1", WORKER, str(tmp_path), "--hold", "60"])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(x.decode(errors="replace") for x in node0.stderr),
                              daemon=True)
    reader.start()
    recs = wait_ranks(str(tmp_path), range(2), time.monotonic() + 20)
    procs.track([rec["pid"] for rec in recs.values()])
    poll_for(lambda: not alive(recs[0]["pid"]), time.monotonic() + 10, "rank 0 to exit (it does not hold)")

    def waiting() -> list[str]:
        node0.send_signal(signal.SIGUSR1)  # once per poll, until the launcher has seen rank 0 end
        return [x for x in list(lines) if x.startswith("rrefrt-run: SIGUSR1: node 0 waiting_nodes")]
    text = poll_for(waiting, time.monotonic() + 10, "the SIGUSR1 status line", interval=0.5)[0]
    assert "node 0 waiting_nodes (waiting for the other nodes) after" in text, text
    assert f"rank 0 pid {recs[0]['pid']} exited with code 0" in text, text
    assert "waiting for node(s) 1 to report done" in text, text
    assert node0.poll() is None  # the job goes on
    print(f"\n{text}")


# ---- an rrefrt program --------------------------------------------------------------------

@pytest.mark.timeout(40)
def test_rrefrt_program_needs_no_rank_or_world_size(procs):
    p = procs.launch(["--nproc-per-node", "3", os.path.join(SCRIPTS, "rpc_ring.py")])
    rc, out, err = finish(p, 30)
    assert rc == 0, err
    for r in range(3):
        assert (f"[rank {r}] worker{r}: add -> {100 + r}; call from worker{r} handled by "
                f"rank {(r + 1) % 3}") in out
