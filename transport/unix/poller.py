"""The receiver thread's wait (``rrefrt_transport.unix.receiver``): an epoll set over the
peer sockets, the listening socket and admissions, and the bell that wakes it.

Thread roles: ``Poller`` is used by the thread that leads the receiver loop alone, but for
``mute`` and ``unmute`` (any thread: they change the kernel's set only, never the table);
``Bell.ring`` may be called from any thread.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Any

READ, WRITE = select.EPOLLIN, select.EPOLLOUT
_ONESHOT = select.EPOLLONESHOT
_ERR = select.EPOLLERR | select.EPOLLHUP


class Poller:
    """An epoll set and what each fd stands for. ``selectors`` did the same with a key
    object, an events translation and a list per wake; this is its subset."""

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._data: dict[int, Any] = {}
        self._events: dict[int, int] = {}
        #: serialises a change of the kernel's mask with the table it is read from (``mute``
        #: and ``unmute`` on other threads must not restore a mask the loop changed meanwhile)
        self._mask = threading.Lock()

    def register(self, fd: int, events: int, data: Any) -> None:
        self._ep.register(fd, events)
        self._data[fd], self._events[fd] = data, events

    def modify(self, fd: int, events: int, data: Any) -> None:
        with self._mask:
            self._ep.modify(fd, events)
            self._data[fd], self._events[fd] = data, events

    def unregister(self, fd: int) -> None:
        """KeyError if ``fd`` is not registered (as ``selectors``)."""
        del self._data[fd], self._events[fd]
        try:
            self._ep.unregister(fd)
        except OSError:
            pass  # closed already: the kernel dropped it

    def mute(self, fd: int) -> None:
        """Any thread: stop reporting ``fd`` readable (NOTE [Own reads] in
        ``rrefrt_transport.unix.receiver``). One-shot: a hang-up or a write event, which epoll
        reports whatever the mask, is reported once more at most, never in a loop. The table
        keeps the wanted events: ``unmute`` restores them."""
        with self._mask:
            try:
                self._ep.modify(fd, (self._events.get(fd, READ) & ~READ) | _ONESHOT)
            except (OSError, ValueError):
                pass  # closed or unregistered meanwhile: nothing to report any more

    def unmute(self, fd: int) -> None:
        """Any thread: report ``fd`` with the events of the table again."""
        with self._mask:
            events = self._events.get(fd)
            if events is None:
                return  # unregistered meanwhile (its channel is gone)
            try:
                self._ep.modify(fd, events)
            except (OSError, ValueError):
                pass

    def events_of(self, fd: int) -> int:
        return self._events.get(fd, 0)

    def poll(self, timeout: float) -> list[tuple[int, Any, int]]:
        """[(fd, data, READ and/or WRITE)]; an error or hang-up counts as what it waits for."""
        out = []
        data, want = self._data, self._events
        for fd, ev in self._ep.poll(timeout, 64):
            d = data.get(fd)
            if d is None:
                continue
            if ev & _ERR:
                ev |= READ | WRITE
            out.append((fd, d, ev & want[fd]))
        return out

    def close(self) -> None:
        self._ep.close()


class Bell:
    """An eventfd that wakes the receiver's wait: rung by any thread that gives the loop
    work (a call, a timer due sooner, a segment release), cleared by the loop. A ring while
    one is pending costs nothing (no syscall)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rung = False

    def ring(self) -> None:
        if not self._rung:
            self._rung = True
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:
                pass  # closed: nobody waits any more

    def clear(self) -> None:
        """The loop woke on the bell: the next ring writes again. Drained before the flag
        drops: a ring between the two finds the flag up and writes nothing, and its work,
        queued before it rang, is run by the loop right after this. (A drain after the flag
        dropped could take a later ring's write and leave the flag up: no ring would write
        again.)"""
        try:
            os.eventfd_read(self.fd)
        except OSError:
            pass
        self._rung = False

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
