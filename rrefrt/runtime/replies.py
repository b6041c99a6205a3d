"""Answers to peers' requests: responses and acknowledgements, on any thread.

Owns: ``respond`` (a call's result or error, a fetched value, a creation's answer) and
``ack`` (the empty OK that acknowledges a protocol message), and what happens when an
answer cannot be sent (too large: an error answer instead; transport closed: dropped).
Used by the callee, remote() creation and the control loop; calls nothing above the
worker's core.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import rrefrt_transport as transport
from rrefrt.errors import SerializationError
from rrefrt.payload import serialization as ser
from rrefrt.protocol.messages import ERROR, OK, Response
from rrefrt.runtime.core import WorkerCore

log = logging.getLogger("rrefrt")

__all__ = ["Replies"]


class Replies:
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def ack(self, dest: int, msg_id: int, about: Any) -> None:
        """Acknowledge a protocol message (an empty OK response)."""
        self.respond(dest, msg_id, Response(OK).meta(), [], about)

    def too_large(self, e: transport.MessageTooLarge, what: str) -> list[Any]:
        """The error frames that stand in for an answer too large to send."""
        return ser.dumps_error(SerializationError(f"{what} too large: {e}"), self.core.info.name)

    def respond(self, dest: int, msg_id: int, meta: Any, frames: Sequence[Any], about: Any) -> bool:
        """Answer request ``msg_id`` of ``dest``; ``about`` (a message or its class) names it
        for the fault hook as ``RESPONSE:<NAME>``. False: the answer was not sent (too large,
        or the transport is closed or fenced), so the forks it carried must be undone."""
        core = self.core
        try:
            core.transport.respond(dest, msg_id, meta, frames, "RESPONSE:" + about.NAME)
            return True
        except transport.MessageTooLarge as e:
            # the error answer keeps the answer's shape: a creation's answer says it is done
            # (its creator waits for a done answer or a REMOTE_RET, and none would follow)
            done = [1] if type(meta) is list and len(meta) >= 3 else []
            try:
                what = "the error or value of remote()" if done else "result"
                core.transport.respond(dest, msg_id, [ERROR, [], *done], self.too_large(e, what))
            except transport.AgentClosed:
                log.debug("response to worker %d dropped: transport closed", dest)
        except transport.AgentClosed:
            log.debug("response to worker %d dropped: transport closed", dest)
        return False
