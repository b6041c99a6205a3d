#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lint-imports --config .importlinter >/dev/null || .venv/bin/lint-imports --config .importlinter
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
