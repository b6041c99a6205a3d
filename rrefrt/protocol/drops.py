"""The events of dropped RRef objects in the RRef context: a user's Python object went away,
so its fork may be deleted (G1) or, unregistered, accepted (NOTE [Lazy registration]).

Owns: ``ContextDrops``, a mixin of ``RRefContext`` whose methods apply drops to the
context's user maps under its lock and return - or, from a destructor, keep - the actions
that follow (NOTE [Drops] in rrefrt/runtime/control.py). Same rules as the context: no I/O, no
waiting (``try_user_dropped`` does not even wait for the lock), no user code. Imports from
rrefrt: messages, rref_records. Must not import the context itself (it is a base class of
it), the runtime or the transport.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rrefrt.protocol.messages import Action, UserDelete
from rrefrt.protocol.records import UserRecord

if TYPE_CHECKING:
    from rrefrt.protocol.ids import ForkId, RRefId


#: ``try_user_dropped``: the lock was busy / actions kept / nothing to send
BUSY, KEPT, DONE = 0, 1, 2


class ContextDrops:
    """The drop events of ``RRefContext`` (the maps are its own; see its ``__init__``)."""

    _lock: threading.Lock
    pending_users: dict[ForkId, UserRecord]
    confirmed_users: dict[ForkId, UserRecord]
    _unsent_deletes: dict[int, list[tuple[RRefId, ForkId]]]
    _unsent: list[Action]
    #: how many actions wait for ``take_dropped`` (read without the lock: a hint)
    unsent_count: int = 0

    def _maybe_delete(self, rec: UserRecord) -> list[Action]:  # the context's (G1)
        raise NotImplementedError

    def lock_free(self) -> bool:
        """No thread holds the context's lock right now (a hint: NOTE [Drops before a
        collection] in rrefrt/runtime/collection.py)."""
        return not self._lock.locked()

    def user_dropped(self, fork_id: ForkId) -> list[Action]:
        """The Python object of a user fork went away (its __del__ enqueued this)."""
        return self.users_dropped((fork_id,))

    def users_dropped(self, fork_ids: Any) -> list[Action]:
        """``user_dropped`` for several forks under one lock (NOTE [Drops] in control.py)."""
        with self._lock:
            return self._drop_locked(fork_ids)

    def _drop_locked(self, fork_ids: Any) -> list[Action]:
        """Under ``_lock``: mark each live user fork of ``fork_ids`` dropped; its actions."""
        actions: list[Action] = []
        pending, confirmed = self.pending_users, self.confirmed_users
        for fork_id in fork_ids:
            rec = pending.get(fork_id) or confirmed.get(fork_id)
            if rec is not None and rec.alive:
                rec.alive = False
                actions += self._maybe_delete(rec)
        return actions

    def try_user_dropped(self, fork_id: ForkId) -> int:
        """``user_dropped`` from an RRef's ``__del__``, only if the lock is free right now: it
        never waits (the garbage collector may run a destructor on a thread that holds the
        lock). What it decides is kept for ``take_dropped``: nothing is sent from a
        destructor. Returns ``BUSY`` (nothing done: the caller queues the drop), ``KEPT``
        (actions wait for ``take_dropped``) or ``DONE`` (nothing to send: the fork was gone
        already, or still waits for its owner or its children) - NOTE [Drops] in control.py."""
        if not self._lock.acquire(False):
            return BUSY
        try:
            rec = self.pending_users.get(fork_id) or self.confirmed_users.get(fork_id)
            if rec is None or not rec.alive:
                return DONE
            rec.alive = False
            actions = self._maybe_delete(rec)
            self._keep_unsent(actions)
        finally:
            self._lock.release()
        return KEPT if actions else DONE

    def take_dropped(self, fork_ids: Any) -> tuple[dict[int, list[tuple[RRefId, ForkId]]], list[Action]]:
        """``users_dropped(fork_ids)`` plus everything ``try_user_dropped`` kept, under one
        lock: the deletes per owner, ``{owner: [(rref id, fork id), ...]}`` in drop order, and
        the other actions (child accepts)."""
        with self._lock:
            self._keep_unsent(self._drop_locked(fork_ids))
            deletes, self._unsent_deletes = self._unsent_deletes, {}
            other, self._unsent = self._unsent, []
            self.unsent_count = 0
        return deletes, other

    def _keep_unsent(self, actions: list[Action]) -> None:
        """Under the lock: keep ``actions`` for ``take_dropped`` (deletes grouped by owner)."""
        for a in actions:
            if type(a) is UserDelete:
                self._unsent_deletes.setdefault(a.dest, []).append((a.rref_id, a.fork_id))
            else:
                self._unsent.append(a)
        self.unsent_count += len(actions)
