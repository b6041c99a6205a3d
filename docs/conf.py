"""Sphinx configuration for rrefrt's documentation site.

Build: ``bash scripts/docs.sh`` (installs the pinned docs requirements into .venv and runs
``sphinx-build -W -b html docs docs/_build/html``). The pages are the Markdown files in
docs/ (read by myst-parser); the API reference comes from the docstrings (autodoc, see
api.md). The toctree in index.md ends with a glob, so a new docs/*.md page is picked up
without editing this file or the index.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # autodoc imports rrefrt from this checkout

project = "rrefrt"
author = "the rrefrt authors"
copyright = "the rrefrt authors"  # noqa: A001 (Sphinx's name)
try:
    from rrefrt import __version__ as release
except Exception:  # pragma: no cover - a broken import shows up in autodoc's warnings anyway
    release = "unknown"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: anchors for ## and ### headings so pages can link to sections (page.md#section).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# API reference: documented in source order, type hints in the description.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "alabaster"
html_title = f"rrefrt {release}"
html_static_path: list[str] = []
