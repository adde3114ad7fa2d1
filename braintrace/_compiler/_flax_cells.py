"""Flax's own recurrent cells, and the drop-in of ``braintrace.layers`` that learns online.

``layers.Stateful(nnx.OptimizedLSTMCell(...))`` runs: the cell's weights go
through plain ``nnx.Linear`` operations, which no eligibility trace follows, so
they learn from their same-step gradient only (no credit over time). The
drop-ins of ``braintrace.layers`` take the same constructor arguments and have
the same Param tree, with their operations routed through ETP primitives.
Reports, ``strict=True``'s error and ``braintrace.compile``'s warning name the
drop-in for the cell that holds such Params.

Example:
    >>> from braintrace._compiler._flax_cells import flax_cell_of
    >>> from braintrace._compiler._modules import ModuleMap
    >>> modules = ModuleMap(classes={"": "Net", "rnn": "Stateful",
    ...                              "rnn.cell": "nnx.OptimizedLSTMCell",
    ...                              "rnn.cell.dense_h": "nnx.Linear"}, eqn_modules=())
    >>> flax_cell_of(modules, "rnn.cell.dense_h.kernel")
    'rnn.cell'
    >>> flax_cell_of(modules, "rnn.carry.0") is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable

from braintrace._compiler._modules import ModuleMap
from braintrace._compiler._phrases import params_phrase

__all__ = ["DROP_INS", "cell_sentence", "drop_in", "flax_cell_of", "flax_cells"]

DROP_INS = {
    "nnx.LSTMCell": "LSTMCell",
    "nnx.OptimizedLSTMCell": "OptimizedLSTMCell",
    "nnx.GRUCell": "GRUCell",
    "nnx.SimpleCell": "SimpleCell",
}
"""Flax's recurrent cells (by their report label) and their drop-ins in ``braintrace.layers``."""


def flax_cell_of(modules: ModuleMap, path: str) -> str | None:
    """The innermost module holding the Param ``path`` that is one of Flax's recurrent cells
    (:data:`DROP_INS`); ``None`` if there is none."""
    parts = path.split(".")
    for end in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:end])
        if modules.classes.get(prefix) in DROP_INS:
            return prefix
    return None


def drop_in(modules: ModuleMap, cell: str) -> str:
    """``'braintrace.layers.OptimizedLSTMCell'``: the drop-in for the Flax cell at ``cell``."""
    return f"braintrace.layers.{DROP_INS[modules.classes[cell]]}"


def flax_cells(modules: ModuleMap, paths: Iterable[str]) -> dict[str, list[str]]:
    """``{cell path: its Params among paths}`` for the Params held by a Flax recurrent cell."""
    cells: dict[str, list[str]] = {}
    for path in paths:
        cell = flax_cell_of(modules, path)
        if cell is not None:
            cells.setdefault(cell, []).append(path)
    return cells


def cell_sentence(modules: ModuleMap, cell: str, params: Iterable[str]) -> str:
    """What is wrong with a Flax cell's untraced ``params`` and what to use instead.

    Example:
        >>> from braintrace._compiler._modules import ModuleMap
        >>> modules = ModuleMap(classes={"": "Net", "rnn": "nnx.GRUCell"}, eqn_modules=())
        >>> print(cell_sentence(modules, "rnn", ["rnn.dense_h.kernel"]))
        `rnn` (nnx.GRUCell) is Flax's own cell: its Params `rnn.dense_h.kernel` reach hidden
        state through plain JAX operations that no eligibility trace follows, so they learn
        from their same-step gradient only (no credit over time); use
        braintrace.layers.GRUCell instead (a drop-in: the same arguments and Param tree, Flax
        weights load as they are, its operations ETP primitives).
    """
    return (f"{modules.label(cell)} is Flax's own cell: its Params {params_phrase(params)} reach "
            "hidden state through plain JAX operations that no eligibility trace follows, so "
            "they learn from their same-step gradient only (no credit over time); use "
            f"{drop_in(modules, cell)} instead (a drop-in: the same arguments and Param tree, "
            "Flax weights load as they are, its operations ETP primitives).")
