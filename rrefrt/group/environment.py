"""Reading a worker's place in the job from the launch engine's environment.

Owns: the mapping from the variables that torchrun, ``rrefrt-run``, SLURM (``srun``), Open MPI
(``mpirun``) and other PMI-based MPI launchers set, to the torch names the runtime uses
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT), and
SLURM hostlist expansion. Standard library and the leaf ``rrefrt.errors`` only, no I/O, no globals: the runtime imports it
(``from rrefrt.group.environment import resolve_env``; the launcher re-exports it as ``rrefrt.run.env``) and must not pay for anything else.

Precedence, per variable: a torch variable that is present wins (``rrefrt-run`` and torchrun
set them all); a missing one is taken from the first engine found, in the order SLURM, Open
MPI, PMI (MPICH / Intel MPI). So ``torchrun`` inside an ``srun`` allocation keeps torchrun's
ranks, and a plain ``srun python train.py`` gets its ranks from SLURM.

Defaults where the engine is silent:

- MASTER_ADDR: SLURM - the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST /
  SLURM_NODELIST; MPI and PMI - 127.0.0.1 when every process is on one node, otherwise left
  unset (pass ``-x MASTER_ADDR=<host of rank 0>`` to mpirun).
- MASTER_PORT: SLURM - ``20000 + SLURM_JOB_ID % 10000`` so that every task of a job agrees
  and two jobs sharing a node rarely collide; otherwise 29500 when MASTER_ADDR is known.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from rrefrt.errors import RpcError

__all__ = ["EnvError", "resolve_env", "detect_engine", "hosted_store", "expand_hostlist"]

#: The names resolve_env may return, in the order the docs list them.
KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT")

_DEFAULT_PORT = 29500

# engine -> (torch name -> engine variable); read only when the torch name is absent.
_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID",
          "NODE_RANK": "SLURM_NODEID"}
_OMPI = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
         "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
         "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}
_PMI = {"RANK": "PMI_RANK", "WORLD_SIZE": "PMI_SIZE", "LOCAL_RANK": "MPI_LOCALRANKID",
        "LOCAL_WORLD_SIZE": "MPI_LOCALNRANKS"}


class EnvError(RpcError, ValueError):
    """An environment variable that names the job's layout is malformed or inconsistent, or
    ``init_method`` / the rank and world size given to init_rpc cannot describe a group.
    An ``RpcError`` like every error rrefrt raises, and a ``ValueError`` for older catchers."""


def detect_engine(environ: Mapping[str, str]) -> str:
    """Which launcher set this process up: "rrefrt-run", "torchrun", "slurm", "mpi", "pmi",
    "env" (torch variables set by hand) or "none"."""
    if environ.get("RREFRT_STORE_HOSTED") == "1" and "RANK" in environ:
        return "rrefrt-run"
    if "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ:
        return "torchrun"
    if "RANK" in environ:
        return "env"
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return "slurm"
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "mpi"
    if "PMI_RANK" in environ:
        return "pmi"
    return "none"


def hosted_store(environ: Mapping[str, str]) -> str | None:
    """Who already serves MASTER_ADDR:MASTER_PORT, so rank 0 must connect instead of bind:
    "rrefrt" (``rrefrt-run``'s StoreServer), "torch" (torchrun's agent TCPStore) or None."""
    if environ.get("RREFRT_STORE_HOSTED") == "1":
        return "rrefrt"
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        return "torch"
    return None


def resolve_env(environ: Mapping[str, str], check_rank: bool = True) -> dict[str, str]:
    """Return this process's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
    MASTER_ADDR and MASTER_PORT (as strings), each only when it can be known.

    Raises EnvError naming the variable when a value is not a non-negative integer, when
    RANK >= WORLD_SIZE (unless ``check_rank`` is false: the runtime's rendezvous reports
    that one to the whole group), or when a SLURM nodelist cannot be parsed.
    """
    out: dict[str, str] = {}
    for key in KEYS:
        if environ.get(key, "") != "":
            out[key] = environ[key]
    if "NODE_RANK" not in out and environ.get("GROUP_RANK", "") != "":
        out["NODE_RANK"] = environ["GROUP_RANK"]  # torchrun's name for the node's rank

    engine_vars: dict[str, str] = {}
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        engine_vars = _SLURM
    elif "OMPI_COMM_WORLD_RANK" in environ:
        engine_vars = _OMPI
    elif "PMI_RANK" in environ:
        engine_vars = _PMI
    for key, var in engine_vars.items():
        if key not in out and environ.get(var, "") != "":
            out[key] = environ[var]
    source = {key: (key if environ.get(key, "") != "" else engine_vars.get(key, key))
              for key in out}

    if engine_vars is _SLURM:
        _fill_slurm(environ, out)
    elif engine_vars:
        _fill_mpi(out)
    if "MASTER_ADDR" in out and "MASTER_PORT" not in out:
        out["MASTER_PORT"] = str(_DEFAULT_PORT)
    _validate(out, source, check_rank)
    return out


def _fill_slurm(environ: Mapping[str, str], out: dict[str, str]) -> None:
    if "LOCAL_WORLD_SIZE" not in out:
        per_node = _slurm_tasks_on_this_node(environ)
        if per_node is not None:
            out["LOCAL_WORLD_SIZE"] = str(per_node)
    if "MASTER_ADDR" not in out:
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if environ.get(var):
                try:
                    out["MASTER_ADDR"] = expand_hostlist(environ[var])[0]
                except ValueError as e:
                    raise EnvError(f"{var}={environ[var]!r} is not a SLURM hostlist: {e}") from None
                break
    if "MASTER_PORT" not in out and environ.get("SLURM_JOB_ID", "").isdigit():
        out["MASTER_PORT"] = str(20000 + int(environ["SLURM_JOB_ID"]) % 10000)


def _slurm_tasks_on_this_node(environ: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE look like "2(x3),1": one count per node.
    node = environ.get("SLURM_NODEID", "")
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = environ.get(var, "")
        if not spec or not node.isdigit():
            continue
        counts: list[int] = []
        for part in spec.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if not m:
                return None
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        return counts[int(node)] if int(node) < len(counts) else None
    return None


def _fill_mpi(out: dict[str, str]) -> None:
    single_node = ("WORLD_SIZE" in out and "LOCAL_WORLD_SIZE" in out
                   and out["WORLD_SIZE"] == out["LOCAL_WORLD_SIZE"])
    if single_node:
        out.setdefault("NODE_RANK", "0")
        out.setdefault("MASTER_ADDR", "127.0.0.1")


def _validate(out: dict[str, str], source: dict[str, str], check_rank: bool = True) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "MASTER_PORT"):
        if key in out and not out[key].strip().isdigit():
            raise EnvError(f"{source.get(key, key)}={out[key]!r} is not a non-negative integer")
        if key in out:
            out[key] = str(int(out[key]))
    if "WORLD_SIZE" in out and int(out["WORLD_SIZE"]) < 1:
        raise EnvError(f"{source['WORLD_SIZE']}=0: the world size must be at least 1")
    if check_rank and "RANK" in out and "WORLD_SIZE" in out and int(out["RANK"]) >= int(out["WORLD_SIZE"]):
        raise EnvError(f"{source['RANK']}={out['RANK']} is not below "
                       f"{source['WORLD_SIZE']}={out['WORLD_SIZE']}")
    if ("LOCAL_RANK" in out and "LOCAL_WORLD_SIZE" in out
            and int(out["LOCAL_RANK"]) >= int(out["LOCAL_WORLD_SIZE"])):
        raise EnvError(f"{source['LOCAL_RANK']}={out['LOCAL_RANK']} is not below "
                       f"LOCAL_WORLD_SIZE={out['LOCAL_WORLD_SIZE']}")
    if "MASTER_PORT" in out and not 0 < int(out["MASTER_PORT"]) < 65536:
        raise EnvError(f"MASTER_PORT={out['MASTER_PORT']} is not a TCP port (1-65535)")


# ---- SLURM hostlists -------------------------------------------------------------------

def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``"node[01-03,7],gpu-[1-2]-ib,login"`` to host names,
    in order: ``node01 node02 node03 node7 gpu-1-ib gpu-2-ib login``.

    Each bracket holds numbers and ranges ``a-b``; a range keeps the zero padding of its
    lower bound, and a bare number keeps its own width. Several brackets in one name expand
    to their product. Raises ValueError on unbalanced brackets or bad ranges.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        if item:
            hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError("the hostlist is empty")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unmatched '['")
    items.append(text[start:])
    return [s.strip() for s in items]


def _expand_item(item: str) -> list[str]:
    parts: list[list[str]] = []
    for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        if literal:
            parts.append([literal])
        if bracket:
            parts.append(_expand_ranges(bracket))
    return ["".join(p) for p in itertools.product(*parts)]


def _expand_ranges(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad range {part!r} in [{spec}]")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {part!r} in [{spec}] runs backwards")
        if int(hi) - int(lo) > 100_000:
            raise ValueError(f"range {part!r} in [{spec}] is implausibly large")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out
