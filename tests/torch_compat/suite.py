"""torch's RPC, distributed-autograd, optimizer and RemoteModule test classes, pointed at
rrefrt: RpcTest and TensorPipeAgentRpcTest (rpc_test.py), DistAutogradTest and
TensorPipeAgentDistAutogradTest (dist_autograd_test.py), DistOptimizerTest
(dist_optimizer_test.py), RemoteModuleTest, ThreeWorkersRemoteModuleTest and
CudaRemoteModuleTest (nn/api/remote_module_test.py).

Importing this module installs the alias (tests/torch_compat/alias.py) and then imports
those modules from ``torch.testing._internal.distributed`` in the installed torch (nothing
is copied). It builds the test classes the way torch's ``rpc_utils.generate_tests`` does:
the generic suite, an agent fixture, and ``SpawnHelper`` (torch's ``MultiProcessTestCase``:
each test method runs in 4 fresh worker processes (2 or 3 for the RemoteModule classes), forked by default - see START_METHOD).
The classes live here, at module level, because spawned workers find their class by
``__module__`` and import this module - which installs the alias in them before the suite
is imported; forked workers inherit the alias.

The fixture is ours: rrefrt's options and backend, rendezvous over ``tcp://`` (torch's
harness sets ``RPC_INIT_WITH_TCP=1`` for that), and a timeout regex that accepts rrefrt's
timeout message as well as torch's.

``run_case(cls, name)`` runs one test method through unittest and returns its outcome;
tests/compat/test_torch_compat.py and tests/torch_compat/run_all.py use it.
"""

from __future__ import annotations

import os
import time
import unittest
from dataclasses import dataclass

# torch's harness reads these at import time.
os.environ.setdefault("RPC_INIT_WITH_TCP", "1")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "90")

from tests.torch_compat import alias  # noqa: E402

alias.install()

import rrefrt  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.distributed.rpc import (  # noqa: E402
    dist_autograd_test,
    dist_optimizer_test,
    rpc_test,
)
from torch.testing._internal.distributed.nn.api import remote_module_test  # noqa: E402
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture,
)
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.common_utils import find_free_port  # noqa: E402


#: How the 4 workers of a test start: "fork" (default; the parent has already imported torch,
#: the suite and the alias, so a test starts in about a second instead of re-importing
#: torch four times) or "spawn" (what torch's own harness uses; set RREFRT_COMPAT_START).
START_METHOD = os.environ.get("RREFRT_COMPAT_START", "fork")

#: RREFRT_COMPAT_DUMP=<seconds>: every process that imports this module (the runner and
#: each worker) prints all its threads' stacks to stderr after that long, to see where a
#: test that runs into the harness's limit waits
if os.environ.get("RREFRT_COMPAT_DUMP"):
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["RREFRT_COMPAT_DUMP"]), exit=False)


class SpawnHelper(MultiProcessTestCase):
    """What torch's ``rpc_utils.SpawnHelper`` does (that module cannot be imported under the
    alias: it pulls in the TorchScript suites, which compile ``RRef`` annotations)."""

    def setUp(self) -> None:
        super().setUp()
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(find_free_port())
        if START_METHOD == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def tearDown(self) -> None:
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
        super().tearDown()


class RrefrtAgentFixture(RpcAgentTestFixture):
    """The agent fixture for rrefrt (torch ships one per agent; this is rrefrt's)."""

    @property
    def rpc_backend(self):  # type: ignore[override]
        return rrefrt.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):  # type: ignore[override]
        return rrefrt.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        return ".*"

    def get_timeout_error_regex(self) -> str:
        # torch's phrase, or rrefrt's RpcTimeoutError text.
        return "RPC ran for more than|[Tt]imed out|timeout"


# Same composition as torch's generate_tests(prefix, mixin, tests, module_name).
class RrefrtRpcTest(rpc_test.RpcTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtTensorPipeAgentRpcTest(rpc_test.TensorPipeAgentRpcTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtDistAutogradTest(dist_autograd_test.DistAutogradTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtTensorPipeAgentDistAutogradTest(
    dist_autograd_test.TensorPipeAgentDistAutogradTest, RrefrtAgentFixture, SpawnHelper
):
    pass


class RrefrtDistOptimizerTest(dist_optimizer_test.DistOptimizerTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtRemoteModuleTest(remote_module_test.RemoteModuleTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtThreeWorkersRemoteModuleTest(remote_module_test.ThreeWorkersRemoteModuleTest, RrefrtAgentFixture, SpawnHelper):
    pass


class RrefrtCudaRemoteModuleTest(remote_module_test.CudaRemoteModuleTest, RrefrtAgentFixture, SpawnHelper):
    pass


CLASSES: dict[str, type[unittest.TestCase]] = {
    "RpcTest": RrefrtRpcTest,
    "TensorPipeAgentRpcTest": RrefrtTensorPipeAgentRpcTest,
    "DistAutogradTest": RrefrtDistAutogradTest,
    "TensorPipeAgentDistAutogradTest": RrefrtTensorPipeAgentDistAutogradTest,
    "DistOptimizerTest": RrefrtDistOptimizerTest,
    "RemoteModuleTest": RrefrtRemoteModuleTest,
    "ThreeWorkersRemoteModuleTest": RrefrtThreeWorkersRemoteModuleTest,
    "CudaRemoteModuleTest": RrefrtCudaRemoteModuleTest,
}

#: the families run_all and the docs count together (torch's RemoteModuleTest family is the
#: three RemoteModule classes of remote_module_test.py: world size 2, 3 and the CUDA tests)
FAMILIES: dict[str, tuple[str, ...]] = {
    "RpcTest": ("RpcTest", "TensorPipeAgentRpcTest"),
    "DistAutogradTest": ("DistAutogradTest", "TensorPipeAgentDistAutogradTest"),
    "DistOptimizerTest": ("DistOptimizerTest",),
    "RemoteModuleTest": ("RemoteModuleTest", "ThreeWorkersRemoteModuleTest", "CudaRemoteModuleTest"),
}


def test_names(cls: type[unittest.TestCase]) -> list[str]:
    """The test methods of ``cls``, in unittest's (sorted) order."""
    return unittest.TestLoader().getTestCaseNames(cls)


@dataclass(frozen=True)
class Outcome:
    status: str  # "pass", "fail", "error", "skip"
    seconds: float
    detail: str


#: a test whose rank 0 found its port taken (torch's ``find_free_port`` hands out a port
#: that another process on the machine may bind before rank 0 does) runs again, once, on a
#: port of its own: the harness's race, not the behaviour under test
_PORT_TAKEN = "is already in use by another process"


def run_case(cls: type[unittest.TestCase], name: str) -> Outcome:
    """Run one test method of ``cls`` (4 spawned processes) and return how it went."""
    first = _run_once(cls, name)
    if first.status in ("fail", "error") and _PORT_TAKEN in first.detail:
        again = _run_once(cls, name)
        return Outcome(again.status, first.seconds + again.seconds,
                       again.detail + ("\n(run twice: rank 0's port was taken the first time)" if again.detail else ""))
    return first


def _run_once(cls: type[unittest.TestCase], name: str) -> Outcome:
    case = cls(name)
    result = unittest.TestResult()
    start = time.monotonic()
    case.run(result)
    seconds = time.monotonic() - start
    if result.skipped:
        return Outcome("skip", seconds, result.skipped[0][1])
    if result.failures:
        return Outcome("fail", seconds, result.failures[0][1])
    if result.errors:
        return Outcome("error", seconds, result.errors[0][1])
    return Outcome("pass", seconds, "")
