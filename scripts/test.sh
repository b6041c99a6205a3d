#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# (the contracts are found in .importlinter; `--config` is deprecated)
.venv/bin/lint-imports >/dev/null || .venv/bin/lint-imports
# The documentation site builds with warnings as errors (about 10 s; skipped when pytest
# arguments select part of the suite, or with RREFRT_SKIP_DOCS=1).
if [ "$#" -eq 0 ] && [ "${RREFRT_SKIP_DOCS:-0}" != 1 ]; then
  bash scripts/docs.sh -q
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
