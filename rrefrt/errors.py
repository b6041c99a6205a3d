"""rrefrt's error tree. Every error the runtime raises derives from ``RpcError``.

Leaf module: imports nothing from rrefrt.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "RpcError",
    "RpcTimeoutError",
    "WorkerUnavailableError",
    "OwnerDiedError",
    "RRefLeakError",
    "SerializationError",
    "ShutdownError",
    "RemoteError",
    "RemoteSerializationError",
    "RRefCreationError",
    "AuthenticationError",
    "ArgumentError",
    "OperatorSchemaError",
]


class RpcError(RuntimeError):
    """Base class of every rrefrt error."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call, ``to_here()`` or wait ran past its timeout. ``remote_stack``: where the
    callee's handler was at the deadline (traceback's text, innermost last), when the
    callee was alive and could say so (docs/stuck.md); else None."""

    remote_stack: str | None = None


class WorkerUnavailableError(RpcError):
    """The destination is unknown, not joined, or dead."""


class OwnerDiedError(WorkerUnavailableError):
    """The owner of an RRef died; its value is gone."""


class RRefLeakError(RpcError):
    """Raised by ``shutdown(graceful=True)`` with ``strict_rref_leaks=True``."""

    def __init__(self, message: str, leaks: list[str] | None = None) -> None:
        super().__init__(message)
        self.leaks = list(leaks or [])


class ArgumentError(RpcError, TypeError, ValueError):
    """A bad argument to the API (a destination, an option, a worker name): also a
    ``TypeError`` and a ``ValueError``, since torch raises one or the other for these."""


class SerializationError(RpcError, TypeError):
    """Something could not be pickled, sent or decoded."""


class ShutdownError(RpcError):
    """The runtime is not running: used before ``init_rpc`` or after ``shutdown``. A
    graceful shutdown that gave up sets ``stuck_calls``: the calls still in flight then
    (``get_debug_info``'s form; a running one with its ``stack``; docs/stuck.md)."""

    stuck_calls: list = []


class RemoteError(RpcError):
    """A remote exception whose type could not be rebuilt on this worker (``remote_type``
    names it, ``worker`` the worker that raised it, ``remote_traceback`` is its traceback
    as text)."""

    def __init__(self, message: str, remote_type: str = "", worker: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.worker = worker
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.remote_type, self.worker, self.remote_traceback), self.__dict__)

    @classmethod
    def from_wire(cls, remote_type: str, worker: str, remote_traceback: str) -> "RemoteError":
        """The error for a remote exception that arrived as text only (its object could not
        be sent or rebuilt): keeps the qualified type name, the worker and the traceback."""
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else remote_type
        return cls(
            f"{last} (raised on worker {worker!r}; its type {remote_type} could not be rebuilt here)"
            # torch's phrase (its programs match on it) heads the traceback
            f"\n\nOriginal exception on remote side was (remote traceback):\n{remote_traceback}",
            remote_type,
            worker,
            remote_traceback,
        )


def rebuildable(exc: BaseException, dumps: "Callable[[Any], bytes]", loads: "Callable[[bytes], Any]") -> bool:
    """Whether ``exc`` survives a pickle round trip here (a class whose constructor needs
    extra arguments does not: sending it would make the whole error undecodable on the
    receiver and lose its type name, worker and traceback)."""
    try:
        loads(dumps(exc))
        return True
    except Exception:
        return False


class RemoteSerializationError(RemoteError, SerializationError):
    """The remote worker could not decode what this worker sent it: a module or class that
    does not exist there, or one its unpickling allowlist refuses. Comes back in one round
    trip; ``remote_type`` names the original error (e.g. ``builtins.ModuleNotFoundError``)."""


class OperatorSchemaError(RemoteError, TypeError):
    """A torch operator (``torch.add``, ...) called through RPC with arguments that match
    none of its schemas. The callee's operator raised ``TypeError``; torch.distributed.rpc
    raises ``RuntimeError`` with the phrase "Overloaded torch operator invoked from Python
    failed to match any schema" there, so this is both, its message holds both texts and
    ``__cause__`` on the callee is the operator's own error."""

    PHRASE = "Overloaded torch operator invoked from Python failed to match any schema"


class AuthenticationError(RpcError):
    """Workers failed to authenticate each other while the group formed: they do not share
    the same secret (RREFRT_SECRET or ``RpcBackendOptions(secret=...)``), or only some
    have one. The message names the workers concerned, ``peers`` lists them."""

    def __init__(self, message: str, peers: list[str] | None = None) -> None:
        super().__init__(message)
        self.peers = list(peers or [])


class RRefCreationError(RpcError):
    """The value of an RRef was never created (the creating call failed or was lost)."""


def fresh(err: BaseException) -> BaseException:
    """A copy of a stored error, to raise without growing the stored one's traceback.

    Errors kept on RRef records are raised on every later use; raising the stored object
    itself would chain frames (and the RRef objects in them) onto it: a reference cycle
    through the RRef context that keeps those RRefs alive forever.
    """
    import copy

    try:
        out = copy.copy(err)
    except Exception:
        out = RpcError(str(err))
    out.__traceback__ = None
    return out
