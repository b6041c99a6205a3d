"""Options and worker identity: ``RpcBackendOptions``, ``WorkerInfo``, ``BackendType``.

Leaf module: imports nothing from rrefrt but errors and arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
import re
from dataclasses import dataclass
from typing import Any

from rrefrt.arguments import _CONSTRUCTOR, flag, integer, seconds
from rrefrt.errors import ArgumentError

__all__ = ["RpcBackendOptions", "TensorPipeRpcBackendOptions", "WorkerInfo", "BackendType"]


class BackendType(enum.Enum):
    """Accepted for drop-in compatibility; rrefrt has one backend."""

    TENSORPIPE = "TENSORPIPE"


#: torch's rule for worker names (its WorkerInfo checks the same, with this text)
_NAME = re.compile(r"[A-Za-z0-9\-_:]{1,127}")


def check_worker_name(name: object) -> None:
    """Raise ArgumentError (a RuntimeError too, as torch's) unless ``name`` is 1-127 of
    ``A-Z a-z 0-9 - _ :``."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ArgumentError(
            "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than 128 chars, "
            f"but got {name!r}"
        )


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the group: its unique ``name`` and ``id`` (its rank). Hashable. The name
    follows torch's rule (``check_worker_name``)."""

    name: str
    id: int

    def __post_init__(self) -> None:
        check_worker_name(self.name)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def _device_str(d: Any) -> str:
    """``0`` and ``"cuda"`` -> ``"cuda:0"``; anything else as ``str`` (a torch.device too).
    Whether the device is valid is checked at init, on every worker (rrefrt/payload/devices.py)."""
    if isinstance(d, int) and not isinstance(d, bool):
        return f"cuda:{d}"
    s = str(d).strip()
    return "cuda:0" if s == "cuda" else s


class RpcBackendOptions:
    """Options of ``init_rpc``. ``timeout``-like fields are finite seconds: ``rpc_timeout``
    ``>= 0`` (0: no timeout), the others ``> 0``; ``heartbeat_timeout`` at least twice
    ``heartbeat_interval``; ``num_worker_threads`` and ``max_message_size`` (bytes) ints
    ``> 0``; ``strict_rref_leaks`` a bool. Anything else raises ``ArgumentError`` naming the
    option, here and again in ``init_rpc`` (a field may be set after construction).

    ``secret`` (str or bytes) keys the CURVE authentication of every peer (docs/security.md);
    None falls back to the environment variable RREFRT_SECRET, and without either the
    workers do not authenticate each other. ``unpickle_allowlist`` restricts the globals a
    received payload may name to these ``"module.qualname"`` strings (plus rrefrt's own);
    None allows any. ``_transports`` and ``_channels`` are TensorPipe's and are ignored.
    """

    def __init__(
        self,
        *,
        init_method: str = "env://",
        rpc_timeout: float = 60.0,
        num_worker_threads: int = 16,
        device_maps: dict[str, dict[Any, Any]] | None = None,
        devices: list[Any] | None = None,
        init_timeout: float = 300.0,
        shutdown_timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
        strict_rref_leaks: bool = False,
        max_message_size: int = 1 << 31,
        secret: str | bytes | None = None,
        unpickle_allowlist: list[str] | None = None,
        _transports: Any = None,
        _channels: Any = None,
    ) -> None:
        if not isinstance(init_method, str) or not (
            init_method.startswith("env://") or init_method.startswith("tcp://")
        ):
            raise ArgumentError(f"init_method must be 'env://' or 'tcp://host:port', got {init_method!r}")
        if device_maps is not None and not isinstance(device_maps, dict):
            raise ArgumentError(f"{_CONSTRUCTOR}device_maps must be a dict {{worker name: {{device: device}}}}, "
                                f"got {type(device_maps).__name__}")
        if devices is not None and (isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple))):
            raise ArgumentError(f"{_CONSTRUCTOR}devices must be a list of devices, got {devices!r}")
        self.init_method = init_method
        self.rpc_timeout = rpc_timeout
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[str, str]] = {}
        for to, dmap in (device_maps or {}).items():
            self.set_device_map(to, dmap)
        self.devices = [_device_str(d) for d in (devices or [])]
        self.init_timeout = init_timeout
        self.shutdown_timeout = shutdown_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.strict_rref_leaks = strict_rref_leaks
        self.max_message_size = max_message_size
        self.secret = secret  #: never shown by repr
        self.unpickle_allowlist = unpickle_allowlist
        self.validate()

    def validate(self) -> None:
        """Check every option and put it in its canonical form (float seconds, int counts),
        or raise ArgumentError naming it (rrefrt/arguments.py). The constructor calls it, and
        ``init_rpc`` again: a field set afterwards (``opts.rpc_timeout = ...``) is checked
        before anything starts, never found bad later."""
        self.rpc_timeout = seconds("rpc_timeout", self.rpc_timeout, constructor=True)  # 0: no timeout
        self.init_timeout = seconds("init_timeout", self.init_timeout, positive=True, constructor=True)
        self.shutdown_timeout = seconds("shutdown_timeout", self.shutdown_timeout, positive=True, constructor=True)
        self.num_worker_threads = integer("num_worker_threads", self.num_worker_threads, minimum=1, constructor=True)
        interval = seconds("heartbeat_interval", self.heartbeat_interval, positive=True, constructor=True)
        timeout = seconds("heartbeat_timeout", self.heartbeat_timeout, positive=True, constructor=True)
        if timeout < 2 * interval:
            raise ArgumentError(
                f"heartbeat_timeout ({timeout} s) must be at least twice heartbeat_interval ({interval} s): "
                "a peer is declared dead after heartbeat_timeout without an answer, so a shorter one "
                "declares live peers dead when one heartbeat is late"
            )
        self.heartbeat_interval, self.heartbeat_timeout = interval, timeout
        self.strict_rref_leaks = flag("strict_rref_leaks", self.strict_rref_leaks)
        self.max_message_size = integer("max_message_size", self.max_message_size, minimum=1, constructor=True,
                                        what="a number of bytes > 0")
        secret = self.secret
        if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
            raise ArgumentError("secret must be a non-empty str or bytes (or None to use RREFRT_SECRET)")
        allow = self.unpickle_allowlist
        if allow is not None:
            names = None if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable) else list(allow)
            if names is None or not all(isinstance(n, str) and "." in n.strip(".") for n in names):
                raise ArgumentError(f"unpickle_allowlist must be a list of 'module.qualname' strings, got {allow!r}")
            self.unpickle_allowlist = names

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Tensors on caller device ``k`` arrive on callee ``to``'s device ``device_map[k]``;
        replies come back by the inverse map (docs/devices.md)."""
        if not isinstance(device_map, dict):
            raise ArgumentError(f"device_map must be a dict, got {type(device_map).__name__}")
        mapped = {_device_str(k): _device_str(v) for k, v in device_map.items()}
        if len(set(mapped.values())) != len(mapped):
            raise ArgumentError(f"device_map to {to!r} maps two devices onto one: {device_map!r}")
        self.device_maps.setdefault(to, {}).update(mapped)

    def set_devices(self, devices: list[Any]) -> None:
        self.devices = [_device_str(d) for d in devices]

    def __repr__(self) -> str:
        return (
            f"RpcBackendOptions(init_method={self.init_method!r}, rpc_timeout={self.rpc_timeout}, "
            f"num_worker_threads={self.num_worker_threads}, shutdown_timeout={self.shutdown_timeout})"
        )


TensorPipeRpcBackendOptions = RpcBackendOptions
