"""The join and authentication policy: when does a failed handshake fail the join.

Owns: the bookkeeping of failed handshakes while the mesh forms and the decision to fail
``connect_peers`` with ``AuthenticationFailed``. Performs no I/O: the data loop feeds it the
monitor's handshake events and fails the join with what it returns.

NOTE [Handshake failures]: the monitor reports failed handshakes. On a connect (whose peer
we know) libzmq retries only one closed mid-handshake, so a protocol or authentication
failure, or HANDSHAKE_ATTEMPTS closed handshakes in a row, fail ``connect_peers`` at once
naming that peer - or, on a first contact after the join (NOTE [Lazy connections] in
rrefrt_transport.zmq.agent), what was sent to that peer. On an accepted connection the monitor names only our own endpoint, and
anyone may connect there: so a failure while lower-ranked peers (those that connect to
us) are still missing fails ``connect_peers`` naming them only if they are still missing
ACCEPT_GRACE seconds later - a stray connection cannot abort a join that completes. After
the join, failures are counted (``handshake_failures``) and logged, nothing else.
"""

from __future__ import annotations

import collections
import logging
from typing import Sequence

import zmq

from rrefrt_transport.zmq import security
from rrefrt_transport.errors import AuthenticationFailed

log = logging.getLogger("rrefrt.transport")

HANDSHAKE_ATTEMPTS = 3  #: closed handshakes in a row on a connect that fail the join
ACCEPT_GRACE = 2.0  #: seconds a peer may stay missing after a failed accepted handshake


class JoinPolicy:
    def __init__(self, name: str, stats: collections.Counter) -> None:
        self.name = name
        self.stats = stats
        self.connects: dict[str, tuple[int, str]] = {}  #: connect endpoint -> (peer id, name)
        self._connect_failures: dict[int, int] = {}  #: peer id -> closed handshakes in a row
        self._accept_failed_at = 0.0  #: first failed accepted handshake before the join ended
        self._accept_cause = ""
        self.started_at = 0.0  #: when connect_peers began (0: not yet)

    def succeeded(self, endpoint: str) -> None:
        peer = self.connects.get(endpoint)
        if peer is not None:
            self._connect_failures.pop(peer[0], None)

    def failed(
        self, endpoint: str, event: int, value: int, joining: bool, peer_joining: bool, now: float
    ) -> AuthenticationFailed | None:
        """A handshake failed; return the error that fails the join, if it must."""
        self.stats["handshake_failures"] += 1
        cause = security.describe_failure(event, value)
        peer = self.connects.get(endpoint)
        if peer is not None:
            pid, pname = peer
            n = self._connect_failures[pid] = self._connect_failures.get(pid, 0) + 1
            if peer_joining and (security.is_terminal(event) or n >= HANDSHAKE_ATTEMPTS):
                tries = "" if security.is_terminal(event) else f" ({n} attempts)"
                return AuthenticationFailed(
                    f"worker {self.name!r} could not authenticate with worker {pname!r} at "
                    f"{endpoint}{tries}: {cause}",
                    [pname],
                )
            if n & (n - 1) == 0:  # 1, 2, 4, 8, ... in a row
                log.warning("handshake of %r with worker %r failed (%d in a row): %s", self.name, pname, n, cause)
            return None
        if joining:
            if not self._accept_failed_at:
                self._accept_failed_at = now
            if not self._accept_cause or event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._accept_cause = cause  # the most telling one
            return None
        n = self.stats["handshake_failures"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a flood of strangers does not flood the log
            log.warning("worker %r refused a connection on %s: %s (%d refused so far)", self.name, endpoint, cause, n)
        return None

    def check_accepts(self, now: float, missing_lower: Sequence[str], endpoints: Sequence[str]) -> AuthenticationFailed | None:
        """During the join: the error when peers that should connect to us are still missing
        ACCEPT_GRACE seconds after an accepted handshake failed."""
        if not self._accept_failed_at or not self.started_at:
            return None
        since = max(self._accept_failed_at, self.started_at)
        if now - since < ACCEPT_GRACE:
            return None
        if not missing_lower:
            self._accept_failed_at = 0.0
            return None
        who = ("worker " if len(missing_lower) == 1 else "workers ") + ", ".join(map(repr, missing_lower))
        return AuthenticationFailed(
            f"worker {self.name!r} could not authenticate with {who}: connections to "
            f"{', '.join(endpoints)} failed the handshake ({self._accept_cause}) and "
            f"{who} never authenticated within {ACCEPT_GRACE:.1f}s after that",
            list(missing_lower),
        )
