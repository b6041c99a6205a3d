"""Warnings a user must see even when the program never configured logging.

Owns: ``warn(logger, msg, *args)``. rrefrt logs through ``logging`` and its package logger
has only a NullHandler, so by default nothing it logs is shown. A few messages are for the
person running the program and are useless unseen: a rendezvous that cannot form (which
ranks are awaited at which address), and a remote function's exception on the worker that
ran it (torch prints it to that worker's stderr). ``warn`` logs them at WARNING; where no
handler but NullHandlers would receive the record, it writes the line to ``sys.stderr``
(looked up at each call) instead. A level set on the logger silences both
(``logging.getLogger("rrefrt").setLevel(logging.ERROR)``). Standard library only.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["warn"]


def _handled(logger: logging.Logger) -> bool:
    """Some handler other than a NullHandler would receive this logger's records."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


def warn(logger: logging.Logger, msg: str, *args: object) -> None:
    """Log ``msg % args`` at WARNING, or write it to stderr if logging is not configured."""
    if not logger.isEnabledFor(logging.WARNING):
        return
    if _handled(logger):
        logger.warning(msg, *args)
        return
    try:
        text = msg % args if args else msg
        sys.stderr.write(f"[{logger.name}] WARNING: {text}\n")
        sys.stderr.flush()
    except Exception:  # a closed or replaced stderr: the warning is lost, never the caller
        pass
