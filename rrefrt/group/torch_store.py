"""torch's stores behind rrefrt's store-client interface, for launch modes where torch
already holds the rendezvous: torchrun's agent store, a process group initialised with
``torch.distributed.init_process_group`` on the same MASTER_ADDR/PORT, and ``file://``.

Owns: ``TorchStore`` (the adapter) and the three constructors. Imports torch lazily, only
when one of them is called; imports from rrefrt: errors, store, torchimport
(which imports torch).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from rrefrt.payload import torchimport
from rrefrt.errors import RpcError
from rrefrt.group.store import StoreError, StoreTimeout

log = logging.getLogger("rrefrt.rendezvous")

#: every rrefrt key in a store shared with torch lives under this prefix
PREFIX = "rrefrt/"


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
        try:
            self._s.wait(keys, timedelta(seconds=max(timeout, 0.001)))
            return True
        except Exception:
            return False

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


def default_group_store(host: str, port: int, timeout: float) -> TorchStore | None:
    """The store of torch's initialised default process group (as torch RPC does when a
    program calls init_process_group on the same MASTER_PORT first), under ``rrefrt/``;
    None if it cannot be had."""
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
