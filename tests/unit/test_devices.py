"""Unit tests of device maps, their validation at init, and the call scope (rrefrt/payload/devices.py).

Fake device lists stand in for GPUs: every rule runs on a CPU-only machine.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from rrefrt.payload import devices as dv
from rrefrt.payload.buffers import DeviceMapError, Route
from rrefrt.run import devices as launcher_devices

UUIDS = ("GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd")


def gpus(n, uuids=None):
    return lambda: dv.CudaProbe(n, tuple(uuids if uuids is not None else UUIDS[:n]))


def info(name, devices=(), maps=None, n=2, uuids=None, env=None):
    return dv.DeviceInfo.local(name, list(devices), maps or {}, env or {}, gpus(n, uuids))


def published(*infos):
    """As every worker sees them: through to_meta/from_meta (plain data, the rendezvous)."""
    return {i.name: dv.DeviceInfo.from_meta(i.name, i.to_meta()) for i in infos}


def plan(me, *infos, same_host=None):
    return dv.DevicePlan.build(me, published(*infos), same_host)


def fails_everywhere(*infos, match=()):
    """A bad configuration fails init on every worker with the same message."""
    texts = set()
    for i in infos:
        with pytest.raises(DeviceMapError) as e:
            plan(i.name, *infos)
        texts.add(str(e.value))
    assert len(texts) == 1, texts
    text = texts.pop()
    for m in match:
        assert m in text, (m, text)
    return text


# ---------------------------------------------------------------------------- normalize
@pytest.mark.parametrize("given,expect", [
    (0, "cuda:0"), (3, "cuda:3"), ("cuda", "cuda:0"), ("cuda:2", "cuda:2"), ("cpu", "cpu"),
    (torch.device("cuda", 1), "cuda:1"), (torch.device("cpu"), "cpu"),
])
def test_normalize(given, expect):
    assert dv.normalize_device(given) == expect


@pytest.mark.parametrize("bad", [-1, True, "gpu0", "cuda:x", "mps", "cuda:0:1"])
def test_normalize_rejects(bad):
    with pytest.raises(DeviceMapError):
        dv.normalize_device(bad)


# ---------------------------------------------------------------------------- routes
def test_request_uses_callers_map_and_reply_its_inverse():
    a = info("a", ["cuda:0", "cuda:1"], {"b": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}})
    b = info("b", ["cuda:0", "cuda:1"], {"a": {"cuda:0": "cuda:0"}})  # b's own map plays no part in replies to a
    pa, pb = plan("a", a, b), plan("b", a, b)
    assert dict(pa.request_route("b").device_map) == {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}
    # b replies to a with the inverse of a's map: a reply lands where a sent from
    assert dict(pb.reply_route("a").device_map) == {"cuda:1": "cuda:0", "cuda:0": "cuda:1"}
    assert dict(pb.request_route("a").device_map) == {"cuda:0": "cuda:0"}
    assert dict(pa.reply_route("b").device_map) == {"cuda:0": "cuda:0"}


def test_reply_lands_on_the_device_the_caller_sent_from():
    a = info("a", ["cuda:1"], {"b": {"cuda:1": "cuda:0"}})
    b = info("b", ["cuda:0"])
    pa, pb = plan("a", a, b), plan("b", a, b)
    arg_on = pa.request_route("b").device_map["cuda:1"]  # the argument arrives on b's cuda:0
    assert arg_on == "cuda:0"
    assert pb.reply_route("a").device_map[arg_on] == "cuda:1"  # and the result returns to a's cuda:1
    # a device of b's that a never mapped to cannot be replied with: error at b's reply
    fake = SimpleNamespace(device=torch.device("cuda", 1))
    with pytest.raises(DeviceMapError, match="'a'"):
        from rrefrt.payload.buffers import target_device

        target_device(fake, pb.reply_route("a"))


def test_no_maps_cpu_only_group():
    a, b = info("a", n=0), info("b", n=None)
    p = plan("a", a, b)
    assert p.local_cuda == () and dict(p.request_route("b").device_map) == {}
    assert p.scope() is dv.NO_SCOPE


def test_local_cuda_includes_devices_named_by_maps():
    a = info("a", [], {"b": {"cuda:1": "cuda:0"}})
    b = info("b", [], {"a": {"cuda:0": "cuda:0"}})
    assert plan("a", a, b).local_cuda == ("cuda:0", "cuda:1")  # source of a's map, target of b's
    assert plan("b", a, b).local_cuda == ("cuda:0",)
    assert plan("c", info("c", ["cuda:1", "cuda:1", "cuda:0"])).local_cuda == ("cuda:1", "cuda:0")


def test_unknown_peer_route_is_empty():
    a = info("a", n=0)
    assert plan("a", a).request_route("zz") == Route("zz")


# ---------------------------------------------------------------------------- validation
def test_map_target_device_missing_on_peer_fails_everywhere():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:3"}}, n=4)
    b = info("b", ["cuda:0"], n=1, env={"CUDA_VISIBLE_DEVICES": "2"})
    text = fails_everywhere(a, b, match=("'a'", "'b'", "cuda:3", "1 CUDA device", "CUDA_VISIBLE_DEVICES=2"))
    assert "maps cuda:0 to cuda:3" in text


def test_map_to_peer_without_cuda_fails_everywhere():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:0"}})
    b = info("b", n=0)
    fails_everywhere(a, b, match=("'a'", "'b'", "cuda:0", "has no CUDA"))


def test_map_to_peer_that_did_not_load_torch_says_what_to_do():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:0"}})
    b = info("b", n=None)
    fails_everywhere(a, b, match=("devices=['cuda:N']",))


def test_map_target_not_among_peers_declared_devices():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:1"}})
    b = info("b", ["cuda:0"], n=2)
    fails_everywhere(a, b, match=("cuda:1", "not among the devices ['cuda:0'] that 'b' declared"))


def test_non_bijective_published_map_fails_everywhere():
    a = info("a", ["cuda:0", "cuda:1"], n=2)
    b = info("b", ["cuda:0"], n=2)
    forged = dv.DeviceInfo("a", a.devices, {"b": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}, 2, UUIDS[:2])
    fails_everywhere(forged, b, match=("'a'", "'b'", "not one-to-one"))


def test_local_problems_are_published_not_raised_so_every_worker_fails():
    # raising before the rendezvous would leave the others waiting until init_timeout
    a = info("a", [], {"b": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}})
    assert any("one-to-one" in p for p in a.problems())
    fails_everywhere(a, info("b", ["cuda:0", "cuda:1"]), match=("one-to-one",))


def test_unsupported_device_string_fails_everywhere():
    a = dv.DeviceInfo.local("a", ["mps"], {"b": {"xla:0": "cuda:0"}}, {}, gpus(1))
    fails_everywhere(a, info("b", ["cuda:0"], n=1), match=("'mps'", "'xla:0'"))


def test_map_to_unknown_worker_fails_everywhere():
    a = info("a", ["cuda:0"], {"c": {"cuda:0": "cuda:0"}})
    b = info("b", ["cuda:0"])
    fails_everywhere(a, b, match=("'a'", "'c'", "not in the group"))


def peer_b():
    return info("b", ["cuda:0"], n=1)


def test_cpu_to_cuda_mapping_is_refused():
    fails_everywhere(info("a", [], {"b": {"cpu": "cuda:0"}}), peer_b(), match=("CPU tensors stay CPU",))
    fails_everywhere(info("a", [], {"b": {"cuda:0": "cpu"}}), peer_b(), match=("CPU tensors stay CPU",))


def test_cuda_on_a_host_without_cuda_fails_everywhere():
    fails_everywhere(info("a", ["cuda:0"], n=0), peer_b(),
                     match=("worker 'a' uses device cuda:0, but it has no CUDA",))
    fails_everywhere(info("a", [], {"b": {"cuda:0": "cuda:0"}}, n=0), peer_b(),
                     match=("names cuda:0 on 'a', but 'a' has no CUDA",))


def test_own_device_index_out_of_range():
    a = info("a", ["cuda:2"], n=2)
    assert a.problems()
    fails_everywhere(a, peer_b(), match=("cuda:2", "2 CUDA device"))


def test_map_source_not_among_own_declared_devices():
    fails_everywhere(info("a", ["cuda:0"], {"b": {"cuda:1": "cuda:0"}}, n=2), peer_b(),
                     match=("not among the devices",))


def test_several_problems_are_all_reported():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:5"}, "zz": {"cuda:0": "cuda:0"}})
    b = info("b", ["cuda:0"], {"a": {"cuda:0": "cuda:7"}})
    text = fails_everywhere(a, b)
    assert "cuda:5" in text and "'zz'" in text and "cuda:7" in text


def test_malformed_published_info():
    with pytest.raises(DeviceMapError, match="'b' published malformed"):
        dv.DeviceInfo.from_meta("b", {"maps": {"a": 3}})
    assert dv.DeviceInfo.from_meta("b", None).devices == ()


def test_missing_self():
    with pytest.raises(DeviceMapError):
        dv.DevicePlan.build("me", {})


# ---------------------------------------------------------------------------- CUDA IPC routes
def test_ipc_devices_match_physical_gpus_by_uuid():
    # one host, the launcher masked each worker to one GPU: both see "cuda:0", different GPUs
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:0"}}, n=1, uuids=["GPU-aaaa"])
    b = info("b", ["cuda:0"], {"a": {"cuda:0": "cuda:0"}}, n=1, uuids=["GPU-bbbb"])
    assert dict(plan("a", a, b).request_route("b").ipc_devices) == {}
    # unmasked: each sees both, in different orders
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:0"}}, n=2, uuids=["GPU-aaaa", "GPU-bbbb"])
    b = info("b", ["cuda:0"], {"a": {"cuda:0": "cuda:0"}}, n=2, uuids=["GPU-bbbb", "GPU-aaaa"])
    pa = plan("a", a, b)
    assert dict(pa.request_route("b").ipc_devices) == {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}
    assert dict(pa.reply_route("b").ipc_devices) == {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}


def test_ipc_off_on_either_side_or_to_self():
    a = info("a", ["cuda:0"], {"b": {"cuda:0": "cuda:0"}}, n=1, env={"RREFRT_CUDA_IPC": "0"})
    b = info("b", ["cuda:0"], {"a": {"cuda:0": "cuda:0"}}, n=1)
    assert dict(plan("b", a, b).request_route("a").ipc_devices) == {}
    assert dict(plan("b", a, b).request_route("b").ipc_devices) == {}  # never to oneself


def test_same_host_comes_from_the_caller():
    a, b = info("a", n=0), info("b", n=0)
    p = plan("a", a, b, same_host=lambda peer: peer == "b")
    assert p.request_route("b").same_host and p.reply_route("b").same_host
    assert not p.request_route("a").same_host


# ---------------------------------------------------------------------------- launcher
def test_launcher_assignment_is_cuda0_inside_the_worker():
    """rrefrt-run gives worker 1 physical GPU 1 as CUDA_VISIBLE_DEVICES=1 and RREFRT_DEVICE
    cuda:0: the worker sees one device, cuda:0, and maps/runs on it."""
    p = launcher_devices.plan_devices(2, ("0", "1"), gpus=None, max_workers_per_gpu=1, cpu_threads=None,
                                      cores=4, environ={})
    env = p.workers[1].environ()
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["RREFRT_DEVICE"] == "cuda:0"
    w = info("w1", [], {"w0": {"cuda:0": "cuda:0"}}, n=1, uuids=["GPU-bbbb"], env=env)
    assert w.devices == ("cuda:0",) and w.visible == "1"
    w0 = info("w0", [], {"w1": {"cuda:0": "cuda:0"}}, n=1, uuids=["GPU-aaaa"], env=p.workers[0].environ())
    pl = plan("w1", w0, w)
    assert pl.local_cuda == ("cuda:0",) and dict(pl.request_route("w0").device_map) == {"cuda:0": "cuda:0"}
    assert dict(pl.request_route("w0").ipc_devices) == {}  # different physical GPUs


def test_launcher_masked_worker_naming_cuda1_gets_an_explaining_error():
    env = {"RREFRT_DEVICE": "cuda:0", "CUDA_VISIBLE_DEVICES": "1"}
    w1 = info("w1", ["cuda:1"], n=1, env=env)
    fails_everywhere(w1, info("w0", n=0), match=("cuda:1", "CUDA_VISIBLE_DEVICES=1"))


def test_default_devices():
    assert dv.default_devices([], {"RREFRT_DEVICE": "cuda:0"}) == ["cuda:0"]
    assert dv.default_devices([], {"RREFRT_DEVICE": "cpu"}) == []
    assert dv.default_devices(["cuda:1"], {"RREFRT_DEVICE": "cuda:0"}) == ["cuda:1"]
    assert dv.default_devices([], {}) == []


def test_no_torch_probe_when_nothing_names_cuda(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as a worker that never imported torch
    monkeypatch.setattr(dv, "probe_cuda", lambda: pytest.fail("probed CUDA"))
    i = dv.DeviceInfo.local("a", [], {}, {})
    assert i.cuda_count is None


# ---------------------------------------------------------------------------- call scope
def test_no_scope_fast_path_costs_next_to_nothing():
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with dv.call_scope((), None) as s:
            s.finish(1)
    per_call = (time.perf_counter() - t0) / n
    assert dv.call_scope((), None) is dv.NO_SCOPE
    assert per_call < 5e-6, per_call


class FakeCuda:
    """torch.cuda's stream/device calls, recorded."""

    def __init__(self):
        self.log = []
        self.device = 0
        self.current = {}
        self.ambient = {}

    def stream(self, dev, tag):
        fake = SimpleNamespace(device_index=dev, tag=tag)
        fake.wait_stream = lambda other, s=fake: self.log.append(("wait", s.tag, other.tag))
        return fake

    def default(self, d=None):
        return self.ambient.setdefault(d, self.stream(d, f"ambient{d}"))

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: self.current.get(d) or self.default(d))
        monkeypatch.setattr(torch.cuda, "default_stream", self.default)

        def set_stream(s):
            self.log.append(("set_stream", s.tag))
            self.device = s.device_index
            self.current[s.device_index] = s

        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: (self.log.append(("set_device", d)),
                                                                 setattr(self, "device", d)))
        counter = iter(range(1000))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: self.stream(device, f"pool{device}.{next(counter)}"))
        monkeypatch.setattr(dv, "_pool", dv._StreamPool())


def test_cuda_scope_sets_device_and_pool_streams_and_restores(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    with dv.call_scope(("cuda:0", "cuda:1"), None) as s:
        assert fake.device == 0  # the first device is the target without CUDA arguments
        s.finish(torch.ones(1))  # a CPU value: nothing to record
        inside = dict(fake.current)
    assert inside[0].tag.startswith("pool0") and inside[1].tag.startswith("pool1")
    assert fake.log[0] == ("wait", inside[1].tag, "ambient1")  # non-target device first
    assert fake.log[1] == ("set_stream", inside[1].tag)
    assert fake.log[3] == ("set_stream", inside[0].tag)  # target last: it stays current
    tail = fake.log[4:]
    assert ("wait", "ambient1", inside[1].tag) in tail and ("wait", "ambient0", inside[0].tag) in tail
    assert tail[-3:] == [("set_stream", "ambient0"), ("set_stream", "ambient1"), ("set_device", 0)]
    assert fake.current[0].tag == "ambient0" and fake.current[1].tag == "ambient1"
    assert fake.device == 0


def test_cuda_scope_restores_after_an_exception(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    fake.device = 1
    with pytest.raises(ZeroDivisionError):
        with dv.call_scope(("cuda:0",), None):
            assert fake.current[0].tag.startswith("pool0")
            1 / 0
    assert fake.current[0].tag == "ambient0" and fake.device == 1


def test_stream_pool_round_robin(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    pool = dv._StreamPool()
    tags = [pool.get(0).tag for _ in range(2 * pool.SIZE)]
    assert len(set(tags)) == pool.SIZE


def test_cuda_tensors_walk_is_bounded_and_ignores_cpu():
    assert dv.cuda_tensors([torch.ones(1), {"a": (torch.ones(2),)}]) == []
    assert dv.cuda_tensors(object()) == []
