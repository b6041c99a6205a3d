"""Test support for the same-host transport: this test process is worker 0 (a UnixTransport
in-process), ``tests/transport_helpers/unix_peer.py`` subprocesses are the others. Children
run in sessions of their own and are SIGKILLed by pid when the group ends."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Iterator

from tests.support import ROOT, env_for
from rrefrt_transport import auto  # noqa: F401 - registers "auto"
from rrefrt_transport.base import PeerAddress, PeerSpec, TransportConfig, create

HELPER = ROOT / "tests" / "transport_helpers" / "unix_peer.py"


class Child:
    def __init__(self, cfg: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), json.dumps(cfg)], env=env_for(env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.expect("hello", 20)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        while True:
            ev = self.events.get(timeout=timeout)
            if ev["event"] in (event, "eof", "error"):
                return ev

    def tell(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class Group:
    """Worker 0 here, workers 1..n as children."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.t: Any = None
        self.messages: queue.Queue = queue.Queue()
        self.dead: queue.Queue = queue.Queue()

    def start(
        self, n: int = 1, secret: str | None = None, child_secret: Any = "same", child_extra: dict | None = None,
        child_env: dict[str, str] | None = None, **kw: Any,
    ) -> list[dict]:
        """Start n children and join; return each child's join event (ready or error)."""
        inc = random.getrandbits(62)
        extra = {k: kw.pop(k) for k in ("shm_threshold", "shm_copy_out", "auto_inner", "unix_queue_bytes", "stream") if k in kw}
        kind = kw.pop("kind", "unix")
        cfg = TransportConfig(worker_id=0, name="w0", incarnation=inc, kind=kind,
                              secret=secret.encode() if secret else None, extra=extra, **kw)
        self.t = create(cfg, lambda *a: self.messages.put(a), lambda p, c: self.dead.put((p, c)))
        addr = self.t.listen()
        self.t.start()
        csecret = secret if child_secret == "same" else child_secret
        for i in range(1, n + 1):
            ccfg = {"id": i, "name": f"w{i}", "secret": csecret, "kind": kind, "hb_interval": kw.get("heartbeat_interval", 1.0),
                    "hb_timeout": kw.get("heartbeat_timeout", 3.0), **extra, **(child_extra or {})}
            self.children.append(Child(ccfg, child_env))
        table = [{"id": 0, "name": "w0", "incarnation": inc, "address": addr.to_wire()}] + [
            {"id": c.cfg["id"], "name": c.cfg["name"], "incarnation": c.hello["incarnation"], "address": c.hello["address"]}
            for c in self.children
        ]
        for c in self.children:
            c.tell(table)
        specs = [PeerSpec(p["id"], p["name"], p["incarnation"], PeerAddress.from_wire(p["address"])) for p in table]
        self.join_error: BaseException | None = None
        try:
            self.t.connect_peers(specs, 10.0)
        except Exception as e:
            self.join_error = e
        return [c.expect("ready", 20) for c in self.children]

    def call(self, dest: int, kind: int, meta: Any, frames: list, timeout: float = 10.0) -> tuple[Any, list, Any]:
        """A blocking request through the transport (the test's own wait is bounded)."""
        box: queue.Queue = queue.Queue()
        assert self.t is not None
        self.t.request(dest, kind, meta, frames, timeout, lambda m, f, e: box.put((m, list(f), e)))
        return box.get(timeout=timeout + 5)

    def close(self) -> None:
        if self.t is not None:
            self.t.close(2.0)
        for c in self.children:
            c.kill()
        for c in self.children:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@contextlib.contextmanager
def group(n: int = 1, **kw: Any) -> Iterator[Group]:
    g = Group()
    try:
        g.joined = g.start(n, **kw)  # type: ignore[attr-defined]
        yield g
    finally:
        g.close()


def join_quietly(t: Any, spec: PeerSpec) -> None:
    """Join ``t`` with ``spec``, who never comes: keeps ``t`` in its join window (admission
    knows the group) for a stranger test; the join's failure is expected."""
    try:
        t.connect_peers([spec], 5.0)
    except Exception:  # noqa: BLE001 - nobody joins: expected
        pass


#: what strangers send to an admission: a well-formed HELLO of id 0 (not in the group), then
#: something that is not a peer at all
STRANGER_JUNK = (b"RRU3" + b"\x00" * 52 + b"\x93\x01\x10\x00" * 100, b"GET / HTTP/1.1\r\n" * 20)


def strangers_are_cut_off(family: int, addr: Any) -> None:
    """Connect to ``addr`` once per ``STRANGER_JUNK`` entry, send it, and expect the
    connection to be closed (or reset) without an answer."""
    for junk in STRANGER_JUNK:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(addr)
        s.sendall(junk)
        try:
            assert s.recv(100) == b"", "the stranger is cut off"
        except ConnectionResetError:
            pass  # cut off with unread bytes in its queue: a reset
        s.close()
