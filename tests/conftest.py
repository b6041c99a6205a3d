from __future__ import annotations

import gc
import os
import threading

import pytest

import rrefrt
from tests.support import Workers, free_port

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
def workers():
    w = Workers()
    yield w
    w.kill_all()


@pytest.fixture(autouse=True)
def _no_thread_leak_between_modules():
    yield
    # a test must not leave the runtime of another group behind
    assert os.getpid() > 0 and threading.active_count() < 200
