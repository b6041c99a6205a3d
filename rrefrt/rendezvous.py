"""Rendezvous: how workers find each other, and the store barriers of shutdown.

Owns: parsing ``init_method`` and the environment, hosting or joining the store, publishing
this worker's record, validating the group (unique names and ranks, agreeing world sizes),
and bounded barriers. Imports from rrefrt: errors, store, environment.

Keys (prefix ``rpc/<generation>/``; the generation counts init_rpc calls of the job, so a
group re-initialised after shutdown never reads stale records):

    rank/<r>          claim counter: > 1 means two workers asked for rank r
    worker/<r>        msgpack record {name, rank, world_size, incarnation, endpoints, host}
    abort             a message: some worker found the group invalid; everyone fails with it
    barrier/<phase>/<r>  worker r reached that phase of shutdown
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import msgpack

from .environment import resolve_env
from .errors import RpcError
from .store import StoreClient, StoreError, StoreServer, StoreTimeout

log = logging.getLogger("rrefrt.rendezvous")


class RendezvousError(RpcError):
    """The group could not be formed (missing, duplicate or inconsistent workers)."""


@dataclass(frozen=True)
class Record:
    name: str
    rank: int
    world_size: int
    incarnation: int
    tcp: str
    ipc: str
    host: str


@dataclass
class GroupSpec:
    master_addr: str
    master_port: int
    rank: int
    world_size: int


def resolve(init_method: str, rank: int, world_size: int | None) -> GroupSpec:
    """Arguments win over the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or
    the SLURM / Open MPI equivalents)."""
    env = resolve_env(os.environ)
    if init_method.startswith("tcp://"):
        url = urlparse(init_method)
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} must be tcp://host:port")
        addr, port = url.hostname, url.port
    else:
        addr, port_s = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr or not port_s:
            raise ValueError(
                "init_method 'env://' needs MASTER_ADDR and MASTER_PORT in the environment "
                "(or use init_method='tcp://host:port', or start the job with rrefrt-run)"
            )
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"MASTER_PORT must be an integer, got {port_s!r}") from None
    if rank is None or rank < 0:
        if "RANK" not in env:
            raise ValueError("no rank given: pass rank=... to init_rpc or set RANK in the environment")
        rank = int(env["RANK"])
    if world_size is None:
        if "WORLD_SIZE" not in env:
            raise ValueError(
                "no world_size given and WORLD_SIZE is not set: dynamic groups (world_size=None) are "
                "planned but not supported yet; pass world_size=... to init_rpc"
            )
        world_size = int(env["WORLD_SIZE"])
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    return GroupSpec(addr, port, rank, world_size)


def bind_host(master_addr: str) -> str:
    """The address of the interface that reaches MASTER_ADDR (never 0.0.0.0)."""
    try:
        infos = socket.getaddrinfo(master_addr, None, socket.AF_INET)
        ip = infos[0][4][0]
    except OSError as e:
        raise RendezvousError(f"cannot resolve MASTER_ADDR {master_addr!r}: {e}") from None
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((ip, 9))
        return s.getsockname()[0]
    finally:
        s.close()


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Rendezvous:
    def __init__(self, spec: GroupSpec, timeout: float) -> None:
        self.spec = spec
        self.server: StoreServer | None = None
        self._seen: set[str] = set()
        hosted = os.environ.get("RREFRT_STORE_HOSTED") == "1"
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if spec.rank == 0 and not hosted and not agent_store:
            self.server = StoreServer(spec.master_addr, spec.master_port)
        try:
            if agent_store:
                self.store: Any = _TorchStore(spec.master_addr, spec.master_port, timeout)
            else:
                self.store = StoreClient(spec.master_addr, spec.master_port, connect_timeout=timeout)
            n = self.store.add("rpc/init_count", 1)
        except Exception:
            self.close()
            raise
        self.prefix = f"rpc/{(n - 1) // spec.world_size}/"

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    def join(self, record: Record, deadline: float) -> list[Record]:
        """Publish our record and return everyone's, validated; raise RendezvousError."""
        spec = self.spec
        if self.store.add(self.key(f"rank/{spec.rank}"), 1) > 1:
            other = self._try_get(f"worker/{spec.rank}")
            msg = (
                f"duplicate rank {spec.rank}: claimed by worker {record.name!r} and by "
                f"{other.name if other else 'another worker'!r}"
            )
            self.store.set(self.key("abort"), msg.encode())
            raise RendezvousError(msg)
        self.store.set(self.key(f"worker/{spec.rank}"), msgpack.packb(record.__dict__))
        keys = [f"worker/{r}" for r in range(spec.world_size)]
        where = f"worker {record.name!r} (rank {spec.rank}) waited for the group at {spec.master_addr}:{spec.master_port}"
        try:
            missing = self._wait_keys(keys, deadline)
        except StoreError as e:
            left = [k.split("/")[1] for k in keys if k not in self._seen]
            raise RendezvousError(
                f"{where}; rank(s) {', '.join(left)} never joined and the store closed "
                f"(rank 0 gave up or failed): {e}"
            ) from None
        if missing:
            ranks = ", ".join(k.split("/")[1] for k in missing)
            msg = f"{where}, but rank(s) {ranks} never joined (world_size={spec.world_size})"
            self.store.set(self.key("abort"), msg.encode())
            raise RendezvousError(msg)
        records = [self._get(k) for k in keys]
        self._validate(records, record)
        return records

    def _validate(self, records: list[Record], mine: Record) -> None:
        by_name: dict[str, Record] = {}
        problem = None
        for r in records:
            if r.world_size != mine.world_size:
                problem = (
                    f"world size mismatch: worker {r.name!r} (rank {r.rank}) has world_size="
                    f"{r.world_size}, worker {mine.name!r} (rank {mine.rank}) has {mine.world_size}"
                )
            elif r.name in by_name:
                problem = f"duplicate worker name {r.name!r}: used by rank {by_name[r.name].rank} and rank {r.rank}"
            by_name.setdefault(r.name, r)
            if problem:
                break
        if problem:
            self.store.set(self.key("abort"), problem.encode())
            raise RendezvousError(problem)

    def _wait_keys(self, keys: list[str], deadline: float, dead: set[int] | None = None) -> list[str]:
        """Wait until every key exists (or its rank is in ``dead``); return the missing."""
        pending = [k for k in keys]
        while True:
            pending = [k for k in pending if not self.store.check([self.key(k)])]
            self._seen = set(keys) - set(pending)
            if dead:
                pending = [k for k in pending if int(k.rsplit("/", 1)[1]) not in dead]
            if not pending:
                return []
            if self.store.check([self.key("abort")]):
                raise RendezvousError(self.store.get(self.key("abort"), 1.0).decode())
            left = deadline - time.monotonic()
            if left <= 0:
                return pending
            self.store.wait([self.key(pending[0])], min(left, 0.2))

    def barrier(self, phase: str, rank: int, world_size: int, deadline: float, dead: set[int]) -> list[int]:
        """Arrive at ``phase``; wait (bounded) for every rank not known dead. Returns the
        ranks that never arrived."""
        self.store.set(self.key(f"barrier/{phase}/{rank}"), b"1")
        keys = [f"barrier/{phase}/{r}" for r in range(world_size)]
        missing = self._wait_keys(keys, deadline, dead)
        return [int(k.rsplit("/", 1)[1]) for k in missing]

    def arrive(self, phase: str, rank: int) -> None:
        self.store.set(self.key(f"barrier/{phase}/{rank}"), b"1")

    def _get(self, suffix: str) -> Record:
        return Record(**msgpack.unpackb(self.store.get(self.key(suffix), 5.0)))

    def _try_get(self, suffix: str) -> Record | None:
        try:
            return self._get(suffix)
        except Exception:
            return None

    def close(self, failed: bool = False) -> None:
        """Close the client (and the server, if hosted here). After a failed join the
        host keeps the store up (at most 3 s) until every worker that joined has left,
        so each of them reads the real error rather than a closed connection."""
        store = getattr(self, "store", None)
        if store is not None and failed and hasattr(self, "prefix"):
            try:
                gone = self.store.add(self.key("gone"), 1)
                if self.server is not None:
                    deadline = time.monotonic() + 3.0
                    while time.monotonic() < deadline:
                        claims = sum(self.store.add(self.key(f"rank/{r}"), 0) for r in range(self.spec.world_size))
                        if gone >= claims:
                            break
                        self.store.wait([self.key("never")], 0.05)  # paces the re-check
                        gone = self.store.add(self.key("gone"), 0)
            except Exception:
                pass
        if store is not None:
            store.close()
        if self.server is not None:
            self.server.close()
            self.server = None


class _TorchStore:
    """torch's TCPStore (torchrun's agent store) behind the StoreClient interface."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True)
        self._td = timedelta

    def set(self, key: str, value: bytes) -> None:
        self._s.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        if not self.wait([key], timeout):
            raise StoreTimeout(f"key {key!r} did not appear within {timeout:.1f}s")
        return self._s.get(key)

    def add(self, key: str, delta: int) -> int:
        return int(self._s.add(key, delta))

    def wait(self, keys: list[str], timeout: float) -> bool:
        try:
            self._s.wait(keys, self._td(seconds=max(timeout, 0.001)))
            return True
        except Exception:
            return False

    def check(self, keys: list[str]) -> bool:
        return bool(self._s.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._s.delete_key(key))

    def close(self) -> None:
        pass
