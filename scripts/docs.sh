#!/usr/bin/env bash
# Build the documentation site (docs/*.md + the API reference from the docstrings) into
# docs/_build/html with Sphinx, warnings as errors. Installs the pinned docs extra
# (sphinx, myst-parser; see pyproject.toml) into .venv on first use.
# Open it with: xdg-open docs/_build/html/index.html   (or python -m http.server -d docs/_build/html)
# Extra arguments go to sphinx-build (e.g. -q).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import sphinx, myst_parser" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.rrefrt-docs-installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[docs]"
  touch .venv/.rrefrt-docs-installed
fi
.venv/bin/python -m sphinx -W --keep-going -b html "$@" docs docs/_build/html
echo "docs: built docs/_build/html/index.html"
