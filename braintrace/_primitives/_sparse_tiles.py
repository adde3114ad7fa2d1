"""The connections of one side of a sparse product in lane tiles, for the staged Pallas kernels.

The staged kernels (``_sparse_staged.py``) copy the rows ``v[source[k]]`` that a block of
targets reads into a staging buffer, one row per connection, and then sum them densely. The
connections are cut once, with NumPy, into **cells** ``(source chunk c, target block b)``
(``cell = c·blocks + b``) as in ``_sparse_cells.py``; within a cell, into **lane tiles**:

* ``'gather'`` (the gather-sum ``z[t] = Σ w[k]·v[source[k]]``): the targets a cell reaches,
  sorted by their number of connections there (largest first, then by row), 128 at a time
  (one per vector lane ``u``); tile ``i`` is ``W_i`` slots wide, its first target's count.
  Its staged row ``s = j·128 + u`` is the ``j``-th connection of its ``u``-th target, or
  padding (the zero row, weight 0) past that target's count. Its weights are ``W_i`` rows
  of 128 (row ``j``, lane ``u``), so that the dense sum is ``Σ_j stage_jᵀ · w_j``.
  ``perm`` takes each sorted position back to its target's row in the block; ``None`` when
  the connections are in target order with one fan-in ``F`` and one chunk
  (:attr:`Tiles.uniform`): every tile is ``F`` wide and its targets in order.
* ``'pair'`` (the pair-sum ``p[k] = Σ_r v[source[k], r]·d[target[k], r]``), for uniform
  connections only: tile ``i`` is targets ``128·i …`` in order, each ``Fp`` rows (``F``
  rounded up to a power of two from 8, or above 128 to a multiple of 128), staged row
  ``s = u·Fp + j``: the staged rows are the connections in order, so the sums come out in
  connection order. Over several source chunks, one index set per chunk ``c`` (cell
  ``c·blocks + b``, as above): a connection whose source lies in chunk ``c`` reads its row
  ``source - c·chunk`` of that chunk's table, every other one the chunk's zero row, so that
  chunk ``c``'s call gives chunk ``c``'s products in connection order and zeros elsewhere,
  and the calls add up. Every chunk's call stages every connection: ``chunks·nnz·Fp/F``
  staged rows and as many index entries (``int32``) in all. **Own** pair tiles
  (``pair_tiles(..., own=True)``) keep instead, per cell, only the connections of its chunk,
  each tile's in staged-row order and padded to groups of :data:`OWN_UNROLL`: two entries
  per connection (its table row, :attr:`Tiles.source`, and its staged row,
  :attr:`Tiles.positions`), ``nnz`` connections over all the chunks.

**Lane-packed** ``'gather'`` tiles (``pack = P`` of 2 or 4, for values of at most ``128 / P``
rows): each row of the staged table holds ``P`` sources, one per **quarter** of ``128 / P``
lanes: quarter ``q`` of table row ``s`` is source ``q·Q + s`` of the chunk (``Q`` rows per
quarter, ``Q ≥ chunk / P``), so that one table of ``Q + 8`` rows holds ``P``× the sources. A
connection from offset ``o`` in its chunk reads table row ``o mod Q`` (``o - q·Q``, quarter
``q = o // Q``; padding the zero row ``Q``), and its weight sits in row ``j·P + q`` of its
slot's ``P`` weight rows (lane ``u``; 0 in the other quarters' rows): the dense sum is
``Σ_j Σ_q stage_jᵀ[quarter q] · w_{j,q}``. :attr:`Tiles.quarters` keeps each slot's
quarter. **Lane-packed** ``'pair'`` tiles read the same tables (each chunk's connections
row ``o mod Q``, the others and the padding row ``Q``); :attr:`Tiles.quarters` keeps each
staged row's quarter (``P``: none, the sum zero) in the output's layout, row ``i·Fp + h``
lane ``l`` for staged row ``h·128 + l`` of tile ``i``.

The scalar unit reads one index per staged row: row ``s = 8·q + g`` of tile ``i`` reads
entry ``16·r_i + q`` of the cell's index row ``g`` (``r_i = Σ_{i' < i} W_i'``, the tile's
first weight row; eight rows, one base each: the kernel's loads are a base plus the loop's
counter). Every cell has the same number of index entries per row (``source.shape[2]``) and
of weight rows (``weight_rows``), padded.
Every index is computed in 64-bit integers and checked to fit ``int32``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from braintrace._primitives._sparse_cells import int32_indices

__all__ = ["LANES", "OWN_UNROLL", "REGIONS", "Tiles", "gather_tiles", "pair_tiles"]

LANES = 128
"""Targets per lane tile: the TPU's vector lanes."""

REGIONS = 8
"""Index regions per tile: staged row ``8·q + g`` reads entry ``q`` of region ``g``."""

MAX_FILL = 3.0
"""The most staged rows per connection (padding included) for which a side is tiled."""

OWN_UNROLL = 8
"""Entries per group of ``'pair'`` tiles that stage only their own chunk's connections: each
tile's padded to a multiple of this, the staging loop's unroll."""


class Tiles(NamedTuple):
    """One side of a connectivity in lane tiles (module docstring).

    Attributes:
        kind: ``'gather'`` or ``'pair'``.
        num_sources: ``S``, source rows (before padding).
        num_targets: ``T``, target rows (before padding).
        chunk: Source rows per chunk (the staged table holds ``chunk + 8`` rows, the last 8
            zero: padding reads row ``chunk``).
        block: Target rows per block (a multiple of 128).
        widths: ``(cells, tiles)`` each tile's width ``W_i`` (0 for a tile past the cell's
            targets); ``tiles`` at least 128 (an SMEM block).
        source: ``(cells, 8, entries)`` the index rows (module docstring); ``chunk`` for
            padding (``'pair'`` tiles: the chunk's own zero row, its number of sources).
        slot: ``(cells, weight_rows, 128)`` the connection ``k`` of each weight (``nnz`` for
            padding); ``None`` when :attr:`uniform`.
        perm: ``(cells, block)`` the target row in the block of each sorted position (``block``
            for padding: a spare row); ``None`` when :attr:`uniform`.
        uniform: The fan-in ``F`` when the connections are in target order with one count and
            one chunk, else 0 (``'pair'`` tiles: ``F``, whatever the chunks).
        width_cap: The widest tile (the staging buffer holds ``width_cap·128`` rows).
        pack: ``P``, sources per table row (module docstring); 1: one.
        quarter: ``Q``, table rows of one quarter when :attr:`pack` > 1 (else 0).
        quarters: ``(cells, slot_rows, 128)`` int8, the quarter of each slot's source
            (``P`` for padding) when :attr:`pack` > 1, else ``None``; ``'pair'`` tiles:
            ``(cells, block·Fp / 128, 128)``, each staged row's (``P`` for padding and the
            connections of other chunks).
        positions: ``(cells, entries)`` int32, for ``'pair'`` tiles that stage only their own
            chunk's connections (``pair_tiles(..., own=True)``): the staged row within its
            tile of each entry of :attr:`source` (then ``(cells, entries)`` too, the table
            rows), :data:`OWN_UNROLL` entries at a time per tile, padding the spare row
            ``width_cap·128`` reading the zero row; else ``None``.
        groups: ``(cells, tiles)`` int32, with :attr:`positions`: each tile's entries in
            groups of :data:`OWN_UNROLL` (a tile's first entry: the groups before it, times
            :data:`OWN_UNROLL`).
    """

    kind: str
    num_sources: int
    num_targets: int
    chunk: int
    block: int
    widths: np.ndarray
    source: np.ndarray
    slot: np.ndarray | None
    perm: np.ndarray | None
    uniform: int
    width_cap: int
    pack: int = 1
    quarter: int = 0
    quarters: np.ndarray | None = None
    positions: np.ndarray | None = None
    groups: np.ndarray | None = None

    @property
    def chunks(self) -> int:
        """Source chunks."""
        return -(-self.num_sources // self.chunk)

    @property
    def blocks(self) -> int:
        """Target blocks."""
        return -(-self.num_targets // self.block)

    @property
    def row_starts(self) -> np.ndarray:
        """``(cells, tiles)`` each tile's first weight row ``r_i = Σ_{i' < i} W_i'``."""
        return _row_starts(self.widths)

    @property
    def table_rows(self) -> int:
        """Rows of sources in a chunk's table (the zero rows from here): :attr:`chunk`, or
        :attr:`quarter` when packed."""
        return self.quarter if self.pack > 1 else self.chunk

    @property
    def slot_rows(self) -> int:
        """Slot rows (of 128) per cell, a multiple of 8: the tiles' widths summed."""
        if self.slot is not None:
            return int(self.slot.shape[1])
        return -(-int(self.widths.sum(axis=1).max(initial=0)) // 8) * 8

    @property
    def weight_rows(self) -> int:
        """Weight rows (of 128) per cell: :attr:`pack` per slot row."""
        return self.pack * self.slot_rows


def _row_starts(widths: np.ndarray) -> np.ndarray:
    """``(cells, tiles)`` each tile's first weight row ``r_i``."""
    return np.concatenate([np.zeros((len(widths), 1), np.int64),
                           np.cumsum(widths, axis=1)[:, :-1]], axis=1)


def _entry(rows: np.ndarray, row_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The index row and entry of staged row ``rows`` of a tile whose first weight row is
    ``row_start``: ``(g, 16·r + q)`` for ``rows = 8·q + g``."""
    q, g = np.divmod(rows, REGIONS)
    return g, row_start * (LANES // REGIONS) + q


def _entries(widths: np.ndarray) -> int:
    """Index entries per row: the largest cell's, rounded up to a multiple of 128."""
    used = int(widths.sum(axis=1).max(initial=0)) * (LANES // REGIONS)
    return max(-(-used // LANES) * LANES, LANES)


def _smem_entries(count: int) -> int:
    """``count`` rounded up to a length that Mosaic takes for a 1-D SMEM block: a power of two
    from 128 to 1,024, above that a multiple of 1,024."""
    return max(1 << (count - 1).bit_length(), LANES) if count <= 1024 else -(-count // 1024) * 1024


def _padded_tiles(count: int) -> int:
    """Tiles per cell in the SMEM table: at least 128 (Mosaic's smallest 1-D block)."""
    return max(LANES, count)


def _uniform_gather(sources: np.ndarray, num_sources: int, num_targets: int, fan_in: int,
                    block: int) -> Tiles:
    blocks = -(-num_targets // block)
    per_block = block // LANES
    widths = np.zeros((blocks, _padded_tiles(per_block)), np.int64)
    widths[:, :per_block] = fan_in
    padded = np.full(blocks * block * fan_in, num_sources, np.int64)
    padded[:sources.size] = sources
    by_slot = padded.reshape(blocks, per_block, LANES, fan_in)  # (b, tile, u, j)
    rows = np.arange(fan_in)[None, :] * LANES + np.arange(LANES)[:, None]  # (u, j) -> s
    g, entry = _entry(rows[None, None], _row_starts(widths)[:, :per_block, None, None])
    source = np.full((blocks, REGIONS, _entries(widths)), num_sources, np.int64)
    cell = np.broadcast_to(np.arange(blocks)[:, None, None, None], by_slot.shape)
    source[cell, np.broadcast_to(g, by_slot.shape), entry] = by_slot
    return Tiles("gather", num_sources, num_targets, num_sources, block, int32_indices(widths),
                 int32_indices(source), None, None, fan_in, fan_in)


def gather_tiles(sources: np.ndarray, targets: np.ndarray, num_sources: int, num_targets: int,
                 chunk: int, block: int, pack: int = 1) -> Tiles | None:
    """The connections ``sources[k] -> targets[k]`` in ``'gather'`` lane tiles (module
    docstring), or ``None`` when their padding would exceed ``MAX_FILL·nnz`` staged rows;
    ``pack`` (1, 2 or 4) sources per table row, ``Q = ⌈chunk / pack⌉`` rows per quarter.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_tiles import gather_tiles
        >>> t = gather_tiles(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=128)
        >>> t.widths[0, :2].tolist(), t.perm[0, :3].tolist()  # target 1 first, then 0, padding
        ([2, 0], [1, 0, 128])
        >>> # staged rows 0 (u 0, j 0), 1 (u 1, j 0), 128 (u 0, j 1) and 8 (padding)
        >>> t.source[0, [0, 1, 0, 0], [0, 0, 16, 1]].tolist()
        [0, 1, 2, 3]
        >>> p = gather_tiles(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, 4, 128, pack=2)
        >>> p.quarter, p.source[0, [0, 1, 0, 0], [0, 0, 16, 1]].tolist()  # padding: row Q
        (2, [0, 1, 0, 2])
        >>> p.quarters[0, :2, :3].tolist()  # sources 0, 1 in quarter 0, 2 in quarter 1
        [[0, 0, 2], [1, 2, 2]]
    """
    if block % LANES or block <= 0 or chunk <= 0 or pack not in (1, 2, 4):
        raise ValueError(f"block must be a positive multiple of {LANES}, chunk positive and "
                         f"pack 1, 2 or 4, got block={block}, chunk={chunk}, pack={pack}.")
    tiles = _gather_tiles(np.asarray(sources, np.int64), np.asarray(targets, np.int64),
                          num_sources, num_targets, chunk, block)
    return tiles if tiles is None or pack == 1 else _packed(tiles, pack, -(-chunk // pack))


def _packed(tiles: Tiles, pack: int, quarter: int) -> Tiles:
    """``tiles`` with ``pack`` sources per table row, ``quarter`` rows per quarter (module
    docstring): each index ``o`` (an offset in its chunk; the padding ``tiles.chunk``) becomes
    ``o mod Q`` (padding: ``Q``), and each slot keeps its quarter ``o // Q`` (padding: ``P``).
    Slot row ``r``, lane ``u`` is staged row ``128·j + u`` of its tile: index row ``u mod 8``,
    entry ``16·r + u // 8``."""
    source = tiles.source.astype(np.int64)
    padding = source >= tiles.chunk
    which = np.where(padding, pack, source // quarter)
    r, u = np.arange(tiles.slot_rows)[:, None], np.arange(LANES)[None, :]
    quarters = which[:, u % REGIONS, (LANES // REGIONS) * r + u // REGIONS]
    return tiles._replace(source=int32_indices(np.where(padding, quarter, source % quarter)),
                          pack=pack, quarter=quarter, quarters=quarters.astype(np.int8))


def _gather_tiles(sources: np.ndarray, targets: np.ndarray, num_sources: int,
                  num_targets: int, chunk: int, block: int) -> Tiles | None:
    """:func:`gather_tiles`, one source per table row."""
    nnz = int(sources.size)
    chunk = min(chunk, max(num_sources, 1))
    if chunk >= num_sources and nnz and nnz % max(num_targets, 1) == 0:
        fan_in = nnz // num_targets
        if np.array_equal(targets, np.repeat(np.arange(num_targets), fan_in)):
            return _uniform_gather(sources, num_sources, num_targets, fan_in, block)
    blocks = -(-num_targets // block)
    num_cells = -(-max(num_sources, 1) // chunk) * blocks
    cell = (sources // chunk) * blocks + targets // block
    pair_key = cell * num_targets + targets
    order = np.argsort(pair_key, kind="stable")
    pairs, first, counts = np.unique(pair_key[order], return_index=True, return_counts=True)
    rank = np.arange(nnz) - np.repeat(first, counts)  # the connection's slot j, in `order`
    pair_of = np.repeat(np.arange(pairs.size), counts)
    pair_cell, pair_target = pairs // num_targets, pairs % num_targets
    by_count = np.lexsort((pair_target, -counts, pair_cell))
    starts_of_cell = np.searchsorted(pair_cell[by_count], np.arange(num_cells))
    place = np.empty(pairs.size, np.int64)
    place[by_count] = np.arange(pairs.size) - starts_of_cell[pair_cell[by_count]]
    tile, lane = np.divmod(place, LANES)
    tiles = _padded_tiles(block // LANES)
    widths = np.zeros((num_cells, tiles), np.int64)
    leaders = lane == 0
    widths[pair_cell[leaders], tile[leaders]] = counts[leaders]
    weight_rows = -(-max(int(widths.sum(axis=1).max(initial=0)), 1) // 8) * 8
    if num_cells * weight_rows * LANES > MAX_FILL * nnz + 2**16:
        return None
    row_start = _row_starts(widths)
    cell_of, tile_of, lane_of = pair_cell[pair_of], tile[pair_of], lane[pair_of]
    g, entry = _entry(rank * LANES + lane_of, row_start[cell_of, tile_of])
    source = np.full((num_cells, REGIONS, _entries(widths)), chunk, np.int64)
    source[cell_of, g, entry] = sources[order] % chunk
    slot = np.full((num_cells, weight_rows, LANES), nnz, np.int64)
    slot[cell_of, row_start[cell_of, tile_of] + rank, lane_of] = order
    perm = np.full((num_cells, block), block, np.int64)
    perm[pair_cell, place] = pair_target % block
    return Tiles("gather", num_sources, num_targets, chunk, block, int32_indices(widths),
                 int32_indices(source), int32_indices(slot), int32_indices(perm), 0,
                 int(widths.max(initial=1)))


def pair_tiles(sources: np.ndarray, num_sources: int, num_targets: int, fan_in: int,
               block: int, chunk: int | None = None, pack: int = 1,
               own: bool = False) -> Tiles:
    """Uniform connections (``targets = repeat(arange(T), F)``, ``sources`` in that order) in
    ``'pair'`` lane tiles: each target ``Fp`` staged rows (module docstring), in order; with
    ``chunk`` below ``num_sources``, one index set per source chunk (``_chunk_rows``; with
    ``own``, of that chunk's connections alone and their staged rows, ``_own_rows``);
    ``pack`` (1, 2 or 4) sources per table row, ``Q = ⌈chunk / pack⌉`` rows per quarter.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_tiles import pair_tiles
        >>> t = pair_tiles(np.array([2, 0, 1, 1]), 3, 2, fan_in=2, block=128)
        >>> # staged rows 0, 1 (target 0), 8 (target 1), 16 (padding)
        >>> t.widths[0, :2].tolist(), t.source[0, [0, 1, 0, 0], [0, 0, 1, 2]].tolist()
        ([8, 0], [2, 0, 1, 3])
        >>> c = pair_tiles(np.array([2, 0, 1, 1]), 3, 2, fan_in=2, block=128, chunk=2)
        >>> c.chunks, c.source[[0, 1], 0, 0].tolist()  # chunk 0 reads its zero row 2
        (2, [2, 0])
        >>> p = pair_tiles(np.array([2, 0, 1, 1]), 3, 2, fan_in=2, block=128, pack=2)
        >>> p.quarter, p.source[0, [0, 1, 0, 0], [0, 0, 1, 2]].tolist()  # rows o mod Q
        (2, [0, 0, 1, 2])
        >>> p.quarters[0, 0, [0, 1, 8, 9, 2]].tolist()  # o // Q; padding P
        [1, 0, 0, 0, 2]
        >>> o = pair_tiles(np.array([2, 0, 1, 1]), 3, 2, fan_in=2, block=128, chunk=2, own=True)
        >>> # chunk 0: staged rows 1, 8, 9 read rows 0, 1, 1; chunk 1: row 0 reads its row 0
        >>> o.positions[[0, 1], :4].tolist(), o.source[[0, 1], :4].tolist()
        ([[1, 8, 9, 1024], [0, 1024, 1024, 1024]], [[0, 1, 1, 2], [0, 1, 1, 1]])
    """
    if block % LANES or block <= 0 or pack not in (1, 2, 4):
        raise ValueError(f"block must be a positive multiple of {LANES} and pack 1, 2 or 4, "
                         f"got block={block}, pack={pack}.")
    sources = np.asarray(sources, np.int64)
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}.")
    chunk = max(num_sources, 1) if chunk is None else min(chunk, max(num_sources, 1))
    width = max(REGIONS, 1 << (fan_in - 1).bit_length()) if fan_in <= LANES else \
        -(-fan_in // LANES) * LANES
    blocks = -(-num_targets // block)
    per_block = block // LANES
    widths = np.zeros((blocks, _padded_tiles(per_block)), np.int64)
    widths[:, :per_block] = width
    padded = np.full((blocks * block, width), -1, np.int64)  # -1: padding
    padded[:num_targets, :fan_in] = sources.reshape(num_targets, fan_in)
    by_row = padded.reshape(blocks, per_block, LANES * width)  # row s = u·Fp + j, in order
    g, entry = _entry(np.arange(LANES * width)[None, None],
                      _row_starts(widths)[:, :per_block, None])
    cell = np.broadcast_to(np.arange(blocks)[:, None, None], by_row.shape)
    g = np.broadcast_to(g, by_row.shape)
    chunks = -(-max(num_sources, 1) // chunk)
    quarter = -(-chunk // pack) if pack > 1 else 0
    rows = [_chunk_rows(by_row, cell, g, entry, c * chunk, min(chunk, num_sources - c * chunk),
                        _entries(widths), pack, quarter) for c in range(chunks)]
    source = np.concatenate([index for index, _ in rows])
    quarters = np.concatenate([q for _, q in rows]) if pack > 1 else None
    positions = groups = None
    if own and chunks > 1:
        source, positions, groups = _own_rows(by_row, chunk, num_sources, pack, quarter,
                                              LANES * width, widths.shape[1])
    return Tiles("pair", num_sources, num_targets, chunk, block,
                 int32_indices(np.tile(widths, (chunks, 1))), source, None, None, fan_in, width,
                 pack, quarter, quarters, positions, groups)


def _own_rows(by_row: np.ndarray, chunk: int, num_sources: int, pack: int, quarter: int,
              spare: int, tiles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk's own connections of the ``'pair'`` tiles' staged rows ``by_row (blocks,
    tiles, rows)`` (sources, ``-1`` padding): ``(table rows, staged rows, groups)``, the first
    two ``(chunks·blocks, entries)`` (cell ``c·blocks + b``; tile ``i``'s entries from
    :data:`OWN_UNROLL` times the groups of the tiles before it, in staged-row order, padded
    with the staged row ``spare`` reading the zero row), the groups ``(chunks·blocks,
    tiles)``. A connection from offset ``o`` of its chunk reads row ``o`` (packed: ``o mod
    Q``)."""
    zero = quarter if pack > 1 else None
    cells = []
    for c in range(-(-max(num_sources, 1) // chunk)):
        size = min(chunk, num_sources - c * chunk)
        local = by_row - c * chunk
        inside = (by_row >= 0) & (local >= 0) & (local < size)
        counts = inside.sum(axis=2)  # (blocks, tiles in a block)
        padded = -(-counts // OWN_UNROLL) * OWN_UNROLL
        first = np.cumsum(padded, axis=1) - padded  # each tile's first entry in its cell
        b, i, s = np.nonzero(inside)  # in order: block, tile, staged row
        flat = counts.reshape(-1)
        rank = np.arange(len(b)) - (np.cumsum(flat) - flat)[b * counts.shape[1] + i]
        entry = first[b, i] + rank
        entries = max(int(padded.sum(axis=1).max(initial=0)), 1)
        zero_row = size if zero is None else zero
        table = np.full((len(by_row), entries), zero_row, np.int64)
        table[b, entry] = local[b, i, s] % quarter if pack > 1 else local[b, i, s]
        staged = np.full((len(by_row), entries), spare, np.int64)
        staged[b, entry] = s
        groups = np.zeros((len(by_row), tiles), np.int64)
        groups[:, :counts.shape[1]] = padded // OWN_UNROLL
        cells.append((table, staged, groups, zero_row))
    entries = _smem_entries(max(cell[0].shape[1] for cell in cells))

    def stacked(part: int, fill) -> np.ndarray:
        return int32_indices(np.concatenate([
            np.pad(cell[part], ((0, 0), (0, entries - cell[part].shape[1])),
                   constant_values=fill(cell)) for cell in cells]))

    return (stacked(0, lambda cell: cell[3]), stacked(1, lambda _: spare),
            int32_indices(np.concatenate([cell[2] for cell in cells])))


def _chunk_rows(by_row: np.ndarray, cell: np.ndarray, g: np.ndarray, entry: np.ndarray,
                start: int, size: int, entries: int, pack: int = 1,
                quarter: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """One source chunk's index rows ``(blocks, 8, entries)`` of the ``'pair'`` tiles: a
    connection whose source lies in the chunk reads its row ``source - start``, every other
    connection and the padding (``-1``) read the chunk's first zero row ``size`` (the chunk's
    sources: the staged table zeroes rows ``size … size + 7``). Packed (``pack = P > 1``):
    offset ``o = source - start`` reads row ``o mod Q`` (``Q = quarter``), the others row
    ``Q``; and each staged row's quarter ``o // Q`` (the others ``P``), ``(blocks, block·Fp /
    128, 128)`` int8 in the output's layout (row ``h`` of tile ``i``: ``i·Fp + h``)."""
    local = by_row - start
    inside = (by_row >= 0) & (local >= 0) & (local < size)
    zero = quarter if pack > 1 else size
    rows = np.where(inside, local % quarter if pack > 1 else local, zero)
    source = np.full((by_row.shape[0], REGIONS, entries), zero, np.int64)
    source[cell, g, entry] = rows
    if pack == 1:
        return int32_indices(source), None
    which = np.where(inside, local // max(quarter, 1), pack).astype(np.int8)
    return int32_indices(source), which.reshape(by_row.shape[0], -1, LANES)
