"""How rrefrt imports torch, and how it tells whether torch is imported.

Owns: ``torch_module()`` and ``import_module(name)`` (import torch, or one of its
submodules, from any rrefrt thread), ``loaded()`` / ``loaded_module(name)`` (torch or a
submodule only when it is *fully* imported, else None) and ``started()`` (imported or being
imported). Every lazy torch
import and every ``sys.modules`` look at torch in rrefrt goes through here.

NOTE [Importing torch from many threads]
  A worker imports torch lazily, often on the thread that decodes the first tensor call,
  while other threads run (the main thread finishing init_rpc, other callee threads, the
  transport and control threads). Python's import system has one lock per module and gives
  a thread a *partially initialized* module when two imports wait for each other. Two ways
  rrefrt used to get there (a worker then fails every call: a failed ``import torch``
  cannot be retried in that process):

  - a thread imported a torch *submodule* (``from torch.autograd import profiler_legacy``,
    ``import torch.distributed``) while another thread was inside ``import torch``:
    Python does not wait for a package that is already in ``sys.modules`` before importing
    its submodule, so this thread ran ``torch/autograd/__init__.py`` next to torch's own
    import, which then read ``torch.autograd`` half-initialized (ImportError "cannot
    import name '_disable_profiler_legacy' from partially initialized module
    'torch.autograd'");
  - code found ``sys.modules["torch"]`` (or ``torch.futures``) and used it while
    another thread was still importing it (AttributeError, or a wrong answer).

  The rules: (1) ``import torch`` itself first, and completely, before any submodule - a
  plain ``import torch`` from a thread that holds no import lock waits for an import under
  way elsewhere, and that wait cannot deadlock; (2) rrefrt's own imports of torch and its
  submodules run one at a time under ``_lock`` (no two rrefrt threads import torch modules
  that import each other); (3) a module counts as imported only when its
  ``__spec__._initializing`` is false (``loaded``). The lock is waited on with a deadline
  (``LOCK_WAIT``): past it the import runs without the lock, which rule (1) keeps safe, so
  a thread never hangs here on a lock a stuck import holds.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from types import ModuleType

log = logging.getLogger("rrefrt.torchimport")

#: seconds a thread waits for another rrefrt thread's torch import before importing alone
LOCK_WAIT = 60.0

_lock = threading.RLock()


def _complete(module: ModuleType | None) -> ModuleType | None:
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None  # another thread is still running its body
    return module


def started() -> bool:
    """Whether torch is imported or being imported (by any thread): the process uses torch."""
    return "torch" in sys.modules


def loaded() -> ModuleType | None:
    """torch when it is fully imported, else None (never a half-imported torch)."""
    return _complete(sys.modules.get("torch"))


def loaded_module(name: str) -> ModuleType | None:
    """The torch submodule ``name`` when torch and it are fully imported, else None."""
    if loaded() is None:
        return None
    return _complete(sys.modules.get(name))


def torch_module() -> ModuleType:
    """torch, imported now if needed (waits for an import under way on another thread).
    Never call it at a module's import time (rule (1) of the NOTE needs no import lock held)."""
    torch = loaded()
    if torch is not None:
        return torch
    return _import("torch")


def import_module(name: str) -> ModuleType:
    """The torch submodule ``name`` (e.g. ``torch.autograd.profiler_legacy``), importing
    torch completely first."""
    if not (name == "torch" or name.startswith("torch.")):
        raise ValueError(f"rrefrt.payload.torchimport imports torch modules only, not {name!r}")
    module = loaded_module(name)
    if module is not None:
        return module
    torch_module()
    return _import(name)


def _import(name: str) -> ModuleType:
    got = _lock.acquire(timeout=LOCK_WAIT)
    if not got:
        log.debug("rrefrt: importing %s without the import lock (another thread held it for %.0f s)", name, LOCK_WAIT)
    try:
        return importlib.import_module(name)
    finally:
        if got:
            _lock.release()
