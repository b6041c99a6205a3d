"""The job's environment contract (RANK, WORLD_SIZE, MASTER_ADDR, ... and the SLURM / MPI
equivalents). Standard library only; shared by the runtime and the launcher."""

from .run.env import EnvError, hosted_store, resolve_env  # noqa: F401  (moved here at integration)
