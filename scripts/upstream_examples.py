"""Run pytorch/examples' distributed RPC programs on rrefrt, changing only their imports.

    python scripts/upstream_examples.py --examples /path/to/pytorch-examples [--only rnn,ddp_rpc] [--timeout 300]

For each example of ``distributed/rpc`` (rl, parameter_server, rnn, batch parameter server,
batch reinforce, pipeline, ddp_rpc) the script copies its folder to a temporary directory,
rewrites the import lines of ``torch.distributed.rpc``, ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and ``torch.distributed.nn.RemoteModule``
to rrefrt's (``IMPORTS``; nothing else is edited), runs the entry script with the given
timeout (its worker processes are killed with it) and prints one line per example:
``ok``, ``FAIL`` (exit status and the tail of the output) or ``skip`` (a module the example
needs is not installed - gymnasium, torchvision - or it wants GPUs this machine lacks).
Exits non-zero if any example failed. The examples pick MASTER_PORT 29500 themselves, so
they run one at a time. Not part of the pytest suite: it needs a checkout of
pytorch/examples (``git clone https://github.com/pytorch/examples``). The DDP + RPC usage
pattern also has a test of its own that needs nothing extra: tests/compat/test_ddp_rpc.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: example -> (folder under distributed/rpc, entry script)
EXAMPLES: dict[str, tuple[str, str]] = {
    "rl": ("rl", "main.py"),
    "parameter_server": ("parameter_server", "rpc_parameter_server.py"),
    "rnn": ("rnn", "main.py"),
    "batch_parameter_server": ("batch", "parameter_server.py"),
    "batch_reinforce": ("batch", "reinforce.py"),
    "pipeline": ("pipeline", "main.py"),
    "ddp_rpc": ("ddp_rpc", "main.py"),
}

#: examples whose README starts one process per rank: example -> the arguments of each
#: (parameter_server: rank 0 the parameter server, two trainers)
PER_RANK: dict[str, list[list[str]]] = {
    "parameter_server": [["--world_size=3", f"--rank={r}"] for r in range(3)],
}

#: examples that download MNIST into ``../data`` (no network here: a small synthetic
#: MNIST is written there first, in torchvision's raw format, so the download is skipped)
NEEDS_MNIST = {"parameter_server"}

#: (pattern, replacement) applied to every line of every .py file of the example
IMPORTS: list[tuple[str, str]] = [
    (r"^(\s*)import torch\.distributed\.rpc as (\w+)\s*$", r"\1import rrefrt as \2"),
    (r"^(\s*)from torch\.distributed\.rpc import (.+)$", r"\1from rrefrt import \2"),
    (r"^(\s*)import torch\.distributed\.autograd as (\w+)\s*$", r"\1import rrefrt.autograd as \2"),
    (r"^(\s*)from torch\.distributed\.optim import DistributedOptimizer\s*$", r"\1from rrefrt.optim import DistributedOptimizer"),
    (r"^(\s*)from torch\.distributed\.nn import RemoteModule\s*$", r"\1from rrefrt.nn import RemoteModule"),
]

#: output that means "this machine cannot run it", not a failure of rrefrt
_SKIP = re.compile(r"No module named '(gymnasium|gym|torchvision)'|Unable to locate sufficient \d+ gpus|"
                   r"Torch not compiled with CUDA enabled|Found no NVIDIA driver")


def swap_imports(text: str) -> tuple[str, int]:
    """The source with rrefrt's imports, and how many lines changed."""
    changed, out = 0, []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        new = body
        for pattern, repl in IMPORTS:
            new = re.sub(pattern, repl, new)
        changed += new != body
        out.append(new + line[len(body):])
    return "".join(out), changed


def fake_mnist(root: Path, train: int = 640, test: int = 320) -> None:
    """MNIST's four raw files (idx format, random pixels, labels 0-9) under
    ``root/MNIST/raw``, where torchvision looks before it downloads."""
    import random
    import struct

    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for prefix, n in (("train", train), ("t10k", test)):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x803, n, 28, 28) + bytes(rng.randrange(256) for _ in range(n * 28 * 28)))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, n) + bytes(rng.randrange(10) for _ in range(n)))


def run_one(name: str, src: Path, script: str, timeout: float) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="rrefrt-upstream-") as tmp:
        work = Path(tmp) / src.name
        shutil.copytree(src, work)
        swapped = 0
        for py in work.glob("*.py"):
            text, n = swap_imports(py.read_text())
            py.write_text(text)
            swapped += n
        note = ""
        if name in NEEDS_MNIST and importlib.util.find_spec("torchvision") is not None:
            fake_mnist(Path(tmp) / "data")
            note = "; a synthetic MNIST (no network)"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        logs = [Path(tmp) / f"process{i}.log" for i in range(len(PER_RANK.get(name, [[]])))]
        procs = []
        for argv, log in zip(PER_RANK.get(name, [[]]), logs):
            with open(log, "w") as f:  # a file, not a pipe: no process blocks on output nobody reads yet
                procs.append(subprocess.Popen([sys.executable, script, *argv], cwd=work, env=env, stdout=f,
                                              stderr=subprocess.STDOUT, text=True, start_new_session=True))
        codes, deadline = [], time.monotonic() + timeout
        try:
            for p in procs:
                try:
                    codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    out = "\n".join(log.read_text(errors="replace") for log in logs)
                    return "FAIL", f"did not finish in {timeout:.0f} s ({swapped} import lines swapped)\n{out[-3000:]}"
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the example's spawned workers share its session
                    p.wait(10)
        out = "\n".join(log.read_text(errors="replace") for log in logs)
        skip = _SKIP.search(out)
        if skip:
            return "skip", skip.group(0)
        if any(codes):
            return "FAIL", f"exit status {codes}\n{out[-3000:]}"
        ranks = f", {len(procs)} processes" if len(procs) > 1 else ""
        return "ok", f"{swapped} import lines swapped{ranks}{note}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", required=True, help="a checkout of pytorch/examples")
    ap.add_argument("--only", default="", help="comma-separated names of EXAMPLES")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    base = Path(args.examples) / "distributed" / "rpc"
    names = [n for n in args.only.split(",") if n] or list(EXAMPLES)
    failed = 0
    for name in names:
        folder, script = EXAMPLES[name]
        status, detail = run_one(name, base / folder, script, args.timeout)
        failed += status == "FAIL"
        print(f"{status:4s} {name}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
