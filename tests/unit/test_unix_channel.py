"""The write side of a stream channel (transport/unix/channel.py) with a scripted socket and
a host that plays the receiver loop at the moment the tests choose."""

from __future__ import annotations

import collections
from typing import Any

from rrefrt_transport.base import PeerAddress, PeerSpec
from rrefrt_transport.unix.channel import UP, Channel


class ScriptedSocket:
    """``sendmsg`` takes what ``takes`` says, call by call (None: everything; 0: full; -1:
    the socket failed, EPIPE)."""

    def __init__(self, takes: list[int | None]) -> None:
        self.takes = collections.deque(takes)
        self.sent = bytearray()

    def sendmsg(self, bufs: list, anc: Any = (), flags: int = 0) -> int:
        data = b"".join(bytes(b) for b in bufs)
        take = self.takes.popleft() if self.takes else None
        if take == 0:
            raise BlockingIOError
        if take == -1:
            raise BrokenPipeError(32, "Broken pipe")
        n = len(data) if take is None else min(take, len(data))
        self.sent += data[:n]
        return n


class LoopThatWritesAtOnce:
    """A host whose receiver loop takes EVENT_WRITE the moment it is asked for: on the
    sender's thread, while the sender still holds the send lock (what a loop on another
    core does between the sender's ``_ask_write`` and its release of the lock)."""

    closing = False

    def __init__(self) -> None:
        self.asked = 0

    def on_loop_thread(self) -> bool:
        return False

    def want_write(self, ch: Channel) -> None:
        self.asked += 1
        ch.want_write = False  # the loop's _writable: the event is taken ...
        ch.try_flush()  # ... and its flush finds the send lock held

    def broken(self, ch: Channel, cause: str) -> None:
        raise AssertionError(cause)


def _channel(sock: ScriptedSocket, host: Any) -> Channel:
    ch = Channel(PeerSpec(1, "b", 1, PeerAddress("h", {})), host, 1 << 20, collections.Counter())
    ch.sock, ch.state = sock, UP  # type: ignore[assignment]
    return ch


def _queue(ch: Channel, payload: bytes) -> None:
    ch.outq.append(([payload], (), len(payload)))
    ch.qbytes += len(payload)


def test_a_flush_that_found_the_socket_full_goes_round_again_when_the_loop_took_the_event_meanwhile() -> None:
    host = LoopThatWritesAtOnce()
    sock = ScriptedSocket([100, 0])  # a part, then full; after that it takes everything
    ch = _channel(sock, host)
    payload = bytes(range(256)) * 40
    _queue(ch, payload)
    ch.try_flush()
    assert host.asked == 1
    # before NOTE [Flush hand-over] the message stayed queued, want_write False: nobody wrote it
    assert bytes(sock.sent) == payload
    assert ch.cur is None and not ch.outq and ch.qbytes == 0


def test_a_flush_leaves_the_rest_to_the_loop_while_it_waits_for_the_event() -> None:
    class Waits(LoopThatWritesAtOnce):
        def want_write(self, ch: Channel) -> None:
            self.asked += 1  # the loop will take EVENT_WRITE later

    host = Waits()
    sock = ScriptedSocket([100, 0])
    ch = _channel(sock, host)
    _queue(ch, b"x" * 1000)
    ch.try_flush()
    assert host.asked == 1 and ch.want_write and ch.cur is not None and len(sock.sent) == 100
    ch.want_write = False  # the loop's EVENT_WRITE
    ch.try_flush()
    assert bytes(sock.sent) == b"x" * 1000 and ch.cur is None and ch.qbytes == 0


def test_a_flush_that_finds_the_socket_failed_stops_and_leaves_the_verdict_to_the_loop() -> None:
    """A failed write is reported once; the flush must not go round again (on the loop's own
    thread that would spin for ever: the verdict it waits for runs on that thread)."""

    class Reports(LoopThatWritesAtOnce):
        def __init__(self) -> None:
            super().__init__()
            self.broke: list[str] = []

        def broken(self, ch: Channel, cause: str) -> None:
            self.broke.append(cause)

    host = Reports()
    sock = ScriptedSocket([-1] * 1000)
    ch = _channel(sock, host)
    _queue(ch, b"x" * 1000)
    ch.try_flush()
    assert len(host.broke) == 1 and "Broken pipe" in host.broke[0]
    assert len(sock.takes) == 999, "one write, not one per round"


class _TruncatedFds:
    """A read whose file descriptors the kernel dropped (the receiver had none free)."""

    def recvmsg_into(self, bufs: list, ancbufsize: int = 0, flags: int = 0) -> tuple:
        import socket

        memoryview(bufs[0])[:4] = b"\0\0\0\0"
        return 4, [], socket.MSG_CTRUNC, None


def test_a_read_whose_fds_the_kernel_dropped_names_the_fd_shortage() -> None:
    """MSG_CTRUNC: the message that attached a segment's fd could not be decoded; the
    connection closes as on a protocol error (the peer goes through the inner transport),
    with the real cause, not as a peer naming a segment it never sent."""
    import pytest

    from rrefrt_transport.unix import wire as unix_wire

    ch = _channel(ScriptedSocket([]), LoopThatWritesAtOnce())
    ch.sock = _TruncatedFds()  # type: ignore[assignment]
    ch.reader = unix_wire.Reader(1 << 20)
    with pytest.raises(unix_wire.FdsDropped, match="no file descriptor free") as e:
        ch.read_some([])
    assert isinstance(e.value, unix_wire.ProtocolError) and "framing" not in e.value.cause()
