"""Device maps and the device/stream scope a call runs in.

Owns: what a worker publishes about its devices at rendezvous (``DeviceInfo``), the
validation of every worker's maps against every other worker's devices and the per-peer
routes that follow (``DevicePlan``), the launcher's device default (``default_devices``),
and ``call_scope``: the current CUDA device and a pooled stream around a call on the owner.
Pure functions over plain data, except ``probe_cuda`` and ``call_scope`` (torch).

torch only when CUDA is named or already
loaded, through rrefrt/payload/torchimport.py.
Must not import the runtime, the transport or the launcher.

NOTE [Device maps]
  torch's semantics. ``set_device_map(to, {mine: theirs})`` on the caller says where a
  tensor on the caller's device ``mine`` lands on worker ``to``. A request to ``to`` uses
  the caller's map; the reply uses the INVERSE of the caller's map (the callee's own map
  to the caller plays no part), so a reply lands on the device the caller sent from.
  CPU tensors stay CPU tensors. A tensor on a device the map does not name is an error at
  the call site (``buffers.target_device``), never a silent move to the CPU.
  At init every worker publishes ``DeviceInfo.to_meta()`` and builds ``DevicePlan`` over
  all of them; the plan checks every worker's maps (not only its own), so a bad map fails
  init on every worker with the same message, naming both workers and the device.

NOTE [Streams]
  On the owner, ``call_scope(devices, incoming)`` (a worker with CUDA devices) makes the
  target device current (the device of the first CUDA tensor among the arguments, else the
  worker's first device), takes a stream per device from a small pool, makes it wait for
  the work already queued on the thread's current stream (where the arguments were copied
  in), and makes it current. On exit each device's default stream waits for the pool
  stream (an event, no host wait), and ``finish(value)`` marks the value's CUDA tensors as
  used on the default stream (``record_stream``), so in-process readers on the default
  stream and the reply's encoding (which stages or exports on the current stream) never
  see unfinished results. A worker without CUDA devices gets a shared no-op scope.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import threading
from typing import Any, Callable, Mapping, Sequence

from rrefrt.payload import buffers

from rrefrt.payload import torchimport
from rrefrt.payload.buffers import DeviceMapError, Route

__all__ = ["DeviceMapError", "DeviceInfo", "DevicePlan", "CudaProbe", "probe_cuda", "default_devices",
           "normalize_device", "call_scope", "NO_SCOPE"]

_CUDA_RE = re.compile(r"cuda:(\d+)")


def normalize_device(d: Any) -> str:
    """``0``, ``"cuda"``, ``torch.device("cuda", 0)`` -> ``"cuda:0"``; ``"cpu"`` -> ``"cpu"``."""
    if isinstance(d, bool):
        raise DeviceMapError(f"not a device: {d!r}")
    if isinstance(d, int):
        if d < 0:
            raise DeviceMapError(f"not a device: {d!r}")
        return f"cuda:{d}"
    s = str(d).strip()
    if s == "cuda":
        return "cuda:0"
    if s == "cpu" or _CUDA_RE.fullmatch(s):
        return s
    raise DeviceMapError(f"unsupported device {d!r}: rrefrt maps 'cpu' and 'cuda:N' devices")


def _cuda_index(d: str) -> int | None:
    m = _CUDA_RE.fullmatch(d)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class CudaProbe:
    """What this process sees of CUDA. ``count`` None: torch not loaded and no CUDA named,
    so not asked (importing torch costs a second)."""

    count: int | None
    uuids: tuple[str, ...] = ()


def probe_cuda() -> CudaProbe:
    torch = torchimport.torch_module()

    if not torch.cuda.is_available():
        return CudaProbe(0)
    n = torch.cuda.device_count()
    uuids = []
    for i in range(n):
        try:
            uuids.append(str(torch.cuda.get_device_properties(i).uuid))
        except Exception:  # older torch, odd platforms: no IPC matching for this device
            uuids.append("")
    return CudaProbe(n, tuple(uuids))


def default_devices(options_devices: Sequence[str], environ: Mapping[str, str], strict: bool = True) -> list[str]:
    """The devices a worker uses: its own ``devices=`` option, else the launcher's
    RREFRT_DEVICE. The launcher masks a worker's GPU with CUDA_VISIBLE_DEVICES, so the GPU
    it was given is ``cuda:0`` inside the worker, whichever physical GPU it is."""
    norm = normalize_device if strict else _norm
    if options_devices:
        return [norm(d) for d in options_devices]
    assigned = environ.get("RREFRT_DEVICE", "").strip()
    if assigned and assigned != "cpu":
        return [norm(assigned)]
    return []


def _norm(d: Any) -> str:
    """normalize_device, or the device as given (``_check_own`` reports it)."""
    try:
        return normalize_device(d)
    except DeviceMapError:
        return str(d)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What one worker publishes at rendezvous about its devices (``to_meta`` is plain data)."""

    name: str
    devices: tuple[str, ...]  #: the devices it uses (declared or from the launcher)
    maps: Mapping[str, Mapping[str, str]]  #: peer name -> {its device: peer's device}
    cuda_count: int | None  #: CUDA devices it sees; None: not asked (see CudaProbe)
    uuids: tuple[str, ...] = ()  #: physical GPU of each cuda:i it sees
    visible: str | None = None  #: its CUDA_VISIBLE_DEVICES, for error messages
    cuda_ipc: bool = True  #: it accepts CUDA IPC handles (RREFRT_CUDA_IPC)

    @classmethod
    def local(cls, name: str, devices: Sequence[Any], device_maps: Mapping[str, Mapping[Any, Any]],
              environ: Mapping[str, str] | None = None,
              probe: Callable[[], CudaProbe] | None = None) -> "DeviceInfo":
        """This worker's info, to publish. Never raises for a bad device or map: a worker
        that stopped before the rendezvous would leave the others waiting for it until
        init_timeout; ``DevicePlan.build`` reports every problem on every worker instead
        (``problems()`` lists this worker's own, for a caller that wants them early)."""
        env = os.environ if environ is None else environ
        devs = tuple(_norm(d) for d in default_devices([_norm(d) for d in devices], env, strict=False))
        maps = {str(peer): {_norm(k): _norm(v) for k, v in m.items()} for peer, m in device_maps.items()}
        named = set(devs) | {d for m in maps.values() for d in [*m.keys(), *m.values()]}
        needs_cuda = any(d != "cpu" for d in named)
        if probe is None:
            probe = probe_cuda if (needs_cuda or torchimport.started()) else (lambda: CudaProbe(None))
        seen = probe()
        return cls(name, devs, maps, seen.count, seen.uuids, env.get("CUDA_VISIBLE_DEVICES"),
                   buffers.cuda_ipc_enabled(env))

    def problems(self) -> list[str]:
        """What is wrong with this worker's own devices and maps (no peer needed)."""
        return _check_own(self)

    def to_meta(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "maps": {p: dict(m) for p, m in self.maps.items()},
                "cuda_count": self.cuda_count, "uuids": list(self.uuids), "visible": self.visible,
                "cuda_ipc": self.cuda_ipc}

    @classmethod
    def from_meta(cls, name: str, meta: Mapping[str, Any] | None) -> "DeviceInfo":
        """A peer's published info (None: a peer that published nothing uses no devices)."""
        if meta is None:
            return cls(name, (), {}, None)
        try:
            return cls(
                name, tuple(str(d) for d in meta.get("devices", ())),
                {str(p): {str(k): str(v) for k, v in m.items()} for p, m in dict(meta.get("maps", {})).items()},
                None if meta.get("cuda_count") is None else int(meta["cuda_count"]),
                tuple(str(u) for u in meta.get("uuids", ())), meta.get("visible"), bool(meta.get("cuda_ipc", False)))
        except (TypeError, ValueError, AttributeError) as e:
            raise DeviceMapError(f"worker {name!r} published malformed device information: {e}") from None

    def describe_cuda(self) -> str:
        if self.cuda_count is None:
            return "did not load torch or declare a CUDA device (pass devices=['cuda:N'] on it)"
        if self.cuda_count == 0:
            return "has no CUDA (torch.cuda.is_available() is False there)"
        vis = f", CUDA_VISIBLE_DEVICES={self.visible}" if self.visible is not None else ""
        return f"sees {self.cuda_count} CUDA device(s): cuda:0..cuda:{self.cuda_count - 1}{vis}"


def _has(info: DeviceInfo, dev: str) -> bool:
    if dev == "cpu":
        return True
    idx = _cuda_index(dev)
    return idx is not None and info.cuda_count is not None and idx < info.cuda_count


def _check_own(w: DeviceInfo) -> list[str]:
    errors = []
    named = set(w.devices) | {d for m in w.maps.values() for d in [*m.keys(), *m.values()]}
    for d in sorted(named):
        if d != "cpu" and _cuda_index(d) is None:
            errors.append(f"worker {w.name!r} names device {d!r}: rrefrt maps 'cpu' and 'cuda:N' devices")
    for d in w.devices:
        if _cuda_index(d) is not None and not _has(w, d):
            errors.append(f"worker {w.name!r} uses device {d}, but it {w.describe_cuda()}")
    for peer, m in sorted(w.maps.items()):
        if len(set(m.values())) != len(m):
            errors.append(f"the device map of worker {w.name!r} to worker {peer!r} is not one-to-one: "
                          f"{dict(m)} maps two devices onto one")
        for src, dst in sorted(m.items()):
            if (src == "cpu") != (dst == "cpu"):
                errors.append(f"the device map of worker {w.name!r} to worker {peer!r} maps {src} to {dst}: "
                              "CPU tensors stay CPU tensors; map CUDA devices to CUDA devices")
            elif _cuda_index(src) is None:
                continue  # reported above
            elif not _has(w, src):
                errors.append(f"the device map of worker {w.name!r} to worker {peer!r} names {src} on "
                              f"{w.name!r}, but {w.name!r} {w.describe_cuda()}")
            elif w.devices and src != "cpu" and src not in w.devices:
                errors.append(f"the device map of worker {w.name!r} to worker {peer!r} names {src}, which is "
                              f"not among the devices {list(w.devices)} that {w.name!r} declared")
    return errors


def _inverse(m: Mapping[str, str]) -> dict[str, str]:
    return {v: k for k, v in m.items()}


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """One worker's view of the group's devices, validated: its CUDA devices and a request
    and a reply route to every peer (see NOTE [Device maps])."""

    me: str
    local_cuda: tuple[str, ...]  #: this worker's CUDA devices: the set call_scope manages
    requests: Mapping[str, Route]
    replies: Mapping[str, Route]

    @classmethod
    def build(cls, me: str, infos: Mapping[str, DeviceInfo],
              same_host: Callable[[str], bool] | None = None) -> "DevicePlan":
        """Validate every worker's maps against every worker's devices; raise one
        DeviceMapError listing every problem (the same text on every worker)."""
        if me not in infos:
            raise DeviceMapError(f"worker {me!r} is missing from the published device information")
        errors: list[str] = []
        for w in sorted(infos.values(), key=lambda i: i.name):
            errors.extend(_check_own(w))
            for peer, m in sorted(w.maps.items()):
                p = infos.get(peer)
                if p is None:
                    errors.append(f"worker {w.name!r} has a device map to worker {peer!r}, which is not in the "
                                  f"group (workers: {', '.join(sorted(infos))})")
                    continue
                for src, dst in sorted(m.items()):
                    if (src == "cpu") != (dst == "cpu") or (dst != "cpu" and _cuda_index(dst) is None):
                        continue  # reported by _check_own
                    if not _has(p, dst):
                        errors.append(f"the device map of worker {w.name!r} to worker {peer!r} maps {src} to "
                                      f"{dst}, but {peer!r} {p.describe_cuda()}")
                    elif p.devices and dst != "cpu" and dst not in p.devices:
                        errors.append(f"the device map of worker {w.name!r} to worker {peer!r} maps {src} to "
                                      f"{dst}, which is not among the devices {list(p.devices)} that {peer!r} "
                                      "declared")
        if errors:
            raise DeviceMapError("invalid device configuration: " + "; ".join(errors))
        mine = infos[me]
        local = same_host or (lambda _peer: False)
        requests: dict[str, Route] = {}
        replies: dict[str, Route] = {}
        for peer, p in infos.items():
            ipc = _ipc_devices(mine, p) if peer != me else {}
            here = peer != me and local(peer)
            requests[peer] = Route(peer, dict(mine.maps.get(peer, {})), ipc, here)
            replies[peer] = Route(peer, _inverse(p.maps.get(me, {})), ipc, here)
        cuda = tuple(dict.fromkeys(d for d in mine.devices if d != "cpu"))
        targets = {v for i in infos.values() for v in i.maps.get(me, {}).values()}
        sources = {k for m in mine.maps.values() for k in m}
        extra = sorted((targets | sources) - set(cuda) - {"cpu"}, key=lambda d: _cuda_index(d) or 0)
        return cls(me, cuda + tuple(extra), requests, replies)

    def request_route(self, peer: str) -> Route:
        return self.requests.get(peer) or Route(peer)

    def reply_route(self, peer: str) -> Route:
        return self.replies.get(peer) or Route(peer)

    def scope(self, incoming: Any = None) -> Any:
        """``call_scope`` over this worker's CUDA devices."""
        return call_scope(self.local_cuda, incoming)


def _ipc_devices(mine: DeviceInfo, peer: DeviceInfo) -> dict[str, str]:
    """My cuda:i -> the peer's cuda:j of the same physical GPU, where both accept IPC."""
    if not (mine.cuda_ipc and peer.cuda_ipc) or not mine.uuids or not peer.uuids:
        return {}
    theirs = {u: j for j, u in enumerate(peer.uuids) if u}
    return {f"cuda:{i}": f"cuda:{theirs[u]}" for i, u in enumerate(mine.uuids) if u and u in theirs}


# ---------------------------------------------------------------------------- call scope
class _NoScope:
    """The scope of a worker without CUDA devices: nothing to set, nothing to record."""

    __slots__ = ()

    def __enter__(self) -> "_NoScope":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def use(self, incoming: Any) -> None:
        return None

    def finish(self, value: Any) -> Any:
        return value


NO_SCOPE = _NoScope()


def call_scope(devices: Sequence[str], incoming: Any = None) -> Any:
    """The device/stream scope a call runs in on the owner (NOTE [Streams]). On the owner:

        with call_scope(plan.local_cuda) as s:     # NO_SCOPE on a worker without CUDA
            func, args, kwargs = loads(frames, rrefs)  # copies in on the pool streams
            s.use(args)                            # the first CUDA argument's device current
            value = s.finish(func(*args, **kwargs))
            frames = dumps(value, route=plan.reply_route(caller))

    ``incoming`` (tensors decoded before the scope) picks the target device at entry."""
    if not devices:
        return NO_SCOPE
    return _CudaScope(devices, incoming)


class _StreamPool:
    """A few streams per device, handed out round robin (created on first use)."""

    SIZE = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, list[Any]] = {}
        self._next = itertools.count()

    def get(self, index: int) -> Any:
        streams = self._streams.get(index)
        if streams is None:
            torch = torchimport.torch_module()

            with self._lock:
                streams = self._streams.get(index)
                if streams is None:
                    streams = [torch.cuda.Stream(device=index) for _ in range(self.SIZE)]
                    self._streams[index] = streams
        return streams[next(self._next) % len(streams)]


_pool = _StreamPool()


def cuda_tensors(value: Any, depth: int = 3, limit: int = 1024) -> list[Any]:
    """The CUDA tensors in ``value``, looking into lists, tuples and dict values
    ``depth`` levels deep, at most ``limit`` of them (cheap; never calls user code)."""
    torch = torchimport.loaded()
    out: list[Any] = []
    if torch is None:
        return out

    def walk(v: Any, d: int) -> None:
        if len(out) >= limit:
            return
        if isinstance(v, torch.Tensor):
            if v.device.type == "cuda":
                out.append(v)
        elif d > 0 and type(v) in (list, tuple):
            for x in v:
                walk(x, d - 1)
        elif d > 0 and type(v) is dict:
            for x in v.values():
                walk(x, d - 1)

    walk(value, depth)
    return out


class _CudaScope:
    def __init__(self, devices: Sequence[str], incoming: Any) -> None:
        self._indices = [i for i in (_cuda_index(d) for d in devices) if i is not None]
        self._incoming = incoming
        self._saved: list[Any] = []
        self._streams: dict[int, Any] = {}
        self._prev_device = -1

    def __enter__(self) -> "_CudaScope":
        torch = torchimport.torch_module()

        first = cuda_tensors(self._incoming, limit=1)
        target = first[0].device.index if first else self._indices[0]
        order = [i for i in self._indices if i != target] + [target]  # the target's stream last
        self._prev_device = torch.cuda.current_device()
        try:
            for i in order:
                prev = torch.cuda.current_stream(i)
                s = _pool.get(i)
                s.wait_stream(prev)  # the arguments were copied in on the thread's current stream
                self._saved.append(prev)
                self._streams[i] = s
                torch.cuda.set_stream(s)  # also makes device i current
        except BaseException:
            self._restore()
            raise
        return self

    def use(self, incoming: Any) -> None:
        """Make the device of ``incoming``'s first CUDA tensor current (for a scope entered
        before the arguments were decoded: decoding runs inside the scope)."""
        torch = torchimport.torch_module()

        first = cuda_tensors(incoming, limit=1)
        if first and first[0].device.index != torch.cuda.current_device():
            torch.cuda.set_device(first[0].device.index)

    def finish(self, value: Any) -> Any:
        """Mark ``value``'s CUDA tensors as used by each device's default stream, which
        waits for the call's stream on exit (so their memory is not reused too early)."""
        torch = torchimport.torch_module()

        for t in cuda_tensors(value):
            t.record_stream(torch.cuda.default_stream(t.device))
        return value

    def __exit__(self, *exc: Any) -> None:
        torch = torchimport.torch_module()

        try:
            for i, s in self._streams.items():
                torch.cuda.default_stream(i).wait_stream(s)
        finally:
            self._restore()

    def _restore(self) -> None:
        torch = torchimport.torch_module()

        for prev in reversed(self._saved):
            torch.cuda.set_stream(prev)
        self._saved.clear()
        if self._prev_device >= 0:
            torch.cuda.set_device(self._prev_device)
