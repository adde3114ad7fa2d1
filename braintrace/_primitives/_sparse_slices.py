"""Connections grouped by the unit they reach, in slices of one width (sliced ELL).

The accelerator formulation of the sparse product (``_sparse_accelerator.py``) sums,
for every target unit ``t`` (an output for the product, an input for its transpose),
the values of the connections that reach it:

.. math::

    z[t] = \\sum_{k:\\, target[k] = t} w[k]\\, v[source[k]].

On a TPU a gather costs per index (~360 M rows per second on a v5e, nearly whatever
the row's length up to 128), so the layout keeps the number of indices close to
``nnz``: the targets are sorted by their number of connections (their *count*) and
grouped into slices whose rows all have one width. A slice is a gather of ``rows ×
width`` source rows and a sum over the width; the slices' results, stacked with one
zero row (for targets that no connection reaches), are put back in target order by
one gather of ``targets`` rows (left out where they are in order already). Padding
(a slot past a target's count) reads a zero source row and a zero weight.

With up to :data:`MAX_SLICES` different counts, each count is a slice of its own (one
fan-in for all: one slice, no padding, no reordering). With more, counts are rounded
up to the next of a ladder of four widths per octave (``1, 2, …, 7, 8, 10, 12, 14,
16, 20, 24, 28, 32, 40, …``), so that padding adds under a quarter and there are
about four slices per doubling of the largest count: a random fan-out of mean 8
(the transposed table of a network with 8 random synapses per neuron) takes about
15 slices and 1.1 ``nnz`` indices, where one table padded to the largest fan-out
takes about 3 ``nnz``.

Built with NumPy from the connection list once per :class:`Connectivity`; a list in
any order, with duplicates, and targets or sources no connection touches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["MAX_SLICES", "Slices", "ladder", "slices"]

MAX_SLICES = 8
"""The most different counts that each get a slice of their own width."""


class Slices(NamedTuple):
    """The connections grouped by target, in slices of one width each.

    Attributes:
        items: Per slice, ``(rows, width)`` connection indices ``k``; padding ``nnz``.
        first: Per slice, ``k`` of its first slot when its slots are the connections
            ``first, first + 1, …`` in order (its weights are then a slice of ``w``);
            else ``None``.
        order: ``(targets,)``: the row of each target among the slices' rows stacked,
            with one zero row after them (the row of targets that no connection
            reaches); ``None`` when that is ``arange(targets)``.
    """

    items: tuple[np.ndarray, ...]
    first: tuple[int | None, ...]
    order: np.ndarray | None

    @property
    def indices(self) -> int:
        """How many indices the gathers read: the slots, and the reordering's rows."""
        slots = sum(int(t.size) for t in self.items)
        return slots + (0 if self.order is None else int(self.order.size))


def ladder(counts: np.ndarray) -> np.ndarray:
    """Each count rounded up to a multiple of ``2^max(0, ⌊log2 c⌋ - 2)``: four widths per
    octave from 8 on, at most a quarter more.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_slices import ladder
        >>> ladder(np.array([0, 3, 7, 8, 9, 17, 33])).tolist()
        [0, 3, 7, 8, 10, 20, 40]
    """
    counts = np.asarray(counts, np.int64)
    octave = np.floor(np.log2(np.maximum(counts, 1))).astype(np.int64)
    step = 2 ** np.maximum(octave - 2, 0)
    return -(-counts // step) * step


def slices(targets: np.ndarray, num_targets: int) -> Slices:
    """The connections ``k`` (``target[k]`` the unit each reaches) grouped by target.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_slices import slices
        >>> s = slices(np.array([0, 0, 1, 0]), 3)  # target 2 reached by none
        >>> [t.tolist() for t in s.items], s.order.tolist()
        ([[[2]], [[0, 1, 3]]], [1, 0, 2])
        >>> uniform = slices(np.repeat(np.arange(3), 2), 3)
        >>> uniform.first, uniform.order is None
        ((0,), True)
    """
    targets = np.asarray(targets, np.int64)
    nnz = int(targets.size)
    counts = np.bincount(targets, minlength=num_targets)
    distinct = np.unique(counts[counts > 0])
    widths = counts if distinct.size <= MAX_SLICES else ladder(counts)
    by_target = np.argsort(targets, kind="stable")  # each target's connections, in list order
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    items, firsts = [], []
    order = np.full(num_targets, -1, np.int64)
    row = 0
    for width in np.unique(widths[widths > 0]):
        members = np.flatnonzero(widths == width)
        slot = np.arange(width)
        filled = slot[None, :] < counts[members][:, None]
        table = np.full((members.size, width), nnz, np.int32)
        table[filled] = by_target[(starts[members][:, None] + slot[None, :])[filled]]
        items.append(table)
        firsts.append(_first(table, nnz))
        order[members] = row + np.arange(members.size)
        row += members.size
    order[order < 0] = row  # the zero row
    in_order = np.array_equal(order, np.arange(num_targets))
    return Slices(tuple(items), tuple(firsts), None if in_order else order.astype(np.int32))


def _first(table: np.ndarray, nnz: int) -> int | None:
    """``table[0, 0]`` when the table is ``first, first + 1, …`` in row-major order."""
    if table.size == 0 or (table == nnz).any():
        return None
    first = int(table[0, 0])
    return first if np.array_equal(table.reshape(-1), np.arange(first, first + table.size)) \
        else None
