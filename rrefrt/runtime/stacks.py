"""Thread stacks: capturing and formatting them, and their wire form (docs/stuck.md).

Owns: the wire form of a stack (``[[file, line, function, source], ...]``, innermost last,
as ``traceback.extract_stack`` gives it), its text (as ``traceback.format_list`` writes it),
its one-line summary ("fns.py:12 in stuck (time.sleep)") and the trimming of the runtime's
own frames. Standard library only: the runtime's parts import it cheaply.

Cost: nothing on the path of a call; a stack is read only when someone asks (a call's
timeout, a shutdown that gives up, a dump), with ``sys._current_frames()``.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

__all__ = ["Frame", "MAX_FRAMES", "MESSAGE_FRAMES", "frames_of", "thread_frames", "format_frames", "summary",
           "decode_frames", "all_threads_text"]

#: the most frames a stack keeps (the innermost ones)
MAX_FRAMES = 48
#: how many of a stack's innermost frames an error's message shows (the rest: an attribute)
MESSAGE_FRAMES = 6

#: one frame on the wire: [file, line, function, source line]
Frame = list


def frames_of(frame: Any, trim: bool = True) -> list[Frame]:
    """The stack ending at ``frame``, innermost last; ``trim``: without the runtime's own
    frames above a user function (those of the pool and of ``Callee.invoke``)."""
    summary = traceback.extract_stack(frame, limit=MAX_FRAMES)
    out = [[f.filename, f.lineno or 0, f.name, (f.line or "").strip()] for f in summary]
    if trim:
        for i in range(len(out) - 1, -1, -1):
            file, _, name, _ = out[i]
            if name == "invoke" and file.endswith(os.path.join("rrefrt", "runtime", "callee.py")):
                return out[i + 1:] or out
    return out


def thread_frames(ident: int, trim: bool = True) -> list[Frame]:
    """The stack of thread ``ident`` now (empty if that thread is gone)."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return []
    try:
        return frames_of(frame, trim)
    finally:
        del frame


def format_frames(frames: list[Frame], last: int | None = None) -> str:
    """``frames`` as traceback formats a stack (innermost last); ``last``: only that many
    of the innermost frames, with a line saying how many were left out."""
    shown = frames if last is None or len(frames) <= last else frames[-last:]
    summaries = [traceback.FrameSummary(f, int(n), fn, line=src, lookup_line=False) for f, n, fn, src in shown]
    text = "".join(traceback.format_list(summaries))
    if len(shown) < len(frames):
        text = f"  ... {len(frames) - len(shown)} outer frame(s) left out\n" + text
    return text


def summary(frames: list[Frame]) -> str:
    """One line for where a stack is: "fns.py:12 in stuck (time.sleep)" - the innermost
    frame's file and line, its function, and the call its source line makes."""
    if not frames:
        return "an unknown place"
    file, line, name, src = frames[-1]
    where = f"{os.path.basename(file)}:{line} in {name}"
    call = src.split("(", 1)[0].strip() if "(" in src else src.strip()
    return f"{where} ({call})" if call else where


def decode_frames(raw: Any) -> list[Frame]:
    """A stack from the wire, checked (a malformed one is dropped, never trusted)."""
    if type(raw) is not list:
        return []
    out: list[Frame] = []
    for f in raw[-MAX_FRAMES:]:
        if (type(f) is list and len(f) == 4 and type(f[0]) is str and type(f[1]) is int and type(f[2]) is str
                and type(f[3]) is str):
            out.append(f)
    return out


def all_threads_text() -> str:
    """Every thread of this process with its stack (innermost last), as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    current = threading.get_ident()
    frames = sys._current_frames()
    main = threading.main_thread().ident
    try:  # the main thread first, then the others as the interpreter lists them
        for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
            if ident != current:  # not the dumping thread itself
                stack = format_frames(frames_of(frame, trim=False))
                parts.append(f"Thread {names.get(ident, '?')!r} ({ident}), innermost last:\n{stack}")
    finally:
        frames.clear()
    return "\n".join(parts)
