"""Worker bootstrap: tie this worker to its launcher, then run the user's script as __main__.

Owns: the guards that keep a worker (and its process group) from outliving ``rrefrt-run``,
and running the user's program the way ``python script.py`` / ``python -m mod`` would.
The launcher runs this file by path (``python .../_bootstrap.py [-m] target args...``), so a
worker pays for no rrefrt import it does not make itself. Standard library only; it must not
import rrefrt (its directory is removed from sys.path before anything else is imported).

NOTE [Workers never outlive the launcher]
  The launcher passes, in RREFRT_RUN_WATCHDOG="<launcher pid>:<fd>", the read end of a pipe
  whose only write end it holds (non-inheritable). Here, before any user code runs:
  1. prctl(PR_SET_PDEATHSIG, DEATH_SIGNAL): the kernel signals us when the launcher (the
     thread that spawned us: the launcher's main thread) dies;
  2. getppid() is re-checked against the launcher pid: had the launcher died before step 1,
     no signal would ever come;
  3. a daemon watchdog thread blocks reading the pipe; EOF means the launcher is gone.
  Steps 1 and 3 both end in killpg(own group, SIGKILL): the worker is its session's and
  group's leader (start_new_session), so this also takes down DataLoader workers and other
  descendants that stayed in the group. DEATH_SIGNAL is a real-time signal with a handler
  rather than SIGKILL itself, because a bare SIGKILL of the worker would race the watchdog
  and leave the worker's children orphaned. Both paths need the GIL: a worker stuck in C
  code that never releases it is stopped only when it does (documented in docs/launcher.md).
  Descendants that leave the group (setsid, setpgid) are out of reach of both.
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
if sys.path and os.path.realpath(sys.path[0] or ".") == _HERE:
    del sys.path[0]  # this package's directory must not shadow the user's modules

import ctypes  # noqa: E402  (after the sys.path fix, on purpose)
import runpy  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402

WATCHDOG_ENV = "RREFRT_RUN_WATCHDOG"
DEATH_SIGNAL = signal.SIGRTMIN + 2
_PR_SET_PDEATHSIG = 1


def _say(text: str) -> None:
    try:
        os.write(2, f"rrefrt-run worker {os.getpid()}: {text}\n".encode())
    except OSError:
        pass  # the launcher's end of our stderr may be gone with it


def _kill_own_group(why: str) -> None:
    _say(f"{why}; killing this worker's process group")
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)  # only reached if the group kill failed


def _on_death_signal(signum: int, frame: object) -> None:
    _kill_own_group("the launcher died (parent-death signal)")


def _watch(fd: int, launcher_pid: int) -> None:
    try:
        while os.read(fd, 64):
            pass  # the launcher never writes; data is ignored, only EOF matters
    except OSError:
        pass
    _kill_own_group(f"the launcher (pid {launcher_pid}) is gone (watchdog pipe closed)")


def guard_parent(spec: str) -> None:
    """Install the three guards of NOTE [Workers never outlive the launcher]."""
    pid_text, _, fd_text = spec.partition(":")
    launcher_pid, fd = int(pid_text), int(fd_text)
    signal.signal(DEATH_SIGNAL, _on_death_signal)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0) != 0:
            _say(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    except (OSError, AttributeError) as e:  # not Linux: the watchdog alone remains
        _say(f"prctl unavailable ({e}); relying on the watchdog pipe")
    if os.getppid() != launcher_pid:
        _kill_own_group(f"the launcher (pid {launcher_pid}) exited before this worker started")
    os.set_inheritable(fd, False)  # programs the worker execs need not hold it
    threading.Thread(target=_watch, args=(fd, launcher_pid), name="rrefrt-run-watchdog",
                     daemon=True).start()


def _trim(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the bootstrap's and runpy's frames so the traceback starts in the user's code."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def run_target(argv: list[str]) -> None:
    """Run ``[-m] target args...`` as ``python`` would, with sys.argv and sys.path set."""
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.path.insert(0, os.getcwd())
        sys.argv = [module, *args]  # run_module replaces argv[0] with the module's file
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        if not os.path.isdir(script):  # run_path puts a directory or zip on sys.path itself
            sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    spec = os.environ.pop(WATCHDOG_ENV, None)
    if spec:
        guard_parent(spec)
    if not sys.argv[1:] or sys.argv[1:] == ["-m"]:
        _say("usage: _bootstrap.py [-m module | script] [args...]")
        sys.exit(2)
    try:
        run_target(sys.argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # report like `python script.py` would, then exit 1
        tb = _trim(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
