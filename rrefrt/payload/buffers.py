"""How a tensor's bytes travel: tensor codecs, chosen per tensor and destination.

Owns: the ``Route`` a payload is encoded for (destination name, device map, what the two
ends share), the registry of tensor codecs, and the two codecs rrefrt has today:

- ``frames``: the tensor's bytes become one out-of-band pickle buffer (a transport frame,
  sent zero-copy; the frame keeps the tensor alive until the transport has sent it). CUDA
  tensors are staged through host memory (``.cpu()`` on the sender's current stream, which
  waits for the work that produced them) and copied to the mapped device on receipt.
- ``cuda_ipc``: a CUDA tensor whose GPU the receiver can also see (same physical GPU, by
  UUID: so same host) travels as a CUDA IPC handle - torch.multiprocessing's mechanism
  (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``). The receiver opens it, copies
  into its own allocation on the mapped device at once, waits for that copy, and drops the
  handle, which releases the sender's block (torch's IPC reference counter keeps the
  sender's memory out of reuse until then, even if the sender dropped the tensor). Any
  failure to export falls back to ``frames`` with one log line.

torch is imported only by the functions that handle
a tensor, through rrefrt/payload/torchimport.py.

NOTE [Tensor codecs]
  A codec is ``encode(tensor, route, device) -> (rebuild, args)``: the pickle reduction of
  one tensor that must land on ``device`` (``target_device``, computed once by
  ``reduce_tensor``). ``rebuild`` must be a module-level function listed in
  ``REBUILD_GLOBALS`` (payloads may be read under an allowlist). Out-of-band bytes are
  returned as ``pickle.PickleBuffer`` inside ``args`` (pickle's buffer_callback makes them
  frames). ``codec_for`` picks the
  codec per tensor: the first registered codec whose ``accepts(tensor, route)`` is true,
  then ``frames``. A same-host shared-memory codec registers with an ``accepts`` that
  looks at ``route.same_host`` (and the transport-level shm segment it writes to); a codec
  must never change where a tensor lands: that is ``target_device`` alone.

NOTE [Strides]
  A strided view travels as the slice of its storage it touches (from its storage offset to
  its last element) with its sizes and strides, and is rebuilt with ``as_strided``: a
  transposed or channels-last tensor arrives with its strides, as torch's own pickling
  does. A view that touches more than twice its own size of storage (a column of a big
  matrix) travels as a contiguous copy instead (its strides are then the contiguous ones):
  sending a large storage for a small view would cost more than strides are worth.
  Staging a CUDA tensor through the host keeps strides where ``.cpu()`` does (dense
  tensors).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import warnings
from typing import Any, Callable, Mapping, Protocol

from rrefrt.payload import torchimport
from rrefrt.errors import RpcError, SerializationError

__all__ = ["Route", "DeviceMapError", "TensorCodec", "register_codec", "codec_for", "reduce_tensor",
           "target_device", "LOCAL_ROUTE"]

log = logging.getLogger("rrefrt.buffers")

#: rrefrt's globals that tensor payloads name (serialization admits them under any allowlist)
REBUILD_GLOBALS = frozenset({"rrefrt.payload.buffers._rebuild_frames", "rrefrt.payload.buffers._rebuild_contiguous",
                             "rrefrt.payload.buffers._rebuild_cuda_ipc"})

#: a view is sent with its strides while its storage span is at most this many times its size
_MAX_SPAN_FACTOR = 2
#: NOTE [Small tensor frames]: a read-only frame up to this size is copied into a tensor of
#: its own on arrival (the same-host transport's inline frames are slices of one bytes
#: object per message: read-only, at any alignment). Aliasing it instead cost a
#: ``warnings.catch_warnings`` (torch warns about read-only buffers) and, when the frame was
#: not aligned for its dtype, a clone anyway: measured 7.8 -> 4.4 us for 4 KB and
#: 38 -> 6 us for 64 KB per tensor (misaligned frames, loaded 2-core machine); an aligned
#: 64 KB frame costs about the same either way, larger ones keep aliasing their frame (a
#: shared-memory segment, a zmq frame).
COPY_FRAMES_BELOW = 64 << 10


class DeviceMapError(RpcError, ValueError):
    """A device map is invalid, or a tensor is on a device that has no mapping to its
    destination. Raised at init (on every worker) or at the call site."""


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a payload goes, as far as tensors care.

    ``device_map``: this worker's device -> the destination's device, for this direction
    (a request uses the caller's map, a reply the inverse of the caller's map).
    ``ipc_devices``: this worker's CUDA device -> the destination's name for the same
    physical GPU, for GPUs both can open CUDA IPC handles on (empty: never use IPC).
    ``same_host``: the destination runs on this host (for a shared-memory codec)."""

    peer: str
    device_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ipc_devices: Mapping[str, str] = dataclasses.field(default_factory=dict)
    same_host: bool = False


#: for payloads that never leave a worker's own tables (errors, tests): CPU tensors only
LOCAL_ROUTE = Route("the destination")


class TensorCodec(Protocol):
    """A codec may set ``cpu_tensors = False``: it never accepts a CPU tensor (CUDA IPC)."""

    name: str

    def accepts(self, tensor: Any, route: Route) -> bool: ...

    def encode(self, tensor: Any, route: Route, device: str) -> tuple[Callable[..., Any], tuple]: ...


_codecs: list[TensorCodec] = []
#: NOTE [Plain CPU tensors]: no registered codec accepts a CPU tensor, so every CPU tensor
#: is FRAMES's without asking them
_cpu_frames = True


def register_codec(codec: TensorCodec, first: bool = True) -> None:
    """Add ``codec`` to the registry (tried before the others when ``first``)."""
    unregister_codec(codec.name)
    if first:
        _codecs.insert(0, codec)
    else:
        _codecs.append(codec)
    _codecs_changed()


def unregister_codec(name: str) -> None:
    _codecs[:] = [c for c in _codecs if c.name != name]
    _codecs_changed()


def _codecs_changed() -> None:
    global _cpu_frames
    _cpu_frames = all(getattr(c, "cpu_tensors", True) is False for c in _codecs)


def codec_for(tensor: Any, route: Route) -> TensorCodec:
    """The codec that carries ``tensor`` to ``route.peer``: the first that accepts it."""
    for codec in _codecs:
        if codec.accepts(tensor, route):
            return codec
    return FRAMES


def target_device(tensor: Any, route: Route) -> str:
    """Where ``tensor`` lands on the destination: CPU stays CPU, any other device goes
    where the map says, and a device without a mapping is an error (torch's rule)."""
    dev = str(tensor.device)
    if dev == "cpu":
        return "cpu"
    target = route.device_map.get(dev)
    if target is None:
        raise DeviceMapError(
            f"cannot send a tensor on {dev} to worker {route.peer!r}: no device map maps {dev} "
            f"to a device of {route.peer!r}. Call options.set_device_map({route.peer!r}, "
            f"{{{dev!r}: <its device>}}) before init_rpc, or move the tensor to the CPU first"
        )
    return target


def reduce_tensor(tensor: Any, route: Route) -> tuple[Callable[..., Any], tuple]:
    """The pickle reduction of one strided tensor (or Parameter) bound for ``route``."""
    if _cpu_frames and tensor.is_cpu:  # NOTE [Plain CPU tensors]: no codec takes CPU tensors
        return FRAMES.encode_cpu(tensor, route)
    device = target_device(tensor, route)  # fails at the call site, whatever the codec
    return codec_for(tensor, route).encode(tensor, route, device)


def _kind(tensor: Any) -> str:
    return "param" if isinstance(tensor, torchimport.torch_module().nn.Parameter) else "tensor"


_dtype_names: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).split(".", 1)[1]
    return name


def _contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(1, size)
    return tuple(reversed(strides))


def _span(t: Any) -> int:
    """Elements of storage the view touches, from its storage offset (strides are >= 0)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _finish(t: Any, requires_grad: bool, kind: str) -> Any:
    torch = torchimport.torch_module()

    if kind == "param":
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# ---------------------------------------------------------------------------- frames
class FramesCodec:
    """The bytes as one out-of-band frame; CUDA tensors staged through host memory."""

    name = "frames"

    def accepts(self, tensor: Any, route: Route) -> bool:
        return True

    def encode_cpu(self, tensor: Any, route: Route) -> tuple[Callable[..., Any], tuple]:
        """NOTE [Plain CPU tensors]: a contiguous CPU tensor (the usual argument) takes
        the short way - no span to compute, no device to look up, and ``_rebuild_contiguous``
        on arrival (no strides to check); anything else is ``encode``'s. Measured for a 4 KB
        tensor: 7.5 -> 2.6 us to reduce, 7.3 -> 3.5 us to rebuild."""
        if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            return self.encode(tensor, route, "cpu")
        data = tensor.detach()
        nbytes = data.nbytes
        kind = "tensor" if type(tensor) is torchimport.torch_module().Tensor else _kind(tensor)
        return (_rebuild_contiguous,
                (tensor_bytes(data, nbytes), _dtype_name(data.dtype), tuple(data.shape), tensor.requires_grad, kind))

    def encode(self, tensor: Any, route: Route, device: str) -> tuple[Callable[..., Any], tuple]:
        data = tensor.detach()
        if data.is_conj():
            data = data.resolve_conj()
        if data.is_neg():
            data = data.resolve_neg()
        if data.device.type != "cpu":
            data = data.cpu()  # on the current stream: waits for the work that made it
        span = _span(data)
        if span > _MAX_SPAN_FACTOR * data.numel() + 64:
            data = data.contiguous()
            span = data.numel()
        nbytes = span * data.element_size()
        return (
            _rebuild_frames,
            (tensor_bytes(data, nbytes), _dtype_name(data.dtype), tuple(data.shape), tuple(data.stride()),
             tensor.requires_grad, _kind(tensor), device),
        )


def tensor_bytes(data: Any, nbytes: int) -> pickle.PickleBuffer:
    """The first ``nbytes`` of CPU tensor ``data``'s memory as an out-of-band buffer, without
    a copy: a ctypes array over them that keeps ``data`` alive until the frame is sent
    (``is_tensor_bytes`` tells such a buffer from any other)."""
    if not nbytes:
        return pickle.PickleBuffer(b"")
    arr = (ctypes.c_char * nbytes).from_address(data.data_ptr())
    arr._keep = data  # type: ignore[attr-defined]
    return pickle.PickleBuffer(memoryview(arr))


def is_tensor_bytes(pb: pickle.PickleBuffer) -> bool:
    """Whether ``pb`` came from ``tensor_bytes`` (NOTE [Foreign buffers] in serialization)."""
    return getattr(getattr(pb.raw().obj, "obj", None), "_keep", None) is not None


def _rebuild_frames(buf: Any, dtype: str, shape: tuple, strides: tuple, requires_grad: bool, kind: str,
                    device: str) -> Any:
    torch = torchimport.torch_module()

    tdtype = getattr(torch, dtype)
    if not isinstance(tdtype, torch.dtype):
        raise SerializationError(f"unknown tensor dtype {dtype!r}")
    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty_strided(shape, strides, dtype=tdtype)
    elif mv.readonly and mv.nbytes <= COPY_FRAMES_BELOW:
        # NOTE [Small tensor frames]: one copy into a private, aligned, writable buffer
        raw = torch.frombuffer(bytearray(mv), dtype=torch.uint8)
        flat = raw.view(tdtype)
        if _span_of(shape, strides) > flat.numel():
            raise SerializationError(f"tensor frame too short for shape {shape} and strides {strides}")
        t = flat.as_strided(shape, strides)
    else:
        raw = _frombuffer_read_only(torch, mv)
        if raw.data_ptr() % max(1, tdtype.itemsize):
            raw = raw.clone()
        flat = raw.view(tdtype)
        if _span_of(shape, strides) > flat.numel():
            raise SerializationError(f"tensor frame too short for shape {shape} and strides {strides}")
        t = flat.as_strided(shape, strides)
    if device != "cpu":
        t = t.to(device)  # on the receiver's current stream
    return _finish(t, requires_grad, kind)


#: torch warns about a read-only buffer once per process (TORCH_WARN_ONCE): only the first
#: such frame needs the warning silenced (``warnings.catch_warnings`` is process-wide state)
_read_only_warned = False


def _frombuffer_read_only(torch: Any, mv: memoryview) -> Any:
    """A uint8 tensor over a frame; when it is read-only (we never write it) torch's warning
    about non-writable tensors is noise and is silenced, the one time torch gives it (a
    writable frame must not count as that time: torch gave no warning for it)."""
    global _read_only_warned
    if _read_only_warned or not mv.readonly:
        return torch.frombuffer(mv, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(mv, dtype=torch.uint8)
    _read_only_warned = True
    return raw


def _rebuild_contiguous(buf: Any, dtype: str, shape: tuple, requires_grad: bool, kind: str) -> Any:
    """A contiguous CPU tensor (``FramesCodec.encode_cpu``): the frame holds exactly its
    bytes; a small read-only frame is copied (NOTE [Small tensor frames])."""
    torch = torchimport.torch_module()
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise SerializationError(f"unknown tensor dtype {dtype!r}")
    mv = memoryview(buf)
    n = mv.nbytes
    numel = 1
    for size in shape:
        numel *= size
    if n != numel * tdtype.itemsize or any(size < 0 for size in shape):
        raise SerializationError(f"tensor frame of {n} bytes does not hold shape {shape} of {dtype}")
    if not n:
        t = torch.empty(shape, dtype=tdtype)
    elif mv.readonly and n <= COPY_FRAMES_BELOW:
        t = torch.frombuffer(bytearray(mv), dtype=tdtype)
        if len(shape) != 1:
            t = t.view(shape)
    elif not mv.readonly:
        # a frame of its own (NOTE [Small frames own their bytes] in the same-host wire) or
        # a writable mapping (a shared-memory segment): the tensor is rebuilt over it, in
        # the dtype at once; copied only if its start is not aligned for dtype (a segment's
        # frames are page-aligned). Writable: torch has nothing to warn about, so no
        # ``warnings.catch_warnings`` (process-wide state, and 40 us of a 1 MB round trip).
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        t = torch.frombuffer(mv, dtype=torch.uint8 if _misaligned(mv, tdtype.itemsize) else tdtype)
        if t.dtype is not tdtype:
            t = t.clone().view(tdtype)
        if len(shape) != 1:
            t = t.view(shape)
    else:
        return _rebuild_frames(buf, dtype, shape, _contiguous_strides(shape), requires_grad, kind, "cpu")
    return _finish(t, requires_grad, kind) if requires_grad or kind != "tensor" else t


def _misaligned(mv: memoryview, itemsize: int) -> bool:
    """Whether a writable frame's first byte is not aligned for ``itemsize``."""
    if itemsize == 1:
        return False
    return bool(ctypes.addressof(ctypes.c_char.from_buffer(mv)) % itemsize)


def _span_of(shape: tuple, strides: tuple) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


FRAMES = FramesCodec()


# ---------------------------------------------------------------------------- CUDA IPC
_ipc_warned = False


def _warn_ipc_once(why: str) -> None:
    global _ipc_warned
    if not _ipc_warned:
        _ipc_warned = True
        log.warning("CUDA IPC unavailable (%s): CUDA tensors to workers on this host are staged "
                    "through host memory", why)


class CudaIpcCodec:
    """CUDA tensors to a worker that sees the same GPU: an IPC handle, copied at once."""

    name = "cuda_ipc"
    cpu_tensors = False

    def accepts(self, tensor: Any, route: Route) -> bool:
        return (bool(route.ipc_devices) and tensor.device.type == "cuda" and str(tensor.device) in route.ipc_devices
                and tensor.numel() > 0)  # an empty storage has no allocation to share

    def encode(self, tensor: Any, route: Route, device: str) -> tuple[Callable[..., Any], tuple]:
        open_on = route.ipc_devices[str(tensor.device)]
        data = tensor.detach()
        if data.is_conj() or data.is_neg():
            return FRAMES.encode(tensor, route, device)
        try:
            # records an event on the current stream: the receiver's copy waits for it
            (_dev, handle, size_b, offset_b, rc_handle, rc_offset, ev_handle, ev_sync) = (
                data.untyped_storage()._share_cuda_())
        except Exception as e:  # e.g. expandable segments, or no IPC on this platform
            _warn_ipc_once(f"{type(e).__name__}: {e}")
            return FRAMES.encode(tensor, route, device)
        return (
            _rebuild_cuda_ipc,
            (_dtype_name(data.dtype), tuple(data.shape), tuple(data.stride()), data.storage_offset(), open_on,
             handle, size_b, offset_b, rc_handle, rc_offset, ev_handle, ev_sync, tensor.requires_grad,
             _kind(tensor), device),
        )


def _rebuild_cuda_ipc(dtype: str, shape: tuple, strides: tuple, storage_offset: int, open_on: str, handle: bytes,
                      size_b: int, offset_b: int, rc_handle: bytes, rc_offset: int, ev_handle: Any, ev_sync: bool,
                      requires_grad: bool, kind: str, device: str) -> Any:
    torch = torchimport.torch_module()

    tdtype = getattr(torch, dtype)
    if not isinstance(tdtype, torch.dtype):
        raise SerializationError(f"unknown tensor dtype {dtype!r}")
    src_dev = torch.device(open_on)
    dst_dev = torch.device(device)
    try:
        torch.cuda._lazy_init()
        # waits (on the current stream of src_dev) for the event the sender recorded
        storage = torch.UntypedStorage._new_shared_cuda(
            src_dev.index, handle, size_b, offset_b, rc_handle, rc_offset, ev_handle, ev_sync)
    except Exception as e:
        raise SerializationError(
            f"cannot open a CUDA IPC handle on {open_on}: {type(e).__name__}: {e}. Set RREFRT_CUDA_IPC=0 on "
            "every worker to stage CUDA tensors through host memory") from e
    try:
        src = torch.empty((0,), dtype=tdtype, device=src_dev).set_(storage, storage_offset, shape, strides)
        out = src.to(dst_dev, copy=True)  # our own allocation, on the current stream
        torch.cuda.current_stream(dst_dev).synchronize()
        if src_dev != dst_dev:
            torch.cuda.current_stream(src_dev).synchronize()
    finally:
        src = None  # noqa: F841
        del storage  # releases the sender's block (torch's IPC reference counter)
    return _finish(out, requires_grad, kind)


CUDA_IPC = CudaIpcCodec()


def cuda_ipc_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """RREFRT_CUDA_IPC=0 turns the CUDA IPC codec off (host staging everywhere)."""
    env = os.environ if environ is None else environ
    return env.get("RREFRT_CUDA_IPC", "1").strip() not in ("0", "false", "no", "off")


register_codec(CUDA_IPC)
