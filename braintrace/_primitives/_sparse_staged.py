"""Staged Pallas TPU kernels for the sparse product's sums: one index load per connection.

For values ``v (R, S)`` (``x``, or the cotangent ``ȳ``; ``R`` rows of the batch, ``S``
sources) and the connections in lane tiles (``_sparse_tiles.py``), two kernels:

.. math::

    z[:, t] = \\sum_{k:\\, target[k] = t} w[k]\\, v[:, source[k]] \\quad\\text{(gather-sum)},
    \\qquad
    p[k] = \\sum_r v[r, source[k]]\\, d[r, target[k]] \\quad\\text{(pair-sum)}.

A call holds one chunk of ``vᵀ`` in VMEM, ``table (chunk + 8, 128)``: at its first grid step
it copies ``v``'s columns from HBM 1,024 at a time and transposes them there (rows past the
chunk and lanes past ``R`` zero), so that XLA neither transposes nor pads ``v``. Each grid
step is one cell: it **stages** the rows its connections read, one scalar load of an index
(SMEM) and one row copy ``stage[s] = table[source[s]]`` per connection, sixteen rows of
eight regions per loop iteration; then sums them densely:

* gather-sum: per lane tile of 128 targets, ``accᵀ = Σ_j stage_jᵀ · w_j`` (each ``stage_j``
  128 rows, one per target, transposed; ``w_j`` a row of 128 weights), written to the
  block's columns of ``z (R, T)``: through ``perm`` (each target's row in the block) when
  the tile's targets are sorted by their counts;
* pair-sum: each target's ``Fp`` staged rows times its row of ``dᵀ`` (the block of ``d``,
  transposed in VMEM), every 128 products transposed and summed over ``r``: one row of 128
  ``p`` in connection order.

**Packed** gather tiles (``Tiles.pack = P`` of 2 or 4, values of at most ``128 / P`` rows)
hold ``P`` sources per table row, source ``q·Q + s`` of the chunk in lanes ``q·128/P …`` of
row ``s`` (``Q = Tiles.quarter``; :func:`~braintrace._primitives._sparse_table.load_table` copies each block of columns ``P``
times, one per quarter, into the copy buffer's rows ``q·128/P …``, then transposes once), so
that a chunk holds ``P`` times the sources; the dense sum takes each quarter of each
transposed ``stage_j`` times its own weight row, ``accᵀ = Σ_j Σ_q stage_jᵀ[q] · w_{j,q}``
(``w_{j,q}`` zero but where slot ``j``'s source is in quarter ``q``). The other quarters of a
staged row are multiplied by zero: a value that is not finite (``inf``, ``NaN``) reaches, as
``NaN``, the sums of the sources that share its table row. **Packed** pair tiles hold the
same table; ``dᵀ``'s rows are copied into every quarter (``d_rows`` rows ``q·128/P …``), so
that one 128-lane product per staged row gives every quarter's, and each staged row's sum
is taken over its own quarter's lanes, ``p = Σ_q [quarter = q] Σ_{r} (stageᵀ · dᵀ)[q·128/P
+ r]`` (the quarters an int row per 128 staged rows, in the output's layout; the other
quarters selected away, not multiplied by zero).

Larger tables run as several calls, each adding into the last one's output (aliased): one
per source chunk, and one per group of 128 rows of ``v`` (their pair-sums add, their
gather-sums fill other rows). A gather-sum's chunk stages only its own connections; every
chunk of the pair-sum stages **every** connection, in connection order, those whose source
lies in another chunk reading the zero row: chunk ``c``'s call gives chunk ``c``'s products
and zeros elsewhere, and the output stays in connection order (no permutation), at
``chunks × nnz`` staged rows (and index entries) in all, where the gather-sum stages ``nnz``;
packed, ``P`` times fewer chunks. With **own** pair tiles (``Tiles.positions``;
``_sparse_tpu.OWN_CHUNK_PAIR``) each chunk's call stages its own connections alone, each into
its staged row (two scalar loads per connection, ``nnz`` staged rows in all), into a stage
zeroed first where it does not pack (packed, the other rows' quarter ``P`` selects them
away); the dense sums still run over every staged row, once per chunk.
No matrix unit: float32 stays float32.
"""

from __future__ import annotations

import functools
import itertools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from braintrace._primitives._sparse_table import (
    COPY_COLUMNS,
    load_table,
    padded_values,
    table_columns,
    table_scratch,
)
from braintrace._primitives._sparse_tiles import LANES, OWN_UNROLL, REGIONS, Tiles

__all__ = ["COPY_COLUMNS", "UNROLL", "gather_sum", "pair_sum"]

UNROLL = LANES // REGIONS
"""Index entries per region per iteration of the staging loop on a TPU and in Pallas' TPU
interpreter (16: one slot ``j`` of a gather tile, 128 rows); in JAX's generic interpreter
(``interpret=True``), 1."""

STEP = LANES // REGIONS
"""Entries per region per 128 staged rows."""


def _stage(source_ref, table, stage, *, first_row, width, unroll: int):
    """``stage[8·q + g] = table[source[g, 16·first_row + q]]`` for ``q < 16·width``; the
    cell's index rows flat in SMEM (``source_ref (8·entries,)``: row ``g`` from
    ``g·entries``)."""
    entries = source_ref.shape[0] // REGIONS
    base = first_row * STEP

    def rows(it, carry):
        q0 = base + it * unroll
        at = pl.multiple_of(it * (REGIONS * unroll), REGIONS * unroll)
        for t in range(unroll):
            for g in range(REGIONS):
                index = source_ref[g * entries + q0 + t]
                stage[pl.ds(at + t * REGIONS + g, 1), :] = table[pl.ds(index, 1), :]
        return carry

    jax.lax.fori_loop(0, width * (STEP // unroll), rows, 0)


def _stage_own(positions_ref, source_ref, table, stage, *, first_entry, groups):
    """``stage[positions[e]] = table[source[e]]`` for the ``OWN_UNROLL·groups`` entries from
    ``first_entry`` (a tile's own connections, padding the spare row)."""

    def rows(it, carry):
        e0 = first_entry + it * OWN_UNROLL
        for t in range(OWN_UNROLL):
            at, index = positions_ref[e0 + t], source_ref[e0 + t]
            stage[pl.ds(at, 1), :] = table[pl.ds(index, 1), :]
        return carry

    jax.lax.fori_loop(0, groups, rows, 0)


def _zero_stage(stage, width: int):
    """``stage[:width·128] = 0``, 128 rows at a time."""

    def rows(h, carry):
        stage[pl.ds(pl.multiple_of(h * LANES, LANES), LANES), :] = jnp.zeros(
            (LANES, LANES), jnp.float32)
        return carry

    jax.lax.fori_loop(0, width, rows, 0)


def _weighted_sum(stage, weight_ref, row0, width, rows: int, pack: int):
    """``Σ_{j < width} stage[128·j …]ᵀ · w[row0 + j]``, its first ``rows`` rows (rounded up to
    8) of 128; packed (``pack = P > 1``): ``Σ_j Σ_q stage[128·j …]ᵀ[q·128/P …] · w[(row0 +
    j)·P + q]``, each quarter's first ``rows``."""
    kept = -(-rows // 8) * 8
    stride = LANES // pack

    def term(j):
        at = pl.multiple_of(j * LANES, LANES)
        t = stage[pl.ds(at, LANES), :].T
        if pack == 1:
            return t[:kept] * weight_ref[pl.ds(row0 + j, 1), :]
        w0 = (row0 + j) * pack
        return functools.reduce(operator.add, (
            t[q * stride:q * stride + kept] * weight_ref[pl.ds(w0 + q, 1), :]
            for q in range(pack)))

    def pair(h, sums):  # two transposes in flight
        return sums[0] + term(2 * h), sums[1] + term(2 * h + 1)

    zero = jnp.zeros((kept, LANES), jnp.float32)
    even, odd = jax.lax.fori_loop(0, width // 2, pair, (zero, zero))
    return jax.lax.cond(width % 2 == 1, lambda: even + odd + term(width - 1),
                        lambda: even + odd)


def _gather_kernel(widths_ref, wrows_ref, source_ref, *refs, rows: int, chain: str,
                   permuted: bool, unroll: int, first: int, start: int, sources: int,
                   pack: int, quarter: int, zero_row: int):
    """One cell of the gather-sum (module docstring); ``refs``: ``perm`` (if ``permuted``),
    the weights, ``v`` (HBM), the last call's output (``chain`` not ``'new'``), the output, then
    the scratch: table, copy buffer, semaphores, stage, and the block's rows (``permuted``)."""
    refs = list(refs)
    perm_ref = refs.pop(0) if permuted else None
    weight_ref, v_hbm = refs.pop(0), refs.pop(0)
    prev_ref = refs.pop(0) if chain != "new" else None  # 'write': in HBM, not read
    prev_ref = prev_ref if chain == "add" else None
    out_ref, table, buf, sem, stage = refs[:5]
    block_rows = refs[5] if permuted else None
    block = out_ref.shape[1]

    @pl.when(pl.program_id(0) == 0)
    def _():
        load_table(v_hbm, table, buf, sem, first=first, rows=rows, start=start,
                    sources=sources, pack=pack, quarter=quarter, zero_row=zero_row)

    if permuted:
        block_rows[...] = jnp.zeros(block_rows.shape, block_rows.dtype)

    def tile(i, carry):
        width = widths_ref[i]

        @pl.when(width > 0)
        def _():
            row0 = wrows_ref[i]
            _stage(source_ref, table, stage, first_row=row0, width=width, unroll=unroll)

            acc = _weighted_sum(stage, weight_ref, row0, width, rows, pack)
            if permuted:  # each target's row to its place, through the free stage
                sums = jnp.pad(acc, ((0, LANES - acc.shape[0]), (0, 0))) if \
                    acc.shape[0] < LANES else acc
                stage[pl.ds(0, LANES), :] = sums.T

                def place(u, carry):
                    block_rows[pl.ds(perm_ref[i * LANES + u], 1), :] = stage[pl.ds(u, 1), :]
                    return carry

                jax.lax.fori_loop(0, LANES, place, 0, unroll=unroll > 1)
            else:
                at = pl.multiple_of(i * LANES, LANES)
                total = acc[:rows]
                if prev_ref is not None:
                    total = total + prev_ref[:, pl.ds(at, LANES)]
                out_ref[:, pl.ds(at, LANES)] = total

        return carry

    jax.lax.fori_loop(0, block // LANES, tile, 0)
    if permuted:
        total = block_rows[pl.ds(0, block), :].T[:rows]
        out_ref[...] = total if prev_ref is None else total + prev_ref[...]


def _pair_kernel(*refs, rows: int, chain: str, width: int, unroll: int, first: int,
                 start: int, sources: int, pack: int, quarter: int, own: bool):
    """One block of the uniform pair-sum over the chunk of ``v``'s columns ``start …
    start + sources`` (module docstring); ``refs``: each tile's groups and the entries' staged
    rows (``own``), the index entries, ``v`` (HBM), ``d``'s block, the staged rows' quarters
    (``pack > 1``), the last call's output (``chain == 'add'``), the output, then the scratch:
    table, copy buffer, semaphores, stage, ``d``'s block padded to 128 rows (``P`` copies,
    one per quarter, when packed) and its transpose. ``own``: each tile stages its own
    chunk's connections alone, into a stage zeroed first unless packed (where the other
    rows' quarter, ``P``, selects them away)."""
    refs = list(refs)
    groups_ref, positions_ref = (refs.pop(0), refs.pop(0)) if own else (None, None)
    source_ref, v_hbm, d_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    quarters_ref = refs.pop(0) if pack > 1 else None
    prev_ref = refs.pop(0) if chain == "add" else None
    out_ref, table, buf, sem, stage, d_rows, d_t = refs
    block = d_ref.shape[1]
    per_row = min(width, LANES)  # staged rows of one target within 128
    stride, kept = LANES // pack, -(-rows // 8) * 8

    @pl.when(pl.program_id(0) == 0)
    def _():
        load_table(v_hbm, table, buf, sem, first=first, rows=rows, start=start,
                    sources=sources, pack=pack, quarter=quarter)
        d_rows[...] = jnp.zeros(d_rows.shape, d_rows.dtype)

    for q in range(pack):  # quarter q of row t of dᵀ: d[:, t]
        d_rows[pl.ds(q * stride, rows), :] = d_ref[...]
    d_t[...] = d_rows[...].T

    def row_sums(products_t, at):
        """``Σ_r`` over each staged row's own quarter of lanes (all 128 when not packed)."""
        if pack == 1:
            return jnp.sum(products_t, axis=0, keepdims=True)
        own = quarters_ref[pl.ds(at, 1), :]  # each staged row's quarter; P: none
        return functools.reduce(operator.add, (
            jnp.where(own == q, jnp.sum(products_t[q * stride:q * stride + kept], axis=0,
                                        keepdims=True), 0.0) for q in range(pack)))

    def tile(i, first_entry):
        if own:
            if pack == 1:
                _zero_stage(stage, width)
            _stage_own(positions_ref, source_ref, table, stage, first_entry=first_entry,
                       groups=groups_ref[i])
            first_entry = first_entry + groups_ref[i] * OWN_UNROLL
        else:
            _stage(source_ref, table, stage, first_row=i * width, width=width, unroll=unroll)
        for h in range(width):  # staged rows h·128 …: 128 / Fp targets, or a part of one
            first_target = i * LANES + h * LANES // width
            rep = jnp.concatenate([
                jnp.broadcast_to(d_t[pl.ds(first_target + n, 1), :], (per_row, LANES))
                for n in range(LANES // per_row)])
            products = stage[pl.ds(h * LANES, LANES), :] * rep
            at = i * width + h
            sums = row_sums(products.T, at)
            if prev_ref is not None:
                sums = sums + prev_ref[pl.ds(at, 1), :]
            out_ref[pl.ds(at, 1), :] = sums
        return first_entry

    jax.lax.fori_loop(0, block // LANES, tile, 0)


def _call(kernel, grid: int, in_specs: list, operands: list, out_block: tuple,
          out_index, out_shape: tuple, scratch: list, vmem: int, chain: str, prev,
          interpret):
    """The ``pallas_call`` of one chunk and group of rows; ``chain``: ``'new'`` (a fresh
    output), ``'write'`` (the last call's output, aliased and left in HBM, this call's blocks
    written into it) or ``'add'`` (the same, this call's blocks added to its)."""
    chained = {"new": [], "write": [pl.BlockSpec(memory_space=pl.ANY)],
               "add": [pl.BlockSpec(out_block, out_index)]}[chain]
    aliases = {len(in_specs): 0} if chained else {}
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=(grid,), in_specs=in_specs + chained,
        out_specs=pl.BlockSpec(out_block, out_index), scratch_shapes=scratch)
    call = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=int(vmem)))
    return call(*operands, *([] if prev is None else [prev]))


def _smem(width: int, index) -> pl.BlockSpec:
    return pl.BlockSpec((width,), index, memory_space=pltpu.SMEM)


def _index_block(tiles: Tiles, cell0: int) -> pl.BlockSpec:
    """A cell's index rows flat, ``(8·entries,)`` in SMEM, for grid step ``b`` of a call whose
    first cell is ``cell0`` (one dimension, as every SMEM block that a v5e ran right)."""
    return _smem(REGIONS * tiles.source.shape[2], lambda b: (cell0 + b,))


def _indices(tiles: Tiles) -> jax.Array:
    """The tiles' index rows, flat: cell ``c``'s row ``g`` from ``(8·c + g)·entries``."""
    return jnp.asarray(tiles.source.reshape(-1))


def _unroll(interpret) -> int:
    """The staging loop's unroll: :data:`UNROLL` on a TPU and in Pallas' TPU interpreter (the
    chip's program), 1 in JAX's generic interpreter (``interpret=True``: faster)."""
    return 1 if interpret is True else UNROLL


def gather_weights(weight: jax.Array, tiles: Tiles) -> jax.Array:
    """The weights in the tiles' rows, ``(cells·weight_rows, 128)``, padding 0: for uniform
    tiles a transpose of ``w``'s rows (``(targets, F)`` to ``(F, 128)`` per tile), else a
    gather (a value that a time loop computes once, before the loop); packed tiles, each slot
    row as ``P`` rows, row ``q`` the weights of the slots whose source is in quarter ``q``.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_tiles import gather_tiles
        >>> from braintrace._primitives._sparse_staged import gather_weights
        >>> t = gather_tiles(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=128)
        >>> gather_weights(jnp.array([1.0, 2.0, 3.0]), t)[:2, :3].tolist()
        [[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]
        >>> p = gather_tiles(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, 4, 128, pack=2)
        >>> gather_weights(jnp.array([1.0, 2.0, 3.0]), p)[:4, :3].tolist()  # slot rows 0, 1
        [[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]
    """
    weight = weight.astype(jnp.float32)
    if tiles.slot is None:
        fan_in, blocks = tiles.uniform, tiles.blocks
        padded = jnp.pad(weight, (0, blocks * tiles.block * fan_in - weight.size))
        by_tile = padded.reshape(blocks, tiles.block // LANES, LANES, fan_in)
        rows = jnp.swapaxes(by_tile, 2, 3).reshape(blocks, -1, LANES)
        rows = jnp.pad(rows, ((0, 0), (0, tiles.slot_rows - rows.shape[1]), (0, 0)))
    else:
        padded = jnp.concatenate([weight, jnp.zeros((1,), weight.dtype)])
        rows = jnp.take(padded, jnp.asarray(tiles.slot), axis=0, mode="clip")
    if tiles.pack == 1:
        return rows.reshape(-1, LANES)
    quarters = jnp.asarray(tiles.quarters)[:, :, None, :]  # row j·P + q: quarter q's weights
    packed = jnp.where(quarters == jnp.arange(tiles.pack)[:, None], rows[:, :, None, :], 0.0)
    return packed.reshape(-1, LANES)


def gather_sum(values: jax.Array, weight: jax.Array, tiles: Tiles, *,
               interpret=False) -> jax.Array:
    """``z[:, t] = Σ_{k: target[k]=t} w[k]·values[:, source[k]]`` for ``values (R, S)``:
    ``(R, T)``.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_tiles import gather_tiles
        >>> from braintrace._primitives._sparse_staged import gather_sum
        >>> t = gather_tiles(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=128)
        >>> values = jnp.array([[1.0, 10.0, 100.0]])
        >>> gather_sum(values, jnp.array([1.0, 2.0, 3.0]), t, interpret=True).tolist()
        [[30.0, 201.0]]
    """
    rows, _ = values.shape
    if tiles.pack > 1 and rows > LANES // tiles.pack:
        raise ValueError(f"tiles packing {tiles.pack} sources per table row take values of at "
                         f"most {LANES // tiles.pack} rows, got {rows}.")
    v, groups = padded_values(values, table_columns(tiles))
    weights = gather_weights(weight, tiles)
    per_cell = tiles.weight_rows
    permuted = tiles.perm is not None
    block, blocks, ntiles = tiles.block, tiles.blocks, tiles.widths.shape[1]
    wrows = jnp.asarray(tiles.row_starts.reshape(-1), jnp.int32)
    widths = jnp.asarray(tiles.widths.reshape(-1))
    source = _indices(tiles)
    scratch, vmem = table_scratch(tiles, tiles.width_cap * LANES)
    if permuted:
        scratch.append(pltpu.VMEM((block + 8, LANES), jnp.float32))
        perm = jnp.asarray(tiles.perm.reshape(-1))
    group_rows = min(rows, LANES)
    vmem += 4 * LANES * (block + 8) + 4 * 4 * group_rows * block + 2 * 4 * per_cell * LANES
    out, unroll = None, _unroll(interpret)
    for lane in range(groups):
        for c in range(tiles.chunks):
            chain = "new" if out is None else "add" if c else "write"
            cell0 = c * blocks
            specs = [_smem(ntiles, lambda b, cell0=cell0: (cell0 + b,))] * 2 + [
                _index_block(tiles, cell0)]
            operands = [widths, wrows, source]
            if permuted:
                specs.append(_smem(block, lambda b, cell0=cell0: (cell0 + b,)))
                operands.append(perm)
            specs += [pl.BlockSpec((per_cell, LANES), lambda b, cell0=cell0: (cell0 + b, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)]
            operands += [weights, v]
            sources = min(tiles.chunk, tiles.num_sources - c * tiles.chunk)
            kernel = functools.partial(
                _gather_kernel, rows=group_rows if groups == 1 else LANES, chain=chain,
                permuted=permuted, unroll=unroll, first=lane * LANES,
                start=c * tiles.chunk, sources=sources, pack=tiles.pack,
                quarter=tiles.quarter, zero_row=tiles.table_rows)
            out = _call(kernel, blocks, specs, operands, (group_rows, block),
                        lambda b, lane=lane: (lane, b), (v.shape[0], blocks * block), scratch,
                        vmem + 8 * 2**20, chain, out, interpret)
    return out[:rows, :tiles.num_targets].astype(values.dtype)


def pair_sum(values: jax.Array, d: jax.Array, tiles: Tiles, nnz: int, *,
             interpret=False) -> jax.Array:
    """``p[k] = Σ_r values[r, source[k]]·d[r, target[k]]`` for ``values (R, S)``, ``d (R, T)``
    and uniform ``'pair'`` tiles: ``(nnz,)`` in connection order. Over several source chunks,
    one call per chunk (and group of 128 rows), each staging every connection (those of
    other chunks read the zero row) and adding into the last one's output: ``chunks·nnz``
    staged rows, no permutation of the result. Packed tiles (``P`` sources per table row,
    ``R ≤ 128 / P``): each staged row's products summed over its own quarter's lanes.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_tiles import pair_tiles
        >>> from braintrace._primitives._sparse_staged import pair_sum
        >>> t = pair_tiles(np.array([0, 2, 1]), 3, 3, fan_in=1, block=128)
        >>> values, d = jnp.array([[1.0, 10.0, 100.0]]), jnp.array([[2.0, 3.0, 4.0]])
        >>> pair_sum(values, d, t, 3, interpret=True).tolist()
        [2.0, 300.0, 40.0]
        >>> p = pair_tiles(np.array([0, 2, 1]), 3, 3, fan_in=1, block=128, pack=4)
        >>> pair_sum(values, d, p, 3, interpret=True).tolist()
        [2.0, 300.0, 40.0]
    """
    rows, _ = values.shape
    if tiles.pack > 1 and rows > LANES // tiles.pack:
        raise ValueError(f"tiles packing {tiles.pack} sources per table row take values of at "
                         f"most {LANES // tiles.pack} rows, got {rows}.")
    v, groups = padded_values(values, table_columns(tiles))
    block, blocks, width = tiles.block, tiles.blocks, tiles.width_cap
    dv, _ = padded_values(d, blocks * block)
    source = _indices(tiles)
    own = tiles.positions is not None
    scratch, vmem = table_scratch(tiles, width * LANES + (8 if own else 0))  # own: a spare row
    scratch += [pltpu.VMEM((LANES, block), jnp.float32), pltpu.VMEM((block, LANES), jnp.float32)]
    group_rows = min(rows, LANES)
    out_rows = block * width // LANES
    vmem += 4 * LANES * block * 4 + 4 * 4 * out_rows * LANES
    packed = tiles.pack > 1
    if packed:  # each staged row's quarter, in the output's layout
        quarters = jnp.asarray(tiles.quarters.reshape(-1, LANES), jnp.int32)
        vmem += 2 * 4 * out_rows * LANES
    if own:  # each tile's groups and the entries' staged rows, flat like the index entries
        own_groups = jnp.asarray(tiles.groups.reshape(-1))
        positions = jnp.asarray(tiles.positions.reshape(-1))
    out, unroll = None, _unroll(interpret)
    for lane, c in itertools.product(range(groups), range(tiles.chunks)):
        chain = "new" if out is None else "add"
        if own:  # each tile's groups, then the entries' staged rows and table rows
            entries, cell0 = tiles.source.shape[1], c * blocks
            specs = [_smem(tiles.groups.shape[1], lambda b, cell0=cell0: (cell0 + b,))] + [
                _smem(entries, lambda b, cell0=cell0: (cell0 + b,))] * 2
            operands = [own_groups, positions, source]
        else:
            specs, operands = [_index_block(tiles, c * blocks)], [source]
        specs += [pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((group_rows, block), lambda b, lane=lane: (lane, b))]
        operands += [v, dv]
        if packed:
            specs.append(pl.BlockSpec((out_rows, LANES), lambda b, cell0=c * blocks: (
                cell0 + b, 0)))
            operands.append(quarters)
        kernel = functools.partial(
            _pair_kernel, rows=group_rows if groups == 1 else LANES, chain=chain, width=width,
            unroll=unroll, first=lane * LANES, start=c * tiles.chunk,
            sources=min(tiles.chunk, tiles.num_sources - c * tiles.chunk), pack=tiles.pack,
            quarter=tiles.quarter, own=own)
        out = _call(kernel, blocks, specs, operands, (out_rows, LANES),
                    lambda b: (b, 0), (blocks * out_rows, LANES), scratch, vmem + 8 * 2**20,
                    chain, out, interpret)
    by_target = out.reshape(blocks * block, width)[:tiles.num_targets, :tiles.uniform]
    return by_target.reshape(-1)[:nnz].astype(values.dtype)
