"""Authentication (CURVE + ZAP from a per-job secret), the unpickling allowlist, and the
warning for unauthenticated workers beyond loopback (docs/security.md).

Real sockets on 127.0.0.1 throughout. The agent-level tests run agents in this process;
the group tests run workers as subprocesses (tests/support/worker_main.py), killed by pid at
teardown. Measured bounds are printed; run with ``pytest -s`` to see them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

import rrefrt
from rrefrt.payload import serialization
from rrefrt.api import warn_unauthenticated
from rrefrt.protocol.messages import PYTHON_CALL
from tests.support import workerfns as fns, zmq_transport
from tests.support import Workers, free_port, poll_for
from rrefrt_transport import PeerAddress, Transport, TransportConfig, create, AuthenticationFailed, CurveAuth, PeerSpec
from rrefrt_transport import wire
from rrefrt_transport.zmq import joinpolicy as agent_mod
from rrefrt_transport.zmq.security import ZapHandler, derive_keypair

pytestmark = pytest.mark.timeout(60)

SECRET = "test-secret-" + secrets.token_hex(8)
AUTH_BOUND_S = 10.0  #: a refused worker must fail this fast (init_timeout is much longer)


# ---------------------------------------------------------------------------- helpers
class _TouchOnLoad:
    """Unpickling this runs ``touch <path>``: the payload an attacker would post."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {shlex.quote(self.path)}",))


def evil_call(marker: Path, msg_id: int = 1) -> list[bytes]:
    """A PYTHON_CALL framed exactly like the runtime's (wire header + pickle payload) whose
    payload creates ``marker`` when it is unpickled."""
    head = wire.encode_header(PYTHON_CALL, msg_id, [[]])
    return [head, pickle.dumps((_TouchOnLoad(str(marker)), (), {}), protocol=5)]


def attacker(ctx: zmq.Context, endpoint: str, curve_server_key: bytes | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A raw DEALER posing as worker 0 (routing id b"w0"): NULL mechanism, or CURVE with a
    random keypair that knows the server's real public key. Returns (socket, monitor)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, b"w0")
    if curve_server_key is not None:
        pub, sec = zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
        s.setsockopt(zmq.CURVE_SECRETKEY, sec)
        s.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
    mon = s.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
    )
    s.connect(endpoint)
    return s, mon


def wait_handshake_result(mon: zmq.Socket, timeout: float) -> str:
    """The name of the first handshake event the attacker's monitor reports."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mon.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
            ev = parse_monitor_message(mon.recv_multipart())
            return zmq.Event(ev["event"]).name
    raise AssertionError(f"no handshake result within {timeout}s")


class _Agents:
    """Agents in this process, closed at teardown."""

    def __init__(self) -> None:
        self.agents: list[Transport] = []
        self.addresses: dict[str, PeerAddress] = {}  #: tcp endpoint -> the agent's address

    def make(self, wid: int, world: int, secret: str | None, on_message: Any = None) -> tuple[Transport, str]:
        config = TransportConfig(wid, f"w{wid}", 1000 + wid, heartbeat_interval=0.5, heartbeat_timeout=2.0,
                                 secret=secret.encode() if secret is not None else None, world_size=world,
                                 same_host=False)
        a = create(config, on_message or (lambda *args: None), lambda peer, cause: None)
        self.agents.append(a)
        address = a.listen()
        a.start()
        endpoint = address.endpoints["tcp"]
        self.addresses[endpoint] = address
        return a, endpoint

    def close(self) -> None:
        for a in self.agents:
            a.close()


@pytest.fixture
def agents() -> Iterator[_Agents]:
    made = _Agents()
    yield made
    made.close()


def join_all(agents: list[Transport], peers: list[PeerSpec], timeout: float) -> dict[int, BaseException | None]:
    """connect_peers on every agent at once; returns each one's error (or None)."""
    errors: dict[int, BaseException | None] = {}

    def run(a: Transport) -> None:
        try:
            a.connect_peers(peers, timeout)
            errors[a.id] = None
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[a.id] = e

    threads = [threading.Thread(target=run, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert len(errors) == len(agents), "connect_peers did not return"
    return errors


def spec(name: str, rank: int, world: int, port: int, **options: Any) -> dict[str, Any]:
    base = {"rpc_timeout": 20.0, "shutdown_timeout": 20.0, "init_timeout": 60.0}
    base.update(options)
    return {"name": name, "rank": rank, "world_size": world, "port": port, "options": base}


@contextlib.contextmanager
def pair(w1_options: dict[str, Any], w1_env: dict[str, str] | None = None, **w0_options: Any) -> Iterator[Workers]:
    """A 2-worker group: this process is w0, a subprocess is w1 (serving until shutdown)."""
    port = free_port()
    workers = Workers()
    try:
        w1 = workers.start(spec("w1", 1, 2, port, **w1_options), w1_env)
        # within the test's 60 s, so that a w1 that died at start is reported with its output
        opts = {"rpc_timeout": 20.0, "shutdown_timeout": 20.0, "init_timeout": 30.0}
        opts.update(w0_options)
        try:
            rrefrt.init_rpc(
                "w0", rank=0, world_size=2,
                rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **opts),
            )
        except Exception as e:
            workers.kill_all()
            out = w1.communicate(timeout=5)[0] if w1.stdout is not None else ""
            raise AssertionError(f"w0 could not join ({e}); w1 (exit code {w1.returncode}) printed:\n{out}") from e
        yield workers
        rrefrt.shutdown(timeout=20)
        for code, out in workers.wait_all(30):
            assert code == 0, out
    finally:
        if rrefrt.state.current_or_none() is not None:
            rrefrt.shutdown(graceful=False)
        workers.kill_all()


def agent_facts() -> dict[str, Any]:
    """Runs on a worker: what its transport knows (endpoints, counters, whether CURVE is on)."""
    agent = zmq_transport(rrefrt.state.current().transport)
    return {"endpoints": list(agent.endpoints), "stats": dict(agent.stats), "curve": agent._auth is not None}


# ---------------------------------------------------------------------------- keys and ZAP
def test_keys_derive_from_secret_and_rank_only() -> None:
    a0 = CurveAuth.for_job(SECRET, 0, 3)
    a2 = CurveAuth.for_job(SECRET.encode(), 2, 3)
    assert a0.peer_keys == a2.peer_keys and len(set(a0.peer_keys)) == 3
    assert a2.public_key == a0.peer_key(2) == derive_keypair(SECRET, 2)[0]
    assert zmq.curve_public(a2.secret_key) == a2.public_key
    assert CurveAuth.for_job("another secret", 0, 3).peer_keys[0] != a0.peer_keys[0]
    assert SECRET not in repr(a0) and a0.secret_key.decode() not in repr(a0)
    with pytest.raises(ValueError):
        CurveAuth.for_job("", 0, 1)


def test_zap_handler_admits_only_the_jobs_curve_keys() -> None:
    import collections

    from zmq.utils import z85

    auth = CurveAuth.for_job(SECRET, 0, 3)
    ctx = zmq.Context()
    stats: collections.Counter = collections.Counter()
    zap = ZapHandler(ctx, auth, stats)
    try:
        def ask(mechanism: bytes, *creds: bytes, version: bytes = b"1.0") -> list[bytes] | None:
            return zap.answer([b"rid", b"", version, b"7", b"rrefrt", b"127.0.0.1", b"", mechanism, *creds])

        member = z85.decode(auth.peer_key(2))
        stranger = z85.decode(zmq.curve_keypair()[0])
        other_job = z85.decode(CurveAuth.for_job("other", 2, 3).public_key)
        ok = ask(b"CURVE", member)
        assert ok is not None and ok[4] == b"200" and ok[6] == b"w2" and ok[3] == b"7"
        for reply in (ask(b"CURVE", stranger), ask(b"CURVE", other_job), ask(b"NULL"),
                      ask(b"PLAIN", b"user", b"pass"), ask(b"CURVE", member, version=b"2.0")):
            assert reply is not None and reply[4] == b"400"
        assert zap.answer([b"rid", b""]) is None
        assert stats["zap_admitted"] == 1 and stats["zap_denied"] == 5
    finally:
        zap.close()
        ctx.term()


# ---------------------------------------------------------------------------- agents
def test_agents_with_the_same_secret_form_the_mesh(agents: _Agents) -> None:
    made = [agents.make(i, 3, SECRET) for i in range(3)]
    peers = [PeerSpec(i, f"w{i}", 1000 + i, agents.addresses[ep]) for i, (_, ep) in enumerate(made)]
    t0 = time.monotonic()
    errors = join_all([a for a, _ in made], peers, 10.0)
    assert errors == {0: None, 1: None, 2: None}, errors
    print(f"\n3 CURVE agents joined in {time.monotonic() - t0:.3f}s")
    # every accepted connection went through the ZAP handler: on the data socket w1 accepts w0,
    # w2 accepts w0 and w1 (eager join: the lower id connects); every worker's heartbeat
    # socket accepts the heartbeat socket of each peer that watches it (all, eagerly: NOTE [Lazy
    # connections] in rrefrt_transport.zmq.agent), and its echo the heartbeat socket of each
    # other worker, and its own (the worker's own liveness, Rule 5 in rrefrt_transport.zmq.heartbeat)
    assert [a.stats["zap_admitted"] for a, _ in made] == [i + 2 + 2 + 1 for i in range(3)]
    assert all(a.stats["zap_denied"] == 0 and a.stats["handshake_failures"] == 0 for a, _ in made)


@pytest.mark.parametrize("secrets_", [("s-one", "s-two"), ("s-one", None), (None, "s-two")], ids=["different", "only-w0", "only-w1"])
def test_agents_that_cannot_authenticate_fail_the_join_naming_the_peer(agents: _Agents, secrets_: tuple) -> None:
    a0, ep0 = agents.make(0, 2, secrets_[0])
    a1, ep1 = agents.make(1, 2, secrets_[1])
    peers = [PeerSpec(0, "w0", 1000, agents.addresses[ep0]), PeerSpec(1, "w1", 1001, agents.addresses[ep1])]
    t0 = time.monotonic()
    errors = join_all([a0, a1], peers, 30.0)
    took = time.monotonic() - t0
    print(f"\n{secrets_}: both joins failed within {took:.3f}s: {errors}")
    assert isinstance(errors[0], AuthenticationFailed) and errors[0].peers == ["w1"], errors
    assert isinstance(errors[1], AuthenticationFailed) and errors[1].peers == ["w0"], errors
    assert "'w1'" in str(errors[0]) and "'w0'" in str(errors[1])
    assert took < agent_mod.ACCEPT_GRACE + 3.0, "must fail on the failed handshakes, not on the 30s timeout"


@pytest.mark.parametrize("secret", [None, SECRET], ids=["control-no-secret", "curve"])
def test_raw_connection_during_the_join_never_gets_its_pickle_decoded(agents: _Agents, tmp_path: Path, secret: str | None) -> None:
    """While worker 1 waits for worker 0, a raw socket poses as worker 0 (routing id b"w0")
    and posts a PYTHON_CALL whose pickle would create a marker file. The victim's handler
    decodes every payload it is given (as the runtime does). Without a secret the attack
    lands (the control: the payload and its framing are valid, after a HELLO with the
    member's published incarnation); with one it never does."""
    marker = tmp_path / "pwned"

    def on_message(src: int, kind: int, msg_id: int, meta: Any, frames: Any) -> None:
        with contextlib.suppress(Exception):
            serialization.loads(frames, [])

    victim, endpoint = agents.make(1, 2, secret, on_message)
    absent = free_port()  # worker 0 never comes: its record points nowhere
    nowhere = f"tcp://127.0.0.1:{absent}"
    peers = [PeerSpec(0, "w0", 1000, PeerAddress("elsewhere", {"tcp": nowhere, "tcp-live": nowhere, "tcp-echo": nowhere})),
             PeerSpec(1, "w1", 1001, agents.addresses[endpoint])]
    result: dict[int, BaseException | None] = {}
    join_timeout = 3.0 if secret is None else 20.0  # the control ends on its timeout

    def join() -> None:
        result.update(join_all([victim], peers, join_timeout))

    joiner = threading.Thread(target=join)
    joiner.start()
    ctx = zmq.Context()
    try:
        if secret is None:
            sock, _ = attacker(ctx, endpoint, None)

            # a pipe carries calls only after a HELLO of the member's incarnation (NOTE [Lazy
            # connections] (3) in rrefrt_transport.zmq.agent); without a secret the attacker
            # reads it from the store
            hello = [wire.encode_header(wire.HELLO, 0, [1000, "w0", 1 << 20])]

            def landed() -> bool:
                with contextlib.suppress(zmq.Again):  # resent until the victim's join began
                    sock.send_multipart(hello, zmq.NOBLOCK)
                    sock.send_multipart(evil_call(marker), zmq.NOBLOCK)
                return marker.exists()

            poll_for(landed, join_timeout, interval=0.05)
            return
        server_key = CurveAuth.for_job(secret, 1, 2).public_key
        outcomes = []
        for key in (None, server_key):  # NULL, then CURVE with a random key
            sock, mon = attacker(ctx, endpoint, key)
            with contextlib.suppress(zmq.Again):  # no connection to queue it on: refused already
                sock.send_multipart(evil_call(marker), zmq.NOBLOCK)
            outcomes.append(wait_handshake_result(mon, 5.0))
        assert outcomes[0].startswith("HANDSHAKE_FAILED") and outcomes[1] == "HANDSHAKE_FAILED_AUTH", outcomes
        t0 = time.monotonic()
        joiner.join(25)
        err = result.get(1)
        print(f"\nvictim's join failed {time.monotonic() - t0:.3f}s after the refused attacks: {err}")
        assert isinstance(err, AuthenticationFailed) and err.peers == ["w0"], err
        assert victim.stats["zap_denied"] == 1 and victim.stats["handshake_failures"] >= 2
        assert victim.stats["messages_received"] == 0
        assert not marker.exists()
    finally:
        ctx.destroy(0)
        joiner.join(25)


# ---------------------------------------------------------------------------- groups of processes
@pytest.fixture(scope="class")
def secure_pair() -> Iterator[Workers]:
    """w0 here (secret from the option), w1 a subprocess (secret from RREFRT_SECRET, as
    rrefrt-run passes it)."""
    with pair({}, {"RREFRT_SECRET": SECRET}, secret=SECRET) as workers:
        yield workers


class TestSameSecret:
    """Both tests share one group (torn down before the next test that starts one)."""

    def test_workers_with_the_same_secret_work(self, secure_pair: Workers) -> None:
        import torch

        t0 = time.monotonic()
        for i in range(20):
            assert rrefrt.rpc_sync("w1", fns.add, args=(i, 1)) == i + 1
        per_call = (time.monotonic() - t0) / 20
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert torch.equal(rrefrt.rpc_sync("w1", fns.add, args=(t, t)), t * 2)
        big = torch.randn(1 << 18)  # 1 MiB: a zero-copy frame, encrypted on the wire
        assert torch.equal(rrefrt.rpc_sync("w1", fns.identity, args=(big,)), big)
        assert rrefrt.rpc_sync("w1", fns.call_back, args=("w0", 2, 3)) == 5  # and the other way round
        facts = rrefrt.rpc_sync("w1", agent_facts)
        assert facts["curve"] and zmq_transport(rrefrt.state.current().transport)._auth is not None
        assert facts["stats"]["zap_admitted"] >= 1 and facts["stats"].get("zap_denied", 0) == 0
        print(f"\nCURVE rpc_sync round trip: {per_call * 1e6:.0f} us (mean of 20, first calls)")

    def test_raw_sockets_cannot_post_a_pickle_to_a_live_worker(self, secure_pair: Workers, tmp_path: Path) -> None:
        marker = tmp_path / "pwned"
        facts = rrefrt.rpc_sync("w1", agent_facts)
        denied_before = facts["stats"].get("zap_denied", 0)
        failures_before = facts["stats"].get("handshake_failures", 0)
        server_key = CurveAuth.for_job(SECRET, 1, 2).public_key
        ctx = zmq.Context()
        outcomes = []
        try:
            for endpoint in facts["endpoints"]:  # tcp:// and ipc://
                for key in (None, server_key):  # NULL; CURVE with a random key
                    sock, mon = attacker(ctx, endpoint, key)
                    with contextlib.suppress(zmq.Again):  # refused before it could be queued
                        sock.send_multipart(evil_call(marker), zmq.NOBLOCK)
                    outcomes.append(wait_handshake_result(mon, 5.0))
        finally:
            ctx.destroy(0)
        n = len(facts["endpoints"])
        # NULL: a mechanism mismatch (or, over ipc://, a connection closed on it); random key: ZAP says no
        assert all(o.startswith("HANDSHAKE_FAILED") for o in outcomes[0::2]), outcomes
        assert outcomes[1::2] == ["HANDSHAKE_FAILED_AUTH"] * n, outcomes
        # the worker keeps serving, and its counters say why nothing got through
        assert rrefrt.rpc_sync("w1", fns.add, args=(40, 2)) == 42
        after = poll_for(
            lambda: (s := rrefrt.rpc_sync("w1", agent_facts)["stats"])["handshake_failures"] >= failures_before + 2 * n and s,
            5.0,
        )
        assert after["zap_denied"] == denied_before + n
        assert not marker.exists(), "an unauthenticated payload was unpickled"


@pytest.mark.parametrize("w1_secret", ["a-different-secret", None], ids=["different", "missing"])
def test_worker_with_another_secret_is_refused_naming_the_peer(w1_secret: str | None) -> None:
    port = free_port()
    workers = Workers()
    try:
        t0 = time.monotonic()
        workers.start(spec("w0", 0, 2, port, secret=SECRET))
        w1_opts = {"secret": w1_secret} if w1_secret else {}
        workers.start(spec("w1", 1, 2, port, **w1_opts), {"RREFRT_SECRET": ""})
        outs = workers.wait_all(AUTH_BOUND_S + 20)
        took = time.monotonic() - t0
    finally:
        workers.kill_all()
    print(f"\nw1 secret {w1_secret!r}: both workers refused within {took:.2f}s (init_timeout 60s)")
    for (code, out), other in zip(outs, ("w1", "w0")):
        assert code != 0, out
        assert "rrefrt.errors.AuthenticationError" in out and f"worker {other!r}" in out, out
        assert "RREFRT_SECRET" in out, out
    assert took < AUTH_BOUND_S, f"refused after {took:.1f}s: must be prompt, not the init timeout"


def gadget_through_rrefrt_module(marker: Path) -> bytes:
    """A pickle naming ``os.system`` as ``rrefrt.runtime.core`` + ``os.system`` (pickle resolves
    dotted names through attributes): "anything in an rrefrt module" would let it through."""
    def text(t: str) -> bytes:
        b = t.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    return (b"\x80\x05" + text("rrefrt.runtime.core") + text("os.system") + pickle.STACK_GLOBAL
            + text(f"touch {shlex.quote(str(marker))}") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def test_allowlist_rejects_other_classes_at_the_callee(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    control = tmp_path / "control"
    serialization.loads([gadget_through_rrefrt_module(control)], [])  # no allowlist: it runs
    assert control.exists(), "the gadget must be a real one"
    allow = ["tests.support.workerfns.add", "tests.support.workerfns.identity"]
    with pair({"secret": SECRET, "unpickle_allowlist": allow}, secret=SECRET):
        assert rrefrt.rpc_sync("w1", fns.add, args=(1, 2)) == 3
        assert rrefrt.rpc_sync("w1", fns.identity, args=({"plain": [1, 2.5, "x", None]},)) == {"plain": [1, 2.5, "x", None]}
        t0 = time.monotonic()
        with pytest.raises(rrefrt.SerializationError, match="tests.support.workerfns.UserDefinedError' is not in the unpickling allowlist"):
            rrefrt.rpc_sync("w1", fns.identity, args=(fns.UserDefinedError("x"),))
        with pytest.raises(rrefrt.SerializationError, match="tests.support.workerfns.pid' is not in the unpickling allowlist"):
            rrefrt.rpc_sync("w1", fns.pid)
        print(f"\nallowlist rejections came back in {time.monotonic() - t0:.3f}s (2 calls)")
        # an authenticated peer posting the gadget directly through its transport
        got: dict[str, Any] = {}
        done = threading.Event()

        def on_done(meta: Any, frames: Any, error: Any) -> None:
            got.update(meta=meta, error=error, decoded=None if error else serialization.loads_error(frames, "w1"))
            done.set()

        rrefrt.state.current().transport.request(1, PYTHON_CALL, [[]], [gadget_through_rrefrt_module(marker)], 10.0, on_done)
        assert done.wait(10.0)
        assert got["error"] is None and got["meta"][0] == 1, got  # status ERROR
        assert isinstance(got["decoded"], rrefrt.SerializationError), got
        assert "rrefrt.runtime.core.os.system' is not in the unpickling allowlist" in str(got["decoded"])
        assert not marker.exists()
        assert rrefrt.rpc_sync("w1", fns.add, args=(2, 2)) == 4  # still serving


def test_allowlist_is_set_at_init_and_reset_at_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RREFRT_SECRET", raising=False)
    port = free_port()
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", unpickle_allowlist=["tests.support.workerfns.add"])
    rrefrt.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        assert serialization._allowlist == frozenset({"tests.support.workerfns.add"})
        assert rrefrt.rpc_sync("solo", fns.add, args=(1, 1)) == 2
        with pytest.raises(rrefrt.SerializationError, match="allowlist"):
            rrefrt.rpc_sync("solo", fns.identity, args=(1,))
    finally:
        rrefrt.shutdown()
    assert serialization._allowlist is None
    with pytest.raises(ValueError, match="module.qualname"):
        rrefrt.RpcBackendOptions(unpickle_allowlist="tests.support.workerfns.add")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- warning
def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "rrefrt" and r.levelno == logging.WARNING
            and "without authentication" in r.getMessage()]


def test_warning_for_no_secret_beyond_loopback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rrefrt")
    assert warn_unauthenticated("127.0.0.1") is False
    assert warn_unauthenticated("::1") is False
    assert _warnings(caplog) == []
    assert warn_unauthenticated("10.1.2.3") is True
    (record,) = _warnings(caplog)
    assert "10.1.2.3" in record.getMessage() and "RREFRT_SECRET" in record.getMessage()


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_init_on_a_non_loopback_address_warns_once_without_a_secret(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, secret: str | None
) -> None:
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    monkeypatch.delenv("RREFRT_SECRET", raising=False)
    caplog.set_level(logging.WARNING, logger="rrefrt")
    opts = rrefrt.RpcBackendOptions(init_method=f"tcp://{addr}:{free_port()}", secret=secret)
    rrefrt.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        assert rrefrt.rpc_sync("solo", fns.add, args=(1, 2)) == 3
        assert all(ep.startswith((f"tcp://{addr}:", "ipc://")) for ep in zmq_transport(rrefrt.state.current().transport).endpoints)
    finally:
        rrefrt.shutdown()
    assert len(_warnings(caplog)) == (1 if secret is None else 0), [r.getMessage() for r in caplog.records]


def test_secret_option_is_validated_and_never_shown() -> None:
    opts = rrefrt.RpcBackendOptions(secret="hunter2-" + SECRET)
    assert SECRET not in repr(opts)
    for bad in ("", b"", 42):
        with pytest.raises(ValueError, match="secret"):
            rrefrt.RpcBackendOptions(secret=bad)  # type: ignore[arg-type]
    assert issubclass(rrefrt.AuthenticationError, rrefrt.RpcError)
