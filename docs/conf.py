"""Sphinx configuration for the optax_dist documentation (``make docs``)."""

import optax_dist

project = "optax_dist"
author = "optax_dist authors"
copyright = "optax_dist authors"
release = optax_dist.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.intersphinx",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings give types and units; signatures keep defaults
autodoc_default_options = {"members": False}

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The docstrings' own sections besides Args/Returns/Raises/Examples/References.
napoleon_custom_sections = [("Shapes", "notes_style"), ("Collectives", "notes_style")]
napoleon_use_rtype = False

intersphinx_mapping = {}

html_theme = "furo"
html_title = f"optax_dist {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
