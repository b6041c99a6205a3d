"""Payload encoding: pickle protocol 5 with tensors as raw out-of-band frames and RRefs as
fork data in the (msgpack) header.

Owns: turning Python objects into frames and back, and the translation of exceptions for
the wire. Imports from rrefrt: errors, messages. torch is imported only when a tensor
crosses (``sys.modules`` tells whether one can exist at all).

Frames of a payload: ``[pickle stream, buffer 0, buffer 1, ...]``. A tensor is reduced to
``_rebuild_tensor(PickleBuffer, dtype, shape, requires_grad, kind)``; its storage bytes
become an out-of-band buffer sent zero-copy (the frame keeps the tensor alive until libzmq
has sent it). Non-contiguous tensors are made contiguous first (values, dtype and shape are
kept; strides of the receiver's tensor are the contiguous ones). Received tensors alias the
received frame's memory: no copy unless the memory is misaligned for the dtype.

An RRef inside a payload is reduced to ``_load_rref(i)``: its fork data goes into the
header's fork list at index ``i`` (created through the ``fork`` hook, so the protocol
registers it), and the receiver turns each entry into an RRef object *before* unpickling,
so a payload that fails to decode still accounts for every fork it carried.

NOTE [Unpickling allowlist]: ``set_unpickle_allowlist`` restricts which globals a payload
may name (for jobs that must not run arbitrary code on receipt). Control messages are never
pickled at all. Under an allowlist a payload may name exactly the listed ``module.qualname``
strings, the few rrefrt globals rrefrt itself pickles (``_INTERNAL_GLOBALS``) and rrefrt's
error classes - never "anything in an rrefrt module": pickle resolves dotted names through
attributes, so ``rrefrt.runtime`` + ``os.system`` would reach ``os.system``.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Sequence

from .errors import RemoteError, RpcError, SerializationError, rebuildable

_tls = threading.local()
_allowlist: frozenset[str] | None = None


def set_unpickle_allowlist(names: Sequence[str] | None) -> None:
    """Only these ``module.qualname`` globals (plus rrefrt's own) may be unpickled."""
    global _allowlist
    _allowlist = None if names is None else frozenset(names)


# ---------------------------------------------------------------------------- tensors
def _tensor_buffer(t: Any) -> Any:
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return b""
    arr = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    arr._keep = t  # the buffer keeps its tensor alive until the frame is sent
    return memoryview(arr)


def _reduce_tensor(t: Any) -> tuple:
    import torch

    kind = "param" if isinstance(t, torch.nn.Parameter) else "tensor"
    send_map = getattr(_tls, "send_map", None) or {}
    device = send_map.get(str(t.device), "cpu") if t.device.type != "cpu" else "cpu"
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    if not data.is_contiguous():
        data = data.contiguous()
    dtype = str(data.dtype).split(".", 1)[1]
    return (
        _rebuild_tensor,
        (pickle.PickleBuffer(_tensor_buffer(data)), dtype, tuple(data.shape), t.requires_grad, kind, device),
    )


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple, requires_grad: bool, kind: str, device: str) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=tdtype)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(mv, dtype=torch.uint8)
        if raw.data_ptr() % max(1, torch.empty((), dtype=tdtype).element_size()):
            raw = raw.clone()
        t = raw.view(tdtype).reshape(shape)
    if device != "cpu":
        t = t.to(device)
    if kind == "param":
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# ---------------------------------------------------------------------------- rrefs
def _load_rref(index: int) -> Any:
    return _tls.rrefs[index]


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, buffers: list, fork: Callable[[Any], Any] | None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._fork = fork
        self.forks: list[Any] = []
        self.fork_error: BaseException | None = None
        self._torch = sys.modules.get("torch")

    def reducer_override(self, obj: Any) -> Any:
        if getattr(obj, "_rrefrt_is_rref", False):
            if self._fork is None:
                raise SerializationError("RRefs can only be sent as arguments or results of rrefrt calls")
            try:
                self.forks.append(self._fork(obj))
            except BaseException as e:  # e.g. the RRef's creation failed: raised as-is
                self.fork_error = e
                raise
            return (_load_rref, (len(self.forks) - 1,))
        torch = self._torch
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided:
            return _reduce_tensor(obj)
        return NotImplemented


#: rrefrt's globals that payloads name, admitted under any allowlist
_INTERNAL_GLOBALS = frozenset({
    "rrefrt.serialization._rebuild_tensor",
    "rrefrt.serialization._load_rref",
    "rrefrt.rref._invoke_on_owner",
    "rrefrt.options.WorkerInfo",
})


def _admitted(module: str, name: str, allow: frozenset[str]) -> bool:
    full = f"{module}.{name}"
    if full in allow or full in _INTERNAL_GLOBALS:
        return True
    if module == "rrefrt.errors" and "." not in name:  # rrefrt's error classes, nothing else
        from . import errors

        obj = getattr(errors, name, None)
        return isinstance(obj, type) and issubclass(obj, RpcError)
    return False


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allow = _allowlist
        if allow is not None and not _admitted(module, name, allow):
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not in the unpickling allowlist")
        return super().find_class(module, name)


def dumps(
    obj: Any, fork: Callable[[Any], Any] | None = None, device_map: dict[str, str] | None = None
) -> tuple[list[Any], list[Any]]:
    """Return ``(frames, forks)``. ``device_map`` maps this worker's devices to the
    receiver's (tensors on unmapped devices arrive on the CPU). On failure the forks already
    made are attached to the raised error as ``.forks``, for the caller to undo."""
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    p = _Pickler(f, buffers, fork)
    _tls.send_map = device_map
    try:
        p.dump(obj)
    except SerializationError as e:
        e.forks = p.forks  # type: ignore[attr-defined]
        raise
    except RpcError as e:  # e.g. an RRef whose creation failed: its error is raised as-is
        e.forks = p.forks  # type: ignore[attr-defined]
        raise
    except Exception as e:
        if e is p.fork_error:
            e.forks = p.forks  # type: ignore[attr-defined]
            raise
        err = SerializationError(f"cannot send {_describe(obj)}: {type(e).__name__}: {e}")
        err.forks = p.forks  # type: ignore[attr-defined]
        raise err from e
    finally:
        _tls.send_map = None
    return [f.getbuffer(), *(b.raw() for b in buffers)], p.forks


def loads(frames: Sequence[Any], rrefs: list[Any]) -> Any:
    if not frames:
        raise SerializationError("payload is missing")
    bufs = [_as_buffer(fr) for fr in frames]
    _tls.rrefs = rrefs
    try:
        return _Unpickler(io.BytesIO(bufs[0]), buffers=bufs[1:]).load()
    except RpcError:
        raise
    except Exception as e:
        raise SerializationError(f"cannot decode payload: {type(e).__name__}: {e}") from e
    finally:
        _tls.rrefs = None


def _as_buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _describe(obj: Any) -> str:
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[0]):
        name = getattr(obj[0], "__qualname__", repr(obj[0]))
        return f"the call to {name!r} (function, args or kwargs)"
    return f"an object of type {type(obj).__name__}"


# ---------------------------------------------------------------------------- errors
def dumps_error(exc: BaseException, worker: str) -> list[Any]:
    """An exception as frames: the object itself when picklable, its text in every case."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    qualname = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        if not rebuildable(exc, pickle.dumps, pickle.loads):  # keep the text decodable (issue 11 item 9)
            raise TypeError("cannot be rebuilt")
        frames, _ = dumps((exc, qualname, tb, worker))
    except Exception:
        frames, _ = dumps((None, qualname, tb, worker))
    return frames


def loads_error(frames: Sequence[Any], fallback_worker: str) -> BaseException:
    try:
        exc, qualname, tb, worker = loads(frames, [])
    except Exception as e:
        return RemoteError(f"worker {fallback_worker!r} raised an error that could not be decoded: {e}")
    message = f"{exc if exc is not None else qualname} (raised on worker {worker!r})\n\nRemote traceback:\n{tb}"
    if exc is None:
        return RemoteError.from_wire(qualname, worker, tb)
    if isinstance(exc, RpcError) or type(exc).__module__.startswith("rrefrt"):
        try:
            rebuilt = type(exc)(message)
            rebuilt.__dict__.update(exc.__dict__)
            return rebuilt
        except Exception:
            return exc
    try:
        rebuilt = type(exc)(message)
        rebuilt.__dict__.update(getattr(exc, "__dict__", {}))
        rebuilt.remote_traceback = tb  # type: ignore[attr-defined]
        rebuilt.worker = worker  # type: ignore[attr-defined]
        return rebuilt
    except Exception:
        try:
            exc.add_note(f"raised on worker {worker!r}; remote traceback:\n{tb}")
        except Exception:
            return RemoteError(f"{qualname}: {message}", qualname, worker)
        return exc
