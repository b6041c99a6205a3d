"""transport/zmq/lend.py's state machine on its own (no sockets): NOTE [Lent frames]."""

from __future__ import annotations

import time

import zmq

from rrefrt_transport.zmq import lend


def test_prepare_lends_only_large_mutable_frames_off_the_loop_thread() -> None:
    big, small = bytearray(lend.LEND_MIN), bytearray(10)
    frame = zmq.Frame(b"received")
    msg, n = lend.prepare([b"header", big, small, frame, memoryview(bytes(lend.LEND_MIN))], False)
    assert isinstance(msg, lend.Lent) and n == 2 * lend.LEND_MIN
    assert msg.lent == [False, True, False, False, True]  # a memoryview may alias mutable memory
    assert msg[1] is big and type(msg[2]) is bytes and msg[3] is frame  # small copied, Frame as is
    out, n = lend.prepare([b"header", big], True)  # the loop's own thread never waits for itself
    assert not isinstance(out, lend.Lent) and n == 0 and type(out[1]) is bytes
    assert lend.prepare([b"h", memoryview(bytearray(2 * lend.LEND_MIN))[::2]], False)[1] == 0  # not contiguous: copied


def test_sender_gives_up_without_copying_when_the_peer_is_gone_and_copies_at_its_deadline() -> None:
    big = bytearray(lend.LEND_MIN)
    msg, _ = lend.prepare([b"h", big], False)
    t0 = time.monotonic()
    assert lend.await_release(msg, lambda: True, None) is True  # peer dead / closing
    assert time.monotonic() - t0 < 5 and msg.state == lend.DROPPED and msg[1] is big  # no copy made
    assert lend.begin(msg) == []  # the loop sends nothing from the caller's memory any more

    msg, _ = lend.prepare([b"h", big], False)
    assert lend.await_release(msg, lambda: False, time.monotonic() + 0.2) is True  # still queued
    assert msg.state == lend.COPIED and type(msg[1]) is bytes and lend.begin(msg) is None


def test_loop_side_refused_send_goes_back_to_waiting_and_a_sent_one_is_released() -> None:
    msg, _ = lend.prepare([b"h", bytearray(lend.LEND_MIN)], False)
    parts = lend.begin(msg)
    assert msg.state == lend.SENDING and isinstance(parts[1], zmq.Frame)
    lend.finish(msg, parts, False)  # no route yet: into the backlog
    assert msg.state == lend.WAITING and not msg.released.is_set()
    parts = lend.begin(msg)
    lend.finish(msg, parts, True)
    assert msg.state == lend.SENT and msg.released.is_set() and msg == [] and parts == []
    # never sent through a socket: the tracker completes once the zmq.Frame is gone
    assert lend.await_release(msg, lambda: False, time.monotonic() + 10) is True
