"""The ``rrefrt-run`` command line: arguments -> LaunchConfig -> Supervisor -> exit code.

Owns: argument parsing, the CLI's logging handler (library messages of the ``rrefrt.run``
logger appear as ``rrefrt-run: warning: ...``) and turning LaunchError into a message and
an exit code. Every flag is documented in docs/launcher.md; keep the two in step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from rrefrt.run.config import LaunchConfig, LaunchError
from rrefrt.run.output import Console

__all__ = ["main", "build_parser", "parse_config"]


def _gpus(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of GPUs or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rrefrt-run", allow_abbrev=False,
        description="Start and supervise the workers of an rrefrt (or torch.distributed) job "
                    "on this node. See docs/launcher.md.",
        usage="%(prog)s [options] (script.py | -m module) [script args...]")
    job = p.add_argument_group("job layout")
    job.add_argument("--nnodes", type=int, default=1, metavar="N",
                     help="number of nodes (default 1)")
    job.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                     help="this node's rank, 0 .. nnodes-1 (default 0); node 0 hosts the store")
    job.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                     metavar="P",
                     help="worker processes on this node (default 1)")
    job.add_argument("--master-addr", "--master_addr", default=None, metavar="A",
                     help="address of node 0, where the rendezvous store listens (default "
                          "127.0.0.1 on one node; required with --nnodes > 1)")
    job.add_argument("--master-port", "--master_port", type=int, default=None, metavar="Q",
                     help="port of the store (default: a free port on one node, 29500 on "
                          "several)")
    job.add_argument("--rdzv-timeout", "--rdzv_timeout", type=float, default=300.0,
                     metavar="S",
                     help="seconds for every node to arrive (default 300)")
    job.add_argument("--node-timeout", "--node_timeout", type=float, default=30.0,
                     metavar="S",
                     help="seconds of silence after which a node is declared lost (default 30)")
    job.add_argument("--dynamic", action="store_true",
                     help="start a dynamic job: host the store, start workers without WORLD_SIZE "
                          "(workers may join and leave; see docs/dynamic-groups.md)")
    job.add_argument("--join", default=None, metavar="HOST:PORT",
                     help="add this node's workers to the running dynamic job whose store "
                          "listens at HOST:PORT")
    dev = p.add_argument_group("devices")
    dev.add_argument("--gpus", type=_gpus, default=None, metavar="G",
                     help="use the first G visible GPUs (default 'auto': all of them)")
    dev.add_argument("--max-workers-per-gpu", "--max_workers_per_gpu", type=int, default=1,
                     metavar="K", help="at most K workers per GPU; the rest run on CPU "
                                       "(default 1)")
    dev.add_argument("--cpu-threads-per-worker", "--cpu_threads_per_worker", type=int,
                     default=None, metavar="T",
                     help="torch/OpenMP/MKL threads per worker (default: OMP_NUM_THREADS if "
                          "set, else usable cores // nproc-per-node)")
    sup = p.add_argument_group("supervision and output")
    sup.add_argument("--grace-period", "--grace_period", type=float, default=5.0, metavar="S",
                     help="seconds between SIGTERM and SIGKILL when stopping workers "
                          "(default 5)")
    sup.add_argument("--on-failure", "--on_failure", choices=("stop", "continue"),
                     default="auto",
                     help="when a worker fails: stop the job (the default), or continue "
                          "(the default with --dynamic / --join: the group evicts it)")
    sup.add_argument("--log-dir", "--log_dir", default=None, metavar="D",
                     help="write each rank's output to D/rank<N>.log instead of "
                          "prefixing it with [rank N] on this terminal")
    sup.add_argument("--tail-lines", "--tail_lines", type=int, default=20, metavar="L",
                     help="lines of a failed worker's output in the report (default 20)")
    sup.add_argument("--start-method", "--start_method", choices=("spawn", "forkserver"),
                     default="spawn", help="accepted for compatibility: workers are always "
                                           "fresh interpreters (spawn)")
    sup.add_argument("--quiet", "-q", action="store_true",
                     help="no header, device table or success summary")
    sup.add_argument("--verbose", "-v", action="store_true", help="log each worker's exit")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module, like python -m")
    p.add_argument("script", nargs="?", help="the script (or module, with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_config(argv: Sequence[str]) -> tuple[LaunchConfig, argparse.Namespace]:
    ns = build_parser().parse_args(list(argv))
    cfg = LaunchConfig(
        script=ns.script or "", script_args=tuple(ns.script_args), module=ns.module,
        nnodes=ns.nnodes, node_rank=ns.node_rank, nproc_per_node=ns.nproc_per_node,
        master_addr=ns.master_addr, master_port=ns.master_port, gpus=ns.gpus,
        max_workers_per_gpu=ns.max_workers_per_gpu,
        cpu_threads_per_worker=ns.cpu_threads_per_worker, log_dir=ns.log_dir,
        start_method=ns.start_method, rdzv_timeout=ns.rdzv_timeout,
        node_timeout=ns.node_timeout, grace_period=ns.grace_period,
        tail_lines=ns.tail_lines, quiet=ns.quiet, dynamic=ns.dynamic, join=ns.join,
        on_failure=ns.on_failure)
    return cfg, ns


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console) -> None:
        super().__init__()
        self._console = console

    def emit(self, record: logging.LogRecord) -> None:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        try:
            self._console.message(f"rrefrt-run: {level}{record.getMessage()}")
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rrefrt-run`` and ``python -m rrefrt.run``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, ns = parse_config(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code) if isinstance(e.code, int) else 2
    console = Console(sys.stdout.buffer, sys.stderr.buffer,
                      live=sys.stderr.isatty() and not cfg.quiet)
    logger = logging.getLogger("rrefrt.run")
    handler = _ConsoleHandler(console)
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if ns.verbose else logging.WARNING)
    logger.propagate = False
    try:
        cfg.validate()
        if cfg.start_method == "forkserver":
            logging.getLogger("rrefrt.run").info(
                "--start-method forkserver: workers are started as fresh interpreters")
        from rrefrt.run.supervisor import Supervisor
        return Supervisor(cfg, console, os.environ).run()
    except LaunchError as e:
        console.message(f"rrefrt-run: error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        console.message("rrefrt-run: interrupted")
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
