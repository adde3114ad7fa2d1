"""The connections of one side of a sparse product cut into cells, for the Pallas kernels.

A sum ``z[t] = Σ_{k: target[k]=t} w[k]·v[source[k]]`` (``_sparse_pallas.py``) keeps a
chunk of ``chunk`` source rows resident in the TPU core's memory and streams the targets
in blocks of ``block`` rows. The connections are cut once, with NumPy, into **cells**
``(source chunk c, target block b)``, in that order (``cell = c·blocks + b``); within a
cell the targets it reaches are sorted by their number of connections there (largest
first) and taken eight at a time (a **group**, summed in lockstep), each group as wide
as its first target's count ``W_g``. A cell's **slots** are its groups one after another,
each group target by target: slot ``offset_g + u·W_g + j`` is the ``j``-th connection of the
group's ``u``-th target, or padding (a zero source row, weight 0) past that target's count.
Every cell has the same number of slots, ``slots`` (a multiple of 128, padding at the
end), so that one grid step streams one cell's tables through the scalar memory.

When the connections are in target order with one count ``F`` for all and the sources
fit one chunk, every group is ``F`` wide and the slots of block ``b`` are its connections
in order, ``b·block·F`` on (targets past the last padded with zero weights): the weights
are the slots as they are, and so are the pullback's values (:attr:`Cells.uniform`).
Otherwise they go through a gather of ``slot`` and of ``position``.

Cut only while the padding stays small: ``cells · slots ≤ MAX_FILL · nnz + SLACK``
(:func:`cells` returns ``None`` otherwise, and the sums keep the XLA formulation).
Every index is computed in 64-bit integers and checked to fit ``int32`` before it is
stored.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["GROUP", "MAX_FILL", "SLACK", "SLOT_ALIGN", "Cells", "cells", "int32_indices"]

GROUP = 8
"""Targets summed in lockstep (a group): one per sublane of a TPU vector register."""

SLOT_ALIGN = 128
"""A cell's slots are padded to a multiple of this (the pullback reduces 128 at a time)."""

MAX_FILL = 3.0
"""The most slots per connection (padding included) for which the connections are cut."""

SLACK = 2**16
"""Slots of padding allowed whatever ``nnz`` (small connectivities pad relatively more)."""

_INT32_MAX = 2**31 - 1


class Cells(NamedTuple):
    """One side of a connectivity cut into ``(source chunk, target block)`` cells.

    Attributes:
        num_sources: ``S``, source rows (before padding).
        num_targets: ``T``, target rows (before padding).
        chunk: Source rows per chunk (the resident table holds ``chunk + 8`` rows, the
            last 8 zero: padding reads row ``chunk``).
        block: Target rows per block (a multiple of 8).
        groups: ``(cells,)`` the groups of each cell.
        widths: ``(cells, block // 8)`` each group's width (0 past ``groups``).
        rows: ``(cells, block)`` each group lane's target row within the block (0 for
            padding lanes, which add zeros).
        source: ``(cells, slots)`` each slot's source row within the chunk (``chunk`` for
            padding).
        slot: ``(cells, slots)`` each slot's connection ``k`` (``nnz`` for padding); ``None``
            when :attr:`uniform`.
        position: ``(nnz,)`` each connection's flat slot ``cell·slots + s``; ``None`` when
            :attr:`uniform`.
        uniform: The fan-in ``F`` when each block's slots are its connections in order
            (module docstring), else 0.
    """

    num_sources: int
    num_targets: int
    chunk: int
    block: int
    groups: np.ndarray
    widths: np.ndarray
    rows: np.ndarray
    source: np.ndarray
    slot: np.ndarray | None
    position: np.ndarray | None
    uniform: int

    @property
    def chunks(self) -> int:
        """Source chunks."""
        return -(-self.num_sources // self.chunk)

    @property
    def blocks(self) -> int:
        """Target blocks."""
        return -(-self.num_targets // self.block)

    @property
    def slots(self) -> int:
        """Slots per cell."""
        return int(self.source.shape[1])


def int32_indices(values: np.ndarray) -> np.ndarray:
    """``values`` as ``int32``, after checking that they fit.

    Example:
        >>> import numpy as np
        >>> int32_indices(np.array([0, 5], dtype=np.int64)).dtype
        dtype('int32')
    """
    if values.size and (values.min() < 0 or values.max() > _INT32_MAX):
        raise OverflowError("a sparse kernel index does not fit int32.")
    return values.astype(np.int32)


def _uniform(sources: np.ndarray, targets: np.ndarray, num_sources: int, num_targets: int,
             block: int) -> Cells | None:
    """The cells of connections in target order with one fan-in, one chunk (module docstring)."""
    nnz = int(targets.size)
    if nnz == 0 or nnz % num_targets:
        return None
    fan_in = nnz // num_targets
    if not np.array_equal(targets, np.repeat(np.arange(num_targets), fan_in)):
        return None
    blocks = -(-num_targets // block)
    used = block * fan_in
    slots = -(-used // SLOT_ALIGN) * SLOT_ALIGN
    padded = np.full(blocks * block * fan_in, num_sources, np.int64)
    padded[:nnz] = sources
    source = np.full((blocks, slots), num_sources, np.int64)
    source[:, :used] = padded.reshape(blocks, used)
    rows = np.broadcast_to(np.arange(block), (blocks, block))
    return Cells(num_sources, num_targets, num_sources, block,
                 groups=np.full(blocks, block // GROUP, np.int32),
                 widths=np.full((blocks, block // GROUP), fan_in, np.int32),
                 rows=int32_indices(rows), source=int32_indices(source), slot=None, position=None,
                 uniform=fan_in)


def cells(sources: np.ndarray, targets: np.ndarray, num_sources: int, num_targets: int,
          chunk: int, block: int) -> Cells | None:
    """The connections ``sources[k] -> targets[k]`` cut into cells (module docstring).

    Args:
        sources: ``(nnz,)`` source row of each connection.
        targets: ``(nnz,)`` target row of each connection.
        num_sources: ``S``.
        num_targets: ``T``.
        chunk: Source rows per chunk (``≥ S``: one chunk).
        block: Target rows per block, a multiple of 8.

    Returns:
        The :class:`Cells`, or ``None`` when their padding would exceed
        ``MAX_FILL · nnz + SLACK`` slots.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_cells import cells
        >>> c = cells(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=8)
        >>> c.groups.tolist(), c.widths[0, :1].tolist(), c.rows[0, :2].tolist()
        ([1], [2], [1, 0])
        >>> c.source[0, :6].tolist()  # target 1's sources, target 0's (one, padding), padding
        [0, 2, 1, 3, 3, 3]
    """
    if block % GROUP or block <= 0 or chunk <= 0:
        raise ValueError(f"block must be a positive multiple of {GROUP} and chunk positive, "
                         f"got block={block}, chunk={chunk}.")
    sources = np.asarray(sources, np.int64)
    targets = np.asarray(targets, np.int64)
    nnz = int(sources.size)
    chunk = min(chunk, max(num_sources, 1))
    if chunk >= num_sources:
        uniform = _uniform(sources, targets, num_sources, num_targets, block)
        if uniform is not None:
            return uniform
    blocks = -(-num_targets // block)
    num_cells = -(-max(num_sources, 1) // chunk) * blocks
    if num_cells * SLOT_ALIGN > MAX_FILL * nnz + SLACK:
        return None
    cell = (sources // chunk) * blocks + targets // block
    # each (cell, target) pair, its count, and each connection's rank within it
    pair_key = cell * num_targets + targets
    order = np.argsort(pair_key, kind="stable")
    pairs, first, counts = np.unique(pair_key[order], return_index=True, return_counts=True)
    rank = np.arange(nnz) - np.repeat(first, counts)  # in `order`
    pair_of = np.repeat(np.arange(pairs.size), counts)  # in `order`
    pair_cell, pair_target = pairs // num_targets, pairs % num_targets
    # within a cell: targets by count, largest first; groups of eight
    by_count = np.lexsort((pair_target, -counts, pair_cell))
    cell_sorted = pair_cell[by_count]
    starts = np.searchsorted(cell_sorted, np.arange(num_cells))
    place = np.empty(pairs.size, np.int64)
    place[by_count] = np.arange(pairs.size) - starts[cell_sorted]  # rank in its cell
    group, lane = place // GROUP, place % GROUP
    group_width = np.zeros((num_cells, block // GROUP), np.int64)
    leaders = lane == 0
    group_width[pair_cell[leaders], group[leaders]] = counts[leaders]
    offsets = np.concatenate([np.zeros((num_cells, 1), np.int64),
                              np.cumsum(GROUP * group_width, axis=1)[:, :-1]], axis=1)
    used = (GROUP * group_width).sum(axis=1)
    slots = max(int(-(-used.max(initial=0) // SLOT_ALIGN) * SLOT_ALIGN), SLOT_ALIGN)
    if num_cells * slots > MAX_FILL * nnz + SLACK:
        return None
    cell_of, group_of = pair_cell[pair_of], group[pair_of]
    flat = (cell_of * slots + offsets[cell_of, group_of]
            + lane[pair_of] * group_width[cell_of, group_of] + rank)  # in `order`
    position = np.empty(nnz, np.int64)
    position[order] = flat
    source = np.full(num_cells * slots, chunk, np.int64)
    source[position] = sources % chunk
    slot = np.full(num_cells * slots, nnz, np.int64)
    slot[position] = np.arange(nnz)
    rows = np.zeros((num_cells, block), np.int64)
    rows[pair_cell, place] = pair_target % block
    groups = (group_width > 0).sum(axis=1)
    return Cells(num_sources, num_targets, chunk, block, groups=int32_indices(groups),
                 widths=int32_indices(group_width), rows=int32_indices(rows),
                 source=int32_indices(source.reshape(num_cells, slots)),
                 slot=int32_indices(slot.reshape(num_cells, slots)),
                 position=int32_indices(position), uniform=0)
