"""Fault injection for tests and chaos campaigns: drop, delay, duplicate or reorder the
messages a worker sends, by label.

Owns: ``FaultPlan`` and its installation on the current runtime (the transport's
``fault_hook``, see NOTE [Fault injection] in transport/zmq/agent.py). A plan is picklable, so a test installs it on any worker with
``rpc_sync(worker, rrefrt.faults.install, args=(plan,))``.

Labels are message kinds (``PYTHON_CALL``, ``PYTHON_REMOTE``, ``REMOTE_RET``, ``RREF_FETCH``,
``RREF_FORK_REQUEST``, ``RREF_CHILD_ACCEPT``, ``RREF_USER_DELETE``) and responses to them
(``RESPONSE:PYTHON_CALL`` - e.g. "drop the response after the function ran"). ``*``
matches every label; a trailing ``*`` matches a prefix (``RREF_*``).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field

from rrefrt import state

__all__ = ["Rule", "FaultPlan", "install", "clear", "stats"]

ACTIONS = ("drop", "delay", "duplicate", "reorder")


@dataclass
class Rule:
    label: str  #: which messages (see the module docstring)
    action: str  #: drop | delay | duplicate | reorder
    first: int = 0  #: apply to the first ``first`` matching messages only (0: all of them)
    after: int = 0  #: let this many matching messages pass untouched first
    probability: float = 1.0  #: chance that a matching message is hit
    delay: float = 0.05  #: seconds, for delay and reorder (reorder: this one waits, later ones pass)
    dest: int | None = None  #: only messages to this worker id

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {ACTIONS}")
        if not 0.0 <= self.probability <= 1.0 or self.first < 0 or self.after < 0 or self.delay < 0:
            raise ValueError(f"bad fault rule {self!r}")

    def matches(self, dest: int, label: str) -> bool:
        if self.dest is not None and dest != self.dest:
            return False
        if self.label == "*" or self.label == label:
            return True
        return self.label.endswith("*") and label.startswith(self.label[:-1])


@dataclass
class FaultPlan:
    rules: list[Rule] = field(default_factory=list)
    seed: int = 0
    #: shorter retry interval for control messages while the plan is installed (None: keep)
    control_retry_interval: float | None = None


class _Installed:
    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.hits = [0] * len(plan.rules)  #: messages each rule was applied to
        self.seen = [0] * len(plan.rules)  #: messages each rule matched
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def __call__(self, dest: int, label: str) -> list[float]:
        with self.lock:
            for i, rule in enumerate(self.plan.rules):
                if not rule.matches(dest, label):
                    continue
                self.seen[i] += 1
                if self.seen[i] <= rule.after or (rule.first and self.hits[i] >= rule.first):
                    continue
                if rule.probability < 1.0 and self.rng.random() >= rule.probability:
                    continue
                self.hits[i] += 1
                self.counts[f"{rule.action}:{label}"] += 1
                if rule.action == "drop":
                    return []
                if rule.action == "duplicate":
                    return [0.0, 0.0]
                return [rule.delay * (self.rng.random() if rule.action == "delay" and rule.probability < 1 else 1.0)]
            return [0.0]


def install(plan: FaultPlan | None) -> bool:
    """Install ``plan`` on this worker's runtime (None removes it). Returns True."""
    rt = state.current()
    if plan is None:
        rt.transport.fault_hook = None
        rt.control_retry_interval = getattr(rt, "_default_retry_interval", rt.control_retry_interval)
        return True
    if not hasattr(rt, "_default_retry_interval"):
        rt._default_retry_interval = rt.control_retry_interval
    if plan.control_retry_interval is not None:
        rt.control_retry_interval = plan.control_retry_interval
    rt.transport.fault_hook = _Installed(plan)
    return True


def clear() -> bool:
    return install(None)


def stats() -> dict[str, int]:
    """How often each rule fired on this worker, as ``{"<action>:<label>": n}``."""
    hook = state.current().transport.fault_hook
    return dict(hook.counts) if isinstance(hook, _Installed) else {}
