#!/usr/bin/env bash
# Set up (if needed) and run the demo: a 3-worker job through the rrefrt-run launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rrefrt-run --nproc-per-node 3 examples/demo.py
