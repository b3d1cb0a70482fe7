"""Sphinx configuration of gpumagic's docs (``docs/``).

Build: ``.venv/bin/sphinx-build -W --keep-going -n -b html docs build/docs`` (what
``tests/test_docs.py`` runs): every warning fails it, broken references and links included.
Nothing is fetched while building: no intersphinx, no remote images or fonts, and the
tutorials are rendered from the notebooks as saved, never executed.  Why Sphinx: see
``about-these-docs.md``.
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

project = "gpumagic"
author = "the gpumagic authors"
copyright = "the gpumagic authors"
language = "en"

extensions = [
    "myst_nb",                 # Markdown pages (MyST) and the tutorials (.ipynb, as saved)
    "sphinx.ext.autodoc",      # the Python API from its docstrings
    "sphinx.ext.napoleon",     # ... which are numpydoc
    "gpumagic_docs",           # the magic reference, generated from the parsers; module docstrings
]

# The tutorials are example-notebooks/ (docs/tutorials is a link to it), shown as saved.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings = []

exclude_patterns = ["_build", "**/.ipynb_checkpoints", "_ext"]
templates_path = []

html_theme = "furo"
html_title = "gpumagic"
html_static_path = []
html_permalinks_icon = "#"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"undoc-members": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True   # a dataclass's Attributes section beside its documented fields

# No intersphinx (the build is offline): a type from the standard library or a dependency
# cannot be linked, so references to classes outside gpumagic are left as text; one to a
# gpumagic object that the docs do not show still fails the build.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!gpumagic\b).*")]

os.environ.setdefault("COLUMNS", "80")  # argparse's help width: what a notebook kernel gets
