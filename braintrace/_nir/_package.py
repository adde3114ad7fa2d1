"""The optional ``nir`` package, imported only when an export or import runs."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = 'pip install -e ".[nir]"  (or: pip install "braintrace-nnx[nir]")'


def nir_package(user: str) -> ModuleType:
    """The ``nir`` module, or an ImportError that says which extra installs it."""
    try:
        return importlib.import_module("nir")
    except ImportError as err:
        raise ImportError(
            f"braintrace.nir.{user} needs the optional package 'nir', which is not installed. "
            f"Install the nir extra: {INSTALL}") from err
