"""Launchers of one job meet at the store that node 0 hosts, and watch each other while it runs.

Owns: the launcher's keys in the job's store (all under ``launcher/``; the runtime uses
``rpc/``), the node rendezvous (``rendezvous()``) and, for multi-node jobs, ``NodeMonitor``,
which turns what other nodes publish into events for the supervisor.

Store keys (values are JSON unless said otherwise):

    launcher/claim/<r>   counter; 1 for the first launcher that claims node rank r
    launcher/node/<r>    {"node_rank", "nnodes", "nproc", "host", "pid", "secret_fp"}
    launcher/alive/<r>   counter bumped every 0.5 s by node r's launcher
    launcher/abort       {"node", "rank", "what", "tail"}: the first failure; every node stops
    launcher/done/<r>    "<exit code>": node r's workers have all ended
    launcher/rdzv_error  {"node", "host", "message"}: a node gave up on the rendezvous
    launcher/rdzv_seen/<r>  node r read rdzv_error (node 0 keeps the store up until then)

NOTE [Store authentication] (issue 11 item 13)
  With a job secret (always on a single node: the launcher makes one; on several nodes when
  RREFRT_SECRET is set) node 0's store authenticates every client with it (the HMAC
  challenge of rrefrt.group.store): a local process without the secret can neither read nor write
  a key. Launchers prove the secret too; a launcher with another secret (or none) is refused
  and says so, and node 0 fails its rendezvous naming it. A launcher with a secret still
  accepts node 0's store when it does not authenticate, so that the fingerprints in
  ``launcher/node/<r>`` report a secret set on some nodes only; workers never accept that.

NOTE [Who holds the store]
  Node 0's launcher hosts the store for the whole job (workers reach it with
  RREFRT_STORE_HOSTED=1), so it must outlive every worker on every node: after its own
  workers end it waits for every other node's ``done`` key, or for the node to be declared
  lost (no ``alive`` bump for --node-timeout), before closing. A non-master launcher that
  loses the store treats it as the loss of node 0 and stops its workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable

from rrefrt.group.store import StoreClient, StoreError, StoreTimeout

from rrefrt.run.config import LaunchError

__all__ = ["NodeInfo", "World", "rendezvous", "withdraw", "NodeMonitor", "secret_fingerprint", "secret_refused"]

log = logging.getLogger("rrefrt.run.rendezvous")

PREFIX = "launcher/"
ABORT_KEY = PREFIX + "abort"
_HEARTBEAT_S = 0.5


def _key(kind: str, node: int) -> str:
    return f"{PREFIX}{kind}/{node}"


def secret_fingerprint(secret: str | None) -> str | None:
    """A short digest that lets nodes compare secrets without publishing them."""
    if secret is None:
        return None
    return hashlib.sha256(b"rrefrt-run secret fingerprint\0" + secret.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    node_rank: int
    nnodes: int
    nproc: int
    host: str
    pid: int
    secret_fp: str | None


@dataclasses.dataclass(frozen=True)
class World:
    """This node's place in the job, known once every node has arrived."""

    nodes: tuple[NodeInfo, ...]  #: indexed by node rank
    node_rank: int

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        return sum(n.nproc for n in self.nodes[: self.node_rank])


RDZV_ERROR_KEY = PREFIX + "rdzv_error"


def rendezvous(client: StoreClient, me: NodeInfo, where: str, timeout: float,
               refused: Callable[[], list[str]] | None = None) -> World:
    """Register this node and wait, at most ``timeout`` seconds, for all the others.

    A node that gives up (timeout, disagreement) publishes why, so every other node fails
    with the same explanation instead of a lost connection. ``refused`` (node 0, whose store
    authenticates): who the store refused for the secret; a refused launcher fails the
    rendezvous (NOTE [Store authentication]).
    """
    try:
        return _rendezvous(client, me, where, timeout, refused)
    except LaunchError as e:
        if not getattr(e, "from_peer", False):
            try:
                if not client.check([RDZV_ERROR_KEY]):
                    client.set(RDZV_ERROR_KEY, json.dumps(
                        {"node": me.node_rank, "host": me.host, "message": str(e)}).encode())
                client.set(_key("rdzv_seen", me.node_rank), b"1")  # this node is finished too
            except StoreError:
                pass
        raise


def withdraw(client: StoreClient, me: NodeInfo) -> None:
    """This node's launcher was interrupted during the rendezvous: give its node rank back,
    so that a launcher started again for it can claim it (``client``: a fresh connection;
    the interrupted one may be in the middle of a request). Only a claim of ours: the node
    record is ours or not written yet (a second launcher for a claimed rank, interrupted,
    must not remove the first one's)."""
    try:
        other = _read_info(client, me.node_rank)
        if other is not None and (other.host, other.pid) != (me.host, me.pid):
            return
        client.delete_key(_key("node", me.node_rank))
        client.delete_key(_key("claim", me.node_rank))
    except StoreError as e:
        log.info("could not give node rank %d back: %s", me.node_rank, e)


def linger_after_failed_rendezvous(client: StoreClient, nnodes: int, timeout: float) -> None:
    """Node 0: keep the store up (bounded) until the nodes that arrived read the error."""
    try:
        arrived = [r for r in range(1, nnodes) if client.check([_key("node", r)])]
        client.wait([_key("rdzv_seen", r) for r in arrived], timeout=timeout)
    except StoreError:
        pass


def _peer_gave_up(client: StoreClient, me: NodeInfo) -> None:
    if not client.check([RDZV_ERROR_KEY]):
        return
    err = json.loads(client.get(RDZV_ERROR_KEY, timeout=1.0))
    try:
        client.set(_key("rdzv_seen", me.node_rank), b"1")
    except StoreError:
        pass  # node 0 may close the store as soon as the key lands, before it answers
    e = LaunchError(f"node {err['node']} (host {err['host']}) gave up the rendezvous: "
                    f"{err['message']}")
    e.from_peer = True  # type: ignore[attr-defined]
    raise e


def secret_refused(node_rank: int, err: Exception) -> str:
    """The launcher of ``node_rank`` was refused by node 0's store (or refused it)."""
    return (f"node {node_rank} could not join the job's store: nodes were started with different "
            f"RREFRT_SECRET values (or it is set on some nodes only): {err}; set the same "
            "RREFRT_SECRET on every node")


def _check_refused(refused: Callable[[], list[str]] | None) -> None:
    launchers = [who for who in (refused() if refused else []) if who.startswith("rrefrt-run node ")]
    if launchers:
        raise LaunchError(f"nodes were started with different RREFRT_SECRET values (or it is set on some "
                          f"nodes only): {launchers[-1]} was refused by the store of node 0, which "
                          "authenticates with its RREFRT_SECRET; set the same RREFRT_SECRET on every node")


def _rendezvous(client: StoreClient, me: NodeInfo, where: str, timeout: float,
                refused: Callable[[], list[str]] | None = None) -> World:
    if client.add(_key("claim", me.node_rank), 1) != 1:
        other = _read_info(client, me.node_rank)
        by = f" (host {other.host}, pid {other.pid})" if other else ""
        raise LaunchError(f"node rank {me.node_rank} was already claimed by another "
                          f"launcher{by} at the store {where}; give each node its own "
                          "--node-rank")
    client.set(_key("node", me.node_rank), json.dumps(dataclasses.asdict(me)).encode())
    keys = [_key("node", r) for r in range(me.nnodes)]
    deadline = time.monotonic() + timeout
    while True:
        _peer_gave_up(client, me)
        _check_refused(refused)
        arrived = _arrived(client, me.nnodes)
        _check_agreement(me, arrived)
        if len(arrived) == me.nnodes:
            return World(tuple(arrived[r] for r in range(me.nnodes)), me.node_rank)
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [r for r in range(me.nnodes) if r not in arrived]
            raise LaunchError(
                f"rendezvous timed out after {timeout:g}s: node(s) "
                f"{', '.join(map(str, missing))} of {me.nnodes} never arrived at the store "
                f"{where} (arrived: {', '.join(map(str, sorted(arrived))) or 'none'}); start "
                f"rrefrt-run with --node-rank {missing[0]} on that node, or raise "
                "--rdzv-timeout")
        client.wait(keys, timeout=min(0.5, left))  # re-check agreement and errors meanwhile


def _read_info(client: StoreClient, node: int) -> NodeInfo | None:
    if not client.check([_key("node", node)]):
        return None
    return NodeInfo(**json.loads(client.get(_key("node", node), timeout=1.0)))


def _arrived(client: StoreClient, nnodes: int) -> dict[int, NodeInfo]:
    out = {}
    for r in range(nnodes):
        info = _read_info(client, r)
        if info is not None:
            out[r] = info
    return out


def _check_agreement(me: NodeInfo, arrived: dict[int, NodeInfo]) -> None:
    for info in arrived.values():
        if info.nnodes != me.nnodes:
            raise LaunchError(f"nodes disagree on --nnodes: node {info.node_rank} (host "
                              f"{info.host}) has {info.nnodes}, node {me.node_rank} has "
                              f"{me.nnodes}")
    with_secret = sorted(r for r, i in arrived.items() if i.secret_fp is not None)
    if with_secret and len(with_secret) != len(arrived):
        without = sorted(set(arrived) - set(with_secret))
        raise LaunchError(f"RREFRT_SECRET is set on node(s) {with_secret} but not on node(s) "
                          f"{without}: set the same RREFRT_SECRET on every node, or on none")
    fps = {i.secret_fp for i in arrived.values() if i.secret_fp is not None}
    if len(fps) > 1:
        raise LaunchError("nodes were started with different RREFRT_SECRET values: set the "
                          "same RREFRT_SECRET on every node")


def local_node_info(node_rank: int, nnodes: int, nproc: int, secret: str | None) -> NodeInfo:
    return NodeInfo(node_rank, nnodes, nproc, socket.gethostname(), os.getpid(),
                    secret_fingerprint(secret))


def publish_abort(client: StoreClient, info: dict[str, object]) -> None:
    """Record the job's first failure (later ones keep the first record)."""
    try:
        if client.add(PREFIX + "abort_count", 1) == 1:
            client.set(ABORT_KEY, json.dumps(info).encode())
    except StoreError as e:
        log.warning("could not tell the other nodes about the failure: %s", e)


def publish_done(client: StoreClient, node: int, code: int) -> None:
    try:
        client.set(_key("done", node), str(code).encode())
    except StoreError as e:  # node 0 may already have everything it needs and be gone
        log.info("could not tell node 0 that node %d is done: %s", node, e)


class NodeMonitor(threading.Thread):
    """Heartbeats for this node (every 0.5 s) and watches the job: posts ``(kind, detail)`` events.

    Kinds: "abort" (detail: the abort record), "store_lost" (str), "node_lost" (node rank),
    "nodes_done" (master only: every other node published ``done``; detail: the nodes among
    them whose code was not 0).
    ``wake`` is called after each event is queued, from this thread.
    """

    def __init__(self, client: StoreClient, world: World, node_timeout: float,
                 wake: Callable[[], None]) -> None:
        super().__init__(name="rrefrt-run-monitor", daemon=True)
        self._client = client  #: its own connection to the job's store (closed by stop())
        self._world = world
        self._node_timeout = node_timeout
        self._wake = wake
        self.events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._halt = threading.Event()
        #: node 0: the nodes that had not published ``done`` at the last heartbeat (swapped whole)
        self._pending: tuple[int, ...] = tuple(r for r in range(len(world.nodes)) if r != world.node_rank)

    def pending_text(self) -> str:
        """The nodes node 0 still waits for, for the launcher's SIGUSR1 status line."""
        return ", ".join(map(str, self._pending)) or "none"

    def stop(self, timeout: float) -> None:
        self._halt.set()
        self.join(timeout)
        self._client.close()

    def _failed(self, nodes: Iterable[int]) -> list[int]:
        """Of ``nodes`` (each published ``done``), those whose code was not 0 (a worker failed
        and the node went on: ``--on-failure continue``)."""
        failed = []
        for r in nodes:
            try:
                if self._client.get(_key("done", r), 5.0) != b"0":
                    failed.append(r)
            except StoreError:
                failed.append(r)
        return failed

    def _post(self, kind: str, detail: object) -> None:
        self.events.put((kind, detail))
        self._wake()

    def run(self) -> None:
        me, nnodes = self._world.node_rank, len(self._world.nodes)
        others = [r for r in range(nnodes) if r != me]
        last_seen = {r: (-1, time.monotonic()) for r in others}  # r -> (counter, when changed)
        aborted = done_posted = False
        lost: set[int] = set()
        try:
            while not self._halt.is_set():
                self._client.add(_key("alive", me), 1)
                if me == 0:
                    pending = [r for r in others if r not in lost
                               and not self._client.check([_key("done", r)])]
                    self._pending = tuple(pending)
                    if not pending and not done_posted:
                        done_posted = True
                        self._post("nodes_done", self._failed(r for r in others if r not in lost))
                    now = time.monotonic()
                    for r in pending:
                        count = self._client.add(_key("alive", r), 0)
                        if count != last_seen[r][0]:
                            last_seen[r] = (count, now)
                        elif now - last_seen[r][1] > self._node_timeout:
                            lost.add(r)
                            self._post("node_lost", r)
                if aborted:
                    self._halt.wait(_HEARTBEAT_S)
                    continue
                try:  # blocks until the abort record appears, at most one heartbeat
                    record = self._client.get(ABORT_KEY, timeout=_HEARTBEAT_S)
                except StoreTimeout:
                    continue
                aborted = True
                self._post("abort", json.loads(record))
        except StoreError as e:
            if not self._halt.is_set():
                self._post("store_lost", str(e))
