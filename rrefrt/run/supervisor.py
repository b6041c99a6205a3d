"""The supervisor: one node's job from rendezvous to the last reaped worker.

Owns: the launch sequence (device plan, store, rendezvous, spawn) and the event loop that
watches workers, signals and other nodes, stops everyone when one fails, and cleans up.
Runs on the launcher's main thread (signal handlers and PR_SET_PDEATHSIG require it);
its helpers are the output pump and, on multi-node jobs, the node monitor.

NOTE [The event loop]
  The loop sleeps in one ``select`` on a wake-up pipe that three things write to: the
  signal machinery (``signal.set_wakeup_fd``; SIGCHLD included, so a worker's exit wakes it
  at once), and the node monitor. After each wake-up it handles signals, collects exits
  with ``Worker.poll()`` and handles monitor events, then advances the phase:

      running --all workers exited 0--> done (or, on node 0 of a multi-node job,
              |                               waiting_nodes until every node is done)
              +--a failure / signal / abort / lost node--> stopping --all exited--> done

  SIGUSR1 asks for a job-wide dump (rrefrt/run/dump.py, docs/stuck.md): the loop starts
  one round on a thread of its own (the workers are signalled, their files printed within
  ``DUMP_WAIT``) and goes on supervising meanwhile; the job is not stopped.

  ``stopping`` sends the first signal (SIGTERM, or the signal the launcher received) to
  every worker's process group, SIGKILL after --grace-period, and gives up waiting 2 s
  later. The select timeout is the time to the next deadline (at most 1 s), never a
  polling interval for synchronisation.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType

from rrefrt.group.store import PortInUseError, StoreAuthError, StoreClient, StoreError, StoreServer

from rrefrt.run import report
from rrefrt.run.dump import DUMP_DIR_ENV, dump_job, make_dump_dir, remove_dump_dir
from rrefrt.run.dynamic import DynamicJob, parse_join
from rrefrt.run.config import LaunchConfig, LaunchError, UsageError
from rrefrt.run.devices import DevicePlan, plan_devices, usable_cores, visible_gpus
from rrefrt.run.output import Console, OutputPump, tail_of_file
from rrefrt.run.nodes import (NodeMonitor, World, linger_after_failed_rendezvous, local_node_info, secret_refused,
                         publish_abort, publish_done, rendezvous, withdraw)
from rrefrt.run.workers import Worker, WorkerSpec, build_argv, group_members, signal_name, worker_environ

__all__ = ["Supervisor"]

log = logging.getLogger("rrefrt.run")

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_KILL_WAIT_S = 2.0  # after SIGKILL, how long to wait for the exits before giving up


class Interrupted(Exception):
    """The launcher got SIGINT/SIGTERM/SIGHUP before any worker existed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class Supervisor:
    def __init__(self, config: LaunchConfig, console: Console, environ: Mapping[str, str]):
        self.cfg = config
        self.console = console
        self.environ = dict(environ)
        self.host = socket.gethostname()
        self.workers: list[Worker] = []  #: this node's workers, by local rank
        self.phase = "starting"  #: starting, running, stopping, waiting_nodes, done
        self.exit_code: int | None = None  #: decided when leaving "running"
        self.reason = ""  #: why the job is stopping, for the status line
        self.first_failure: Worker | None = None  #: the local worker whose failure stopped us
        self.remote_abort: dict[str, object] | None = None  #: another node's abort record
        self.extra_report: list[str] = []  #: lines for the final report (node loss, ...)
        self._signals: list[int] = []  #: signals received, not yet handled (main thread only)
        self._spawning = False
        self._kill_at: float | None = None  #: when stopping: SIGKILL everyone at this time
        self._give_up_at: float | None = None
        self._started = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._watch_r, self._watch_w = os.pipe()  # NOTE [Workers never outlive the launcher]
        self._store: StoreServer | None = None
        self._client: StoreClient | None = None
        self._secret: str | None = None  #: the job's secret: the store and the workers use it
        self._identity = "rrefrt-run"  #: how this launcher names itself to the store
        self._monitor: NodeMonitor | None = None
        self._pump: OutputPump | None = None
        self._world: World | None = None
        self._lost_nodes: set[int] = set()  #: nodes declared lost (node 0 only)
        self._dyn: DynamicJob | None = None  #: --dynamic / --join (rrefrt/run/dynamic.py)
        self._dyn_failed = False  #: a worker failed and the job went on (--on-failure continue)
        #: node 0: every other node is done (the ones among them that had a failure); None: not yet
        self._nodes_done: list[int] | None = None
        self._dump_dir: str | None = None  #: the job's dump directory (rrefrt/run/dump.py)
        self._dump_asked = False  #: SIGUSR1 arrived, no dump round started for it yet
        self._dump_thread: threading.Thread | None = None  #: the dump round under way

    # ---- launch --------------------------------------------------------------------

    def run(self) -> int:
        old = self._install_signals()
        code = 1
        try:
            code = self._run()
        except Interrupted as e:
            self.console.message(f"rrefrt-run: interrupted by {e} before any worker started")
            code = 128 + e.signum
        finally:
            try:
                self._cleanup()
            except Interrupted as e:  # another signal while cleaning up: the cleanup is cut short
                self.console.message(f"rrefrt-run: interrupted by {e} while cleaning up")
                code = 128 + e.signum
            finally:
                self._restore_signals(old)
        return code

    def _run(self) -> int:
        cfg = self.cfg
        try:
            visible, source = visible_gpus(self.environ)
        except ValueError as e:
            raise UsageError(str(e)) from None
        plan = plan_devices(cfg.nproc_per_node, visible, gpus=cfg.gpus,
                            max_workers_per_gpu=cfg.max_workers_per_gpu,
                            cpu_threads=cfg.cpu_threads_per_worker, cores=usable_cores(),
                            environ=self.environ, source=source)
        for w in plan.warnings:
            log.warning("%s", w)
        secret = self.environ.get("RREFRT_SECRET") or None
        if secret is None and cfg.dynamic_mode:
            log.warning("RREFRT_SECRET is not set: the workers of this dynamic job get no per-job secret "
                        "(set the same RREFRT_SECRET for the --dynamic launcher and every --join)")
        elif secret is None and not cfg.multi_node:
            secret = secrets.token_hex(32)
        elif secret is None and cfg.is_master:
            log.warning("RREFRT_SECRET is not set: the workers of this multi-node job get no "
                        "shared per-job secret (set the same RREFRT_SECRET on every node)")
        addr, port = cfg.resolved_master_addr, cfg.resolved_master_port
        if cfg.join is not None:
            addr, port = parse_join(cfg.join)
        elif cfg.is_master:  # NOTE [Store authentication]: with a secret, clients must prove it
            self._store = self._host_store(addr, port, secret)
            port = self._store.port
        where = f"{addr}:{port}"
        self._identity = f"rrefrt-run node {cfg.node_rank} (host {self.host}, pid {os.getpid()})"
        self._secret = secret
        try:
            self._client = self._store_client(addr, port, cfg.rdzv_timeout)
        except StoreAuthError as e:
            raise LaunchError(secret_refused(cfg.node_rank, e)) from None
        except StoreError as e:
            raise LaunchError(f"node 0 never arrived: {e}") from None
        me = local_node_info(cfg.node_rank, cfg.nnodes, cfg.nproc_per_node, secret)
        if cfg.dynamic_mode:  # no node rendezvous: ranks come from the store's counter
            self._dyn = DynamicJob(self._client, cfg.nproc_per_node, cfg.join is not None, addr, port,
                                   lambda: self._store_client(addr, port, 5.0))
            self._world = World((me,), 0)
        else:
            store = self._store
            refused = (lambda: [who for _, who in store.auth_failures]) if store is not None else None
            try:
                self._world = rendezvous(self._client, me, where, cfg.rdzv_timeout, refused)
            except StoreError as e:
                raise LaunchError(f"lost the rendezvous store at {where}: {e}") from None
            except Interrupted:
                if not cfg.is_master:  # (node 0's store ends with it)
                    self._client.close()  # it may be in the middle of a request
                    try:
                        fresh = self._store_client(addr, port, 2.0)
                    except StoreError as e:
                        log.info("could not give node rank %d back: %s", cfg.node_rank, e)
                    else:
                        withdraw(fresh, me)
                        fresh.close()
                raise
        self._print_header(plan, where)
        self._dump_dir = make_dump_dir()
        self._spawn_all(plan, addr, port, secret)
        if cfg.multi_node:
            try:
                self._monitor = NodeMonitor(self._store_client(addr, port, 10.0), self._world,
                                            cfg.node_timeout, self._wake)
            except StoreError as e:
                raise LaunchError(f"lost the store at {where} after the rendezvous: {e}") from None
            self._monitor.start()
        self.phase = "running"
        return self._loop()

    def _store_client(self, addr: str, port: int, connect_timeout: float) -> StoreClient:
        """A client of the job's store: it proves the secret when the store asks for it. It
        accepts a store that does not ask (node 0 without RREFRT_SECRET), so that the node
        rendezvous reports a secret set on some nodes only; workers do not (rrefrt.group.rendezvous)."""
        return StoreClient(addr, port, connect_timeout=connect_timeout, secret=self._secret,
                           require_auth=False, identity=self._identity)

    def _host_store(self, addr: str, port: int, secret: str | None) -> StoreServer:
        try:
            return StoreServer(addr, port, secret=secret, label="rrefrt-run on node 0")
        except PortInUseError as e:
            text = e.strerror or next((a for a in reversed(e.args) if isinstance(a, str)), str(e))
            raise UsageError(f"--master-port {port}: {text}") from None
        except StoreError as e:
            raise UsageError(f"{e}; node 0 hosts the rendezvous store, so --master-addr must "
                             "be an address of this host") from None

    def _print_header(self, plan: DevicePlan, where: str) -> None:
        if self.cfg.quiet:
            return
        world = self._world
        assert world is not None
        first, n = self._first_rank(), self.cfg.nproc_per_node
        hosted = " (hosted here)" if self.cfg.is_master and self.cfg.join is None else ""
        size = ("a dynamic group" if self.cfg.dynamic_mode else f"world size {world.world_size}")
        self.console.message(
            f"rrefrt-run: node {self.cfg.node_rank} of {self.cfg.nnodes} (host {self.host}): "
            f"{n} worker{'s' if n != 1 else ''}, ranks {first}-{first + n - 1} of {size}; "
            f"store {where}{hosted}")
        if plan.visible:
            k = self.cfg.max_workers_per_gpu
            self.console.message(f"rrefrt-run: GPUs visible: {', '.join(plan.visible)} (from "
                                 f"{plan.source}); at most {k} worker{'s' if k != 1 else ''} "
                                 "per GPU")
        else:
            self.console.message(f"rrefrt-run: GPUs visible: none ({plan.source})")
        for dev in plan.workers:
            self.console.message(f"rrefrt-run:   rank {first + dev.local_rank} (local "
                                 f"{dev.local_rank}): {dev.describe()}")
        for note in plan.notes:
            self.console.message(f"rrefrt-run: {note}")

    def _first_rank(self) -> int:
        assert self._world is not None
        return self._dyn.first_rank if self._dyn is not None else self._world.rank_offset

    def _spawn_all(self, plan: DevicePlan, addr: str, port: int, secret: str | None) -> None:
        world, cfg = self._world, self.cfg
        assert world is not None
        argv = build_argv(cfg.script, cfg.script_args, cfg.module)
        self._pump = OutputPump(self.console, cfg.tail_lines)
        self._spawning = True  # from here on, signals are handled by the loop
        for dev in plan.workers:
            rank = self._first_rank() + dev.local_rank
            env = worker_environ(
                self.environ, rank=rank, local_rank=dev.local_rank,
                world_size=world.world_size, local_world_size=cfg.nproc_per_node,
                node_rank=cfg.node_rank, master_addr=addr, master_port=port, secret=secret,
                device_env=dev.environ(), watchdog=f"{os.getpid()}:{self._watch_r}")
            if cfg.dynamic_mode:
                env.pop("WORLD_SIZE")  # init_rpc joins a dynamic group
            if self._dump_dir is not None:
                env[DUMP_DIR_ENV] = self._dump_dir
            log_path = (os.path.join(cfg.log_dir, f"rank{rank}.log")
                        if cfg.log_dir is not None else None)
            spec = WorkerSpec(rank, dev.local_rank, cfg.node_rank, argv, env, log_path)
            try:
                worker = Worker.spawn(spec, self._watch_r)
            except OSError as e:
                raise LaunchError(f"could not start rank {rank}: {e}") from None
            self.workers.append(worker)
            if worker.popen.stdout is not None and worker.popen.stderr is not None:
                self._pump.add(rank, worker.popen.stdout.fileno(), to_stderr=False)
                self._pump.add(rank, worker.popen.stderr.fileno(), to_stderr=True)
        os.close(self._watch_r)  # only workers hold read ends; the launcher keeps the write end
        self._watch_r = -1
        self._pump.start()

    # ---- signals and wake-ups ---------------------------------------------------------

    def _install_signals(self) -> dict[int, object]:
        old: dict[int, object] = {}
        for sig in (*_FORWARDED, signal.SIGCHLD):
            old[sig] = signal.signal(sig, self._on_signal)
        if hasattr(signal, "SIGUSR1"):
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_dump_signal)
        old[-1] = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return old

    def _restore_signals(self, old: dict[int, object]) -> None:
        signal.set_wakeup_fd(old.pop(-1))  # type: ignore[arg-type]
        for sig, handler in old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGCHLD:
            return  # the wake-up fd already woke the loop
        if not self._spawning:
            raise Interrupted(signum)
        self._signals.append(signum)

    def _on_dump_signal(self, signum: int, frame: FrameType | None) -> None:
        self._dump_asked = True  # the wake-up fd woke the loop

    def _start_dump(self) -> None:
        """NOTE [The event loop]: a dump round on its own thread; one at a time."""
        self._dump_asked = False
        self.console.message(f"rrefrt-run: SIGUSR1: {self._describe()}")
        if self._dump_dir is None or self.phase != "running":
            return
        if self._dump_thread is not None and self._dump_thread.is_alive():
            return
        workers = [(w.rank, w.pid) for w in self.workers if w.running]
        self.console.message(f"rrefrt-run: SIGUSR1: dumping the threads and calls in flight of rank(s) "
                             f"{', '.join(str(r) for r, _ in workers)}; the job goes on")
        self._dump_thread = threading.Thread(target=dump_job, args=(self._dump_dir, workers, self.console.message),
                                             name="rrefrt-run-dump", daemon=True)
        self._dump_thread.start()

    def _describe(self) -> str:
        """Where this launcher is: its phase, its workers, and the nodes node 0 still waits for."""
        what = f"{self.phase} ({self.reason})" if self.reason else self.phase
        ranks = []
        for w in self.workers:
            state = "running" if w.running else (w.status.describe() if w.status is not None else "ended")
            ranks.append(f"rank {w.rank} pid {w.pid} {state}")
        text = f"node {self.cfg.node_rank} {what} after {time.monotonic() - self._started:.1f}s; " + \
            ("; ".join(ranks) or "no workers")
        if self.phase == "waiting_nodes" and self._monitor is not None:
            text += f"; waiting for node(s) {self._monitor.pending_text()} to report done"
        return text

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # already awake

    def _sleep(self, timeout: float) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout))
        if ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    # ---- the loop (NOTE [The event loop]) ----------------------------------------------

    def _loop(self) -> int:
        while True:
            self._handle_signals()
            if self._dump_asked:
                self._start_dump()
            self._collect_exits()
            self._handle_monitor_events()
            self._advance()
            if self.phase == "done":
                assert self.exit_code is not None
                return self.exit_code
            self._show_status()
            self._sleep(self._next_timeout())

    def _next_timeout(self) -> float:
        now, timeout = time.monotonic(), 1.0
        for t in (self._kill_at, self._give_up_at):
            if t is not None:
                timeout = min(timeout, t - now)
        return max(0.0, timeout)

    def _handle_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if self.phase == "waiting_nodes":  # our workers are done; stop waiting for others
                self.reason = f"received {signal_name(sig)}"
                self._publish_abort({"what": f"the launcher of node 0 received {signal_name(sig)}"})
                self._finish(128 + sig)
                continue
            if self.phase == "stopping":
                log.warning("received %s while stopping: killing every worker now",
                            signal_name(sig))
                self._kill_all()
                continue
            self._begin_stop(f"received {signal_name(sig)}", 128 + sig, sig)
            self._publish_abort({"what": f"the launcher of node {self.cfg.node_rank} received "
                                         f"{signal_name(sig)}"})

    def _collect_exits(self) -> None:
        for w in self.workers:
            if not w.running:
                continue
            st = w.poll()
            if st is None:
                continue
            log.info("rank %d (pid %d) %s", w.rank, w.pid, st.describe())
            if not st.ok and w.stopped_with is None and self.phase == "running" and not self.cfg.stop_on_failure:
                self._dyn_failed = True
                self.first_failure = self.first_failure or w
                log.warning("rank %d %s; the job goes on without it (the group evicts it; --on-failure stop "
                            "stops the job instead)", w.rank, st.describe())
            elif not st.ok and w.stopped_with is None and self.phase == "running":
                self.first_failure = w
                self._begin_stop(f"rank {w.rank} failed", 1, signal.SIGTERM)
                if self._pump is not None:
                    self._pump.wait_drained(w.rank, 0.2)
                self._publish_abort({"rank": w.rank, "what": f"rank {w.rank} {st.describe()}",
                                     "tail": self._tail(w)})

    def _handle_monitor_events(self) -> None:
        if self._monitor is None:
            return
        while not self._monitor.events.empty():
            kind, detail = self._monitor.events.get_nowait()
            if kind == "abort":
                assert isinstance(detail, dict)
                if detail.get("node") == self.cfg.node_rank:
                    continue  # our own
                self.remote_abort = detail
                self._stop_for_job(f"node {detail.get('node')} failed")
            elif kind == "store_lost" and self.phase in ("running", "waiting_nodes"):
                self.extra_report.append(f"rrefrt-run: lost contact with node 0's store "
                                         f"({detail}); node 0's launcher is gone")
                self._stop_for_job("node 0 was lost")
            elif kind == "node_lost":
                assert isinstance(detail, int)
                self._lost_nodes.add(detail)
                if self.phase not in ("running", "waiting_nodes"):
                    continue  # already stopping for another reason
                self.extra_report.append(
                    f"rrefrt-run: node {detail} was lost: its launcher sent no heartbeat for "
                    f"{self.cfg.node_timeout:g}s (--node-timeout)")
                self._stop_for_job(f"node {detail} was lost")
                self._publish_abort({"what": f"node {detail} was lost"})
            elif kind == "nodes_done":  # posted once: kept for when our own workers end
                assert isinstance(detail, list)
                self._nodes_done = detail
                if detail:
                    self.extra_report.append("rrefrt-run: node(s) " + ", ".join(map(str, detail))
                                             + " ended with a non-zero code")
                if self.phase == "waiting_nodes":
                    self._finish(self._job_code())

    def _stop_for_job(self, why: str) -> None:
        if self.phase == "running":
            self._begin_stop(why, 1, signal.SIGTERM)
        elif self.phase == "waiting_nodes":
            self._finish(1)

    def _advance(self) -> None:
        now = time.monotonic()
        if self.phase == "running" and all(not w.running for w in self.workers) and self._dyn is not None:
            self.exit_code = 1 if self._dyn_failed else 0
            self.phase, self.reason = "waiting_nodes", "waiting for the launchers that joined"
        if self.phase == "waiting_nodes" and self._dyn is not None:
            if self.cfg.join is not None or not self._dyn.joiners_running(self.cfg.node_timeout):
                self._finish(self.exit_code or 0)
        elif self.phase == "running" and all(not w.running for w in self.workers):
            code = 1 if self._dyn_failed else 0  # a worker failed and the others went on
            if not self.cfg.multi_node or not self.cfg.is_master:
                self._finish(code)
                return
            assert self._client is not None
            publish_done(self._client, self.cfg.node_rank, code)
            self.exit_code = code
            self.phase, self.reason = "waiting_nodes", "waiting for the other nodes"
            if self._nodes_done is not None:  # they finished before our own workers did
                self._finish(self._job_code())
        elif self.phase == "stopping":
            if all(not w.running for w in self.workers):
                self._finish(self.exit_code if self.exit_code is not None else 1)
            elif self._kill_at is not None and now >= self._kill_at:
                left = [w.rank for w in self.workers if w.running]
                log.warning("rank(s) %s still running %.1fs after being stopped: sending SIGKILL",
                            ", ".join(map(str, left)), self.cfg.grace_period)
                self._kill_all()
            elif self._give_up_at is not None and now >= self._give_up_at:
                left = [w.rank for w in self.workers if w.running]
                log.error("rank(s) %s did not exit within %.1fs of SIGKILL; giving up on them",
                          ", ".join(map(str, left)), _KILL_WAIT_S)
                self._finish(self.exit_code if self.exit_code is not None else 1)

    def _begin_stop(self, reason: str, code: int, sig: int) -> None:
        if self.phase not in ("running", "starting"):
            return
        self.phase, self.reason, self.exit_code = "stopping", reason, code
        for w in self.workers:
            w.signal_group(sig)  # finished workers too: their leftover descendants
        self._kill_at = time.monotonic() + self.cfg.grace_period

    def _kill_all(self) -> None:
        for w in self.workers:
            w.signal_group(signal.SIGKILL)
        self._kill_at = None
        self._give_up_at = time.monotonic() + _KILL_WAIT_S

    def _job_code(self) -> int:
        """Node 0, every node done: 0 if every worker of every node exited 0."""
        return 1 if self.exit_code or self._nodes_done else 0

    def _finish(self, code: int) -> None:
        if self._dyn is not None:
            self._dyn.finish(code)  # a joining launcher: the host stops waiting for it
        if self.cfg.multi_node and self._client is not None and self.phase != "waiting_nodes":
            publish_done(self._client, self.cfg.node_rank, code)
        self.phase, self.exit_code = "done", code

    def _publish_abort(self, info: dict[str, object]) -> None:
        if not self.cfg.multi_node or self._client is None:
            return
        info = {"node": self.cfg.node_rank, "host": self.host, **info}
        publish_abort(self._client, info)

    def _tail(self, w: Worker) -> list[str] | None:
        """The last --tail-lines lines of a worker's output; None when the flag is 0."""
        n = self.cfg.tail_lines
        if n == 0:
            return None
        if w.spec.log_path is not None:
            return tail_of_file(w.spec.log_path, n)
        return self._pump.tail(w.rank)[-n:] if self._pump is not None else []

    def _show_status(self) -> None:
        if not self.console.live:
            return
        running = sum(w.running for w in self.workers)
        failed = sum(1 for w in self.workers if w.status is not None and not w.status.ok)
        finished = len(self.workers) - running - failed
        what = f"{self.phase} ({self.reason})" if self.reason else self.phase
        self.console.status(f"rrefrt-run: {what}: {running} running, {finished} finished, "
                            f"{failed} failed [{time.monotonic() - self._started:.0f}s]")

    # ---- cleanup and the final report ---------------------------------------------------

    def _cleanup(self) -> None:
        self.console.clear_status()
        self._reap_everything()
        if self._pump is not None:
            deadline = time.monotonic() + 1.0
            for w in self.workers:
                self._pump.wait_drained(w.rank, max(0.0, deadline - time.monotonic()))
            self._pump.stop(timeout=1.0)
        for w in self.workers:
            for stream in (w.popen.stdout, w.popen.stderr):
                if stream is not None:
                    stream.close()
        self._print_report()
        for fd in (self._watch_r, self._watch_w):
            if fd >= 0:
                os.close(fd)
        self._watch_r = self._watch_w = -1
        self._close_store()
        if self._dump_thread is not None:
            self._dump_thread.join(1.0)
        remove_dump_dir(self._dump_dir)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _reap_everything(self) -> None:
        """Nothing this node started survives: running workers and leftover descendants."""
        for w in self.workers:
            if w.running and w.poll() is None:
                w.signal_group(signal.SIGKILL)
        leftovers = [w for w in self.workers if group_members(w.pid)]
        if leftovers and self.phase == "done" and self.exit_code == 0:
            for w in leftovers:  # a polite word first: they had none yet
                w.signal_group(signal.SIGTERM)
            _wait_until(lambda: not any(group_members(w.pid) for w in leftovers),
                        time.monotonic() + min(self.cfg.grace_period, 2.0))
        for w in leftovers:
            if group_members(w.pid):
                log.info("killing leftover processes of rank %d's process group", w.rank)
                w.signal_group(signal.SIGKILL)
        for w in self.workers:
            w.reap(timeout=_KILL_WAIT_S)

    def _print_report(self) -> None:
        code = self.exit_code
        for line in self.extra_report:
            self.console.message(line)
        if self.first_failure is not None:
            w = self.first_failure
            others = [o for o in self.workers if o is not w]
            self.console.message(report.failure_report(w, self._tail(w), self.host, others))
        elif self.remote_abort is not None:
            self.console.message(report.remote_failure_report(self.remote_abort, self.workers))
        elif code == 0 and self.workers and not self.cfg.quiet:
            self.console.message(report.summary_line(
                self.cfg.node_rank, self.workers, time.monotonic() - self._started))
        elif code is not None and code > 128 and self.workers:
            lines = [f"rrefrt-run: {self.reason}: stopped the workers of node "
                     f"{self.cfg.node_rank}", *report.outcome_lines(self.workers)]
            self.console.message("\n".join(lines))
        elif code not in (None, 0) and self.workers:
            self.console.message("\n".join([f"rrefrt-run: stopped: {self.reason}",
                                            *report.outcome_lines(self.workers)]))

    def _close_store(self) -> None:
        if self._monitor is not None:
            self._monitor.stop(timeout=2.0)
        if (self._store is not None and self.cfg.multi_node and self._client is not None
                and self.exit_code not in (None, 0) and self._world is not None):
            # NOTE [Who holds the store]: let the other nodes read the abort and stop first.
            others = [f"launcher/done/{r}" for r in range(1, self.cfg.nnodes)
                      if r not in self._lost_nodes]
            try:
                self._client.wait(others, timeout=self.cfg.grace_period + 3.0)
            except StoreError:
                pass
        if (self._store is not None and self._client is not None and self._world is None
                and self.cfg.multi_node):
            linger_after_failed_rendezvous(self._client, self.cfg.nnodes, timeout=2.0)
        if self._client is not None:
            self._client.close()
        if self._store is not None:
            self._store.close()


def _wait_until(predicate: Callable[[], bool], deadline: float, interval: float = 0.02) -> bool:
    """Bounded wait for a condition nothing signals (processes that are not our children)."""
    pause = threading.Event()
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pause.wait(min(interval, left))
    return True
