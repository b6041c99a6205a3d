"""The launcher's configuration: one frozen, validated description of this node's part of a job.

Owns: ``LaunchConfig`` (what the command line asked for), its validation, and the launcher's
two error types with the exit codes the CLI uses. Standard library only; no I/O except the
checks that name a missing script or an unusable log directory.

Exit codes (docs/launcher.md repeats them): 0 every worker succeeded; 1 the job failed (a
worker failed, a node never arrived or was lost); 2 bad arguments or the job could not
start (port in use, missing script); 128 + N the launcher was stopped by signal N.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import math
import os
import re
import sys

__all__ = ["LaunchConfig", "LaunchError", "UsageError", "EXIT_FAILED", "EXIT_USAGE"]

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_MULTI_NODE_PORT = 29500


class LaunchError(Exception):
    """The job failed before or outside its workers; the message says what to do next."""

    exit_code = EXIT_FAILED


class UsageError(LaunchError):
    """Bad arguments, or a resource the arguments name cannot be used (exit code 2)."""

    exit_code = EXIT_USAGE


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launcher's view of the job. ``validate()`` raises UsageError on bad values."""

    script: str  #: script path, or a module name when ``module`` is set
    script_args: tuple[str, ...] = ()
    module: bool = False  #: run ``python -m script`` instead of a file
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    master_addr: str | None = None  #: None: 127.0.0.1 on one node; required on several
    master_port: int | None = None  #: None: a free port on one node, 29500 on several
    gpus: int | None = None  #: None ("auto"): every GPU the launcher can see
    max_workers_per_gpu: int = 1
    cpu_threads_per_worker: int | None = None  #: None: cores // nproc_per_node
    log_dir: str | None = None  #: one file per rank here; None: prefixed lines on stdout
    start_method: str = "spawn"
    rdzv_timeout: float = 300.0  #: seconds for every node to reach the store
    node_timeout: float = 30.0  #: seconds of silence after which a node is declared lost
    grace_period: float = 5.0  #: seconds between SIGTERM and SIGKILL when stopping workers
    tail_lines: int = 20  #: lines of a failed worker's output in the report
    quiet: bool = False  #: no header, assignment table or summary (reports still print)
    dynamic: bool = False  #: host a dynamic group: workers get no WORLD_SIZE (rrefrt/run/dynamic.py)
    join: str | None = None  #: HOST:PORT of a running dynamic job's store: add workers to it
    on_failure: str = "auto"  #: "stop" the job when a worker fails, "continue", or "auto"

    @property
    def dynamic_mode(self) -> bool:
        return self.dynamic or self.join is not None

    @property
    def stop_on_failure(self) -> bool:
        return self.on_failure == "stop" or (self.on_failure == "auto" and not self.dynamic_mode)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    @property
    def resolved_master_addr(self) -> str:
        return self.master_addr or "127.0.0.1"

    @property
    def resolved_master_port(self) -> int:
        """The port to use; 0 means "any free port" (one node, no --master-port)."""
        if self.master_port is not None:
            return self.master_port
        return DEFAULT_MULTI_NODE_PORT if self.multi_node else 0

    def validate(self) -> None:
        _at_least("--nproc-per-node", self.nproc_per_node, 1,
                  "a job needs at least one worker process on each node")
        _at_least("--nnodes", self.nnodes, 1, "")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is out of range: with --nnodes "
                             f"{self.nnodes} it must be between 0 and {self.nnodes - 1}")
        if self.multi_node and not self.master_addr:
            raise UsageError("--master-addr is required when --nnodes > 1: give the address "
                             "of node 0, reachable from every node")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port (1-65535)")
        if self.gpus is not None:
            _at_least("--gpus", self.gpus, 0, "")
        _at_least("--max-workers-per-gpu", self.max_workers_per_gpu, 1, "")
        if self.cpu_threads_per_worker is not None:
            _at_least("--cpu-threads-per-worker", self.cpu_threads_per_worker, 1, "")
        if self.start_method not in ("spawn", "forkserver"):
            raise UsageError(f"--start-method {self.start_method!r}: choose spawn or forkserver "
                             "(workers are never forked from the launcher)")
        for flag, value in (("--rdzv-timeout", self.rdzv_timeout),
                            ("--node-timeout", self.node_timeout)):
            if not 0 < value < math.inf:
                raise UsageError(f"{flag} must be a positive number of seconds (got {value})")
        if not 0 <= self.grace_period < math.inf:
            raise UsageError(f"--grace-period must be a number of seconds >= 0 (got {self.grace_period})")
        _at_least("--tail-lines", self.tail_lines, 0, "")
        self._validate_dynamic()
        self._validate_target()
        if self.log_dir is not None:
            try:
                os.makedirs(self.log_dir, exist_ok=True)
            except OSError as e:
                raise UsageError(f"--log-dir {self.log_dir!r} cannot be created: {e}") from None
            if not os.access(self.log_dir, os.W_OK):
                raise UsageError(f"--log-dir {self.log_dir!r} is not writable")

    def _validate_dynamic(self) -> None:
        if self.on_failure not in ("auto", "stop", "continue"):
            raise UsageError(f"--on-failure {self.on_failure!r}: choose stop or continue")
        if not self.dynamic_mode:
            return
        if self.dynamic and self.join is not None:
            raise UsageError("--dynamic starts a dynamic job and --join adds workers to one: give one of them")
        if self.multi_node:
            raise UsageError("--dynamic / --join run one launcher per node (no --nnodes): start "
                             "`rrefrt-run --join HOST:PORT` on every other node")
        if self.join is not None:
            host, _, port = self.join.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--join {self.join!r}: expected HOST:PORT of the job's store "
                                 "(the --dynamic launcher prints it)")

    def _validate_target(self) -> None:
        if not self.script:
            raise UsageError("no script given: rrefrt-run [options] script.py [args...] "
                             "(or -m package.module [args...])")
        if self.module:
            if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", self.script):
                raise UsageError(f"-m {self.script!r} is not a module name")
            top = self.script.split(".")[0]
            # Look the top-level package up without importing it (that would run its code
            # here); workers run with the current directory first on sys.path, as -m does.
            if (top not in sys.builtin_module_names and importlib.machinery.PathFinder
                    .find_spec(top, [os.getcwd(), *sys.path]) is None):
                raise UsageError(f"-m {self.script}: no module named {top!r} on the worker's "
                                 f"path (current directory {os.getcwd()!r}, then sys.path)")
            return
        if not os.path.exists(self.script):
            raise UsageError(f"script {self.script!r} not found (current directory "
                             f"{os.getcwd()!r})")
        if os.path.isdir(self.script) and not os.path.exists(
                os.path.join(self.script, "__main__.py")):
            raise UsageError(f"script {self.script!r} is a directory without __main__.py")
        if not os.access(self.script, os.R_OK):
            raise UsageError(f"script {self.script!r} is not readable")


def _at_least(flag: str, value: int, low: int, why: str) -> None:
    if value < low:
        tail = f" ({why})" if why else ""
        raise UsageError(f"{flag} must be at least {low}, got {value}{tail}")
