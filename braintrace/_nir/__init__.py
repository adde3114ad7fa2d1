"""NIR interchange, the implementation behind :mod:`braintrace.nir`.

Imports go one way: ``_package`` (the optional ``nir`` module) and ``_units``
(time constants, gains, conv geometry; plain numpy) are used by ``_export``
(braintrace layers -> NIR nodes) and ``_import`` (NIR nodes -> layers).
"""

from braintrace._nir._export import to_nir as to_nir
from braintrace._nir._import import from_nir as from_nir

__all__ = ["from_nir", "to_nir"]
