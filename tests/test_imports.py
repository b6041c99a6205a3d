"""Import costs and layering that import-linter cannot see (a package's __init__ is not an
import edge): the launcher loads no runtime, and ``import rrefrt`` loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("zmq", "msgpack", "torch", "rrefrt.runtime", "rrefrt.api", "transport")


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
