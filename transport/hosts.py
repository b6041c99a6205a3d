"""Where this process runs: the host id, and the private directory of its ipc sockets.

Owns: ``host_id()`` (equal values = same machine, so ipc may be used) and ``IpcDir``.

NOTE [ipc socket files]: each transport puts its ipc sockets in a directory of its own,
``<tmp>/rrefrt-<pid>-<random>/``, created with mode 0700 (so only this user can connect,
whatever the umask), and removes it on close. A process killed before close leaves its
directory behind; the next transport started by the same user removes every such directory
whose process is gone (and the flat ``rrefrt-<pid>-<hex>.sock`` files of older versions).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import tempfile

log = logging.getLogger("rrefrt.transport")

_DIR = re.compile(r"^rrefrt-(\d+)-[0-9a-f]+(\.sock)?$")


def host_id() -> str:
    """hostname/boot id: two workers with the same value share a kernel (ipc works)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clean_stale(tmp: str | None = None) -> int:
    """Remove ipc directories (and old flat socket files) of this user whose process is
    gone; return how many were removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = 0
    uid = os.getuid()
    try:
        names = os.listdir(tmp)
    except OSError:
        return 0
    for name in names:
        m = _DIR.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid:
                continue
            if m.group(2):
                os.unlink(path)
            else:
                shutil.rmtree(path)
            removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d stale ipc socket paths from %s", removed, tmp)
    return removed


class IpcDir:
    """A 0700 directory of this process's ipc sockets; ``remove()`` deletes it."""

    def __init__(self, tmp: str | None = None) -> None:
        tmp = tmp or tempfile.gettempdir()
        clean_stale(tmp)
        self.path = os.path.join(tmp, f"rrefrt-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path, 0o700)
        os.chmod(self.path, 0o700)  # whatever the umask

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
