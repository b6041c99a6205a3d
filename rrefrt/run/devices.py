"""Which GPU (or the CPU) and how many CPU threads each worker of this node gets.

Owns: counting the GPUs the launcher can see without importing torch, and the per-worker
device plan. Pure functions over explicit inputs (the environment is passed in), so tests
simulate any GPU count; the only I/O is one bounded ``nvidia-smi -L``.

NOTE [Device assignment]
  Workers are dealt to the visible GPUs round robin, at most ``max_workers_per_gpu`` (K) per
  GPU: with G GPUs, worker i < G*K gets GPU i % G; the rest ("overflow") run on CPU with CUDA
  hidden (CUDA_VISIBLE_DEVICES=""). A GPU worker sees exactly one device: its
  CUDA_VISIBLE_DEVICES names the launcher-visible id (an index or a GPU-/MIG- UUID, as the
  launcher's own CUDA_VISIBLE_DEVICES spelled it), so inside the worker it is ``cuda:0``,
  which is what RREFRT_DEVICE says. ``--gpus G`` asks for the first G visible GPUs; asking
  for more than are visible is a warning and uses what there is. With no --gpus and no GPU
  visible every worker is "cpu" and CUDA_VISIBLE_DEVICES is left as it was.

GPU discovery, first match wins: CUDA_VISIBLE_DEVICES when set (CUDA's rules: entries up to
the first invalid one; "" or "-1" means none); RREFRT_FAKE_GPU_COUNT=N (a test hook that
stands in for N physical GPUs 0..N-1); ``nvidia-smi -L``; otherwise none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["WorkerDevice", "DevicePlan", "visible_gpus", "plan_devices", "usable_cores"]

log = logging.getLogger("rrefrt.run.devices")

FAKE_GPU_COUNT_ENV = "RREFRT_FAKE_GPU_COUNT"
_NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class WorkerDevice:
    """One worker's assignment; the environment it implies is ``environ()``."""

    local_rank: int
    device: str  #: "cuda:0" or "cpu": the device as the worker itself names it
    gpu: str | None  #: the launcher-visible GPU id ("3", "GPU-5f..."), None on CPU
    cuda_visible_devices: str | None  #: value to set; None leaves the inherited one
    cpu_threads: int
    set_thread_env: bool  #: also set OMP_NUM_THREADS / MKL_NUM_THREADS

    def environ(self) -> dict[str, str]:
        env = {"RREFRT_DEVICE": self.device, "RREFRT_CPU_THREADS": str(self.cpu_threads)}
        if self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        if self.set_thread_env:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.cpu_threads)
        return env

    def describe(self) -> str:
        if self.gpu is not None:
            where = f"cuda:0 (GPU {self.gpu}, CUDA_VISIBLE_DEVICES={self.cuda_visible_devices})"
        elif self.cuda_visible_devices == "":
            where = "cpu (CUDA hidden)"
        else:
            where = "cpu"
        return f"{where}, {self.cpu_threads} CPU thread{'s' if self.cpu_threads != 1 else ''}"


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    workers: tuple[WorkerDevice, ...]
    visible: tuple[str, ...]  #: GPUs the launcher can see, in order
    used: tuple[str, ...]  #: the GPUs workers were dealt to
    source: str  #: where ``visible`` came from
    warnings: tuple[str, ...]  #: things the user asked for and did not get
    notes: tuple[str, ...] = ()  #: informational lines printed with the assignment


def parse_cuda_visible_devices(value: str) -> tuple[str, ...]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: entries up to the first invalid one."""
    out: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if re.fullmatch(r"\d+", entry) or re.fullmatch(r"(GPU|MIG)-[\w/-]+", entry):
            if entry in out:
                break  # CUDA stops at a repeated device too
            out.append(entry)
        else:
            break
    return tuple(out)


def visible_gpus(environ: Mapping[str, str],
                 use_nvidia_smi: bool = True) -> tuple[tuple[str, ...], str]:
    """The GPUs this launcher can see and where that came from (see the module docstring)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_cuda_visible_devices(environ["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES"
    fake = environ.get(FAKE_GPU_COUNT_ENV)
    if fake is not None:
        if not fake.strip().isdigit():
            raise ValueError(f"{FAKE_GPU_COUNT_ENV}={fake!r} is not a non-negative integer")
        return tuple(str(i) for i in range(int(fake))), FAKE_GPU_COUNT_ENV
    smi = shutil.which("nvidia-smi") if use_nvidia_smi else None
    if smi is None:
        return (), "no CUDA_VISIBLE_DEVICES, no nvidia-smi"
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True,
                              timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi -L failed (%s); assuming no GPUs", e)
        return (), "nvidia-smi failed"
    if proc.returncode != 0:
        log.info("nvidia-smi -L exited %d: %s", proc.returncode, proc.stderr.strip()[:200])
        return (), "nvidia-smi found no GPU"
    count = sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))
    return tuple(str(i) for i in range(count)), "nvidia-smi -L"


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_devices(nproc: int, visible: tuple[str, ...], *, gpus: int | None,
                 max_workers_per_gpu: int, cpu_threads: int | None, cores: int,
                 environ: Mapping[str, str], source: str = "") -> DevicePlan:
    """Deal ``nproc`` workers to GPUs and CPU threads (see NOTE [Device assignment]).

    ``gpus`` None means every visible GPU; ``cpu_threads`` None means automatic:
    OMP_NUM_THREADS from ``environ`` when the user set it, else ``cores // nproc`` (>= 1).
    """
    warnings: list[str] = []
    if gpus is None:
        used = visible
    else:
        used = visible[:gpus]
        if gpus > len(visible):
            warnings.append(
                f"--gpus {gpus} asked for {gpus} GPU(s) but only {len(visible)} "
                f"{'is' if len(visible) == 1 else 'are'} visible to the launcher "
                f"({_describe_visible(visible, source)}); using {len(used)}")
    hide_cuda = gpus is not None or bool(used)
    slots = [g for _ in range(max_workers_per_gpu) for g in used]  # round robin, K deep
    overflow = max(0, nproc - len(slots))
    notes: list[str] = []
    if used and overflow:
        notes.append(f"{overflow} of {nproc} worker(s) overflow to CPU: {len(used)} GPU(s) x "
                     f"--max-workers-per-gpu {max_workers_per_gpu} = {len(slots)} GPU slot(s)")

    threads, thread_env = _threads(cpu_threads, cores, nproc, environ, warnings)
    workers = []
    for i in range(nproc):
        if i < len(slots):
            workers.append(WorkerDevice(i, "cuda:0", slots[i], slots[i], threads, thread_env))
        else:
            workers.append(WorkerDevice(i, "cpu", None, "" if hide_cuda else None, threads,
                                        thread_env))
    return DevicePlan(tuple(workers), visible, tuple(used), source, tuple(warnings), tuple(notes))


def _threads(cpu_threads: int | None, cores: int, nproc: int, environ: Mapping[str, str],
             warnings: list[str]) -> tuple[int, bool]:
    if cpu_threads is not None:
        if cpu_threads * nproc > cores:
            warnings.append(f"--cpu-threads-per-worker {cpu_threads} x {nproc} workers "
                            f"oversubscribes the {cores} usable core(s) of this node")
        return cpu_threads, True
    user = environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return int(user), False  # the user's own OMP/MKL settings stay as they are
    return max(1, cores // nproc), True


def _describe_visible(visible: tuple[str, ...], source: str) -> str:
    names = ", ".join(visible) if visible else "none"
    return f"{names}; from {source}" if source else names
