from __future__ import annotations

import gc
import os
import threading

import pytest

# The suite starts several hundred Python processes (workers, launchers, examples, chaos
# and close campaigns), each importing rrefrt, transport and tests/ afresh. Where the
# environment sets PYTHONDONTWRITEBYTECODE=1 (this machine's and CI's do), each of them
# compiled every one of those modules from source (~0.25 s of CPU a process, ~0.8 s of wall
# time on the loaded 2-core machine). The processes the tests start may write and reuse
# bytecode (in the usual git-ignored __pycache__ folders); RREFRT_TEST_BYTECODE=0 keeps
# the environment as it is. This process's own flag is left alone.
if os.environ.get("RREFRT_TEST_BYTECODE", "1") != "0":
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import rrefrt  # noqa: E402
from tests.support import Workers, free_port  # noqa: E402

WORLD = 3


def options(**kw):
    base = dict(rpc_timeout=30.0, shutdown_timeout=60.0)
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def cluster():
    """A 3-worker group: this test process is w0, two subprocesses are w1 and w2."""
    port = free_port()
    workers = Workers()
    try:
        for rank in (1, 2):
            workers.start({"name": f"w{rank}", "rank": rank, "world_size": WORLD, "port": port, "options": options()})
        rrefrt.init_rpc(
            "w0", rank=0, world_size=WORLD,
            rpc_backend_options=rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **options()),
        )
        yield workers
        gc.collect()
        rrefrt.shutdown(timeout=30)
        results = workers.wait_all(30)
        for code, out in results:
            assert code == 0, out
    finally:
        if rrefrt.state.current_or_none() is not None:
            rrefrt.shutdown(graceful=False)
        workers.kill_all()


@pytest.fixture
def group():
    """``start(world, w0_options=None, peer_options=None)``: this process is w0, the others
    are serving subprocesses (they wait in their own graceful shutdown, serving calls, until
    w0 shuts down); returns {"w1": Popen, ...}. Options are added to rpc_timeout 30 s and
    shutdown_timeout 30 s. ``start.workers`` is the ``Workers``. Teardown closes w0's
    runtime and kills every child by pid. (test_failures.py, test_lazy_forks.py)"""
    workers = Workers()

    def start(world: int, w0_options: dict | None = None, peer_options: dict | None = None) -> dict:
        base = {"rpc_timeout": 30.0, "shutdown_timeout": 30.0}
        for attempt in range(3):
            port = free_port()
            procs = {}
            for r in range(1, world):
                procs[f"w{r}"] = workers.start({"name": f"w{r}", "rank": r, "world_size": world, "port": port,
                                                "options": base | (peer_options or {})})
            opts = rrefrt.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **(base | (w0_options or {})))
            try:
                rrefrt.init_rpc("w0", rank=0, world_size=world, rpc_backend_options=opts)
                return procs
            except OSError as e:  # the free port was taken meanwhile (other tests run in parallel)
                if "already in use" not in str(e) or attempt == 2:
                    raise
                for p in procs.values():
                    workers.kill(p)
        raise AssertionError("unreachable")

    start.workers = workers  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        if rrefrt.state.current_or_none() is not None:
            rrefrt.shutdown(graceful=False)
        workers.kill_all()


@pytest.fixture
def workers():
    w = Workers()
    yield w
    w.kill_all()


@pytest.fixture(autouse=True)
def _no_thread_leak_between_modules():
    yield
    # a test must not leave the runtime of another group behind
    assert os.getpid() > 0 and threading.active_count() < 200


#: test folders by layer; each folder's tests carry the marker of its name, so that
#: ``pytest -m unit`` or ``pytest tests/unit`` runs one layer (CI runs them all)
LAYERS = ("unit", "protocol", "transport", "cluster", "failure", "launcher", "gpu", "compat")
_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = os.path.relpath(str(item.path), _TESTS).split(os.sep)
        if rel and rel[0] in LAYERS:
            item.add_marker(getattr(pytest.mark, rel[0]))
