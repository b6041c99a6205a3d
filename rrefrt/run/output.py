"""The launcher's output: workers' lines with rank prefixes, the live status line, log tails.

Owns: ``Console`` (every write to the launcher's stdout/stderr goes through it, under one
lock, so a worker's line never splits the status line), ``OutputPump`` (one thread that
reads every worker pipe and keeps the last lines of each rank for the failure report) and
``tail_of_file`` (the same for --log-dir files). Imports nothing from the rest of rrefrt.

Without --log-dir a worker's stdout goes to the launcher's stdout and its stderr to the
launcher's stderr, one line at a time, each prefixed "[rank N] ". A line longer than
``MAX_LINE`` bytes is cut into several prefixed lines; a last line without a newline is
flushed when the pipe closes.
"""

from __future__ import annotations

import collections
import os
import selectors
import shutil
import threading
from typing import BinaryIO

__all__ = ["Console", "OutputPump", "tail_of_file"]

MAX_LINE = 16 * 1024
_CLEAR = b"\r\x1b[K"


class Console:
    """Serialises the launcher's writes; draws a one-line status on a terminal."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, live: bool) -> None:
        self._out, self._err = stdout, stderr
        self._lock = threading.Lock()
        self.live = live  #: draw the status line (stderr is a terminal)
        self._status = b""  #: the status line currently drawn, b"" when none

    def _write(self, stream: BinaryIO, data: bytes) -> None:
        try:
            stream.write(data)
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stdout must not take the supervisor down

    def worker_line(self, to_stderr: bool, data: bytes) -> None:
        with self._lock:
            if self._status:
                self._write(self._err, _CLEAR)
            self._write(self._err if to_stderr else self._out, data)
            if self._status:
                self._write(self._err, self._status)

    def message(self, text: str) -> None:
        """One of the launcher's own lines (header, warnings, report) on stderr."""
        self.worker_line(True, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))

    def status(self, text: str) -> None:
        if not self.live:
            return
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        line = text[:width].encode("utf-8", "replace")
        with self._lock:
            self._write(self._err, _CLEAR + line)
            self._status = line

    def clear_status(self) -> None:
        with self._lock:
            if self._status:
                self._write(self._err, _CLEAR)
                self._status = b""


class OutputPump(threading.Thread):
    """Reads every worker's stdout and stderr pipes until they close.

    Register every pipe with ``add()`` before ``start()``. ``tail(rank)`` and
    ``wait_drained(rank, timeout)`` may be called from any thread.
    """

    def __init__(self, console: Console, tail_lines: int) -> None:
        super().__init__(name="rrefrt-run-output", daemon=True)
        self._console = console
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._tails: dict[int, collections.deque[str]] = {}  #: rank -> last lines, both streams
        self._open: dict[int, int] = {}  #: rank -> pipes not yet at EOF
        self._drained: dict[int, threading.Event] = {}  #: rank -> set when all its pipes closed
        self._tail_lines = tail_lines
        self._stop_r, self._stop_w = os.pipe()
        self._sel.register(self._stop_r, selectors.EVENT_READ, None)

    def add(self, rank: int, fd: int, to_stderr: bool) -> None:
        self._tails.setdefault(rank, collections.deque(maxlen=max(1, self._tail_lines)))
        self._drained.setdefault(rank, threading.Event())
        self._open[rank] = self._open.get(rank, 0) + 1
        os.set_blocking(fd, False)
        self._sel.register(fd, selectors.EVENT_READ, (rank, to_stderr, bytearray()))

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def wait_drained(self, rank: int, timeout: float) -> bool:
        event = self._drained.get(rank)
        return event is None or event.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Ask the thread to finish (flushing partial lines) and join it, bounded."""
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        try:
            while len(self._sel.get_map()) > 1:
                stop = False
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data is None:
                        stop = True
                    else:
                        self._read(key)
                if stop:
                    break
        finally:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._close(key)
            self._sel.close()
            os.close(self._stop_r)
            os.close(self._stop_w)

    def _read(self, key: selectors.SelectorKey) -> None:
        rank, to_stderr, buf = key.data
        try:
            chunk = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(key)
            return
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0 and len(buf) < MAX_LINE:
                break
            end = nl + 1 if nl >= 0 else MAX_LINE
            self._emit(rank, to_stderr, bytes(buf[:end]))
            del buf[:end]

    def _close(self, key: selectors.SelectorKey) -> None:
        rank, to_stderr, buf = key.data
        if buf:
            self._emit(rank, to_stderr, bytes(buf))
            buf.clear()
        self._sel.unregister(key.fd)
        self._open[rank] -= 1
        if self._open[rank] == 0:
            self._drained[rank].set()

    def _emit(self, rank: int, to_stderr: bool, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            self._tails[rank].append(line.decode("utf-8", "replace").rstrip("\r\n"))
        self._console.worker_line(to_stderr, f"[rank {rank}] ".encode() + line)


def tail_of_file(path: str, lines: int, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``lines`` lines of a log file (reading at most ``max_bytes`` from its end)."""
    if lines <= 0:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]  # the first line read is probably cut
    return text[-lines:]
