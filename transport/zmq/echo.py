"""The echo socket: answers heartbeats from libzmq's side, without the GIL.

Owns: one ROUTER socket that sends every message it receives straight back to its sender,
served by ``zmq.proxy_steerable(sock, sock)`` on a thread of its own. pyzmq runs the proxy
without the GIL, so the echo answers while every Python thread of the process is stuck or
the GIL is held by a long C call; it stops answering only when the process is dead, stopped
or cut off (NOTE [Liveness] in ``rrefrt_transport.zmq.heartbeat``).

Rule 1: the socket has routing id ``b"e<worker id>"`` (a peer's heartbeat socket reaches its
    data and heartbeat sockets as ``b"w<id>"`` and its echo as ``b"e<id>"``); it is a CURVE
    server with the job's keys when there is a secret (the ZAP handler admits peers only).
Rule 2: it never blocks and never grows: no ROUTER_MANDATORY (an echo to a vanished sender
    is dropped), bounded high-water marks, 64 KiB messages at most.
Rule 3: ``stop()`` sends TERMINATE on the proxy's control socket; the proxy thread then
    closes the socket with linger 0.
"""

from __future__ import annotations

import itertools
import logging
import threading

import zmq

from rrefrt_transport.zmq import security

log = logging.getLogger("rrefrt.transport")

_ids = itertools.count()


def echo_id(worker_id: int) -> bytes:
    return b"e%d" % worker_id


class Echo:
    def __init__(self, ctx: zmq.Context, worker_id: int, auth: security.CurveAuth | None) -> None:
        self._auth = auth
        s = self._sock = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTING_ID, echo_id(worker_id))
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, 1000)
        s.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        s.setsockopt(zmq.AFFINITY, 2)  # the liveness I/O thread (NOTE [Liveness], Rule 2)
        if auth is not None:
            security.configure_keys(s, auth)
        addr = f"inproc://rrefrt-echo-{id(self)}-{next(_ids)}"
        self._ctl_ours = ctx.socket(zmq.PAIR)
        self._ctl_ours.setsockopt(zmq.LINGER, 0)
        self._ctl_ours.bind(addr)
        self._ctl_theirs = ctx.socket(zmq.PAIR)
        self._ctl_theirs.setsockopt(zmq.LINGER, 0)
        self._ctl_theirs.connect(addr)
        self._thread = threading.Thread(target=self._run, name=f"rrefrt-echo-{worker_id}", daemon=True)
        self.endpoints: list[str] = []

    def bind(self, endpoint: str) -> str:
        return security.bind(self._sock, self._auth, endpoint, self.endpoints)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            zmq.proxy_steerable(self._sock, self._sock, None, self._ctl_theirs)
        except zmq.ZMQError as e:  # ETERM and the like: the context is going away
            log.debug("echo proxy ended: %s", e)
        finally:
            self._sock.close(0)
            self._ctl_theirs.close(0)

    def stop(self, timeout: float) -> bool:
        """Stop the proxy and close the socket (Rule 3); False if the thread did not end."""
        if self._thread.ident is None:  # never started
            self._sock.close(0)
            self._ctl_theirs.close(0)
        else:
            try:
                self._ctl_ours.send(b"TERMINATE", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._thread.join(timeout)
        self._ctl_ours.close(0)
        return not self._thread.is_alive()
