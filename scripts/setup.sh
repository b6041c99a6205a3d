#!/usr/bin/env bash
# Set up a virtual environment in .venv with rrefrt (editable) and its test extra.
# torch is pinned to 2.13.0 here (a CPU build that installs quickly on dev/CI machines);
# the package itself accepts any torch >= 2.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import rrefrt, torch, zmq, msgpack, pytest, pytest_timeout, pytest_asyncio, hypothesis, importlinter, pytest_rerunfailures" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.rrefrt-installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" numpy
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  touch .venv/.rrefrt-installed
fi
