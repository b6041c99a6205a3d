"""A protocol trace for diagnosing chaos leaks (test support, off unless installed).

``install(path)`` wraps, in this worker process, every event method of the RRef context
(its arguments and the actions it returned), the control loop's sends of protocol
messages (each attempt and its outcome), the protocol messages read, and the zmq
transport's outgoing messages with the fault hook's decision for each (dropped,
delayed, duplicated). ``dump()`` writes the events as JSON lines to ``path``. Each event
is ``[t, thread, what, ...]`` with ids as ``"w:n"`` text; ``rrefs`` of ``grep`` picks out one
RRef id's history.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

_events: list[list[Any]] = []
_path = ""
_local = threading.local()

#: RRefContext methods traced (args and returned actions)
_CTX_METHODS = (
    "new_remote_user", "on_remote_ret", "abandon_user", "give_up_user", "on_fork_request_ack", "register_users",
    "on_user_deletes_ack", "on_child_accepts", "fork_owned", "fork_user", "abort_fork", "on_fork_received",
    "on_remote_request", "set_value", "on_fork_request", "on_user_delete", "on_user_deletes", "on_peer_dead",
    "delete_all_users", "users_dropped", "try_user_dropped", "take_dropped",
)


def _text(x: Any, depth: int = 0) -> Any:
    """A short JSON-able form of protocol values (ids as "w:n", records by their ids)."""
    from rrefrt.protocol.ids import ForkId, RRefId
    from rrefrt.protocol.records import OwnerRecord, UserRecord

    if isinstance(x, (RRefId, ForkId)):
        return f"{x.worker}:{x.local}"
    if isinstance(x, UserRecord):
        return {"user": _text(x.fork_id), "rref": _text(x.rref_id), "owner": x.owner, "parent": x.parent,
                "confirmed": x.confirmed, "registered": x.registered, "alive": x.alive, "children": x.children}
    if isinstance(x, OwnerRecord):
        return {"owner_rec": _text(x.rref_id), "state": x.state, "created": x.created}
    if depth > 4:
        return repr(x)[:80]
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_text(v, depth + 1) for v in list(x)[:64]]
    if isinstance(x, dict):
        return {str(_text(k, depth + 1)): _text(v, depth + 1) for k, v in list(x.items())[:64]}
    if hasattr(x, "__dataclass_fields__"):
        out = {"kind": type(x).__name__}
        for name in x.__dataclass_fields__:
            if name in ("payload", "records", "record") and type(x).__name__ in ("RemoteRet", "Releases"):
                continue
            out[name] = _text(getattr(x, name), depth + 1)
        return out
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if isinstance(x, BaseException):
        return f"{type(x).__name__}: {str(x)[:120]}"
    return repr(x)[:80]


def note(*fields: Any) -> None:
    _events.append([round(time.monotonic(), 6), threading.current_thread().name[-12:], *fields])


def install(path: str) -> None:
    global _path
    from rrefrt import state
    from rrefrt.protocol.context import RRefContext
    from rrefrt.runtime.control import ControlLoop

    _path = path
    for name in _CTX_METHODS:
        orig = getattr(RRefContext, name)

        def wrapped(self: Any, *args: Any, __orig: Any = orig, __name: str = name, **kw: Any) -> Any:
            try:
                out = __orig(self, *args, **kw)
            except BaseException as e:
                note("ctx", __name, _text(args), "raised", _text(e))
                raise
            note("ctx", __name, _text(args), _text(out))
            return out

        setattr(RRefContext, name, functools.wraps(orig)(wrapped))

    orig_request = ControlLoop.request

    def request(self: Any, msg: Any, on_ack: Any, frames: Any = (), attempt: int = 1, on_reply: Any = None) -> None:
        note("send", msg.NAME, attempt, _text(msg))

        if getattr(on_ack, "_traced", False):
            return orig_request(self, msg, on_ack, frames, attempt, on_reply)

        def acked(err: Any, m: Any = msg) -> None:
            note("acked", m.NAME, _text(m), _text(err))
            on_ack(err)

        acked._traced = True  # type: ignore[attr-defined]
        return orig_request(self, msg, acked, frames, attempt, on_reply)

    ControlLoop.request = request  # type: ignore[method-assign]

    orig_incoming = ControlLoop.on_incoming

    def on_incoming(self: Any, src: int, msg_id: int, msg: Any) -> None:
        note("recv", type(msg).__name__, src, msg_id, _text(msg))
        return orig_incoming(self, src, msg_id, msg)

    ControlLoop.on_incoming = on_incoming  # type: ignore[method-assign]

    orig_delivered = ControlLoop.deletes_delivered

    def deletes_delivered(self: Any, dest: int, deletes: tuple, error: Any) -> None:
        note("piggyback", dest, _text(deletes), _text(error))
        return orig_delivered(self, dest, deletes, error)

    ControlLoop.deletes_delivered = deletes_delivered  # type: ignore[method-assign]

    transport = state.current().transport
    zt = getattr(transport, "inner", transport)
    orig_faulty = zt._send_faulty

    def send_faulty(dest: int, frames: Any, label: str) -> None:
        from rrefrt_transport import wire

        try:
            kind, msg_id, meta = wire.decode_header(bytes(frames[0]))
        except Exception:
            kind, msg_id, meta = -1, -1, None
        _local.current = (dest, label, msg_id, kind, meta)
        note("wire", dest, label, kind, msg_id, _text(meta) if label != "PYTHON_CALL" else "call")
        try:
            return orig_faulty(dest, frames, label)
        finally:
            _local.current = None

    zt._send_faulty = send_faulty
    orig_req = zt.request

    def req(dest: int, kind: int, meta: Any, frames: Any, timeout: float, on_done: Any, label: str = "") -> int:
        mid = orig_req(dest, kind, meta, frames, timeout, on_done, label)
        note("req", dest, label, mid, _text(meta) if label != "PYTHON_CALL" else "call")
        return mid

    zt.request = req
    hook = zt.fault_hook
    if hook is not None:
        orig_call = type(hook).__call__

        def hooked(self: Any, dest: int, label: str) -> list[float]:
            out = orig_call(self, dest, label)
            cur = getattr(_local, "current", None)
            if out != [0.0]:
                note("fault", dest, label, cur[2] if cur else -1, out)
            return out

        type(hook).__call__ = hooked  # type: ignore[method-assign]


def dump() -> None:
    if not _path:
        return
    with open(_path, "w") as f:
        for e in list(_events):
            f.write(json.dumps(e, default=str) + "\n")


def grep(path: str, rref: str) -> list[list[Any]]:
    """The events of ``path`` that mention ``rref`` (an id as "w:n")."""
    out = []
    with open(path) as f:
        for line in f:
            if f'"{rref}"' in line:
                out.append(json.loads(line))
    return out
