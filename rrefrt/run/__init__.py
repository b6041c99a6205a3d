"""rrefrt-run: start, place and supervise the worker processes of a job (one per node).

Standard library only (plus ``rrefrt.group.store``): the launcher stands apart from the runtime,
which it never imports; the runtime reads what it needs from the environment contract
(docs/launcher.md) and from ``rrefrt.group.environment``. Importing this package is cheap: the
supervisor is loaded only when ``main()`` runs.

    rrefrt-run --nproc-per-node 4 train.py --epochs 3
    python -m rrefrt.run --nproc-per-node 4 train.py --epochs 3
"""

from __future__ import annotations

from rrefrt.run.cli import main

__all__ = ["main"]
