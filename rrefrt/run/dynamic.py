"""rrefrt-run for dynamic groups: ``--dynamic`` starts a job whose workers join a group
without a world size, ``--join HOST:PORT`` adds workers to such a running job
(docs/launcher.md, docs/dynamic-groups.md).

Owns: the launcher's keys of a dynamic job (under ``launcher/dyn/``), the ranks each
launcher hands out, the heartbeat of a joining launcher and the host's view of the joining
launchers still running.

Keys:

    launcher/dyn/next_rank   counter: ranks handed out so far (a launcher of P workers
                             takes the block [n - P, n) with one ``add``)
    launcher/dyn/launchers   counter: joining launchers (launcher k has number k)
    launcher/dyn/alive/<k>   counter bumped every 0.5 s by joining launcher k
    launcher/dyn/done/<k>    "<exit code>": launcher k's workers have all ended

NOTE [The host outlives the joiners]
  The ``--dynamic`` launcher hosts the store, which the group cannot outlive. After its own
  workers end it keeps the store up while some joining launcher is running: not done, and
  its heartbeat moved within ``--node-timeout`` seconds (a joining launcher that was killed
  stops counting after that long). Ctrl-C on the host ends the wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rrefrt.group.store import StoreClient, StoreError

from rrefrt.run.config import LaunchError

__all__ = ["DynamicJob", "parse_join"]

log = logging.getLogger("rrefrt.run")

PREFIX = "launcher/dyn/"
_HEARTBEAT_S = 0.5


def parse_join(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of ``--join`` (validated by LaunchConfig)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class DynamicJob:
    """This launcher's part of a dynamic job: its block of ranks, and (joining) its
    heartbeat, or (hosting) the joining launchers it waits for."""

    def __init__(self, client: StoreClient, nproc: int, joining: bool, addr: str, port: int,
                 connect: Callable[[], StoreClient]) -> None:
        """``connect``: a new client of the store, as the supervisor's own (it proves the job
        secret when the store asks for it), for the heartbeat's own connection."""
        self._client = client
        self._connect = connect
        try:
            self.first_rank = client.add(PREFIX + "next_rank", nproc) - nproc
            self.number = client.add(PREFIX + "launchers", 1) if joining else 0
        except StoreError as e:
            raise LaunchError(f"the dynamic job's store at {addr}:{port} failed: {e}") from None
        self._addr, self._port = addr, port
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}  #: launcher -> (last alive count, when it moved)
        if joining:
            self._thread = threading.Thread(target=self._beat, name="rrefrt-run-dyn-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        try:  # its own connection: the supervisor's client is used on the main thread
            client = self._connect()
        except StoreError as e:  # the host stops waiting for this launcher after --node-timeout
            log.warning("the heartbeat of this joining launcher cannot reach the store at %s:%d (%s): the "
                        "hosting launcher may end before this one's workers do", self._addr, self._port, e)
            return
        try:
            while not self._stop.wait(_HEARTBEAT_S):
                client.add(f"{PREFIX}alive/{self.number}", 1)
        except StoreError:
            pass  # the host is gone: the supervisor finds out through its workers
        finally:
            client.close()

    def finish(self, code: int) -> None:
        """A joining launcher's workers have all ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            try:
                self._client.set(f"{PREFIX}done/{self.number}", str(code).encode())
            except StoreError:
                pass

    def joiners_running(self, node_timeout: float) -> list[int]:
        """The host: joining launchers not done whose heartbeat moved within node_timeout
        (NOTE [The host outlives the joiners])."""
        now = time.monotonic()
        try:
            count = self._client.add(PREFIX + "launchers", 0)
            running = []
            for k in range(1, count + 1):
                if self._client.check([f"{PREFIX}done/{k}"]):
                    continue
                alive = self._client.add(f"{PREFIX}alive/{k}", 0)
                last, since = self._seen.get(k, (-1, now))
                if alive != last:
                    last, since = alive, now
                self._seen[k] = (last, since)
                if now - since < node_timeout:
                    running.append(k)
            return running
        except StoreError:
            return []
