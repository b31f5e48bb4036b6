"""Sphinx configuration of drpo's documentation: `make docs` builds it into docs/_build/html,
warnings as errors (a broken cross-reference, a page missing from the navigation, a docstring that
does not parse). The reference pages are generated from the code (docs/_ext/drpo_reference.py)."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]

project = "drpo"
author = "the drpo authors"
copyright = "2026, the drpo authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "drpo_reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "results/*.jsonl"]
myst_enable_extensions = ["dollarmath", "deflist", "colon_fence"]
myst_heading_anchors = 4  # [text](page.md#a-heading) links are checked like page links
suppress_warnings = ["myst.header"]  # pages moved in from README start at level 2 under their own title
html_theme = "furo"
html_title = "drpo"
html_static_path: list[str] = []
autodoc_member_order = "bysource"
autodoc_typehints = "description"
nitpicky = False  # type names in signatures (torch.Tensor) have no target here; page and heading links are checked
