"""Import costs and layering that import-linter cannot see (a package's __init__ is not an
import edge): the launcher loads no runtime, and ``import rrefrt`` loads no torch."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

HEAVY = ("zmq", "msgpack", "torch", "rrefrt.runtime.root", "rrefrt.api", "transport")


def _loaded(stmt: str) -> list[str]:
    code = f"import sys; {stmt}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.timeout(120)
def test_launcher_import_loads_no_runtime():
    assert _loaded("import rrefrt.run") == []
    assert _loaded("import rrefrt.run.cli, rrefrt.run.supervisor") == []


@pytest.mark.timeout(120)
def test_package_import_is_lazy_and_torch_free():
    assert _loaded("import rrefrt") == []
    loaded = _loaded("import rrefrt; rrefrt.init_rpc; rrefrt.Future; rrefrt.functions.async_execution")
    assert "torch" not in loaded and "zmq" in loaded


@pytest.mark.timeout(60)
def test_public_names_resolve():
    import rrefrt

    for name in rrefrt.__all__:
        assert getattr(rrefrt, name) is not None
    with pytest.raises(AttributeError):
        rrefrt.no_such_name  # noqa: B018
    from rrefrt import RpcError, init_rpc  # noqa: F401


def test_loaded_never_returns_a_module_still_being_imported(monkeypatch):
    import types

    from rrefrt.payload import torchimport

    fake = types.ModuleType("torch")
    fake.__spec__ = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.futures", types.ModuleType("torch.futures"))
    assert torchimport.started() and torchimport.loaded() is None
    assert torchimport.loaded_module("torch.futures") is None  # its package is half-imported
    fake.__spec__._initializing = False
    assert torchimport.loaded() is fake and torchimport.loaded_module("torch.futures") is not None
    with pytest.raises(ValueError):
        torchimport.import_module("os")


# A fresh interpreter decodes a torch call (which imports torch) while another thread runs
# init_rpc's profiler hook, the moment torch appears in sys.modules. The decoding thread is
# held at its first torch submodule until the other thread waits on a lock, so the
# two imports always overlap. Before rrefrt/payload/torchimport.py the hook imported torch.autograd
# beside torch's own import and the decoder got "cannot import name ... from partially
# initialized module 'torch.autograd'" (a worker's first call failed, and torch could never
# be imported again in that process).
_CONCURRENT_IMPORT = r"""
import pickle, sys, threading, time
import rrefrt
from rrefrt import futures, profiling
from rrefrt.payload import serialization
from rrefrt.payload import torchimport

frames = pickle.load(open(sys.argv[1], "rb"))
assert "torch" not in sys.modules
errors, hooked = [], []

def poll(pred, timeout):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True

def parked(thread):
    # blocked on a module's import lock, or on rrefrt's torch import lock (the decoder holds it)
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return False
    code = frame.f_code
    return ((code.co_name == "acquire" and "importlib._bootstrap" in code.co_filename)
            or (code.co_name == "_import" and code.co_filename.endswith("torchimport.py")))

class HoldFirstTorchSubmodule:
    held = False
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torch.") and not self.held and threading.current_thread() is decoder:
            self.held = True
            half = torchimport.loaded() is None and torchimport.started()
            poll(lambda: parked(hook) or not hook.is_alive(), 60)
            if not half or futures.Future()._torch_side:
                errors.append("torch looked imported while it was being imported")
        return None

def decode():
    try:
        value = serialization.loads(frames, [])
        func, args, _ = value
        assert float(func(*args)) == 4.0
    except BaseException as e:
        errors.append(f"decoder: {type(e).__name__}: {e}")

def hook():
    try:
        if not poll(lambda: "torch" in sys.modules, 60):
            errors.append("torch was never imported")
        hooked.append(profiling.install())
    except BaseException as e:
        errors.append(f"hook: {type(e).__name__}: {e}")

holder = HoldFirstTorchSubmodule()
sys.meta_path.insert(0, holder)
hook = threading.Thread(target=hook)
decoder = threading.Thread(target=decode)
hook.start()
decoder.start()
decoder.join(120)
hook.join(120)
print("ERRORS", errors, flush=True)
assert not decoder.is_alive() and not hook.is_alive(), "a thread did not finish"
assert holder.held, "the decoder was never held"
assert hooked == [True], hooked
assert futures.Future()._torch_side, "torch futures after the import"
"""


@pytest.mark.timeout(240)
def test_a_torch_call_decoded_while_another_thread_hooks_the_profiler_imports_torch_once(tmp_path):
    torch = pytest.importorskip("torch")
    from rrefrt.payload import serialization
    from tests.support import env_for

    frames, _ = serialization.dumps((torch.sum, (torch.ones(4),), {}))
    payload = tmp_path / "frames.pkl"
    payload.write_bytes(pickle.dumps([bytes(f) for f in frames]))
    script = tmp_path / "concurrent_import.py"
    script.write_text(_CONCURRENT_IMPORT)
    out = subprocess.run([sys.executable, str(script), str(payload)], capture_output=True, text=True, timeout=180,
                         env=env_for())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERRORS []" in out.stdout, out.stdout + out.stderr
