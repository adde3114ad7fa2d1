"""Sphinx configuration of the braintrace documentation.

Build (from the repository root, after ``pip install -e ".[docs]"``)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

Sphinx with MyST-NB, as Flax, optax and JAX do: pages in Markdown, notebooks rendered with
the outputs stored in them (never executed here: ``docs/execute_notebooks.py`` stores them),
the API reference generated from ``__all__`` by ``_ext/api_pages.py`` and autosummary (with
the private module's docstring on the page of an object that refers to it,
``_ext/module_docstrings.py``), and Google-style docstrings read by napoleon.
"""

import pathlib
import sys

import braintrace

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "braintrace"
author = "The braintrace authors"
copyright = "2025, The braintrace authors"
release = braintrace.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
    "api_pages",
    "class_signatures",
    "own_inherited_members",
    "module_docstrings",
    "notebook_pages",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
master_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "examples"]

# -- API reference -------------------------------------------------------------------------
autosummary_generate = True
autosummary_generate_overwrite = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # an nnx.Module's own methods, not Flax's docstrings
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: no duplicate entries beside autodoc's
napoleon_use_rtype = False

# -- Notebooks and Markdown (MyST-NB) ----------------------------------------------------------
nb_execution_mode = "off"  # outputs are stored in the notebooks by execute_notebooks.py
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# -- HTML ------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"braintrace {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
