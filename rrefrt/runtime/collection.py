"""Garbage collections and the RRef protocol: the process's one ``gc.callbacks`` hook.

Owns: the hook (NOTE [Drops before a collection]), the registry of the running control
loops it serves, and ``collect_fully``. Imports only the standard library; it reaches a
control loop through its ``flush_before_collection()`` (a ``Flusher``) and must not import
rrefrt.runtime.control or anything above it.

NOTE [Drops before a collection]: a full garbage collection holds the GIL for its whole
length (about 100 ms in a process that imported torch), so the control thread that a burst
of drops woke - ``del rrefs`` just before ``gc.collect()``, the benchmark's drain and a
common program pattern - could send their deletes only once it is over, and the owner
started on them then. Before a generation-2 collection starts, each registered loop with
deletes decided and not yet sent (or a flush of them under way on another thread: the
control thread woken by the drops, or a caller's - it could not finish during the
collection either) is asked to send them: its control thread gets a ``Sync`` (it flushes
the drops). The collecting thread waits for them at most ``COLLECT_WAIT`` in all, so the
owner applies them while this process collects. Bounded and deadlock-free: nothing is sent
from here, and a loop says no (``None``) when its flush would wait for this very thread -
a collection on its control thread, inside a flush of this thread, or with the context's
lock held; a collection that starts while its thread holds a lock the send needs (a
transport lock) waits ``COLLECT_WAIT`` and goes on, and the deletes leave after it as
before. One hook for every loop: one deadline per collection, and ``gc.callbacks`` is
never edited while a collection walks it.

Only one collection runs at a time (CPython's own flag), so only one thread is ever in the
hook's "start" phase. While it waits there, a ``gc.collect()`` on another thread returns at
once having collected nothing: ``collect_fully`` is for the callers that need their
collection (the strict leak report, a dynamic leave).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, Protocol

#: NOTE [Drops before a collection]: the longest a full garbage collection waits for the
#: control threads to send the deletes that drops decided (sending 1000 takes about 0.5 ms)
COLLECT_WAIT = 0.005


class Flusher(Protocol):
    def flush_before_collection(self) -> threading.Event | None:
        """Ask for the deletes decided so far to be sent; the event set once they are, or
        None when there is nothing to send or waiting for it is not safe."""


#: the running control loops of this process
_LOOPS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False
#: a collection (any generation, any thread) is between its "start" and "stop" callbacks
_collecting = False
#: ``collect_fully`` callers wait here for another thread's collection to end (reentrant:
#: a collection may start on a thread that holds it, inside ``Condition.wait`` itself)
_ended = threading.Condition(threading.RLock())
_awaited = 0  #: callers waiting on ``_ended``


def register(loop: Flusher) -> None:
    """A control loop started: serve it from now on (the hook is installed once)."""
    global _installed
    _LOOPS.add(loop)
    with _install_lock:
        if not _installed:
            gc.callbacks.append(_gc_hook)
            _installed = True


def unregister(loop: Flusher) -> None:
    _LOOPS.discard(loop)


def _gc_hook(phase: str, info: dict[str, Any]) -> None:
    """NOTE [Drops before a collection]."""
    global _collecting
    if phase != "start":
        _collecting = False
        if _awaited:
            with _ended:
                _ended.notify_all()
        return
    _collecting = True
    if info.get("generation") != 2 or not _LOOPS:
        return
    events = [ev for loop in list(_LOOPS) if (ev := loop.flush_before_collection()) is not None]
    deadline = time.monotonic() + COLLECT_WAIT
    for ev in events:
        ev.wait(max(0.0, deadline - time.monotonic()))


def collect_fully(deadline: float) -> None:
    """``gc.collect()`` that has collected when it returns: a collection of another thread
    in progress (maybe waiting in the hook, or running finalizers that release the GIL)
    makes ``gc.collect()`` return at once; wait for it to end (until ``deadline``) and
    collect again."""
    global _awaited
    gc.collect()
    waited = False
    with _ended:
        _awaited += 1
        try:
            while _collecting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                _ended.wait(left)
                waited = True
        finally:
            _awaited -= 1
    if waited:
        gc.collect()
