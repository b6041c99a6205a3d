"""Shared-memory segments (transport/unix/shm.py): the pool, aliasing frames and their release,
and no leak when a peer is SIGKILLed mid-transfer (real processes, real sockets)."""

from __future__ import annotations

import gc
import os
import queue
import threading

import pytest

from tests.support import poll_for
from tests.transport_helpers.unix_peer import BIG, ECHO, HOLD, pattern
from tests.support.unix_support import group
from rrefrt_transport.unix import shm


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _receive(seg: shm.Segment, sizes: list[int]) -> tuple:
    """What a receiver does: map the segment, take its frames (they alias it)."""
    mapping = shm.map_segment(seg.fd)
    return mapping, shm.frames_of(mapping, sizes, seg.lease)


def test_pool_lends_reclaims_marked_segments_and_caps_idle_bytes() -> None:
    pool = shm.SegmentPool("t", max_idle_bytes=3 << 20)
    try:
        a = pool.acquire(100, peer=1)
        assert a.size == shm.MIN_SEGMENT and a.lent_to == 1 and pool.lent() == 1
        a.known_by.add(1)
        mapping, frames = _receive(a, [100])
        assert pool.acquire(shm.MIN_SEGMENT, peer=2) is not a, "a segment whose frames live stays lent"
        del frames
        gc.collect()
        assert a.released() and pool.lent() == 1, "the receiver marked it; counted as lent no more"
        b = pool.acquire(shm.MIN_SEGMENT, peer=2)
        assert b is a and b.lent_to == 2 and not b.released(), "a marked segment is reclaimed and lent again"
        shm.unmap(mapping)
        c = pool.acquire(3 << 20, peer=2)  # 4 MB class
        c.known_by.update({1, 2})
        for seg in (b, c):
            shm.mark_released(seg.map, seg.lease)
        assert sorted(pool.sweep()) == [(1, c.id), (2, c.id)], "over the cap: closed, its holders told"
        assert pool.count() == 2 and pool.lent() == 1, "the 1 MB one lent to peer 2 above is still out"
        d = pool.acquire(10, peer=3)  # the idle 1 MB one (peer 1 still maps it)
        assert d is a and pool.peer_gone(3) == [(1, d.id)] and d.lent_to is None, "unmarked: closed, peer 1 told"
        assert pool.count() == 1 and pool.dropped() == 1, "and not pooled (NOTE [Segments] (3))"
    finally:
        pool.close()
    assert shm.count_memfds() == 0


def test_a_segment_a_gone_peer_did_not_mark_is_closed_and_never_lent_again() -> None:
    """NOTE [Segments] (3): a peer's connection closed while it held frames of a segment (it
    may go on running): the segment is closed on our side, not pooled, so the next message
    gets another one; the peer's frames keep their bytes, what it writes into them lands in
    no other message, and its late mark returns nothing."""
    pool = shm.SegmentPool("t")
    try:
        a = pool.acquire(100, peer=1)
        a.known_by.update({1, 2})
        a.map[:5] = b"first"
        mapping, frames = _receive(a, [100])
        assert pool.peer_gone(1) == [(2, a.id)], "its other holder is told to forget it"
        assert pool.count() == 0 and pool.lent() == 0 and pool.dropped() == 1
        b = pool.acquire(100, peer=2)
        assert b is not a and b.id != a.id
        b.map[:5] = b"other"
        assert bytes(frames[0][:5]) == b"first", "the gone peer's frames keep their bytes"
        frames[0][:5] = b"wrote"  # it updates its tensor in place
        assert bytes(b.map[:5]) == b"other", "and that lands in no other message"
        del frames  # it lets go of its frames only now: it marks its mapping
        gc.collect()
        assert not b.released() and pool.sweep() == [] and b.lent_to == 2, "which returns nothing"
        shm.unmap(mapping)
    finally:
        pool.close()
    assert shm.count_memfds() == 0


def test_received_frames_alias_the_segment_and_mark_it_when_dropped() -> None:
    pool = shm.SegmentPool("t")
    try:
        sizes = [5000, 1 << 20]
        seg = pool.acquire(shm.layout(sizes)[1], peer=1)
        offsets, _ = shm.layout(sizes)
        seg.map[offsets[1] : offsets[1] + 3] = b"abc"
        mapping, frames = _receive(seg, sizes)
        assert [len(f) for f in frames] == sizes and bytes(frames[1][:3]) == b"abc"
        seg.map[offsets[1] : offsets[1] + 3] = b"xyz"
        assert bytes(frames[1][:3]) == b"xyz", "the frame aliases the segment: no copy"
        view = memoryview(frames[1])[1:2]  # a derived view keeps the mapping alive
        del frames
        gc.collect()
        assert not seg.released()
        del view
        gc.collect()
        assert seg.released()
        seg = pool.acquire(shm.layout(sizes)[1], peer=1)
        out = shm.frames_of(mapping, sizes, seg.lease, copy_out=True)
        assert seg.released() and isinstance(out[1], bytes) and out[1][:3] == b"xyz"
        with pytest.raises(ValueError, match="in a segment of"):
            shm.frames_of(mapping, [len(mapping)], seg.lease)
        shm.unmap(mapping)
    finally:
        pool.close()


@pytest.mark.timeout(90)
def test_no_segment_outlives_a_peer_sigkilled_mid_transfer() -> None:
    dev_shm = _dev_shm()
    base = shm.count_memfds()
    with group(1, shm_threshold=256 << 10) as g:
        # segments we received from the peer and still hold, and ones it holds from us
        held = [g.call(1, BIG, {"n": 2 << 20}, [])[1] for _ in range(2)]
        for _ in range(2):
            assert g.call(1, HOLD, None, [pattern(1 << 20)])[2] is None
        child = g.children[0]
        child.tell({"cmd": "stats"})
        st = child.expect("stats", 10)
        assert st["held"] == 2 and st["memfds"] >= 2
        # now keep 16 MB frames flowing from two threads and SIGKILL the peer mid-way
        stop = threading.Event()
        errors: queue.Queue = queue.Queue()
        frame = pattern(16 << 20)

        def pump() -> None:
            while not stop.is_set():
                try:
                    g.t.request(1, ECHO, None, [frame], 10.0, lambda m, f, e: errors.put(e))
                except Exception as e:  # noqa: BLE001 - recorded and checked below
                    errors.put(e)
                    return

        threads = [threading.Thread(target=pump, daemon=True) for _ in range(2)]
        for th in threads:
            th.start()
        poll_for(lambda: g.t.stats["shm_frames_sent"] >= 6, 20, "large frames are flowing")
        child.kill()
        poll_for(lambda: not g.t.is_alive(1), 2, "the killed peer is declared dead")
        stop.set()
        for th in threads:
            th.join(5)
        assert g.t.shm_segments()[1] == 0, "no segment is lent to the dead peer any more"
        fds_before_release = shm.count_memfds()
        del held
        gc.collect()
        own = g.t.shm_segments()[0]
        # left: our own pooled segments (fd + the pool's mapping each), nothing of the peer's
        poll_for(lambda: shm.count_memfds() == base + 2 * own, 5,
                 lambda: f"memfds {shm.count_memfds()} (before release {fds_before_release}), own segments {own}")
    assert shm.count_memfds() == base, "closing the transport closes every segment"
    assert _dev_shm() == dev_shm, "nothing is ever created in /dev/shm"


def test_segments_of_a_response_return_when_the_caller_drops_them() -> None:
    with group(1, shm_threshold=256 << 10) as g:
        got: queue.Queue = queue.Queue()
        g.t.request(1, BIG, {"n": 1 << 20}, [], 10.0, lambda m, f, e: got.put(e))
        assert got.get(timeout=10) is None
        child = g.children[0]
        poll_for(lambda: (child.tell({"cmd": "stats"}) or child.expect("stats", 5))["segments"][1] == 0, 5,
                 "the child's segment came back after we dropped the frame")
