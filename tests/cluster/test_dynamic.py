"""Dynamic groups (init_rpc without world_size; docs/dynamic-groups.md): real processes and
sockets on 127.0.0.1. One scenario starts one cluster and checks join (calls both ways),
duplicate name and rank, leave, a join after a leave, and eviction of a SIGKILLed member;
tests/support/dynamic_worker.py is the driver (it starts the members in its own process group, which
the test kills whatever happens). The unit tests below use no processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.support import ROOT, Workers, env_for, free_port, poll_for

import rrefrt
from rrefrt.group.membership import Event
from rrefrt.group.rendezvous import DYNAMIC, resolve


@pytest.mark.timeout(240)
def test_join_leave_evict_and_refusals() -> None:
    port = free_port()
    workers = Workers()
    try:
        p = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "dynamic_worker.py"), "driver", "driver", "0", str(port)],
            env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        workers.procs.append(p)
        (code, text), = workers.wait_all(200)
    finally:
        workers.kill_all()
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert code == 0 and lines, text[-6000:]
    r = json.loads(lines[0][7:])

    # join into a running group; calls both ways, also between joiners
    assert r["alone"] == ["driver"]
    assert r["after_joins"] == ["driver", "w1", "w2"] and r["w1_sees"] == ["driver", "w1", "w2"]
    assert r["to_w1"] == 3 and r["w2_via_w1"] == 42 and r["w1_via_w2"] == 42

    # a taken name or rank is refused with torch's phrase, naming the holder; nothing changes
    assert r["dup_name"]["type"] == "RendezvousError", r["dup_name"]
    assert "'w1' is not unique" in r["dup_name"]["msg"] and "rank 1" in r["dup_name"]["msg"]
    assert "rank 2 is not unique" in r["dup_rank"]["msg"] and "'w2'" in r["dup_rank"]["msg"], r["dup_rank"]
    assert r["after_dups"] == ["driver", "w1", "w2"]

    # leave: calls to the leaver fail at once with WorkerUnavailableError naming it
    assert r["rref_before"] == [5, 5] and r["w1_exit"][0] == 0, r["w1_exit"]
    assert r["call_left"]["unavailable"] and "'w1' left the group" in r["call_left"]["msg"], r["call_left"]
    assert r["rref_left"]["type"] == "OwnerDiedError", r["rref_left"]
    assert r["w2_sees"] == ["driver", "w2"]

    # a join after a leave
    assert r["w3_via_w2"] == 42

    # SIGKILL: the call in flight fails within the liveness bound, the member is evicted everywhere
    assert r["inflight_killed"]["unavailable"] and "'w2'" in r["inflight_killed"]["msg"], r["inflight_killed"]
    assert r["inflight_killed"]["secs"] < 30, r["inflight_killed"]
    assert r["call_evicted"]["unavailable"] and "'w2' was evicted" in r["call_evicted"]["msg"], r["call_evicted"]
    assert r["w3_sees"] == ["driver", "w3"] and r["w3_exit"][0] == 0, r["w3_exit"]
    assert all(v == 0 for v in r["debug"].values()), r["debug"]


def test_resolve_without_world_size_is_dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    spec = resolve("tcp://127.0.0.1:1234", 3, None)
    assert spec.world_size == DYNAMIC and spec.rank == 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve("tcp://127.0.0.1:1234", 3, None).world_size == 4  # the environment still wins


def test_event_wire_round_trip() -> None:
    ev = Event("evict", 5, 123456789, "w5", b"", "declared dead by worker 'w0'")
    assert Event.from_wire(ev.to_wire()) == ev


def test_get_worker_infos_needs_init() -> None:
    with pytest.raises(rrefrt.ShutdownError):
        rrefrt.get_worker_infos()


@pytest.mark.timeout(240)
def test_launcher_adds_workers_to_a_running_job() -> None:
    """rrefrt-run --dynamic hosts the store and starts a worker; rrefrt-run --join adds two
    to the running job; the host's launcher waits for the joining launcher to finish."""
    port = free_port()
    script = str(ROOT / "tests" / "launcher_scripts" / "dynamic_job.py")
    workers = Workers()
    try:
        host = subprocess.Popen(
            [sys.executable, "-m", "rrefrt.run", "-q", "--dynamic", "--master-port", str(port), script, "host"],
            env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        workers.procs.append(host)
        poll_for(lambda: _listening(port) or host.poll() is not None, 60, "the --dynamic launcher's store")
        joiner = subprocess.Popen(
            [sys.executable, "-m", "rrefrt.run", "-q", "--join", f"127.0.0.1:{port}", "--nproc-per-node", "2",
             script, "joiner"],
            env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        workers.procs.append(joiner)
        (hcode, htext), (jcode, jtext) = workers.wait_all(200)
    finally:
        workers.kill_all()
    assert jcode == 0, jtext[-4000:]
    assert hcode == 0, htext[-4000:]
    assert "HOST host0 called back ['joiner1', 'joiner2']" in htext, htext[-4000:]
    assert jtext.count("dynamic True called back True") == 2, jtext[-4000:]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
