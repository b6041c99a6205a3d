"""Globally unique ids for RRefs and their forks. Leaf module."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, order=True, slots=True)
class GloballyUniqueId:
    """``(creator worker id, local counter)``; printed as ``<worker id>:<n>``."""

    worker: int
    local: int

    def __str__(self) -> str:
        return f"{self.worker}:{self.local}"

    def to_wire(self) -> list[int]:
        return [self.worker, self.local]

    @classmethod
    def from_wire(cls, data: list[int]) -> "GloballyUniqueId":
        worker, local = data
        if type(worker) is not int or type(local) is not int:
            raise ValueError("bad id")
        return cls(worker, local)


RRefId = GloballyUniqueId
ForkId = GloballyUniqueId


class IdGenerator:
    """Per-runtime id source (``itertools.count`` is atomic under the GIL)."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self._next = itertools.count(1)

    def new(self) -> GloballyUniqueId:
        return GloballyUniqueId(self.worker_id, next(self._next))
