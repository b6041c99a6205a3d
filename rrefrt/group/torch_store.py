"""torch's stores behind rrefrt's store-client interface, for launch modes where torch
already holds the rendezvous: torchrun's agent store, a process group initialised with
``torch.distributed.init_process_group`` on the same MASTER_ADDR/PORT, and ``file://``.

Owns: ``TorchStore`` (the adapter) and the three constructors. Imports torch lazily, only
when one of them is called; imports from rrefrt: errors, store, torchimport
(which imports torch).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from rrefrt.payload import torchimport
from rrefrt.errors import RpcError
from rrefrt.group.store import StoreError, StoreTimeout

log = logging.getLogger("rrefrt.rendezvous")

#: every rrefrt key in a store shared with torch lives under this prefix
PREFIX = "rrefrt/"

#: never set: TorchStore.wait's pause between two checks
_PACE = threading.Event()


class TorchStore:
    """A ``torch.distributed.Store`` with the StoreClient interface (set/get/add/wait/
    check/delete_key/close); torch's errors become StoreError."""

    def __init__(self, store: Any) -> None:
        self._s = store

    def set(self, key: str, value: bytes) -> None:
        try:
            self._s.set(key, value)
        except RuntimeError as e:
            raise StoreError(f"torch store failed: {e}") from None

    def get(self, key: str, timeout: float) -> bytes:
        if not self.wait([key], timeout):
            raise StoreTimeout(f"key {key!r} did not appear within {timeout:.1f}s")
        try:
            return bytes(self._s.get(key))
        except RuntimeError as e:
            raise StoreError(f"torch store failed: {e}") from None

    def add(self, key: str, delta: int) -> int:
        try:
            return int(self._s.add(key, delta))
        except RuntimeError as e:
            raise StoreError(f"torch store failed: {e}") from None

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Poll with ``check`` (a few ms apart, 50 ms at most): torch's own ``wait`` logs two
        c10d warnings ("waitForInput ... timed out") each time a short wait runs out, and the
        rendezvous waits in short steps."""
        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            if self.check(keys):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _PACE.wait(min(pause, left))  # paces the poll; nothing sets it
            pause = min(pause * 2, 0.05)

    def check(self, keys: list[str]) -> bool:
        try:
            return bool(self._s.check(keys))
        except RuntimeError as e:
            raise StoreError(f"torch store failed: {e}") from None

    def delete_key(self, key: str) -> bool:
        return bool(self._s.delete_key(key))

    def close(self) -> None:
        pass


def agent_store(host: str, port: int, timeout: float) -> TorchStore:
    """torchrun's agent TCPStore (TORCHELASTIC_USE_AGENT_STORE=True)."""
    dist = torchimport.import_module("torch.distributed")

    return TorchStore(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True))


def group_store_address(store: Any) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under a process group's store (through its
    PrefixStores); None for another kind of store (FileStore, HashStore) or an unknown shape."""
    for _ in range(8):
        inner = getattr(store, "_underlying_non_prefix_store", None) or getattr(store, "underlying_store", None)
        if inner is None or inner is store:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return host, port
    return None


def same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Two host:port pairs name one endpoint ("localhost" and "127.0.0.1" alike)."""
    if a[1] != b[1]:
        return False
    if a[0] == b[0]:
        return True
    try:
        resolve = lambda h: {i[4][0] for i in socket.getaddrinfo(h, None, socket.AF_INET)}  # noqa: E731
        return bool(resolve(a[0]) & resolve(b[0]))
    except OSError:
        return False


def default_group_store(host: str, port: int, timeout: float, explicit: bool = False) -> TorchStore | None:
    """The store of torch's initialised default process group, under ``rrefrt/``, when it
    serves the rendezvous's address (torch RPC shares it the same way: its TCPStore is
    multi-tenant on one port); None when it cannot be had or serves another address.

    Which address counts: with ``explicit`` (init_method="tcp://host:port") the group's
    store must be a TCPStore at that address; with env:// a TCPStore at another address is
    not shared either, and a store of another kind (a FileStore) is. A program that gives
    its process group one port and RPC another (DDP trainers beside an RPC master and
    parameter server, which have no process group) must rendezvous on RPC's own port, or
    nobody would host the store the others wait for."""
    dist = torchimport.import_module("torch.distributed")
    store = None
    try:
        distributed_c10d = torchimport.import_module("torch.distributed.distributed_c10d")

        store = distributed_c10d._get_default_store()
    except Exception as e:  # private helper: fall back to a client of the TCPStore on the port
        log.debug("no default process-group store (%s); connecting to %s:%d", e, host, port)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception:
            return None
    where = group_store_address(store)
    if (where is None and explicit) or (where is not None and not same_address(where, (host, port))):
        log.debug("the process group's store (%s) is not the rendezvous at %s:%d: not shared",
                  f"{where[0]}:{where[1]}" if where else "not a TCPStore", host, port)
        return None
    return TorchStore(dist.PrefixStore(PREFIX, store))


def file_store(path: str, world_size: int, timeout: float) -> TorchStore:
    """init_method="file://<path>", as torch accepts it (torch's FileStore)."""
    try:
        dist = torchimport.import_module("torch.distributed")
    except ImportError:
        raise RpcError("init_method='file://...' needs torch (it uses torch.distributed.FileStore)") from None
    store = dist.FileStore(path, world_size)
    store.set_timeout(timedelta(seconds=timeout))
    return TorchStore(dist.PrefixStore(PREFIX, store))
