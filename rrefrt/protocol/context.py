"""The RRef context: who owns what, who holds which fork, what is still in flight.

Owns: the protocol state of one worker (owners, forks, users, pending children) and its
invariants (their check is in ``rref_audit``, the records in ``rref_records``). Imports from
rrefrt: ids, messages, errors, recent, rref_records, rref_audit. Performs no I/O and never calls
user code: each event method updates the maps under ``_lock`` and returns the actions
(``messages.ForkRequest`` ...) for its caller to perform after the lock is released.

Rule 1: never send, wait or run a destructor while holding ``_lock``. Values leave through
        ``Release`` actions so their destructors run in the caller, outside the lock.
Rule 2: G1 - a user sends RREF_USER_DELETE only once its fork is confirmed by the owner and
        no child it forked is still unconfirmed (the parent's fork keeps the owner's value
        alive while the child's fork request is in flight). A fork received in a call's
        arguments and dropped within the call never registers, so never deletes: it is
        accepted (RREF_CHILD_ACCEPT to its parent) instead (NOTE [Lazy registration]).
Rule 3: G2 - the owner drops an OwnerRecord only when no fork references it; forks sent by
        the owner are registered before the message leaves (early fork registration), forks
        sent by a user stay covered by the parent's own fork until the child accepts.
Rule 4: G3 - when a worker dies its forks are dropped on every owner, its pending children
        count as accepted, and every user of an RRef it owned fails with OwnerDiedError.
        Nothing registers a fork for a dead worker afterwards (no fork is sent to it, a
        late fork request or creation from it registers nothing), a placeholder waiting
        for a creation by a dead worker fails, and a value released after its last holder
        died, or created by a dead worker whose creation never came, is never re-created
        empty by a late fork request, fetch or fork data (``_lost``), whatever the order of
        the death and the late event (NOTE [Late events] in docs/protocol.md).
Rule 5: every wait has a deadline (``wait_*``); see docs/protocol.md for the full statement.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

from rrefrt.errors import OwnerDiedError, RpcError, RRefCreationError, WorkerUnavailableError, fresh
from rrefrt.protocol.ids import ForkId, IdGenerator, RRefId
from rrefrt.protocol.recent import HORIZON_S, RecentIds
from rrefrt.protocol.messages import (
    Action,
    ChildAccept,
    ForkData,
    ForkRequest,
    Release,
    Releases,
    ServeFetch,
    UserDelete,
)
from rrefrt.protocol.audit import ContextAudit, creation_site
from rrefrt.protocol.drops import ContextDrops
from rrefrt.protocol.records import _NO_VALUE, FAILED, PENDING, READY, OwnerRecord, UserRecord

_id = RRefId._make  #: a named id from a decoded (worker, n) tuple

__all__ = ["RRefContext", "OwnerRecord", "UserRecord", "PENDING", "READY", "FAILED", "_NO_VALUE", "creation_site"]


class RRefContext(ContextAudit, ContextDrops):
    """The protocol state of one worker (a monitor: see the module docstring). The records
    are in ``rrefrt/protocol/records.py``; the read-only diagnostics (counts, leaks, the
    invariant check) in ``rrefrt/protocol/audit.py``; the events of dropped RRef objects in
    ``rrefrt/protocol/drops.py``."""

    def __init__(self, worker_id: int, ids: IdGenerator, horizon: float = HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self.ids = ids
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: rref id -> record; an owned RRef is here while some fork references it, or while
        #: it is a placeholder (a fetch/fork request arrived before its creating call).
        self.owners: dict[RRefId, OwnerRecord] = {}
        #: rref id -> {fork id -> holder worker}; registered on PYTHON_REMOTE, on a fork
        #: request, or by the owner before it sends a fork; removed on RREF_USER_DELETE or
        #: when the holder dies.
        self.forks: dict[RRefId, dict[ForkId, int]] = {}
        #: fork id -> record; forks held here whose owner has not confirmed them yet. Leave
        #: for confirmed_users on REMOTE_RET / the fork request's ack.
        self.pending_users: dict[ForkId, UserRecord] = {}
        #: fork id -> record; confirmed forks held here. Leave for deleting_users when the
        #: Python object is gone (and no child is pending), or when the owner dies.
        self.confirmed_users: dict[ForkId, UserRecord] = {}
        #: fork id -> record; RREF_USER_DELETE sent, its ack not yet received.
        self.deleting_users: dict[ForkId, UserRecord] = {}
        #: child fork id -> (parent record, child worker); forks this worker sent to another
        #: user and that child has not accepted. Leave on RREF_CHILD_ACCEPT or child death.
        self.pending_children: dict[ForkId, tuple[UserRecord, int]] = {}
        #: fork ids deleted on this owner (tombstones): a duplicated or retried fork request
        #: or creation that arrives late must not resurrect them. Kept for ``horizon`` seconds
        #: at least, then forgotten (NOTE [Bounded memory of finished things], rrefrt/protocol/recent.py)
        self.deleted_forks: RecentIds = RecentIds(horizon, clock=clock)
        self.dead: set[int] = set()  #: workers declared dead
        #: rref ids of values owned here that left ``owners`` for good (Release, or a creation
        #: its creator gave up): a late fork request, fetch or fork data for one (a fork its
        #: dead holder sent on) must not re-create it as an empty placeholder that nothing
        #: would ever free (``_lost``). Kept for ``horizon`` seconds at least, as deleted_forks.
        self.released: RecentIds = RecentIds(horizon, clock=clock)
        #: rref id -> record, for every value owned here while anything references it
        #: (``owners`` or a local RRef object): how an RRef sent to itself finds its value.
        self.known_owned: weakref.WeakValueDictionary[RRefId, OwnerRecord] = weakref.WeakValueDictionary()
        #: NOTE [Drops] in control.py: what drops applied in an RRef's ``__del__`` decided and
        #: no thread has sent yet (``try_user_dropped`` / ``take_dropped``): the deletes per
        #: owner, [(rref id, fork id), ...], and the other actions (child accepts)
        self._unsent_deletes: dict[int, list[tuple[RRefId, ForkId]]] = {}
        self._unsent: list[Action] = []

    def _notify(self) -> None:
        """Under the lock: wake the waiters of ``_changed`` - if there are any (an empty
        ``notify_all`` costs about 0.7 us, and forks and drops change the maps per RRef)."""
        if self._changed._waiters:  # type: ignore[attr-defined]
            self._changed.notify_all()

    # ------------------------------------------------------------------ user side
    def new_remote_user(self, owner: int, type_name: str = "object", timeout: float = 0.0) -> UserRecord:
        """remote() to another worker: a pending user whose fork id is the RRef id."""
        rid = self.ids.new()
        self.ids.new()  # the id torch gives this user's fork: str(rref) numbers ids as torch does (RRef.__str__)
        rec = UserRecord(rid, rid, owner, parent=owner, type_name=type_name)
        if timeout > 0:
            rec.creation_deadline = time.monotonic() + timeout
        with self._lock:
            if owner in self.dead:
                rec.error = OwnerDiedError(f"owner worker {owner} of RRef {rid} is dead")
                return rec
            self.pending_users[rid] = rec
        return rec

    def on_remote_ret(self, fork_id: ForkId, error: BaseException | None) -> list[Action]:
        with self._lock:
            rec = self.pending_users.get(fork_id)
            if rec is None:
                return []
            if error is not None and rec.error is None:
                rec.error = error
            return self._confirm(rec)

    def abandon_user(self, fork_id: ForkId, error: BaseException) -> list[Action]:
        """The creating message of a remote() was never acknowledged (or could not be sent:
        no RRef object will hold the record): the RRef fails with
        ``error`` on every use, and a delete goes to the owner at once (once no child
        forked from it is pending). The owner keeps a tombstone, so a creation that turns
        up late never runs, and one that did arrive (only its ack was lost) is freed."""
        with self._lock:
            rec = self.pending_users.get(fork_id)
            if rec is None:
                return []
            rec.error = rec.error or error
            del self.pending_users[fork_id]
            rec.confirmed, rec.alive = True, False
            self.confirmed_users[fork_id] = rec
            self._notify()
            # its children still need its fork: the delete waits until they accepted (before,
            # such a creation stayed pending for good and its fork on the owner with it)
            return self._maybe_delete(rec)

    def give_up_user(self, fork_id: ForkId, error: BaseException) -> list[Action]:
        """A pending user's fork request was never acknowledged (retries exhausted): the
        RRef fails with ``error`` on every use. The owner may have registered the fork all
        the same (only the acks were lost, or came after their deadline: an owner slowed
        down past the retry horizon), so, as for a lost creation (``abandon_user``), a
        delete goes to the owner - its tombstone makes a fork request that arrives later a
        no-op - and the parent, which kept its own fork for this child, gets the
        RREF_CHILD_ACCEPT it waits for and may let its fork go. Both leave once no child of
        this fork is pending (they are covered by it; ``_maybe_delete``). Before, the fork
        was only forgotten here: the owner kept it and the parent's fork for good (chaos
        "large" runs: issue 21)."""
        with self._lock:
            rec = self.pending_users.get(fork_id)
            if rec is None:
                return []
            del self.pending_users[fork_id]
            rec.error = rec.error or error
            rec.given_up = True
            rec.confirmed, rec.alive = True, False
            self.confirmed_users[fork_id] = rec
            self._notify()
            return self._maybe_delete(rec)

    def on_fork_request_ack(self, fork_id: ForkId, lost: BaseException | None = None) -> list[Action]:
        """The owner answered the fork request: registered, or ``lost`` (its value is gone:
        the RRef fails with that error on every use; its delete is a no-op there)."""
        with self._lock:
            rec = self.pending_users.get(fork_id)
            if rec is None:
                return []
            if lost is not None and rec.error is None:
                rec.error = lost
            actions = self._confirm(rec)
            if rec.parent not in self.dead:
                actions.insert(0, ChildAccept(rec.parent, fork_id))
            return actions

    def register_users(self, recs: Any) -> list[Action]:
        """NOTE [Lazy registration]: these unregistered forks outlive the call that brought
        them (or their user asks ``confirmed_by_owner()``): send their fork requests now;
        the protocol then goes on as for any pending user (ack -> confirmed -> child
        accept). Forks already registered, dropped or failed are skipped."""
        with self._lock:
            return [a for rec in recs for a in self._register(rec)]

    def _register(self, rec: UserRecord) -> list[Action]:
        if rec.registered or self.pending_users.get(rec.fork_id) is not rec or rec.owner in self.dead:
            return []
        rec.registered = True
        return [ForkRequest(rec.owner, rec.rref_id, rec.fork_id, rec.parent)]

    def _confirm(self, rec: UserRecord) -> list[Action]:
        del self.pending_users[rec.fork_id]
        rec.confirmed = True
        self.confirmed_users[rec.fork_id] = rec
        self._notify()
        return self._maybe_delete(rec)

    def _maybe_delete(self, rec: UserRecord) -> list[Action]:
        """G1: delete once the Python object is gone, confirmed, and no child pending. An
        unregistered fork (NOTE [Lazy registration]) is accepted instead: the owner never
        counted it, so only its parent hears of it."""
        if not rec.registered:
            if rec.alive or rec.children or self.pending_users.pop(rec.fork_id, None) is None:
                return []
            self._notify()
            return [] if rec.parent in self.dead else [ChildAccept(rec.parent, rec.fork_id)]
        if rec.alive or not rec.confirmed or rec.children or rec.fork_id not in self.confirmed_users:
            return []
        del self.confirmed_users[rec.fork_id]  # no waiter's condition changes: no notify
        if rec.owner in self.dead:
            return []
        self.deleting_users[rec.fork_id] = rec
        if rec.given_up and rec.parent not in self.dead:  # its parent still waits (give_up_user)
            return [UserDelete(rec.owner, rec.rref_id, rec.fork_id), ChildAccept(rec.parent, rec.fork_id)]
        return [UserDelete(rec.owner, rec.rref_id, rec.fork_id)]

    def on_user_delete_ack(self, fork_id: ForkId) -> None:
        self.on_user_deletes_ack((fork_id,))

    def on_user_deletes_ack(self, fork_ids: Any) -> None:
        """The owner acknowledged these deletes (one RREF_USER_DELETE(S)); one lock."""
        with self._lock:
            deleting = self.deleting_users
            if sum(deleting.pop(fid, None) is not None for fid in fork_ids):
                self._notify()

    def on_child_accept(self, fork_id: ForkId) -> list[Action]:
        return self.on_child_accepts((fork_id,))

    def on_child_accepts(self, fork_ids: Any) -> list[Action]:
        """RREF_CHILD_ACCEPT(S): these children accepted; one lock for all of them."""
        actions: list[Action] = []
        with self._lock:
            accepted = False
            for fork_id in fork_ids:
                entry = self.pending_children.pop(fork_id, None)
                if entry is None:
                    continue
                parent, _ = entry
                parent.children -= 1
                accepted = True
                actions += self._maybe_delete(parent)
            if accepted:
                self._notify()
        return actions

    # ------------------------------------------------------------------ forks in messages
    def fork_owned(self, record: OwnerRecord, dest: int) -> ForkData:
        """The owner sends its RRef to ``dest``: register the fork before it leaves (G2).
        Also when ``dest`` is this worker (a call to itself): the fork keeps the record in
        ``owners`` while the message is in flight, and it has its own id, so that undoing it
        (``abort_fork``) cannot drop the creator's fork, whose id is the RRef id."""
        with self._lock:
            self._check_alive(dest)
            fid = self.ids.new()
            self.owners[record.rref_id] = record
            self.forks.setdefault(record.rref_id, {})[fid] = dest
            return ForkData(record.rref_id, fid, self.worker_id, self.worker_id, record.type_name)

    def fork_user(self, rec: UserRecord, dest: int) -> ForkData:
        """A user sends its RRef to ``dest``: keep its own fork until the child accepts."""
        fid = self.ids.new()
        with self._lock:
            self._check_alive(dest)
            if rec.error is not None:
                raise fresh(rec.error)
            if rec.fork_id not in self.pending_users and rec.fork_id not in self.confirmed_users:
                raise RpcError(f"RRef {rec.rref_id} (fork {rec.fork_id}) was already deleted on this worker")
            rec.children += 1
            self.pending_children[fid] = (rec, dest)
            return ForkData(rec.rref_id, fid, rec.owner, self.worker_id, rec.type_name)

    def _check_alive(self, dest: int) -> None:
        """Under the lock: a fork for a dead worker would never be dropped (G3 ran)."""
        if dest in self.dead:
            raise WorkerUnavailableError(f"cannot send an RRef to worker {dest}: it was declared dead")

    def abort_fork(self, data: ForkData) -> list[Action]:
        """A message carrying ``data`` was never sent (serialization or send failed)."""
        if data.owner == self.worker_id:
            with self._lock:
                return self._drop_fork(data.rref_id, data.fork_id)
        return self.on_child_accept(data.fork_id)

    def on_fork_received(
        self, data: ForkData, sender: int, lazy: bool = False
    ) -> tuple[OwnerRecord | UserRecord, list[Action]]:
        """A message from ``sender`` carried ``data``: return the record the new RRef object
        refers to, and the protocol messages to send. ``lazy`` (a call's arguments): a fork
        from another user is kept unregistered, no fork request is sent (NOTE [Lazy
        registration] in docs/protocol.md)."""
        with self._lock:
            if data.owner == self.worker_id:
                if self._lost(data.rref_id):  # G3 ran for it: an RRef that fails on use, nothing kept
                    accept = [] if data.parent == self.worker_id else [ChildAccept(data.parent, data.fork_id)]
                    return self._lost_record(data.rref_id), accept
                rec = self._owner_record(data.rref_id, data.type_name)
                if data.parent == self.worker_id:
                    # our own fork came back (fork_owned to self): the new RRef object holds
                    # the record now, so the fork that covered the message goes
                    return rec, self._drop_fork(data.rref_id, data.fork_id)
                return rec, [ChildAccept(data.parent, data.fork_id)]
            user = UserRecord(data.rref_id, data.fork_id, data.owner, data.parent, data.type_name)
            if data.owner in self.dead:
                user.error = OwnerDiedError(f"owner worker {data.owner} of RRef {data.rref_id} is dead")
                user.confirmed = True
                actions = [ChildAccept(data.parent, data.fork_id)] if data.parent != data.owner else []
                return user, actions
            if data.parent == data.owner:
                user.confirmed = True
                self.confirmed_users[data.fork_id] = user
                return user, []
            self.pending_users[data.fork_id] = user
            if lazy and data.parent != self.worker_id and data.parent not in self.dead:
                user.registered = False
                return user, []
            return user, [ForkRequest(data.owner, data.rref_id, data.fork_id, data.parent)]

    # ------------------------------------------------------------------ owner side
    def _owner_record(self, rref_id: RRefId, type_name: str = "object", register: bool = False) -> OwnerRecord:
        """The record of an owned RRef; a placeholder if its creation has not arrived yet
        (placeholders and ``register=True`` records - about to get a fork - go in owners)."""
        rec = self.owners.get(rref_id) or self.known_owned.get(rref_id)
        if rec is None:
            rec = OwnerRecord(rref_id, type_name)
            self.known_owned[rref_id] = rec
            register = True
        if register:
            self.owners[rref_id] = rec
        return rec

    def _lost(self, rref_id: RRefId) -> bool:
        """Nothing here holds a record of this value and none can come back: it was released
        (or its creation given up), or its creator is dead and its creation never arrived
        (``on_remote_request`` refuses a dead creator's). A late fork request, fetch or fork
        data for it must not make a placeholder: nothing would ever free it (NOTE [Late
        events] in docs/protocol.md - peer deaths are applied on the control thread, protocol
        messages on the reading thread, in either order)."""
        if rref_id in self.owners or self.known_owned.get(rref_id) is not None:
            return False
        return rref_id in self.released or rref_id.worker in self.dead

    def _lost_record(self, rref_id: RRefId) -> OwnerRecord:
        """A failed stand-in for a lost value (never registered)."""
        err: RpcError
        if rref_id in self.released:
            err = RpcError(
                f"RRef {rref_id} no longer exists on its owner: it was freed (its last holder died while "
                "passing it on) or its creation was given up as lost"
            )
        else:
            err = RRefCreationError(
                f"RRef creation failed: its creator (worker {rref_id.worker}) died before the creation arrived"
            )
        return OwnerRecord(rref_id, state=FAILED, error=err, created=True)

    def new_local_owner(self, value: Any, type_name: str) -> OwnerRecord:
        """RRef(value) or remote() to self: a record not yet in ``owners`` (no fork yet)."""
        rec = OwnerRecord(self.ids.new(), type_name, created=True)
        if value is not _NO_VALUE:
            rec.state, rec.value = READY, value
        with self._lock:
            self.known_owned[rec.rref_id] = rec
        return rec

    def on_remote_request(
        self, rref_id: RRefId, fork_id: ForkId, creator: int, type_name: str
    ) -> OwnerRecord | None:
        """PYTHON_REMOTE arrived: register the creator's fork; the value follows. Returns
        None for a duplicate (retried or duplicated creation): the function must not run
        twice."""
        with self._lock:
            if fork_id in self.deleted_forks or creator in self.dead:
                return None
            rec = self.owners.get(rref_id) or self.known_owned.get(rref_id)
            if rec is not None and rec.created:
                return None
            rec = self._owner_record(rref_id, type_name, register=True)
            rec.created = True
            self.forks.setdefault(rref_id, {})[fork_id] = creator
            return rec

    def owned_record(self, rref_id: RRefId) -> OwnerRecord | None:
        with self._lock:
            return self.owners.get(rref_id) or self.known_owned.get(rref_id)

    def set_value(self, rec: OwnerRecord, value: Any = None, error: BaseException | None = None) -> list[Action]:
        with self._lock:
            if rec.state != PENDING:
                return []
            if error is None:
                rec.state, rec.value = READY, value
            else:
                rec.state, rec.error = FAILED, error
            waiters, rec.waiters = rec.waiters, []
            self._notify()
            actions: list[Action] = [ServeFetch(src, mid, rec) for src, mid in waiters]
            if not self.forks.get(rec.rref_id) and self.owners.get(rec.rref_id) is rec and rec.created:
                del self.owners[rec.rref_id]
                self.released.add(rec.rref_id)
                actions.append(Release(rec))
            return actions

    def on_fetch(self, rref_id: RRefId, src: int, msg_id: int) -> ServeFetch | None:
        """Serve now (returned) or when the value is set (remembered, no thread parked)."""
        with self._lock:
            if self._lost(rref_id):
                return ServeFetch(src, msg_id, self._lost_record(rref_id))
            rec = self._owner_record(rref_id)
            if rec.state != PENDING:
                return ServeFetch(src, msg_id, rec)
            rec.waiters.append((src, msg_id))
            return None

    def on_fork_request(self, rref_id: RRefId, fork_id: ForkId, requester: int) -> BaseException | None:
        """Register the fork. Returns the error to answer with when the value is gone (the
        requester's RRef must fail on every use from now on: once ``released`` forgets the
        id, a fetch of it would wait for a value that never comes)."""
        with self._lock:
            if fork_id in self.deleted_forks:
                return None  # a duplicate or retry that arrived after the fork was deleted
            if requester in self.dead:
                return None  # G3 already ran for it: nothing to keep alive, nobody to tell
            if self._lost(rref_id):
                return self._lost_record(rref_id).error  # the value is gone: nothing to keep alive
            self._owner_record(rref_id, register=True)
            self.forks.setdefault(rref_id, {})[fork_id] = requester
            return None

    def on_user_delete(self, rref_id: RRefId, fork_id: ForkId) -> list[Action]:
        with self._lock:
            return self._user_delete(rref_id, fork_id)

    def on_user_deletes(self, deletes: Any) -> list[Action]:
        """Several RREF_USER_DELETE at once (``messages.UserDeletes``), in their order, under
        one lock: the owner's count drops for all of them at once (the benchmark's drain).
        The usual case - the last fork of a created value with its value set - is inlined
        (``_user_delete`` does the same, slower); one notify for the batch."""
        actions: list[Action] = []
        owners, forks_of = self.owners, self.forks
        freed: list[OwnerRecord] = []
        with self._lock:
            tombs, released = self.deleted_forks.generation(), self.released.generation()  # one clock read
            for rref_id, fork_id in deletes:
                forks = forks_of.get(rref_id)
                if forks is not None and len(forks) == 1 and fork_id in forks:
                    rec = owners.get(rref_id)
                    if rec is not None and rec.created and rec.state != PENDING:
                        tombs.add(fork_id)
                        del forks_of[rref_id], owners[rref_id]
                        released.add(rec.rref_id)
                        freed.append(rec)
                        continue
                # decoded ids may be plain (worker, n) tuples (messages._deletes)
                actions += self._user_delete(_id(rref_id), _id(fork_id))
            if freed:
                self._notify()
        if freed:
            actions.append(Release(freed[0]) if len(freed) == 1 else Releases(freed))
        return actions

    def _user_delete(self, rref_id: RRefId, fork_id: ForkId) -> list[Action]:
        """Under the lock: one RREF_USER_DELETE."""
        self.deleted_forks.add(fork_id)
        rec = self.owners.get(rref_id)
        if rec is not None and not rec.created and not self.forks.get(rref_id) and fork_id == rref_id:
            # the creator gave the creation up as lost: drop the placeholder, fail its fetches
            del self.owners[rref_id]
            self.released.add(rref_id)  # a late fetch or fork must not re-create it
            rec.state = FAILED
            rec.error = RRefCreationError(f"RRef creation failed: the creation of RRef {rref_id} never arrived")
            waiters, rec.waiters = rec.waiters, []
            self._notify()
            return [ServeFetch(src, mid, rec) for src, mid in waiters]
        return self._drop_fork(rref_id, fork_id)

    def _drop_fork(self, rref_id: RRefId, fork_id: ForkId) -> list[Action]:
        forks = self.forks.get(rref_id)
        if forks is None or forks.pop(fork_id, None) is None:
            return []
        if forks:
            return []
        del self.forks[rref_id]
        rec = self.owners.get(rref_id)
        self._notify()
        if rec is None:
            return []
        if rec.state == PENDING and not rec.created:
            if rref_id.worker not in self.dead and rref_id not in self.deleted_forks:
                return []  # a placeholder: its creation may still come
            # its creation can never come (its creator died, or gave it up as lost while
            # this placeholder had forks): it goes, and its fetches fail
            del self.owners[rref_id]
            self.released.add(rref_id)
            rec.state = FAILED
            rec.error = RRefCreationError(f"RRef creation failed: the creation of RRef {rref_id} never arrived")
            waiters, rec.waiters = rec.waiters, []
            return [ServeFetch(src, mid, rec) for src, mid in waiters]
        if rec.state == PENDING:
            return []  # creation still running; set_value releases it
        del self.owners[rref_id]
        self.released.add(rref_id)
        return [Release(rec)]

    # ------------------------------------------------------------------ failures (G3)
    def on_peer_dead(self, peer: int) -> list[Action]:
        with self._lock:
            self.dead.add(peer)
            actions: list[Action] = []
            self._unsent_deletes.pop(peer, None)  # decided in a __del__, not sent: G3 covers them
            self._unsent = [a for a in self._unsent if getattr(a, "dest", None) != peer]
            for rid in list(self.forks):
                for fid in [f for f, holder in self.forks[rid].items() if holder == peer]:
                    actions += self._drop_fork(rid, fid)
            for rec in self.owners.values():
                rec.waiters = [(s, m) for s, m in rec.waiters if s != peer]
            for rid, rec in list(self.owners.items()):
                if rid.worker == peer and not rec.created and rec.state == PENDING:
                    # a placeholder: its creation (by the dead worker) can never arrive
                    rec.state = FAILED
                    rec.error = RRefCreationError(
                        f"RRef creation failed: its creator (worker {peer}) died before the creation arrived"
                    )
                    waiters, rec.waiters = rec.waiters, []
                    actions += [ServeFetch(s, m, rec) for s, m in waiters]
                    if not self.forks.get(rid):
                        del self.owners[rid]
            for fid, (parent, child) in list(self.pending_children.items()):
                if child == peer or parent.owner == peer:
                    del self.pending_children[fid]
                    parent.children -= 1
                    actions += self._maybe_delete(parent)
            for rec in list(self.pending_users.values()):
                if not rec.registered and rec.parent == peer:
                    # its cover is gone: register now (if the owner freed the value
                    # meanwhile, the fork request registers nothing and every use of the
                    # RRef fails typed, ``_lost``) - NOTE [Lazy registration]
                    actions += self._register(rec)
            err = OwnerDiedError(f"the owner (worker {peer}) of this RRef died")
            for table in (self.pending_users, self.confirmed_users, self.deleting_users):
                for fid, rec in list(table.items()):
                    if rec.owner == peer:
                        rec.error = rec.error or err
                        del table[fid]
            self._notify()
            return actions

    # ------------------------------------------------------------------ shutdown
    def delete_all_users(self) -> list[Action]:
        """Graceful shutdown: every user fork here is dropped, referenced or not."""
        with self._lock:
            actions: list[Action] = []
            for rec in list(self.pending_users.values()) + list(self.confirmed_users.values()):
                rec.closed_by_shutdown = True
                if rec.alive:
                    rec.alive = False
                    actions += self._maybe_delete(rec)
            return actions

    def wait_value(self, rec: OwnerRecord, deadline: float) -> bool:
        """Until an owned value is set (or failed); False at the deadline."""
        with self._lock:
            while rec.state == PENDING:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def wait_users_settled(self, deadline: float) -> bool:
        """Until no user is pending, no child pending, no delete unacknowledged."""
        with self._lock:
            while self.pending_users or self.pending_children or self.deleting_users:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
            return True

    def wait_owners_drained(self, deadline: float) -> bool:
        """Until every fork on this owner belongs to a dead worker (or none remains)."""
        with self._lock:
            while any(h not in self.dead for fs in self.forks.values() for h in fs.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
            return True
