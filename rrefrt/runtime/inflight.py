"""The calls in flight on one worker, in both directions: what ``get_debug_info`` lists,
what a CALL_STACK_QUERY answers, and what a shutdown that gives up names (docs/stuck.md).

Owns: ``InFlight``, two maps touched once or twice per call without a lock (single dict
operations, atomic under the GIL; readers copy the map first). Stacks are read with rrefrt/runtime/stacks.py.

Rules:
1. An incoming call is in ``incoming`` from its arrival (queued) until its answer is
   handed on (``done``); its thread is set when a pool thread starts it, and cleared
   (``WAITING``) when its function returned a future the answer waits for.
2. An outgoing call is in ``outgoing`` from just before its request is sent until the
   transport ran its ``on_done`` (answer, error or timeout).
3. Nothing here is read on a call's path: stacks are read only when someone asks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rrefrt.runtime.stacks import thread_frames

#: the thread slot of an incoming call whose function returned a future (async_execution,
#: ``async def``): no thread runs it, the answer waits for that future
WAITING = -1

#: the bits of a message id that a transport may use to tag the path a message came in on
#: (transport/auto.py's LOCAL_TAG): a query arrives on its call's path, so it has its tag
TAG_MASK = ~((1 << 48) - 1)


def creation_key(rref_id: Any) -> tuple:
    """The key of the remote() creation of ``rref_id`` (never equal to a call's key)."""
    return (CREATION, rref_id)


CREATION = "remote"


def func_name(func: Any) -> str:
    """A function's name as errors and debug info show it."""
    if func is None:
        return "?"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        name = getattr(getattr(func, "func", None), "__qualname__", None) or type(func).__qualname__
    return str(name)


class InFlight:
    def __init__(self) -> None:
        #: key -> [peer, func, start (monotonic), thread ident (0: queued, WAITING)]; key is
        #: (caller id, msg_id) for a call, ``creation_key(rref id)`` for a remote() (Rule 1)
        self.incoming: dict[Any, list] = {}
        #: id(call) -> the caller's ``_Call`` (its ``dest``, ``func``/``what``, ``t0``) (Rule 2)
        self.outgoing: dict[int, Any] = {}

    # ------------------------------------------------------------------ incoming (callee)
    def arrived(self, key: Any, peer: int) -> None:
        self.incoming[key] = [peer, None, time.monotonic(), 0]

    def started(self, key: Any, peer: int) -> list:
        """A pool thread starts the call (a remote() to this worker itself never arrived)."""
        entry = self.incoming.get(key)
        if entry is None:
            entry = self.incoming[key] = [peer, None, time.monotonic(), 0]
        entry[3] = threading.get_ident()
        return entry

    def finished(self, key: Any) -> None:
        self.incoming.pop(key, None)

    def describe(self, key: Any) -> list:
        """The answer to a CALL_STACK_QUERY: ``[state, function, age, frames]``; state is
        "running" (frames: its thread's stack now), "queued", "waiting" (for the future
        its function returned) or "unknown" (not here: finished, or never arrived)."""
        entry = self.incoming.get(key)
        if entry is None:
            return ["unknown", "", 0.0, []]
        _peer, func, t0, thread = entry
        age = round(time.monotonic() - t0, 3)
        if thread == 0:
            return ["queued", func_name(func) if func is not None else "", age, []]
        if thread == WAITING:
            return ["waiting", func_name(func), age, []]
        return ["running", func_name(func), age, thread_frames(thread)]

    def running_here(self, names: Any, stacks: bool = True) -> list[dict[str, Any]]:
        """The incoming calls, oldest first; ``names(peer)`` gives a worker's name."""
        now = time.monotonic()
        out = []
        for key, (peer, func, t0, thread) in sorted(dict(self.incoming).items(), key=lambda kv: kv[1][2]):
            state = "queued" if thread == 0 else "waiting" if thread == WAITING else "running"
            item: dict[str, Any] = {
                "id": _key_text(key), "direction": "incoming", "function": func_name(func) if func else "?",
                "peer": names(peer), "age": round(now - t0, 3), "state": state,
            }
            if stacks and state == "running":
                item["stack"] = thread_frames(thread)
            out.append(item)
        return out

    # ------------------------------------------------------------------ outgoing (caller)
    def sent_from_here(self, names: Any) -> list[dict[str, Any]]:
        """The outgoing calls, oldest first."""
        now = time.monotonic()
        out = []
        for call in sorted(list(self.outgoing.values()), key=lambda c: c.t0):
            out.append({
                "id": str(call.msg_id), "direction": "outgoing", "function": call.label(),
                "peer": names(call.dest), "age": round(now - call.t0, 3), "state": "awaiting answer",
            })
        return out


def _key_text(key: Any) -> str:
    if key[0] == CREATION:
        return f"creation of RRef {key[1]}"
    return str(key[1] & ~TAG_MASK)
