"""Options and worker identity: ``RpcBackendOptions``, ``WorkerInfo``, ``BackendType``.

Leaf module: imports nothing from rrefrt but errors.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from .errors import ArgumentError

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
    Whether the device is valid is checked at init, on every worker (rrefrt/devices.py)."""
    if isinstance(d, int) and not isinstance(d, bool):
        return f"cuda:{d}"
    s = str(d).strip()
    return "cuda:0" if s == "cuda" else s


class RpcBackendOptions:
    """Options of ``init_rpc``. ``timeout``-like fields are seconds.

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
        for label, value in (
            ("rpc_timeout", rpc_timeout),
            ("init_timeout", init_timeout),
            ("shutdown_timeout", shutdown_timeout),
        ):
            if not isinstance(value, (int, float)):  # torch's phrase (a timedelta, say)
                raise ArgumentError(f"incompatible constructor arguments: {label} must be a number of seconds, got {value!r}")
            if value < 0:
                raise ArgumentError(f"{label} must be a number of seconds >= 0, got {value!r}")
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ArgumentError(f"num_worker_threads must be a positive int, got {num_worker_threads!r}")
        if not heartbeat_interval > 0 or not heartbeat_timeout > 0:
            raise ArgumentError("heartbeat_interval and heartbeat_timeout must be > 0")
        if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
            raise ArgumentError("secret must be a non-empty str or bytes (or None to use RREFRT_SECRET)")
        if unpickle_allowlist is not None and (
            isinstance(unpickle_allowlist, (str, bytes))
            or not all(isinstance(n, str) and "." in n.strip(".") for n in unpickle_allowlist)
        ):
            raise ArgumentError(f"unpickle_allowlist must be a list of 'module.qualname' strings, got {unpickle_allowlist!r}")
        self.init_method = init_method
        self.rpc_timeout = float(rpc_timeout)
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[str, str]] = {}
        for to, dmap in (device_maps or {}).items():
            self.set_device_map(to, dmap)
        self.devices = [_device_str(d) for d in (devices or [])]
        self.init_timeout = float(init_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.strict_rref_leaks = bool(strict_rref_leaks)
        self.max_message_size = int(max_message_size)
        self.secret = secret  #: never shown by repr
        self.unpickle_allowlist = None if unpickle_allowlist is None else list(unpickle_allowlist)

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
