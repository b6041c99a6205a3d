"""The tcp stream plane (NOTE [Tcp stream plane] in transport/unix/transport.py) with real
processes over real TCP sockets on 127.0.0.1: alone (kind "stream") and inside the
composite transport (transport/auto.py, Rule 8). This process is worker 0;
tests/transport_helpers/unix_peer.py children are the others (killed by pid at the end of
every test)."""

from __future__ import annotations

import ctypes
import gc
import queue
import socket
import threading
import time

import pytest

from tests.support import poll_for
from tests.support.unix_support import Child, group, join_quietly, strangers_are_cut_off
from tests.transport_helpers.unix_peer import BIG, ECHO, IGNORE, pattern
from rrefrt_transport.auto import stream_enabled
from rrefrt_transport.base import PeerAddress, PeerSpec, TransportConfig
from rrefrt_transport.errors import AuthenticationFailed, PeerUnavailable
from rrefrt_transport.unix import admit
from rrefrt_transport.unix import transport as stream_transport
from rrefrt_transport.unix import wire as unix_wire
from rrefrt_transport.unix.admit import split_stream_endpoint
from rrefrt_transport.unix.transport import UnixTransport

pytestmark = pytest.mark.timeout(60)


def _address(frame: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(frame))


def test_the_stream_plane_carries_small_and_large_messages_over_tcp() -> None:
    with group(1, kind="stream") as g:
        assert g.joined == [{"event": "ready"}] and g.join_error is None
        assert ":" in g.children[0].hello["address"]["endpoints"]["stream"]
        meta, frames, err = g.call(1, ECHO, {"k": [1, "x"]}, [b"a", b"", b"ccc"])
        assert err is None and meta == {"k": [1, "x"]} and [bytes(f) for f in frames] == [b"a", b"", b"ccc"]
        mid = pattern(200 << 10)  # a body read out of the reader's buffer
        meta, frames, err = g.call(1, ECHO, "mid", [b"h", mid])
        assert err is None and bytes(frames[1]) == mid
        stats = g.t.stats
        assert stats["messages_sent"] >= 2 and not stats["shm_frames_sent"], "no shared memory over tcp"


def test_a_large_body_is_read_into_an_aligned_mapping_that_is_reused_once_its_frames_are_gone() -> None:
    """NOTE [Large bodies]: the largest frame starts on a 64-byte boundary (a tensor is rebuilt
    over it without a copy) and the mapping goes back to the pool when the frames go."""
    n = 40 << 20
    with group(1, kind="stream") as g:
        reused = unix_wire.BODIES.reused
        for i in range(3):
            meta, frames, err = g.call(1, BIG, {"n": n}, [], timeout=30)
            assert err is None and len(frames) == 1 and frames[0].nbytes == n
            assert not frames[0].readonly and _address(frames[0]) % 64 == 0
            assert bytes(frames[0][:1000]) == pattern(1000)
            del frames, meta
            gc.collect()
        assert unix_wire.BODIES.reused >= reused + 2, "the second and third bodies reuse a mapping"
        # a header of another length: the largest frame is still aligned
        meta, frames, err = g.call(1, ECHO, {"pad": "x" * 37}, [b"p" * 3, pattern(n)], timeout=30)
        assert err is None and _address(frames[1]) % 64 == 0 and bytes(frames[1][-100:]) == pattern(n)[-100:]


def test_an_eof_closes_the_stream_connection_without_judging_the_peer() -> None:
    """A reset may come from the network: the requests waiting on the connection fail at
    once, naming the cause, and the peer is not declared dead by the stream plane."""
    with group(1, kind="stream", heartbeat_interval=0.5, heartbeat_timeout=30.0) as g:
        errors: queue.Queue = queue.Queue()
        g.t.request(1, IGNORE, None, [b"x"], 60.0, lambda m, f, e: errors.put(e))
        poll_for(lambda: g.t.stats["messages_sent"] >= 1, 5, "the request is written")
        t0 = time.monotonic()
        g.children[0].kill()
        err = errors.get(timeout=5)
        assert time.monotonic() - t0 < 2.0
        assert isinstance(err, PeerUnavailable) and "w1" in str(err) and "tcp stream connection was closed" in str(err)
        assert g.t.stats["connections_lost"] == 1
        assert g.dead.empty() and 1 not in g.t.dead_peers(), "the stream plane alone judges nobody dead"
        g.t.request(1, ECHO, None, [], 5.0, lambda m, f, e: errors.put(e))
        assert isinstance(errors.get(timeout=5), PeerUnavailable), "the closed connection stays closed"


def test_a_different_secret_is_refused_over_the_stream_plane() -> None:
    with group(1, kind="stream", secret="ours", child_secret="theirs") as g:
        assert isinstance(g.join_error, AuthenticationFailed)


def test_the_stream_plane_is_off_with_a_secret_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 8: it does not encrypt, so a job with a secret keeps every byte on zmq's CURVE."""
    monkeypatch.delenv("RREFRT_TCP_STREAM", raising=False)
    assert stream_enabled(TransportConfig(0, "a", 1))
    assert not stream_enabled(TransportConfig(0, "a", 1, secret=b"s"))
    assert not stream_enabled(TransportConfig(0, "a", 1, extra={"stream": False}))
    monkeypatch.setenv("RREFRT_TCP_STREAM", "off")
    assert not stream_enabled(TransportConfig(0, "a", 1))


@pytest.mark.parametrize("how", ["default", "env_off", "extra_off"])
def test_auto_sends_peers_it_does_not_reach_over_the_same_host_plane_over_the_stream(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"RREFRT_SAME_HOST": "0", "RREFRT_TCP_STREAM": "0" if how == "env_off" else "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kw: dict = {"stream": False} if how == "extra_off" else {}
    with group(1, kind="auto", auto_inner="zmq", child_env=env, **kw) as g:
        assert g.join_error is None and g.joined == [{"event": "ready"}]
        on = how == "default"
        big = pattern(3 << 20)
        meta, frames, err = g.call(1, ECHO, "m", [b"x", big])
        assert err is None and meta == "m" and bytes(frames[1]) == big
        assert not g.t.uses_same_host_path(1)
        assert g.t.uses_stream_path(1) is on
        assert (g.t.stream is not None) is on
        if on:
            assert g.t.stream.stats["messages_sent"] >= 1 and g.t.stream.connected_peers() == {1}
        # a request pending when the peer is killed fails at once over the stream (EOF), and
        # the inner transport's liveness then judges the death
        errors: queue.Queue = queue.Queue()
        g.t.request(1, IGNORE, None, [], 60.0, lambda m, f, e: errors.put(e))
        g.children[0].kill()
        assert isinstance(errors.get(timeout=10), PeerUnavailable)
        assert g.dead.get(timeout=15)[0] == 1 and not g.t.is_alive(1)


def test_a_stranger_at_the_stream_port_is_refused_before_anything_is_decoded() -> None:
    """The port is reachable from the network: junk, a peer id outside the group, and a
    connection that sends nothing are cut off by admission; nothing reaches on_message."""
    messages: queue.Queue = queue.Queue()
    t = UnixTransport(TransportConfig(5, "w5", 7, kind="stream"), lambda *a: messages.put(a), lambda p, c: None,
                      plane="stream")
    try:
        family, addr = split_stream_endpoint(t.listen().endpoints["stream"])
        t.start()
        absent = PeerSpec(1, "w1", 8, PeerAddress("h", {"stream": "127.0.0.1:9"}))
        threading.Thread(target=lambda: join_quietly(t, absent), daemon=True).start()
        strangers_are_cut_off(family, addr)
        poll_for(lambda: t.stats["unix_refused"] >= 2, 5, "both strangers are refused")
        assert messages.empty() and t.stats["messages_received"] == 0
    finally:
        t.close()


def test_a_peer_whose_stream_port_cannot_be_reached_is_given_up_within_seconds() -> None:
    """Its port listens before it is published, so a connect that keeps failing means the
    path is blocked: what waits on the channel fails naming the cause, and on_closed sends
    the peer through the inner transport, after STREAM_UNREACHABLE, not CONNECT_TIMEOUT."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connects are refused
    t = UnixTransport(TransportConfig(0, "w0", 7, kind="stream", connect="lazy"), lambda *a: None,
                      lambda p, c: None, plane="stream")
    closed_paths: queue.Queue = queue.Queue()
    t.on_closed = lambda peer, cause: closed_paths.put((peer, cause))
    t.on_connect_wanted = lambda peer: None
    try:
        t.listen()
        t.start()
        t.connect_peers([PeerSpec(1, "w1", 8, PeerAddress("h", {"stream": f"127.0.0.1:{closed}"}))], 5.0)
        errors: queue.Queue = queue.Queue()
        t0 = time.monotonic()
        t.request(1, ECHO, None, [b"x"], 60.0, lambda m, f, e: errors.put(e))
        err = errors.get(timeout=stream_transport.STREAM_UNREACHABLE + 5)
        took = time.monotonic() - t0
        assert isinstance(err, PeerUnavailable) and "could not be made" in str(err) and "refused" in str(err).lower()
        assert stream_transport.STREAM_UNREACHABLE <= took < stream_transport.STREAM_UNREACHABLE + 3, took
        assert closed_paths.get(timeout=1)[0] == 1
        assert t.stats["connect_retries"] > 0 and t.stats["connections_failed"] == 1
    finally:
        t.close()


def test_the_peer_that_asked_for_a_connection_gives_up_when_told_it_could_not_be_made() -> None:
    """Lazy connections: the higher id asks the lower one to connect; when the lower one
    cannot, it says so (the composite carries it over zmq: ``on_connect_failed`` ->
    ``connect_failed``) and the higher one's waiting messages fail at once, not at its
    CONNECT_TIMEOUT."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
    probe.close()

    def lazy(wid: int) -> UnixTransport:
        t = UnixTransport(TransportConfig(wid, f"w{wid}", 7, kind="stream", connect="lazy"), lambda *a: None,
                          lambda p, c: None, plane="stream")
        t.listen()
        t.start()
        return t

    low, high = lazy(0), lazy(1)
    try:
        low.on_connect_wanted = lambda peer: None
        high.on_connect_wanted = lambda peer: low.connect_wanted(1)  # what the composite carries
        low.on_connect_failed = lambda peer, cause: high.connect_failed(0, cause)  # likewise
        # the high one's address, as the low one has it, is one where nothing listens
        low.connect_peers([PeerSpec(1, "w1", 7, PeerAddress("h", {"stream": f"127.0.0.1:{closed}"}))], 5.0)
        high.connect_peers([PeerSpec(0, "w0", 7, PeerAddress("h", {"stream": "127.0.0.1:9"}))], 5.0)
        errors: queue.Queue = queue.Queue()
        t0 = time.monotonic()
        high.request(0, ECHO, None, [b"x"], 60.0, lambda m, f, e: errors.put(e))
        err = errors.get(timeout=stream_transport.STREAM_UNREACHABLE + 5)
        assert isinstance(err, PeerUnavailable) and "'w0' could not connect" in str(err), err
        assert time.monotonic() - t0 < stream_transport.STREAM_UNREACHABLE + 3
    finally:
        low.close()
        high.close()


@pytest.mark.timeout(20)
def test_a_body_dropped_while_the_pool_is_locked_does_not_deadlock_the_dropping_thread() -> None:
    """A garbage collection may finalize a holder inside ``take`` (the pool's lock held) on
    the same thread: giving a mapping back takes no lock."""
    pool = unix_wire.BodyPool(64 << 20)
    view = pool.take(2 << 20)
    with pool._lock:
        del view
        gc.collect()  # the finalizer runs here, on this thread, under the lock
    again = pool.take(2 << 20)
    assert pool.reused == 1 and again.nbytes == 2 << 20


def test_a_connection_lost_in_the_middle_of_a_large_body_drops_it() -> None:
    """NOTE [Large bodies]: the half-read body of a connection that ended is not kept by its
    dead channel's reader."""
    with group(1, kind="stream", heartbeat_timeout=30.0, child_extra={"slow_send": True}) as g:
        got: queue.Queue = queue.Queue()
        g.t.request(1, BIG, {"n": 40 << 20}, [], 60.0, lambda m, f, e: got.put(e))
        poll_for(lambda: g.t.stats["bytes_received"] > 1 << 20, 20, "the body is on its way")
        ch = g.t._peers[1]
        assert ch.reader is not None and ch.reader.big is not None
        g.children[0].kill()
        assert isinstance(got.get(timeout=10), PeerUnavailable)
        poll_for(lambda: ch.reader is None, 5, "the dead channel's reader is dropped")


def test_abandoning_a_plane_closes_its_connections_without_a_death_on_either_side() -> None:
    """The composite gives a plane up when its join fails: its peers are told CLOSE, not BYE,
    so none takes this live worker for gone (both go on over the inner transport)."""
    with group(1, kind="stream") as g:
        assert g.call(1, ECHO, "m", [])[0] == "m"
        g.t.abandon("its tcp stream join failed: a test", 1.0)
        child = g.children[0]
        poll_for(lambda: _child_stats(child)["stats"].get("connections_closed_by_peer") == 1, 10,
                 "the peer closed its side")
        st = _child_stats(child)
        assert st["dead_peers"] == [] and not st["stats"].get("peers_declared_dead"), st


def test_strangers_waiting_for_admission_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admit, "MAX_ADMITTING", 2)
    t = UnixTransport(TransportConfig(5, "w5", 7, kind="stream"), lambda *a: None, lambda p, c: None, plane="stream")
    idle = []
    try:
        family, addr = split_stream_endpoint(t.listen().endpoints["stream"])
        t.start()
        for _ in range(5):  # they send nothing: each would wait ADMIT_TIMEOUT
            s = socket.socket(family, socket.SOCK_STREAM)
            s.connect(addr)
            idle.append(s)
        poll_for(lambda: t.stats["unix_refused"] >= 3, 5, "the connections past the cap are refused at once")
        assert len(t._acceptor.conns) == 2
    finally:
        for s in idle:
            s.close()
        t.close()


def _child_stats(child: Child) -> dict:
    child.tell({"cmd": "stats"})
    return child.expect("stats", 10)
