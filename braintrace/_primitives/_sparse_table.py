"""The staged kernels' source table in VMEM (``_sparse_staged.py``): ``vᵀ``'s chunk copied from
HBM a block of columns at a time and transposed in the core, and what a call needs for it.

``v (R, S)`` stays in HBM in its own layout; a call's first grid step fills
``table (rows + 8, 128)``: row ``s`` holds source ``start + s``'s ``R`` values in its first
lanes (the other lanes zero), and the 8 rows below are zero (padding reads them). Packed
tables (``P`` of 2 or 4) hold source ``start + q·Q + s`` in lanes ``q·128/P …`` of row ``s``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from braintrace._primitives._sparse_tiles import LANES, Tiles

__all__ = ["COPY_COLUMNS", "ZERO_ROWS", "load_table", "padded_values", "table_columns",
           "table_scratch"]

ZERO_ROWS = 8
"""Zero rows below each chunk's table; padding reads the first."""

COPY_COLUMNS = 1024
"""Columns of ``v`` copied from HBM and transposed at a time."""


def load_table(v_hbm, table, buf, sem, *, first: int, rows: int, start: int, sources: int,
                pack: int = 1, quarter: int = 0, zero_row: int | None = None):
    """``table[s, :rows] = v[first:first + rows, start + s]`` for ``s < sources``; zero rows
    ``zero_row … zero_row + 7`` (default ``sources``; lanes past ``rows`` are zero: ``buf`` is
    zeroed first). ``v``'s columns are a multiple of 128, and so is ``start``: the last copy is
    widened to one. Its rows are copied as a multiple of 8 and the rest (Mosaic slices VMEM
    in whole tiles of 8 rows, or within one: 20 or 33 rows in one copy do not compile).
    With ``pack = P > 1``: quarter ``q`` (lanes ``q·128/P …``) of ``table[s]`` is
    ``v[first:first + rows, start + q·Q + s]`` for ``s < Q = quarter``, from ``P`` copies of
    each block of columns into rows ``q·128/P …`` of the copy buffer (quarters past
    ``sources`` none: their lanes stay zero), then the one transpose."""
    table_rows = quarter if pack > 1 else sources
    stride = LANES // pack
    used = [q for q in range(pack) if q * table_rows < sources]
    full, tail = divmod(table_rows, COPY_COLUMNS)
    buf[...] = jnp.zeros(buf.shape, buf.dtype)

    pieces = [(r0, n) for r0, n in ((0, rows // 8 * 8), (rows // 8 * 8, rows % 8)) if n]

    def copies(column: int, size: int, slot) -> list:  # rows in whole tiles of 8, then the rest
        return [pltpu.make_async_copy(
            v_hbm.at[pl.ds(first + r0, n), pl.ds(start + q * table_rows + column, size)],
            buf.at[slot, pl.ds(q * stride + r0, n), pl.ds(0, size)],
            sem.at[(slot * pack + q) * 2 + i]) for q in used for i, (r0, n) in enumerate(pieces)]

    if full:
        for c in copies(0, COPY_COLUMNS, 0):
            c.start()

        def block(b, carry):
            slot = b % 2

            @pl.when(b + 1 < full)
            def _():
                for c in copies((b + 1) * COPY_COLUMNS, COPY_COLUMNS, 1 - slot):
                    c.start()

            for c in copies(b * COPY_COLUMNS, COPY_COLUMNS, slot):
                c.wait()
            at = pl.multiple_of(b * COPY_COLUMNS, COPY_COLUMNS)
            table[pl.ds(at, COPY_COLUMNS), :] = buf[slot].T
            return carry

        jax.lax.fori_loop(0, full, block, 0)
    if tail:
        last = copies(full * COPY_COLUMNS, -(-tail // LANES) * LANES, 0)
        for c in last:
            c.start()
        for c in last:
            c.wait()
        table[pl.ds(full * COPY_COLUMNS, tail), :] = buf[0].T[:tail]
    zero_row = table_rows if zero_row is None else zero_row
    table[pl.ds(zero_row, ZERO_ROWS), :] = jnp.zeros((ZERO_ROWS, LANES), table.dtype)


def padded_values(v: jax.Array, columns: int) -> tuple[jax.Array, int]:
    """``v (R, S)`` as float32, its rows padded to a multiple of 128 when it needs several
    groups of 128 rows, its columns to ``columns``, and the number of groups."""
    rows, width = v.shape
    groups = -(-rows // LANES)
    pad = (groups * LANES - rows if groups > 1 else 0, columns - width)
    v = v.astype(jnp.float32)
    return (jnp.pad(v, ((0, pad[0]), (0, pad[1]))) if any(pad) else v), groups


def table_columns(tiles: Tiles) -> int:
    """The columns ``v`` is padded to: each chunk's copies (of each quarter holding sources,
    ``table_rows`` columns each when packed), the last widened to a multiple of 128 columns,
    stay inside it (none at sizes where chunks, quarters and ``S`` are multiples of 128)."""
    ends = []
    for c in range(tiles.chunks):
        sources = min(tiles.chunk, tiles.num_sources - c * tiles.chunk)
        per_quarter = tiles.table_rows if tiles.pack > 1 else sources
        last = (sources - 1) // per_quarter
        ends.append(c * tiles.chunk + last * per_quarter + -(-per_quarter // LANES) * LANES)
    return max(ends)


def table_scratch(tiles: Tiles, stage_rows: int) -> tuple[list, int]:
    """The scratch every call holds (table, copy buffers, semaphores, stage) and its bytes."""
    table_rows = -(-(tiles.table_rows + ZERO_ROWS) // 8) * 8
    scratch = [pltpu.VMEM((table_rows, LANES), jnp.float32),
               pltpu.VMEM((2, LANES, COPY_COLUMNS), jnp.float32),
               pltpu.SemaphoreType.DMA((4 * tiles.pack,)),
               pltpu.VMEM((stage_rows, LANES), jnp.float32)]
    return scratch, 4 * LANES * (table_rows + 2 * COPY_COLUMNS + stage_rows)
