"""Unit tests of payload encoding and tensor codecs (rrefrt/payload/serialization.py, rrefrt/payload/buffers.py).

No processes: dumps/loads in one process, CUDA paths exercised with stand-ins for torch's
CUDA functions where the logic can run without a GPU.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from rrefrt.payload import buffers

from rrefrt.payload import serialization as ser
from rrefrt.payload.buffers import DeviceMapError, Route
from rrefrt.errors import SerializationError


def roundtrip(obj, route=None):
    frames, forks = ser.dumps(obj, route=route)
    assert forks == []
    return ser.loads([bytes(f) for f in frames], [])


# ---------------------------------------------------------------------------- strides
@pytest.mark.parametrize("make", [
    lambda b: b.transpose(0, 2),
    lambda b: b.permute(1, 2, 0),
    lambda b: b[1:, ::2],
    lambda b: b[:, 1:5, 2:],
    lambda b: b[2],
    lambda b: b.expand(3, 4, 6, 5)[1],
    lambda b: b[0, 0, 0].expand(4, 3),
    lambda b: b.contiguous(memory_format=torch.channels_last) if b.dim() == 4 else b.unsqueeze(0).contiguous(
        memory_format=torch.channels_last),
], ids=["transpose", "permute", "step-slice", "offset-slice", "index", "expand", "stride0", "channels_last"])
def test_views_keep_values_shape_and_strides(make):
    base = torch.arange(4 * 6 * 5, dtype=torch.float64).reshape(4, 6, 5)
    t = make(base)
    out = roundtrip(t)
    assert torch.equal(out, t) and out.shape == t.shape and out.dtype == t.dtype
    assert out.stride() == t.stride(), (out.stride(), t.stride())


def test_sparse_view_travels_contiguous_and_small():
    big = torch.arange(1000 * 1000, dtype=torch.float32).reshape(1000, 1000)
    col = big[:, 3]  # touches ~1M elements of storage for 1000 values
    frames, _ = ser.dumps(col)
    assert sum(memoryview(f).nbytes for f in frames[1:]) == 1000 * 4
    out = ser.loads([bytes(f) for f in frames], [])
    assert torch.equal(out, col) and out.is_contiguous()


def test_view_sends_only_its_storage_span():
    base = torch.arange(100, dtype=torch.int64)
    t = base[10:20]
    frames, _ = ser.dumps(t)
    assert memoryview(frames[1]).nbytes == 10 * 8
    assert torch.equal(ser.loads([bytes(f) for f in frames], []), t)


def test_conj_neg_param_requires_grad_and_empty():
    c = torch.randn(3, dtype=torch.complex64).conj()
    assert torch.equal(roundtrip(c), c.resolve_conj())
    p = torch.nn.Parameter(torch.ones(2, 3).t())
    out = roundtrip(p)
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad and out.stride() == p.stride()
    g = torch.ones(2, requires_grad=True)
    assert roundtrip(g).requires_grad
    for shape in [(0,), (3, 0, 2), ()]:
        e = torch.zeros(shape)
        assert roundtrip(e).shape == e.shape


def test_received_tensor_is_usable_after_frames_are_gone():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    frames, _ = ser.dumps(t)
    data = [bytes(f) for f in frames]
    del frames, t
    out = ser.loads(data, [])
    assert out.tolist() == torch.arange(12, dtype=torch.float32).reshape(3, 4).t().tolist()


def test_misaligned_frame_is_copied():
    t = torch.arange(5, dtype=torch.float64)
    frames, _ = ser.dumps(t)
    raw = bytearray(b"x" + bytes(frames[1]))
    out = ser.loads([bytes(frames[0]), memoryview(raw)[1:]], [])
    assert torch.equal(out, t)


@pytest.mark.parametrize("offset", [0, 1])
def test_a_writable_frame_is_aliased_in_its_dtype_or_copied_when_misaligned(monkeypatch, offset):
    """A writable frame (a shared-memory segment's, page-aligned) becomes a tensor over its
    memory, in its dtype and shape, with no ``warnings.catch_warnings`` (process-wide
    state); a misaligned one is copied."""
    import mmap
    import struct
    import warnings

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    frames, _ = ser.dumps(t)
    data = bytes(frames[1])
    seg = mmap.mmap(-1, 4096)
    frame = memoryview(seg)[offset:offset + len(data)]
    frame[:] = data

    def no_filters(*a, **k):
        raise AssertionError("a writable frame needs no warning filter")
    monkeypatch.setattr(warnings, "catch_warnings", no_filters)
    out = ser.loads([bytes(frames[0]), frame], [])
    assert torch.equal(out, t) and out.shape == (3, 4) and out.dtype == torch.float32
    frame[0:4] = struct.pack("f", 42.0)
    assert out[0, 0].item() == (42.0 if offset == 0 else 0.0)  # aliased when aligned, else a copy
    del out, frame


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_a_small_read_only_frame_becomes_a_private_writable_tensor(offset):
    """NOTE [Small tensor frames]: a read-only frame (a slice of the message's bytes, at
    any alignment) is copied once into a tensor of its own; a larger one keeps aliasing."""
    t = torch.arange(1024, dtype=torch.float32).reshape(32, 32).t()
    frames, _ = ser.dumps(t)
    blob = b"x" * offset + bytes(frames[1])
    frame = memoryview(blob)[offset:]
    out = ser.loads([bytes(frames[0]), frame], [])
    assert torch.equal(out, t) and out.stride() == t.stride()
    out.add_(1)  # writable, and not the frame's memory
    assert bytes(frame) == bytes(frames[1])
    big = torch.arange(buffers.COPY_FRAMES_BELOW // 4 + 16, dtype=torch.float32)
    bframes, _ = ser.dumps(big)
    raw = bytes(bframes[1])
    out_big = ser.loads([bytes(bframes[0]), memoryview(raw)], [])
    assert torch.equal(out_big, big)


def test_short_frame_is_a_serialization_error():
    t = torch.arange(10, dtype=torch.float64).reshape(2, 5).t()
    frames, _ = ser.dumps(t)
    with pytest.raises(SerializationError):
        ser.loads([bytes(frames[0]), bytes(frames[1])[:8]], [])


def test_old_contiguous_wire_form_still_decodes():
    buf = pickle.PickleBuffer(torch.arange(6, dtype=torch.int32).numpy().tobytes())
    t = ser._rebuild_tensor(buf, "int32", (2, 3), False, "tensor", "cpu")
    assert t.tolist() == [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------------------- device maps
def test_cpu_tensors_stay_cpu_whatever_the_map():
    out = roundtrip(torch.ones(2), Route("w1", {"cuda:0": "cuda:1"}))
    assert out.device.type == "cpu"


def test_unmapped_device_raises_at_the_call_site_naming_device_and_peer():
    t = torch.empty(3, device="meta")  # any non-CPU device: the rule is the same as for CUDA
    with pytest.raises(DeviceMapError) as e:
        ser.dumps(([t], {}), route=Route("trainer3", {"cuda:0": "cuda:0"}))
    assert "meta" in str(e.value) and "trainer3" in str(e.value) and "set_device_map" in str(e.value)
    with pytest.raises(DeviceMapError):
        ser.dumps(t, None, None)  # the old positional spelling, no map: an error, not a CPU copy


def test_device_map_argument_is_the_old_spelling_of_a_route():
    fake = SimpleNamespace(device=torch.device("cuda", 1))
    assert buffers.target_device(fake, Route("w", {"cuda:1": "cuda:0"})) == "cuda:0"
    with pytest.raises(DeviceMapError, match="cuda:1"):
        buffers.target_device(fake, Route("w", {"cuda:0": "cuda:0"}))


def test_no_thread_local_map_leaks_between_threads():
    assert not hasattr(ser._tls, "send_map")
    errors = []

    def send_meta():
        try:
            ser.dumps(torch.empty(1, device="meta"), route=Route("w1", {}))
        except DeviceMapError:
            pass
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    th = threading.Thread(target=send_meta)
    th.start()
    th.join(10)
    assert not th.is_alive() and not errors
    assert roundtrip(torch.ones(1)).device.type == "cpu"


def test_device_map_error_keeps_forks_for_undo():
    class R:
        _rrefrt_is_rref = True

    made = []
    with pytest.raises(DeviceMapError) as e:
        ser.dumps([R(), torch.empty(1, device="meta")], lambda r: made.append(r) or ["fork"], route=Route("w1"))
    assert e.value.forks == [["fork"]]


def test_rebuild_globals_are_admitted_under_an_allowlist():
    ser.set_unpickle_allowlist(["tests.support.workerfns.add"])
    try:
        t = torch.arange(6.0).reshape(2, 3).t()
        assert torch.equal(roundtrip(t), t)
    finally:
        ser.set_unpickle_allowlist(None)
    assert buffers.REBUILD_GLOBALS <= ser._INTERNAL_GLOBALS


# ---------------------------------------------------------------------------- plain CPU tensors
def test_a_contiguous_cpu_tensor_takes_the_short_way_and_its_frame_is_checked():
    """NOTE [Plain CPU tensors]: contiguous CPU tensors reduce to ``_rebuild_contiguous``
    (no strides on the wire); others keep ``_rebuild_frames``; a frame that does not hold
    the shape fails decoding with SerializationError."""
    for t in (torch.rand(3, 4), torch.zeros(0), torch.ones(2, dtype=torch.bool), torch.nn.Parameter(torch.rand(2)),
              torch.rand(2, 3, requires_grad=True), torch.arange(6, dtype=torch.int16).reshape(2, 3)):
        fn, args = buffers.reduce_tensor(t, Route("w"))
        assert fn is buffers._rebuild_contiguous, t
        back = roundtrip(t)
        assert type(back) is type(t) and back.requires_grad == t.requires_grad and back.dtype == t.dtype
        assert torch.equal(back.detach(), t.detach()) and back.is_contiguous()
    for t in (torch.rand(3, 4).t(), torch.arange(10.0)[2:8:2]):
        assert buffers.reduce_tensor(t, Route("w"))[0] is buffers._rebuild_frames
        assert torch.equal(roundtrip(t), t)
    with pytest.raises(SerializationError, match="does not hold shape"):
        buffers._rebuild_contiguous(memoryview(bytes(12)), "float32", (2, 2), False, "tensor")
    with pytest.raises(SerializationError, match="unknown tensor dtype"):
        buffers._rebuild_contiguous(memoryview(bytes(4)), "Tensor", (1,), False, "tensor")


# ---------------------------------------------------------------------------- codec registry
def test_codec_registry_picks_the_first_that_accepts():
    t = torch.arange(4.0)
    assert buffers.codec_for(t, Route("w")).name == "frames"

    class Shm:
        name = "shm-test"

        def accepts(self, tensor, route):
            return route.same_host

        def encode(self, tensor, route, device):
            return buffers.FRAMES.encode(tensor * 2, route, device)

    buffers.register_codec(Shm())
    try:
        assert buffers.codec_for(t, Route("w", same_host=True)).name == "shm-test"
        assert buffers.codec_for(t, Route("w", same_host=False)).name == "frames"
        assert torch.equal(roundtrip(t, Route("w", same_host=True)), t * 2)
    finally:
        buffers.unregister_codec("shm-test")
    assert buffers.codec_for(t, Route("w", same_host=True)).name == "frames"


def test_cuda_ipc_codec_accepts_only_cuda_tensors_on_shared_gpus():
    cuda0 = SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: 4)
    cuda1 = SimpleNamespace(device=torch.device("cuda", 1), numel=lambda: 4)
    empty = SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: 0)
    r = Route("w", {"cuda:0": "cuda:0", "cuda:1": "cuda:1"}, {"cuda:0": "cuda:2"}, True)
    assert buffers.CUDA_IPC.accepts(cuda0, r)
    assert not buffers.CUDA_IPC.accepts(cuda1, r)
    assert not buffers.CUDA_IPC.accepts(empty, r)
    assert not buffers.CUDA_IPC.accepts(torch.ones(1), r)
    assert not buffers.CUDA_IPC.accepts(cuda0, Route("w", {"cuda:0": "cuda:0"}))


class _FakeCudaTensor:
    """Enough of a CUDA tensor for CudaIpcCodec.encode."""

    def __init__(self, share):
        self.device = torch.device("cuda", 0)
        self.dtype = torch.float32
        self.shape = torch.Size([2, 3])
        self.requires_grad = False
        self._share = share

    def detach(self):
        return self

    def is_conj(self):
        return False

    def is_neg(self):
        return False

    def stride(self):
        return (1, 2)

    def storage_offset(self):
        return 4

    def untyped_storage(self):
        return SimpleNamespace(_share_cuda_=self._share)


def test_cuda_ipc_encode_carries_handle_placement_and_strides():
    share = (0, b"handle", 4096, 512, b"/rc", 8, b"event", True)
    route = Route("w", {"cuda:0": "cuda:1"}, {"cuda:0": "cuda:3"}, True)
    fn, args = buffers.CUDA_IPC.encode(_FakeCudaTensor(lambda: share), route, "cuda:1")
    assert fn is buffers._rebuild_cuda_ipc
    assert args[:5] == ("float32", (2, 3), (1, 2), 4, "cuda:3")  # opened where the peer sees that GPU
    assert args[5:12] == share[1:]
    assert args[-1] == "cuda:1"  # lands where the map says
    assert pickle.loads(pickle.dumps(args)) == args  # plain data only


def test_cuda_ipc_export_failure_falls_back_to_staging_and_logs_once(monkeypatch, caplog):
    def refuse():
        raise RuntimeError("expandable segments do not support IPC")

    staged = []
    monkeypatch.setattr(buffers, "_ipc_warned", False)
    monkeypatch.setattr(buffers.FRAMES, "encode", lambda t, r, d: staged.append(t) or ("frames", ()))
    route = Route("w", {"cuda:0": "cuda:0"}, {"cuda:0": "cuda:0"}, True)
    with caplog.at_level(logging.WARNING, logger="rrefrt.payload.buffers"):
        for _ in range(3):
            assert buffers.CUDA_IPC.encode(_FakeCudaTensor(refuse), route, "cuda:0") == ("frames", ())
    assert len(staged) == 3
    assert sum("CUDA IPC unavailable" in r.getMessage() for r in caplog.records) == 1


def test_cuda_ipc_rebuild_copies_then_releases(monkeypatch):
    """The receiver logic with torch's CUDA calls stood in for: open, view with strides,
    copy into its own allocation, wait for the copy, drop the opened storage."""
    src_values = torch.arange(16, dtype=torch.float32)
    opened = []
    synced = []

    def new_shared(*args):
        storage = src_values.untyped_storage()
        opened.append(args)
        return storage

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda d=None: SimpleNamespace(synchronize=lambda: synced.append(str(d))))
    out = buffers._rebuild_cuda_ipc("float32", (2, 3), (1, 2), 4, "cpu", b"h", 64, 0, b"/rc", 8, None, False,
                                    True, "tensor", "cpu")
    expect = src_values.as_strided((2, 3), (1, 2), 4)
    assert torch.equal(out, expect) and out.requires_grad
    assert out.untyped_storage().data_ptr() != src_values.untyped_storage().data_ptr()  # a copy
    assert opened and opened[0][1] == b"h" and synced == ["cpu"]


def test_cuda_ipc_open_failure_is_a_serialization_error_with_advice(monkeypatch):
    def refuse(*args):
        raise RuntimeError("invalid device context")

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(refuse), raising=False)
    with pytest.raises(SerializationError, match="RREFRT_CUDA_IPC=0"):
        buffers._rebuild_cuda_ipc("float32", (2,), (1,), 0, "cuda:0", b"h", 8, 0, b"/rc", 0, None, False,
                                  False, "tensor", "cuda:0")


def test_cuda_ipc_can_be_turned_off():
    assert buffers.cuda_ipc_enabled({})
    assert not buffers.cuda_ipc_enabled({"RREFRT_CUDA_IPC": "0"})


def test_torch_phrases_in_decode_and_remote_errors():
    """torch programs match on "RPC pickler does not serialize" (a function the callee
    cannot find by name) and "Original exception on remote side was" (a remote exception
    that cannot be rebuilt); rrefrt's messages keep their own words after them."""
    import types

    import rrefrt

    mod = types.ModuleType("rrefrt_test_gone_module")
    exec("def gone():\n    return 1\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        frames, _ = ser.dumps(mod.gone)
    finally:
        del sys.modules[mod.__name__]
    sys.modules[mod.__name__] = types.ModuleType(mod.__name__)  # same module, no such name
    try:
        with pytest.raises(rrefrt.SerializationError, match="RPC pickler does not serialize.*sent by name"):
            ser.loads([bytes(f) for f in frames], [])
    finally:
        del sys.modules[mod.__name__]
    err = rrefrt.RemoteError.from_wire("m.CustomException", "w1", "Traceback...\nm.CustomException: foo\n")
    assert "Original exception on remote side was" in str(err) and "CustomException" in str(err)
    assert "w1" in str(err)
    pickle.loads(pickle.dumps(err))


# ---------------------------------------------------------------------------- errors
def _raise_here(err: BaseException) -> BaseException:
    """``err`` as a worker's user function lets it through: raised, with frames."""
    try:
        raise err
    except BaseException as e:
        return e


@pytest.mark.parametrize("make", [lambda: ValueError("innermost cause"), lambda: SerializationError("innermost cause")],
                         ids=["user-type", "rrefrt-type"])
def test_an_error_passed_on_over_nested_calls_does_not_grow_per_hop(make):
    """NOTE [Errors over hops]: w4 raises; w3, w2, w1 each let the error of their nested
    call through. The message keeps the innermost text and traceback once and names the
    workers it passed; it no longer nests each hop's whole message (it doubled per hop)."""
    err = _raise_here(make())
    sizes = []
    for worker in ("w4", "w3", "w2", "w1"):
        err = _raise_here(ser.loads_error([bytes(f) for f in ser.dumps_error(err, worker)], worker))
        sizes.append(len(str(err)))
    msg = str(err)
    assert type(err) is type(make())
    assert msg.startswith("innermost cause (raised on worker 'w4'; passed on by 'w3' -> 'w2' -> 'w1')"), msg
    assert msg.count("innermost cause") == 2  # the text, and the last line of the innermost traceback
    assert "Remote traceback:" in msg and msg.count("Remote traceback:") == 1
    assert sizes[-1] - sizes[0] < 40, sizes  # only the worker names were added
    if isinstance(err, ValueError):
        assert err.worker == "w4" and "innermost cause" in err.remote_traceback


def test_pickle_stream_is_bytes_so_the_transport_sends_it_without_a_snapshot_copy():
    # a memoryview of the stream would be copied by the zmq transport for the argument
    # snapshot (transport/zmq/lend.py); bytes are immutable and travel as they are
    frames, _ = ser.dumps((b"x" * (1 << 20), torch.ones(4)))
    assert type(frames[0]) is bytes and len(frames[0]) > 1 << 20
    assert ser.loads(frames, [])[0] == b"x" * (1 << 20)


# ---------------------------------------------------------------------------- atoms
@pytest.mark.parametrize("value", [None, True, False, 0, -7, 2**70, 1.5, float("inf"), 2j, "", "héllo", b"\x00" * 100,
                                   "x" * 200_000])
def test_atoms_skip_the_pickler_and_give_the_same_bytes(value, monkeypatch):
    """A call's usual answer (None, a number, a string) is pickled without setting up
    ``_Pickler`` (its stream, buffer callback and route): the same bytes, no forks."""
    import io

    def refuse(*a, **k):
        raise AssertionError("the Pickler was set up for an atom")

    with monkeypatch.context() as m:
        m.setattr(ser, "_Pickler", refuse)
        frames, forks = ser.dumps(value)
    assert forks == [] and len(frames) == 1 and type(frames[0]) is bytes
    f = io.BytesIO()
    ser._Pickler(f, [], None, buffers.LOCAL_ROUTE).dump(value)
    assert frames[0] == f.getvalue()
    assert ser.loads(frames, []) == value


class _Tag(int):
    pass


def test_subclasses_of_atoms_still_go_through_the_pickler(monkeypatch):
    Tag = _Tag
    seen = []
    real = ser._Pickler
    monkeypatch.setattr(ser, "_Pickler", lambda *a, **k: seen.append(1) or real(*a, **k))
    monkeypatch.setattr(ser._tls, "pickler", None, raising=False)  # (not this thread's kept one)
    frames, _ = ser.dumps(Tag(3))
    assert seen == [1] and pickle.loads(frames[0]) == 3


def test_a_torchscript_function_is_refused_at_the_call_site_by_its_name():
    torch = pytest.importorskip("torch")
    from rrefrt.payload import serialization as ser_mod
    from rrefrt.errors import SerializationError as SerErr

    @torch.jit.script
    def scripted_add_one(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    with pytest.raises(SerErr, match="TorchScript function '__torch__.*scripted_add_one'"):
        ser_mod.dumps((scripted_add_one, (torch.ones(1),), {}))


# ---------------------------------------------------------------------------- foreign buffers
class _Blob:
    """An object that offers its bytes out of band (as numpy arrays do under protocol 5)."""

    def __init__(self, data):
        self.data = data

    def __reduce_ex__(self, protocol):
        return (_rebuild_blob, (pickle.PickleBuffer(self.data),))


def _rebuild_blob(buf):
    blob = _Blob(buf)
    blob.readonly = memoryview(buf).readonly
    return blob


def test_only_tensor_bytes_leave_the_stream_so_other_buffers_arrive_writable():
    """NOTE [Foreign buffers]: a PickleBuffer that is not a tensor's is pickled in the
    stream, so it is rebuilt writable (received frames are read-only bytes)."""
    import torch

    frames, _ = ser.dumps((_Blob(bytearray(b"x" * 100_000)), torch.arange(4.0)))
    assert len(frames) == 2  # the stream and the tensor's bytes, nothing else
    blob, t = ser.loads([bytes(f) for f in frames], [])
    assert blob.readonly is False and bytes(blob.data) == b"x" * 100_000
    blob.data[0] = 0  # writable, as with torch's RPC pickler
    assert torch.equal(t, torch.arange(4.0))


def test_a_numpy_array_arrives_writable():
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames, _ = ser.dumps({"state": a})
    back = ser.loads([bytes(f) for f in frames], [])["state"]
    assert back.flags.writeable and (back == a).all()
    back[0, 0] = 7.0


def test_large_read_only_frames_raise_no_warning_and_change_no_filter():
    """torch warns once per process about a read-only buffer: the first large read-only
    frame is decoded with that warning silenced, later ones without touching the
    process-wide warning filters. In a fresh process where every warning is an error."""
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "from rrefrt.payload import serialization as ser\n"
        "big = torch.arange(1 << 15, dtype=torch.float32)\n"
        "frames, _ = ser.dumps(big)\n"
        "for _ in range(3):\n"
        "    before = list(warnings.filters)\n"
        "    out = ser.loads([bytes(frames[0]), memoryview(bytes(frames[1]))], [])\n"
        "    assert torch.equal(out, big) and warnings.filters == before\n"
        "    warnings.catch_warnings = None  # the first frame only may silence the warning\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# ---------------------------------------------------------------------------- NOTE [Tensor streams]
def _full_stream(t):
    """The stream the Pickler itself writes for ``t`` (no fast path)."""
    import io

    f, out = io.BytesIO(), []
    ser._Pickler(f, out, None, buffers.LOCAL_ROUTE).dump(t)
    assert len(out) == 1
    return f.getvalue()


@pytest.mark.parametrize("t", [torch.rand(1024), torch.arange(12, dtype=torch.int64).reshape(3, 4),
                               torch.ones(2, 3, 4, dtype=torch.float16), torch.zeros((), dtype=torch.float64),
                               torch.ones(5, requires_grad=True), torch.tensor([True, False])])
def test_a_plain_tensor_payload_is_sent_as_the_stream_the_pickler_writes(t):
    frames, forks = ser.dumps(t)
    assert frames[0] == _full_stream(t) and not forks
    assert bytes(frames[1]) == t.detach().numpy().tobytes()
    out = ser.loads([bytes(frames[0]), bytearray(bytes(frames[1]))], [])
    assert torch.equal(out, t.detach()) and out.shape == t.shape and out.requires_grad == t.requires_grad


def test_a_stream_seen_once_decodes_without_an_unpickler(monkeypatch):
    t = torch.arange(7, dtype=torch.int32).reshape(7, 1)
    frames, _ = ser.dumps(t)
    stream = bytes(frames[0])
    ser._stream_keys.pop(stream, None)
    assert torch.equal(ser.loads([stream, bytearray(bytes(frames[1]))], []), t)  # learned here
    assert stream in ser._stream_keys

    def no_unpickler(*a, **k):
        raise AssertionError("a known tensor stream needs no Unpickler")
    monkeypatch.setattr(ser, "_Unpickler", no_unpickler)
    for i in range(3):
        other = t + i
        out = ser.loads([stream, bytearray(other.numpy().tobytes())], [])
        assert torch.equal(out, other) and out.shape == (7, 1)
    with pytest.raises(SerializationError):  # a frame of the wrong size is still refused
        ser.loads([stream, bytearray(8)], [])


def test_only_a_plain_tensors_exact_stream_is_learned():
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    for t in (base.t(), torch.nn.Parameter(base.clone()), [base]):  # strided, a Parameter, a list
        frames, _ = ser.dumps(t)
        stream = bytes(frames[0])
        ser.loads([stream, *[bytearray(bytes(f)) for f in frames[1:]]], [])
        assert stream not in ser._stream_keys


_WARN_ONCE_CHECK = """
import warnings, torch
warnings.simplefilter("always")
from rrefrt.payload import buffers, serialization as ser
big = torch.arange(buffers.COPY_FRAMES_BELOW // 4 + 64, dtype=torch.float32).reshape(-1, 64).t()  # strided
frames, _ = ser.dumps(big)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert torch.equal(ser.loads([bytes(frames[0]), memoryview(bytearray(frames[1]))], []), big)  # writable
    assert torch.equal(ser.loads([bytes(frames[0]), memoryview(bytes(frames[1]))], []), big)  # read-only
print(sorted(str(w.message)[:40] for w in seen))
"""


def test_no_torch_warning_for_a_read_only_frame_after_a_writable_one() -> None:
    """A large writable frame (a shared-memory segment's) must not use up the one time the
    read-only path silences torch's warn-once warning about non-writable buffers: the first
    read-only frame after it would warn (in a fresh process: torch warns once per process)."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", _WARN_ONCE_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class _CallsDumps:
    """Pickled as the payload it pickles itself on the way (a nested ``dumps`` on one thread)."""

    def __reduce__(self):
        inner, _ = ser.dumps({"inner": [1, 2, 3]})
        return (bytes, (bytes(inner[0]),))


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("no")


def test_one_pickler_per_thread_is_reset_between_payloads() -> None:
    """NOTE [One Pickler per thread]: a thread's Pickler serves payload after payload, each
    the bytes a fresh Pickler writes; a payload pickled while it is busy (a __reduce__ that
    pickles) gets its own; one that raised is not used again; threads do not share it."""
    import io
    import pickle as pk

    def fresh(obj):
        p = ser._Pickler(io.BytesIO(), [], None, buffers.LOCAL_ROUTE)
        p.dump(obj)
        return p.file.getvalue()

    for obj in [("f", (1, "x"), {"k": [1, 2]}), ("f", (1, "x"), {"k": [1, 2]}), {"a": (1,)}, [None] * 3]:
        frames, forks = ser.dumps(obj)
        assert frames == [fresh(obj)] and forks == []
        assert ser.loads(frames, []) == obj
    mine = ser._tls.pickler
    frames, _ = ser.dumps([_CallsDumps(), "after"])  # nested: the inner payload gets its own
    out = ser.loads(frames, [])
    assert pk.loads(out[0]) == {"inner": [1, 2, 3]} and out[1] == "after"
    with pytest.raises(SerializationError):
        ser.dumps([1, _Unpicklable()])
    assert ser._tls.pickler is not mine  # the one that raised was dropped
    assert ser.loads(ser.dumps(("ok", 1))[0], []) == ("ok", 1)
    seen: list = []

    def other() -> None:
        ser.dumps(("t", 2))
        seen.append(ser._tls.pickler)

    th = threading.Thread(target=other)
    th.start()
    th.join(30)
    assert seen and seen[0] is not ser._tls.pickler
    t = torch.arange(12).reshape(3, 4).t()  # out-of-band frames, then none again
    frames, _ = ser.dumps({"t": t})
    assert len(frames) == 2 and torch.equal(ser.loads(frames, [])["t"], t)
    assert ser.dumps({"n": 1})[0] == [fresh({"n": 1})]
