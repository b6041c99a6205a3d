"""rrefrt's error tree. Every error the runtime raises derives from ``RpcError``.

Leaf module: imports nothing from rrefrt.
"""

from __future__ import annotations

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
]


class RpcError(RuntimeError):
    """Base class of every rrefrt error."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call, ``to_here()`` or wait ran past its timeout."""


class WorkerUnavailableError(RpcError):
    """The destination is unknown, not joined, or dead."""


class OwnerDiedError(WorkerUnavailableError):
    """The owner of an RRef died; its value is gone."""


class RRefLeakError(RpcError):
    """Raised by ``shutdown(graceful=True)`` with ``strict_rref_leaks=True``."""

    def __init__(self, message: str, leaks: list[str] | None = None) -> None:
        super().__init__(message)
        self.leaks = list(leaks or [])


class SerializationError(RpcError, TypeError):
    """Something could not be pickled, sent or decoded."""


class ShutdownError(RpcError):
    """The runtime is not running: used before ``init_rpc`` or after ``shutdown``."""


class RemoteError(RpcError):
    """A remote exception whose type could not be rebuilt on this worker (``remote_type``
    names it, ``worker`` the worker that raised it)."""

    def __init__(self, message: str, remote_type: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.worker = worker


class RemoteSerializationError(RemoteError, SerializationError):
    """The remote worker could not decode what this worker sent it: a module or class that
    does not exist there, or one its unpickling allowlist refuses. Comes back in one round
    trip; ``remote_type`` names the original error (e.g. ``builtins.ModuleNotFoundError``)."""


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
