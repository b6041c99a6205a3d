"""Rendezvous: how workers find each other, and the store barriers of shutdown.

Owns: parsing ``init_method`` and the environment, choosing the store (hosting or joining
rrefrt's own, or using torch's where torch already holds one), publishing this worker's
record, validating the group (unique names and ranks, agreeing world sizes), and bounded
barriers.

Keys (``rpc/init_count`` and ``rpc/ticket/<n>`` job-wide; the rest under ``rpc/<generation>/``,
where the generation counts init_rpc calls of the job, so a group re-initialised after
shutdown never reads stale records):

    init_count        n-th init_rpc of the job; generation = (n - 1) // world_size
    ticket/<n>        msgpack {name, rank, world_size, host, pid}: who took ticket n. Every
                      worker scans the tickets around its own and fails at once, naming both
                      processes, on a duplicate rank, a world size that differs or a rank
                      outside [0, world_size) (NOTE [Conflicts])
    done/<n>          the join of ticket n ended (formed, or failed and its error read)
    worker/<r>        msgpack Record
    abort             a message: some worker found the group invalid; everyone fails with it.
                      Written under the generation of every ticket near the writer's, as
                      each worker computes it with its own world_size (NOTE [Conflicts])
    barrier/<phase>/<r>  worker r reached that phase of shutdown

NOTE [Conflicts]
  Generations are computed from each worker's own world_size, so a worker whose world_size
  differs (or a second claimant of a rank, which shifts every later ticket by one) may land
  in another generation and never meet the others in ``rpc/<g>/``. The tickets are outside
  the generations: ticket j with world size w belongs to window [g*w + 1, (g+1)*w]; two
  tickets in one window with one rank are a duplicate, overlapping windows with different
  world sizes a mismatch. Each waiting worker re-reads the tickets near its own on every
  poll, so every worker of the group reports the conflict within a poll or two. An abort
  for a conflict is written under the generation of each party to it too (a worker whose
  world_size differs looks under another prefix), never under a running group's.
  After a failed join, the store's host (rank 0) keeps the store up (at most _LINGER_S)
  until every rank of the group took a ticket and every ticket near its own is done: a
  worker that starts late (a loaded machine) still finds the store, sees the conflict and
  fails with it, instead of retrying a closed port until its init timeout (300 s by
  default; the conflict tests once hung 60 s that way under load). The host lingers on a
  thread of its own (``rrefrt-store-linger <addr>:<port>``, not a daemon: the process exits
  once it ends; a rank 0 of the same process that retries init_rpc at once waits for it),
  after init_rpc raised: its own error is reported as soon as it is found, never up to
  _LINGER_S later (a second rank 0 hosting the store once reported its duplicate after
  11.7 s, under load, while rank 1 was slow to start).

NOTE [Refused store clients]
  A connection the store refuses (no or wrong secret) never fails the join: anyone who can
  reach the port can make one, and its handshake proves nothing (NOTE [Refused clients] in
  rrefrt/group/store.py). Only a refused process that the kernel shows to be of this job's own
  user on this host - a worker started with another secret, in practice - fails the join on
  every worker, naming it, if a rank is still missing _AUTH_GRACE later. A refused worker on
  another host fails at once itself; the others fail at init_timeout with "never joined",
  and rank 0's message adds how many connections the store refused, and from where.

NOTE [Re-initialisation] (issue 11 item 6)
  When rank 0 hosts the store, a worker that shut down and calls init_rpc again may reach
  the old store before rank 0 (still finishing its own shutdown) retires it. When that store
  closes under a joining worker, the worker reconnects (for at most ``_RECONNECT_S``) and
  joins afresh on the new one.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union
from urllib.parse import unquote, urlparse

import msgpack

from rrefrt.group.environment import EnvError, resolve_env
from rrefrt import userlog
from rrefrt.payload import torchimport
from rrefrt.errors import AuthenticationError, RpcError, ShutdownError
from rrefrt.group.store import PortInUseError, StoreAuthError, StoreClient, StoreClosed, StoreError, StoreServer, StoreTimeout
from rrefrt.group.torch_store import TorchStore, agent_store, default_group_store, file_store

log = logging.getLogger("rrefrt.rendezvous")

#: how long a worker whose store closed under it during join waits for the next store
_RECONNECT_S = 10.0
#: how long a refused store client may stay unexplained while ranks are missing
_AUTH_GRACE = 2.0
#: a probe of an occupied port: how long to wait for an rrefrt store's greeting
_PROBE_S = 2.0
#: after a failed join, how long the store's host waits for the group to read the error
_LINGER_S = 10.0
#: how long a store takes to close, at most (StoreServer.close)
_CLOSE_S = 3.0
#: how long a worker with an invalid rank tries to reach the store to report it
_INVALID_REACH_S = 10.0
#: a join that waits says so (a warning naming the awaited ranks and the address) after
#: this long, and again every _PROGRESS_EVERY_S, until init_timeout
_PROGRESS_FIRST_S = 5.0
_PROGRESS_EVERY_S = 30.0

Dead = Union[Iterable[int], Callable[[], Iterable[int]]]


class RendezvousError(RpcError):
    """The group could not be formed (missing, duplicate or inconsistent workers)."""


class InvalidRankError(RendezvousError, ValueError):
    """This worker's rank is outside [0, world_size)."""


@dataclass(frozen=True)
class Record:
    """What a worker publishes at rendezvous. ``address`` is the transport's opaque
    ``PeerAddress.to_wire()`` ({"host": ..., "endpoints": {...}}); ``meta`` is opaque
    per-worker metadata (devices, device maps, ...). Both must be msgpack-able."""

    name: str
    rank: int
    world_size: int
    incarnation: int
    address: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_wire(self) -> bytes:
        return msgpack.packb(
            {"name": self.name, "rank": self.rank, "world_size": self.world_size,
             "incarnation": self.incarnation, "address": self.address, "meta": self.meta}
        )

    @classmethod
    def from_wire(cls, data: bytes) -> "Record":
        d = msgpack.unpackb(data)
        return cls(d["name"], int(d["rank"]), int(d["world_size"]), int(d["incarnation"]),
                   dict(d.get("address") or {}), dict(d.get("meta") or {}))


#: GroupSpec.world_size of a dynamic group (init_rpc without world_size; docs/dynamic-groups.md)
DYNAMIC = 0


@dataclass
class GroupSpec:
    master_addr: str
    master_port: int
    rank: int
    world_size: int
    #: init_method="file://<path>": the rendezvous goes through torch's FileStore there
    file_path: str | None = None
    #: the address came from init_method="tcp://..." (not the environment): a process
    #: group's store elsewhere is not shared (torch_store.default_group_store)
    explicit: bool = False


def resolve(init_method: str, rank: int, world_size: int | None) -> GroupSpec:
    """Arguments win over the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or
    the SLURM / Open MPI equivalents). A rank outside [0, world_size) is reported by the
    rendezvous (so that the other workers learn it too), not here."""
    env = resolve_env(os.environ, check_rank=False)
    file_path = None
    explicit = False
    if init_method.startswith("tcp://"):
        url = urlparse(init_method)
        if not url.hostname or not url.port:
            raise EnvError(f"init_method {init_method!r} must be tcp://host:port")
        addr, port = url.hostname, url.port
        explicit = True
    elif init_method.startswith("file://"):
        file_path = unquote(urlparse(init_method).path)
        if not file_path:
            raise EnvError(f"init_method {init_method!r} must be file:///path/to/a/shared/file")
        addr, port = env.get("MASTER_ADDR") or "127.0.0.1", 0
    else:
        addr, port_s = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr or not port_s:
            raise EnvError(
                "init_method 'env://' needs MASTER_ADDR and MASTER_PORT in the environment "
                "(or use init_method='tcp://host:port', or start the job with rrefrt-run)"
            )
        try:
            port = int(port_s)
        except ValueError:
            raise EnvError(f"MASTER_PORT must be an integer, got {port_s!r}") from None
    if rank is None or rank < 0:
        if "RANK" not in env:
            raise EnvError(  # torch's phrases, which its tests match
                "no rank given (rank parameter missing; environment variable RANK expected): pass rank=... to "
                "init_rpc or set RANK in the environment")
        rank = int(env["RANK"])
    if world_size is None:
        if "WORLD_SIZE" not in env:  # a dynamic group (rrefrt/group/membership.py): world_size 0
            return GroupSpec(addr, port, rank, DYNAMIC, file_path, explicit)
        world_size = int(env["WORLD_SIZE"])
    if world_size < 1 or rank < 0:
        raise EnvError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    return GroupSpec(addr, port, rank, world_size, file_path, explicit)


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


def torch_pg_initialized() -> bool:
    """torch's default process group is up in this process (its store can be shared)."""
    dist = torchimport.loaded_module("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


@dataclass(frozen=True)
class _Ticket:
    n: int
    name: str
    rank: int
    world_size: int
    host: str
    pid: int

    @property
    def gen(self) -> int:
        return (self.n - 1) // self.world_size

    def window(self) -> range:
        return range(self.gen * self.world_size + 1, (self.gen + 1) * self.world_size + 1)

    def who(self) -> str:
        return f"worker {self.name!r} (pid {self.pid} on {self.host})"


class Rendezvous:
    def __init__(self, spec: GroupSpec, timeout: float, secret: str | bytes | None = None, name: str = "") -> None:
        self.spec = spec
        self._name = name
        self._me = f"worker {name!r} (rank {spec.rank}, pid {os.getpid()} on {socket.gethostname()})"
        self._auth_seen: float | None = None
        self.server: StoreServer | None = None
        self._secret = secret
        self._seen: set[str] = set()
        self._tickets: dict[int, _Ticket] = {}
        #: a client of a store that rank 0 hosts: it may retire under us (re-initialisation)
        self._may_reconnect = False
        #: the store is rrefrt's own, hosted by rank 0 (set by _open)
        self._rank0_store = False
        #: the join failed on a conflict (an abort): the host waits for late workers
        self._conflict = False
        #: when a waiting join next reports who it waits for (_report_waiting)
        self._next_report: float | None = None
        self._join_start = 0.0
        self.store: Any = None
        valid = 0 <= spec.rank < spec.world_size
        try:
            # an invalid rank is reported to the group if its store answers in time
            self.store = self._open(timeout if valid else min(_INVALID_REACH_S, timeout))
        except StoreAuthError as e:
            self.close()
            raise AuthenticationError(f"{self._me} could not join the rendezvous store: {e}; see docs/security.md") from None
        except Exception:
            self.close()
            if valid:
                raise
            self.store = None
        if not valid:
            msg = f"rank must be in [0, world_size); got rank={spec.rank}, world_size={spec.world_size}"
            if self.store is not None:
                try:
                    self._post_ticket(self._name or f"rank{spec.rank}")
                    self._abort(f"{self._tickets[self._n].who()}: {msg}")
                except Exception:
                    pass
                self.close(failed=True)
            raise InvalidRankError(msg)

    def _open(self, timeout: float) -> Any:
        spec, env = self.spec, os.environ
        if spec.file_path is not None:
            return file_store(spec.file_path, spec.world_size, timeout)
        if torch_pg_initialized():  # torch's process group serves this address: share its store
            store = default_group_store(spec.master_addr, spec.master_port, timeout, spec.explicit)
            if store is not None:
                return store
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
            return agent_store(spec.master_addr, spec.master_port, timeout)
        if env.get("RREFRT_STORE_HOSTED") == "1":
            # rrefrt-run's store authenticates with the launcher's secret, which the launcher
            # put in RREFRT_SECRET (the program may use another one for its own traffic);
            # with a secret, a store that does not authenticate is refused (a forged one)
            store_secret = env.get("RREFRT_SECRET") or None
            return StoreClient(spec.master_addr, spec.master_port, timeout, store_secret, identity=self._me)
        self._rank0_store = True
        if spec.rank == 0:
            try:
                try:
                    self.server = self._host_store()
                except PortInUseError:
                    if not self._wait_own_linger(time.monotonic() + _LINGER_S + _CLOSE_S):
                        raise
                    self.server = self._host_store()  # this process's lingering store just closed
            except PortInUseError as e:
                return self._probe_occupied(e)
        else:
            self._may_reconnect = True
            return self._connect(timeout)
        return StoreClient(spec.master_addr, spec.master_port, timeout, self._secret, identity=self._me)

    def _host_store(self) -> StoreServer:
        spec = self.spec
        return StoreServer(spec.master_addr, spec.master_port, secret=self._secret, label=f"worker {self._name!r} (rank 0)")

    def _linger_name(self) -> str:
        return f"rrefrt-store-linger {self.spec.master_addr}:{self.spec.master_port}"

    def _wait_own_linger(self, deadline: float) -> bool:
        """NOTE [Conflicts]: a store of this process's failed join may still hold the port (an
        init_rpc retried at once): wait for it to close (bounded). True if there was one."""
        mine = [t for t in threading.enumerate() if t.name == self._linger_name()]
        for t in mine:
            t.join(max(0.0, deadline - time.monotonic()))
        return bool(mine)

    def _connect(self, timeout: float) -> StoreClient:
        """A client of the store rank 0 hosts, trying for ``timeout``; while it cannot
        connect it warns after _PROGRESS_FIRST_S and every _PROGRESS_EVERY_S."""
        spec = self.spec
        start = time.monotonic()
        deadline = start + timeout
        step = _PROGRESS_FIRST_S
        while True:
            left = deadline - time.monotonic()
            try:
                return StoreClient(spec.master_addr, spec.master_port, max(0.0, min(step, left)), self._secret,
                                   identity=self._me)
            except StoreTimeout as e:
                if time.monotonic() >= deadline:
                    raise StoreTimeout(
                        f"{self._me} could not reach the rendezvous store at {spec.master_addr}:{spec.master_port} "
                        f"within {timeout:.1f}s (init_timeout); rank 0 hosts it: is rank 0 running, with this "
                        f"init_method? ({e})"
                    ) from None
                userlog.warn(
                    log, "%s has waited %.0f s for the rendezvous store at %s:%d, which rank 0 hosts (is rank 0 running, "
                    "with the same init_method?); it gives up in %.0f s (init_timeout)",
                    self._me, time.monotonic() - start, spec.master_addr, spec.master_port,
                    max(0.0, deadline - time.monotonic()))
                step = _PROGRESS_EVERY_S

    def _probe_occupied(self, err: PortInUseError) -> StoreClient:
        """Rank 0 could not bind: if an rrefrt store holds the port (another rank 0, of this
        job or another), join it as a client so the duplicate is reported with both
        claimants; otherwise the port is simply in use."""
        spec = self.spec
        try:
            return StoreClient(spec.master_addr, spec.master_port, _PROBE_S, self._secret, identity=self._me)
        except StoreAuthError:
            raise
        except StoreError:
            raise PortInUseError(
                f"rank 0 cannot host the rendezvous store: {spec.master_addr}:{spec.master_port} is already in "
                "use by another process (Address already in use) that is not an rrefrt store; choose another "
                "MASTER_PORT (or stop the process that holds it)"
            ) from None

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    # ------------------------------------------------------------------ join
    def join(self, record: Record, deadline: float) -> list[Record]:
        """Publish our record and return everyone's, validated; raise RendezvousError."""
        while True:
            try:
                return self._join_once(record, deadline)
            except StoreClosed as e:
                if not self._may_reconnect:
                    raise RendezvousError(self._where(record) + f", but the store closed: {e}") from None
                left = min(_RECONNECT_S, deadline - time.monotonic())
                log.info("rendezvous store closed during join (%s); reconnecting for %.1fs", e, left)
                self.store.close()
                self._tickets.clear()
                self._conflict = False
                try:
                    self.store = StoreClient(self.spec.master_addr, self.spec.master_port, max(0.0, left), self._secret,
                                             identity=self._me)
                except StoreError as e2:
                    raise RendezvousError(
                        f"{self._where(record)}; the store closed under it and no store came back within "
                        f"{max(0.0, left):.1f}s (rank 0 left or failed): {e2}"
                    ) from None

    def _where(self, record: Record) -> str:
        spec = self.spec
        where = spec.file_path or f"{spec.master_addr}:{spec.master_port}"
        return f"worker {record.name!r} (rank {spec.rank}) waited for the group at {where}"

    def _join_once(self, record: Record, deadline: float) -> list[Record]:
        spec = self.spec
        self._post_ticket(record.name)
        self._check_conflicts()
        self.store.set(self.key(f"worker/{spec.rank}"), record.to_wire())
        keys = [f"worker/{r}" for r in range(spec.world_size)]
        where = self._where(record)
        try:
            missing = self._wait_keys(keys, deadline, conflicts=True)
        except StoreClosed:
            raise
        except StoreError as e:
            left = [k.split("/")[1] for k in keys if k not in self._seen]
            raise RendezvousError(
                f"{where}; rank(s) {', '.join(left)} never joined and the store failed "
                f"(rank 0 gave up or failed): {e}"
            ) from None
        if missing:
            ranks = ", ".join(k.split("/")[1] for k in missing)
            msg = f"{where}, but rank(s) {ranks} never joined (world_size={spec.world_size}){self._refused_hint()}"
            self._abort(msg, conflict=False)
            raise RendezvousError(msg)
        records = [self._get(k) for k in keys]
        self._validate(records, record)
        self.store.set(f"rpc/done/{self._n}", b"1")
        return records

    def _post_ticket(self, name: str) -> None:
        spec = self.spec
        n = self.store.add("rpc/init_count", 1)
        self.prefix = f"rpc/{(n - 1) // spec.world_size}/"
        self._n = n
        me = _Ticket(n, name, spec.rank, spec.world_size, socket.gethostname(), os.getpid())
        self._tickets[n] = me
        self.store.set(f"rpc/ticket/{n}", msgpack.packb([me.name, me.rank, me.world_size, me.host, me.pid]))

    def _scan(self) -> list[_Ticket]:
        """Read the tickets near ours (NOTE [Conflicts]) not read yet; return all of them."""
        me = self._tickets[self._n]
        count = self.store.add("rpc/init_count", 0)
        lo = max(1, me.window().start - me.world_size)
        hi = min(count, me.window().stop - 1 + me.world_size)
        for j in range(lo, hi + 1):
            if j not in self._tickets and self.store.check([f"rpc/ticket/{j}"]):
                name, rank, ws, host, pid = msgpack.unpackb(self.store.get(f"rpc/ticket/{j}", 1.0))
                self._tickets[j] = _Ticket(j, name, int(rank), int(ws), host, int(pid))
        return [self._tickets[j] for j in sorted(self._tickets) if lo <= j <= hi]

    def _abort(self, msg: str, parties: Iterable[_Ticket] = (), conflict: bool = True) -> None:
        """Publish ``msg`` as the group's error under our generation and under those of the
        ``parties`` to a conflict, each computed with that party's own world_size."""
        self._conflict = self._conflict or conflict
        forming = [t for t in parties if not self.store.check([f"rpc/done/{t.n}"])]  # not a formed group's
        for prefix in sorted({self.prefix} | {f"rpc/{t.gen}/" for t in forming}):
            if conflict:  # written first: a reader of the abort knows whether to linger
                self.store.set(prefix + "abort_conflict", b"1")
            self.store.set(prefix + "abort", msg.encode())

    def _check_conflicts(self) -> None:
        """NOTE [Conflicts]: raise (and publish) a duplicate rank, world size mismatch or
        invalid rank found among the tickets near ours."""
        me = self._tickets[self._n]
        near = self._scan()
        problem, parties = None, []
        for t in near:
            if not 0 <= t.rank < t.world_size:
                problem = f"{t.who()} has rank {t.rank} outside [0, world_size={t.world_size})"
                parties = [t]
                break
            for u in near:
                if u.n <= t.n:
                    continue
                if u.world_size != t.world_size and (u.n in t.window() or t.n in u.window()):
                    problem = (
                        f"world size mismatch: {t.who()} (rank {t.rank}) has world_size={t.world_size} but "
                        f"{u.who()} (rank {u.rank}) has world_size={u.world_size}; every worker must use the same"
                    )
                elif u.world_size == t.world_size and u.gen == t.gen and u.rank == t.rank:
                    problem = (
                        f"duplicate rank {t.rank}: two processes claimed it, {t.who()} and {u.who()}; "
                        "give every process its own rank (RANK)"
                    )
                if problem:
                    parties = [t, u]
                    break
            if problem:
                break
        if problem is None and self._rank0_store:
            problem = self._held_by_running_group(me, near)  # the running group is left alone
        if problem:
            self._abort(problem, parties)
            raise RendezvousError(problem)

    def _refused_hint(self) -> str:
        """NOTE [Refused store clients]: on the host, what its store refused (addresses only)."""
        server = self.server
        if server is None or not server.refused:
            return ""
        return (
            f"; meanwhile the rendezvous store refused {server.refused} connection(s) that did not prove the job's "
            f"secret (the latest from {server.refused_from[-1]}): a worker started with another RREFRT_SECRET, or "
            "another program; see docs/security.md"
        )

    def _check_auth_failures(self) -> None:
        """The host of the store: a process of this user on this host refused for its secret
        while ranks are still missing 2 s later (_AUTH_GRACE: a stray connection cannot abort
        a join that completes) fails the join on every worker, naming the refused process.
        Nobody else's refusal counts (NOTE [Refused store clients])."""
        if self.server is None or not self.server.auth_failures:
            return
        now = time.monotonic()
        if self._auth_seen is None:
            self._auth_seen = now
        if now - self._auth_seen < _AUTH_GRACE:
            return
        who = self.server.auth_failures[-1][1]
        msg = (
            f"{who} was refused by the rendezvous store of {self._me}: it does not have this job's secret "
            "(or has another one). Every worker must use the same RREFRT_SECRET or RpcBackendOptions(secret=...), "
            "or none may; see docs/security.md"
        )
        self._abort(msg, conflict=False)  # the refused process takes no ticket: no lingering for it
        raise AuthenticationError(msg, [who])

    def _held_by_running_group(self, me: _Ticket, near: list[_Ticket]) -> str | None:
        """A late duplicate: another process holds our rank in the previous generation,
        which neither left (no leave barrier) nor failed (no abort). Only asked of a store
        that rank 0 hosts: it lives as long as one group, so a second generation in it is
        always a conflict (stores that outlive groups - the launcher's, torch's - also see
        generations of workers that crashed and were restarted)."""
        for t in near:
            if (t.world_size == me.world_size and t.gen == me.gen - 1 and t.rank == me.rank
                    and (t.pid, t.host) != (me.pid, me.host)):
                prev = f"rpc/{t.gen}/"
                if not self.store.check([prev + f"barrier/leave/{t.rank}"]) and not self.store.check([prev + "abort"]):
                    return (
                        f"duplicate rank {me.rank}: two processes claimed it, {t.who()} (in the running group) "
                        f"and {me.who()}; give every process its own rank (RANK)"
                    )
        return None

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
                problem = (
                    f"duplicate worker name {r.name!r}: used by rank {by_name[r.name].rank} and rank {r.rank} "
                    f"(RPC worker name {r.name} is not unique)"
                )
            by_name.setdefault(r.name, r)
            if problem:
                break
        if problem:
            self._abort(problem)
            raise RendezvousError(problem)

    def _wait_keys(self, keys: list[str], deadline: float, dead: Dead | None = None, conflicts: bool = False) -> list[str]:
        """Wait until every key exists (or its rank is dead); return the missing. ``dead``
        is a set of ranks or a callable returning the current one, re-read on every poll."""
        pending = list(keys)
        while True:
            pending = [k for k in pending if not self.store.check([self.key(k)])]
            self._seen = set(keys) - set(pending)
            gone = set(dead() if callable(dead) else dead) if dead is not None else set()
            if gone:
                pending = [k for k in pending if int(k.rsplit("/", 1)[1]) not in gone]
            if not pending:
                return []
            if self.store.check([self.key("abort")]):
                # only a conflict makes the host linger for every rank (NOTE [Conflicts]); a
                # rank that never joined will not come, and waiting for it cost 10 s
                self._conflict = self._conflict or self.store.check([self.key("abort_conflict")])
                raise RendezvousError(self.store.get(self.key("abort"), 1.0).decode(errors="replace"))
            if conflicts:
                self._check_conflicts()
                self._check_auth_failures()
                self._report_waiting(pending, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                return pending
            self.store.wait([self.key(pending[0])], min(left, 0.2))

    def _report_waiting(self, pending: list[str], deadline: float) -> None:
        """A join still waiting: warn which ranks are awaited at which address (first after
        _PROGRESS_FIRST_S, then every _PROGRESS_EVERY_S), so a group that cannot form says
        so long before init_timeout."""
        now = time.monotonic()
        if self._next_report is None:
            self._next_report = now + _PROGRESS_FIRST_S
            self._join_start = now
        if now < self._next_report:
            return
        self._next_report = now + _PROGRESS_EVERY_S
        spec = self.spec
        where = spec.file_path or f"{spec.master_addr}:{spec.master_port}"
        kind = "the process group's store" if isinstance(self.store, TorchStore) else "the rendezvous store"
        ranks = ", ".join(k.rsplit("/", 1)[1] for k in pending)
        userlog.warn(
            log, "%s has waited %.0f s at %s (%s) for rank(s) %s to join (world_size=%d); it gives up in %.0f s "
            "(init_timeout). Every worker must use the same init_method (or MASTER_ADDR/MASTER_PORT)",
            self._me, now - self._join_start, where, kind, ranks, spec.world_size, max(0.0, deadline - now))

    def barrier(self, phase: str, rank: int, world_size: int, deadline: float, dead: Dead) -> list[int]:
        """Arrive at ``phase``; wait (bounded) for every rank not dead. ``dead`` is a set of
        ranks or a callable returning the current set, re-evaluated on every poll (so a
        death while waiting releases the barrier at once). Returns the ranks that never
        arrived."""
        store = self.store
        answer = getattr(store, "answer_timeout", None)
        try:
            if answer is not None:  # a slow store host is waited for up to the barrier's deadline
                store.answer_timeout = max(answer, deadline - time.monotonic())
            store.set(self.key(f"barrier/{phase}/{rank}"), b"1")
            keys = [f"barrier/{phase}/{r}" for r in range(world_size)]

            def gone() -> set[int]:
                # a worker that gave up its shutdown (it arrived at "failed") and closed is not
                # a death that completes the barrier: it stays missing, and this shutdown
                # reports it instead of completing without it
                ranks = set(dead() if callable(dead) else dead)
                return {r for r in ranks if not store.check([self.key(f"barrier/failed/{r}")])}

            missing = self._wait_keys(keys, deadline, gone)
        except StoreError as e:
            raise self._barrier_failed(phase, e) from None
        finally:
            if answer is not None:
                store.answer_timeout = answer
        return [int(k.rsplit("/", 1)[1]) for k in missing]

    def arrive(self, phase: str, rank: int) -> None:
        try:
            self.store.set(self.key(f"barrier/{phase}/{rank}"), b"1")
        except StoreError as e:
            raise self._barrier_failed(phase, e) from None

    def _barrier_failed(self, phase: str, e: StoreError) -> ShutdownError:
        spec = self.spec
        where = spec.file_path or f"{spec.master_addr}:{spec.master_port}"
        return ShutdownError(
            f"the shutdown barrier {phase!r} could not complete: the rendezvous store at {where} "
            f"(hosted by rank 0 or the launcher) failed - its host may have died or left: {e}"
        )

    def _linger(self, deadline: float) -> None:
        """The host, after a failed join: wait (until ``deadline``) until every ticket near
        ours is done and, after a conflict, every rank of the group took a ticket."""
        while time.monotonic() < deadline:
            near = self._scan()
            ranks = {t.rank for t in near}
            size = max(t.world_size for t in near)
            arrived = not self._conflict or all(r in ranks for r in range(size))
            if arrived and all(self.store.check([f"rpc/done/{t.n}"]) for t in near):
                return
            self.store.wait(["rpc/never"], 0.05)  # paces the re-check

    def _get(self, suffix: str) -> Record:
        return Record.from_wire(self.store.get(self.key(suffix), 5.0))

    def close(self, failed: bool = False) -> None:
        """Close the client (and the server, if hosted here). After a failed join the
        host keeps the store up until the group has read the error (NOTE [Conflicts])."""
        store, server = self.store, self.server
        if store is not None and failed and hasattr(self, "prefix"):
            try:
                store.set(f"rpc/done/{self._n}", b"1")
            except Exception:
                pass
            if server is not None:  # NOTE [Conflicts]: the caller reports its error now, the store lingers
                self.server = None
                threading.Thread(target=self._linger_then_close, args=(time.monotonic() + _LINGER_S, server),
                                 name=self._linger_name(), daemon=False).start()
                return
        if store is not None:
            store.close()
        if server is not None:
            server.close()
            self.server = None

    def _linger_then_close(self, deadline: float, server: StoreServer) -> None:
        try:
            self._linger(deadline)
        except Exception:
            pass
        finally:
            self.store.close()
            server.close()


__all__ = ["Record", "GroupSpec", "DYNAMIC", "Rendezvous", "RendezvousError", "InvalidRankError", "TorchStore",
           "resolve", "bind_host"]
