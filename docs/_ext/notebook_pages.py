"""Copies the tutorial notebooks into the documentation source at build time.

Sphinx reads only files under its source folder; the notebooks live in ``notebooks/`` at the
top of the repository (where the test suite runs them). Before Sphinx lists its sources, this copies each
``notebooks/*.ipynb`` to ``docs/notebooks/`` (ignored by git) when its content changed, and
removes copies whose notebook is gone. The copies are rendered as they are, outputs included:
``conf.py`` sets ``nb_execution_mode = "off"``.
"""

from __future__ import annotations

import pathlib
import shutil

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
TARGET = "notebooks"


def copy_notebooks(source_dir: pathlib.Path) -> list[pathlib.Path]:
    """Mirrors ``notebooks/*.ipynb`` into ``<source_dir>/notebooks``; returns the copies."""
    target = source_dir / TARGET
    target.mkdir(exist_ok=True)
    originals = sorted(SOURCE.glob("*.ipynb"))
    if not originals:
        raise FileNotFoundError(f"no notebooks in {SOURCE}")
    copies = []
    for original in originals:
        copy = target / original.name
        if not copy.exists() or copy.read_bytes() != original.read_bytes():
            shutil.copyfile(original, copy)
        copies.append(copy)
    for stale in set(target.glob("*.ipynb")) - set(copies):
        stale.unlink()
    return copies


def _on_config_inited(app, config) -> None:
    copy_notebooks(pathlib.Path(app.srcdir))


def setup(app):
    app.connect("config-inited", _on_config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
