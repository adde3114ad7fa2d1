"""Pallas TPU kernels for the sparse product's sums: rows read from the core's memory.

For values ``v (S, R)`` (``xᵀ``, or the cotangent ``ȳᵀ``), the connections cut into cells
(``_sparse_cells.py``) and weights ``w``, two kernels:

.. math::

    z[t] = \\sum_{k:\\, target[k] = t} w[k]\\, v[source[k]] \\quad\\text{(gather-sum)},
    \\qquad
    p[k] = \\sum_r v[source[k], r]\\, d[target[k], r] \\quad\\text{(pair-sum)}.

The product is the gather-sum over each output's incoming connections, its ``x``-cotangent
the same over each input's outgoing connections, the weight pullback the pair-sum of
``xᵀ`` and ``dᵀ`` over the incoming ones. A kernel call holds one chunk of ``v`` (rows
padded to a multiple of 128 values, the vector lanes, and 8 zero rows that padding reads)
in VMEM for its whole grid; each grid step is one cell: its index tables arrive in SMEM
(one block per step, double-buffered by the pipeline), its target block in VMEM. A group
of eight targets is summed in lockstep: each slot reads one row of ``v`` by
``v[pl.ds(i, 1), :]`` and adds it, times its weight (a scalar from SMEM), to the target's
running row (the loop over a group's width unrolled where all groups have one width); the pair-sum multiplies the row by its target's row of ``d`` into a staging
buffer that is summed over the values 128 slots at a time (a transpose and a sublane sum).
No matrix unit: float32 stays float32.

Larger tables run as several calls, each adding into the last one's output (aliased):
one per source chunk (``Connectivity``'s cells, built once), and one per group of
``lanes`` value columns when ``R`` padded exceeds what fits beside the chunk.

VMEM per call (float32, ``C`` chunk rows, ``L`` lanes, ``B`` block rows, ``P`` slots per
cell): the chunk ``(C + 8)·L·4`` once, the target blocks ``2·B·L·4`` each for the output,
the accumulated input and ``d``, and for the pair-sum a staging buffer ``P·L·4``;
:data:`VMEM_BUDGET` bounds the chunk (``chunk_rows``), ``vmem_limit_bytes`` is set to the
sum plus 8 MiB. SMEM per step: ``2·(2P + B + B/8)·4`` bytes (16 KiB per thousand slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from braintrace._primitives._sparse_cells import GROUP, SLOT_ALIGN, Cells

__all__ = ["LANES", "VMEM_BUDGET", "chunk_rows", "gather_sum", "pair_sum", "stream_weights"]

LANES = 128
"""The TPU's vector lanes: value rows are padded to a multiple of this."""

VMEM_BUDGET = 80 * 2**20
"""The most bytes of resident values per call (v5e: 128 MiB of VMEM; 16 MiB scoped by
default, raised per call)."""

ZERO_ROWS = 8
"""Zero rows below each chunk; padding slots read the first."""

STAGED = False
"""Uniform cells' gather-sum staged: each slot's row copied into a buffer, then the block's
weighted sum dense, ``F`` products of ``(64, L)`` tiles by weight columns (the form a probe
timed on a v5e), instead of the rows added into registers times scalar weights."""

STAGE_TILE = 64
"""Rows per tile of the staged dense sum."""


def chunk_rows(lanes: int = LANES, budget: int = VMEM_BUDGET) -> int:
    """The most source rows of ``lanes`` float32 values a chunk holds within ``budget``
    (a multiple of 8): 163,832 at 128 lanes.

    Example:
        >>> from braintrace._primitives._sparse_pallas import chunk_rows
        >>> chunk_rows()
        163832
    """
    return (budget // (4 * lanes) - ZERO_ROWS) // 8 * 8


def _lane_groups(width: int, chunk: int) -> int:
    """Lanes per call: all of ``width`` (a multiple of 128) if the chunk fits, else fewer."""
    most = max(LANES, (VMEM_BUDGET // (4 * (chunk + ZERO_ROWS))) // LANES * LANES)
    return min(width, most)


def _chunked(values: jax.Array, cells: Cells) -> jax.Array:
    """``values (S, R)`` as ``(chunks, chunk + 8, L)``: zero rows below each chunk, zero
    columns up to ``L``, a multiple of 128."""
    rows, width = values.shape
    lanes = -(-width // LANES) * LANES
    chunks, chunk = cells.chunks, cells.chunk
    padded = jnp.pad(values, ((0, chunks * chunk - rows), (0, lanes - width)))
    padded = padded.reshape(chunks, chunk, lanes)
    return jnp.pad(padded, ((0, 0), (0, ZERO_ROWS), (0, 0)))


def stream_weights(weight: jax.Array, cells: Cells) -> jax.Array:
    """The weights in slot order, ``(cells, slots)``, padding 0: as they are for
    :attr:`Cells.uniform`, else a gather.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_cells import cells
        >>> from braintrace._primitives._sparse_pallas import stream_weights
        >>> c = cells(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=8)
        >>> stream_weights(jnp.array([1.0, 2.0, 3.0]), c)[0, :5].tolist()
        [1.0, 2.0, 3.0, 0.0, 0.0]
    """
    if cells.uniform:
        return _uniform_stream(weight, cells)
    padded = jnp.concatenate([weight, jnp.zeros((1,), weight.dtype)])
    return jnp.take(padded, jnp.asarray(cells.slot), mode="clip")


def _uniform_stream(values: jax.Array, cells: Cells) -> jax.Array:
    """Connection-ordered ``values (nnz,)`` as slots ``(blocks, slots)``: block ``b``'s
    connections in order, zeros after."""
    used = cells.block * cells.uniform
    padded = jnp.pad(values, (0, cells.blocks * used - values.shape[0]))
    return jnp.pad(padded.reshape(cells.blocks, used), ((0, 0), (0, cells.slots - used)))


def _connection_order(flat: jax.Array, cells: Cells, nnz: int) -> jax.Array:
    """Slot-ordered ``flat (cells·slots,)`` back in connection order ``(nnz,)``."""
    if not cells.uniform:
        return jnp.take(flat, jnp.asarray(cells.position), mode="clip")
    used = cells.block * cells.uniform
    return flat.reshape(cells.blocks, cells.slots)[:, :used].reshape(-1)[:nnz]


def _vmem_limit(*buffers: int) -> int:
    return int(sum(buffers) + 8 * 2**20)


def _flat(table: np.ndarray) -> tuple[jax.Array, int]:
    """A ``(cells, width)`` table flat, each row padded to a power of two from 128 or a
    multiple of 1024 (the one-dimensional blocks Mosaic takes), and that width."""
    width = max(SLOT_ALIGN, 1 << (table.shape[1] - 1).bit_length())
    if width > 1024:
        width = -(-table.shape[1] // 1024) * 1024
    return jnp.asarray(np.pad(table, ((0, 0), (0, width - table.shape[1]))).reshape(-1)), width


def _smem_block(width: int, chunk_index: int, blocks: int) -> pl.BlockSpec:
    """A cell's row of a flat table of rows of ``width``, in SMEM, for grid step ``b``."""
    return pl.BlockSpec((width,), lambda b, groups: (chunk_index * blocks + b,),
                        memory_space=pltpu.SMEM)


def _tables(cells: Cells) -> tuple[list[jax.Array], list[int]]:
    """The flat ``widths``, ``rows`` and ``source`` tables and their row widths."""
    flat = [_flat(t) for t in (cells.widths, cells.rows, cells.source)]
    return [f[0] for f in flat], [f[1] for f in flat]


def _slot_loop(width, body, carry, fixed: int):
    """``body(j, carry)`` for ``j < width``: unrolled when every group is ``fixed`` wide."""
    if fixed:
        return jax.lax.fori_loop(0, fixed, body, carry, unroll=True)
    return jax.lax.fori_loop(0, width, body, carry)


def _gather_kernel(groups_ref, widths_ref, rows_ref, source_ref, weight_ref, values_ref,
                   *refs, cell0: int, accumulate: bool, fixed: int):
    """One cell of the gather-sum: ``out[rows[g,u]] += Σ_j w[s]·v[source[s]]`` over the slots
    ``s = offset_g + u·W_g + j`` of group ``g``."""
    out_ref = refs[-1]
    lanes = out_ref.shape[-1]
    direct = fixed and not accumulate  # every group fills its own eight rows, in order
    if accumulate:
        out_ref[...] = refs[0][...]
    elif not direct:
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def group(g, offset):
        width = widths_ref[g]

        def slot(j, sums):
            at = [offset + u * width + j for u in range(GROUP)]
            return tuple(total + values_ref[pl.ds(source_ref[at[u]], 1), :] * weight_ref[at[u]]
                         for u, total in enumerate(sums))

        zero = jnp.zeros((1, lanes), out_ref.dtype)
        sums = _slot_loop(width, slot, (zero,) * GROUP, fixed)
        if direct:
            out_ref[pl.ds(pl.multiple_of(g * GROUP, GROUP), GROUP), :] = jnp.concatenate(sums)
            return offset + GROUP * width
        for u in range(GROUP):
            row = rows_ref[g * GROUP + u]
            out_ref[pl.ds(row, 1), :] = out_ref[pl.ds(row, 1), :] + sums[u]
        return offset + GROUP * width

    jax.lax.fori_loop(0, groups_ref[cell0 + pl.program_id(0)], group, jnp.int32(0))


def _staged_kernel(groups_ref, widths_ref, rows_ref, source_ref, weight_ref, values_ref, *refs,
                   accumulate: bool, fan_in: int):
    """One block of a uniform gather-sum, staged: ``stage[j·B + r] = v[source[r·F + j]]``,
    then ``out = Σ_j stage[j·B : (j+1)·B]·w[:, j]`` a tile at a time."""
    del groups_ref, widths_ref, rows_ref
    out_ref, stage_ref = refs[-2], refs[-1]
    block = out_ref.shape[0]

    def row(r, carry):
        for j in range(fan_in):
            stage_ref[pl.ds(j * block + r, 1), :] = values_ref[
                pl.ds(source_ref[r * fan_in + j], 1), :]
        return carry

    jax.lax.fori_loop(0, block, row, 0, unroll=GROUP)
    tile = min(STAGE_TILE, block)

    def dense(t, carry):
        start = pl.multiple_of(t * tile, tile)
        total = refs[0][pl.ds(start, tile), :] if accumulate else 0.0
        for j in range(fan_in):
            total = total + (stage_ref[pl.ds(j * block + start, tile), :]
                             * weight_ref[pl.ds(start, tile), pl.ds(j, 1)])
        out_ref[pl.ds(start, tile), :] = total
        return carry

    jax.lax.fori_loop(0, block // tile, dense, 0)


def _pair_kernel(groups_ref, widths_ref, rows_ref, source_ref, values_ref, d_ref, *refs,
                 cell0: int, accumulate: bool, fixed: int):
    """One cell of the pair-sum: ``stage[s] = v[source[s]]·d[rows[g,u]]`` for the slots
    ``s = offset_g + u·W_g + j`` of group ``g``, then each 128 staged rows summed over their
    values into one row of the output."""
    out_ref, stage_ref = refs[-2], refs[-1]

    def group(g, offset):
        targets = [d_ref[pl.ds(rows_ref[g * GROUP + u], 1), :] for u in range(GROUP)]
        width = widths_ref[g]

        def slot(j, carry):
            for u in range(GROUP):
                at = offset + u * width + j
                stage_ref[pl.ds(at, 1), :] = values_ref[pl.ds(source_ref[at], 1), :] * targets[u]
            return carry

        _slot_loop(width, slot, 0, fixed)
        return offset + GROUP * width

    used = jax.lax.fori_loop(0, groups_ref[cell0 + pl.program_id(0)], group, jnp.int32(0))

    def reduce(q, carry):
        start = pl.multiple_of(q * SLOT_ALIGN, SLOT_ALIGN)
        tile = stage_ref[pl.ds(start, SLOT_ALIGN), :]
        total = jnp.sum(tile.T, axis=0, keepdims=True)
        if accumulate:
            total = total + refs[0][pl.ds(q, 1), :]
        out_ref[pl.ds(q, 1), :] = total
        return carry

    jax.lax.fori_loop(0, (used + SLOT_ALIGN - 1) // SLOT_ALIGN, reduce, 0)


def _call(kernel, cells: Cells, in_specs: list, out_block: tuple,
          out_index, out_shape: tuple, scratch: list, vmem: int, chain: str,
          interpret: bool):
    """The ``pallas_call`` of one chunk (and group of lanes). ``chain``: ``'new'``, a fresh
    output; ``'write'``, the last call's output (aliased, left in HBM) with this call's blocks
    written into it; ``'add'``, the same with this call's blocks added to its."""
    chained = {"new": [], "write": [pl.BlockSpec(memory_space=pl.ANY)],
               "add": [pl.BlockSpec(out_block, out_index)]}[chain]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(cells.blocks,), in_specs=in_specs + chained,
        out_specs=pl.BlockSpec(out_block, out_index), scratch_shapes=scratch)
    aliases = {1 + len(in_specs): 0} if chained else {}
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem))


def _resident(cells: Cells, lanes: int, chunk_index: int, lane_group: int) -> pl.BlockSpec:
    """The chunk of values, one buffer: fetched when the call starts, held for its grid."""
    return pl.BlockSpec((None, cells.chunk + ZERO_ROWS, lanes),
                        lambda b, groups: (chunk_index, 0, lane_group),
                        pipeline_mode=pl.Buffered(1))


def gather_sum(values: jax.Array, weight: jax.Array, cells: Cells, *,
               interpret: bool = False) -> jax.Array:
    """``z[t] = Σ_{k: target[k]=t} w[k]·values[source[k]]`` for ``values (S, R)``: ``(T, R)``.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_cells import cells
        >>> from braintrace._primitives._sparse_pallas import gather_sum
        >>> c = cells(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=8)
        >>> values = jnp.array([[1.0], [10.0], [100.0]])
        >>> gather_sum(values, jnp.array([1.0, 2.0, 3.0]), c, interpret=True).tolist()
        [[30.0], [201.0]]
    """
    rows, width = values.shape
    table = _chunked(values.astype(jnp.float32), cells)
    lanes = _lane_groups(table.shape[-1], cells.chunk)
    tables, widths = _tables(cells)
    weights = stream_weights(weight.astype(jnp.float32), cells)
    weights = jnp.pad(weights, ((0, 0), (0, widths[2] - cells.slots))).reshape(-1)
    groups = jnp.asarray(cells.groups)
    block, blocks = cells.block, cells.blocks
    vmem = _vmem_limit((cells.chunk + ZERO_ROWS) * lanes * 4, 4 * block * lanes * 4)
    out = None
    calls = [(c, lane) for lane in range(table.shape[-1] // lanes) for c in range(cells.chunks)]
    staged = STAGED and cells.uniform and block % min(STAGE_TILE, block) == 0
    if staged:  # the weights as columns: (targets, F), a block's rows per step
        fan_in = cells.uniform
        weights = jnp.pad(weight.astype(jnp.float32), (0, blocks * block * fan_in - weight.size))
        weights = weights.reshape(blocks * block, fan_in)
        vmem += block * fan_in * lanes * 4 + 2 * block * LANES * 4
    for c, lane in calls:
        chain = "new" if out is None else "add" if c else "write"  # chunks add, lanes write
        specs = [*(_smem_block(w, c, blocks) for w in widths), _smem_block(widths[2], c, blocks),
                 _resident(cells, lanes, c, lane)]
        kernel = functools.partial(_gather_kernel, cell0=c * blocks, accumulate=chain == "add",
                                   fixed=cells.uniform)
        scratch = []
        if staged:
            specs[3] = pl.BlockSpec((block, cells.uniform), lambda b, groups: (b, 0))
            kernel = functools.partial(_staged_kernel, accumulate=chain == "add",
                                       fan_in=cells.uniform)
            scratch = [pltpu.VMEM((block * cells.uniform, lanes), jnp.float32)]
        call = _call(kernel, cells, specs, (block, lanes),
                     lambda b, groups, lane=lane: (b, lane), (blocks * block, table.shape[-1]),
                     scratch, vmem, chain, interpret)
        operands = [groups, *tables, weights, table] + ([out] if out is not None else [])
        out = call(*operands)
    return out[:cells.num_targets, :width].astype(values.dtype)


def pair_sum(values: jax.Array, d: jax.Array, cells: Cells, nnz: int, *,
             interpret: bool = False) -> jax.Array:
    """``p[k] = Σ_r values[source[k], r]·d[target[k], r]`` for ``values (S, R)``,
    ``d (T, R)``: ``(nnz,)`` in connection order.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._primitives._sparse_cells import cells
        >>> from braintrace._primitives._sparse_pallas import pair_sum
        >>> c = cells(np.array([0, 2, 1]), np.array([1, 1, 0]), 3, 2, chunk=3, block=8)
        >>> values, d = jnp.array([[1.0], [10.0], [100.0]]), jnp.array([[2.0], [3.0]])
        >>> pair_sum(values, d, c, 3, interpret=True).tolist()
        [3.0, 300.0, 20.0]
    """
    table = _chunked(values.astype(jnp.float32), cells)
    full = table.shape[-1]
    lanes = _lane_groups(full, cells.chunk)
    block, blocks, slots = cells.block, cells.blocks, cells.slots
    targets = jnp.pad(d.astype(jnp.float32),
                      ((0, blocks * block - d.shape[0]), (0, full - d.shape[1])))
    tables, widths = _tables(cells)
    groups = jnp.asarray(cells.groups)
    rows_out = slots // SLOT_ALIGN
    vmem = _vmem_limit((cells.chunk + ZERO_ROWS) * lanes * 4, 2 * block * lanes * 4,
                       slots * lanes * 4, 4 * rows_out * SLOT_ALIGN * 4)
    calls = [(c, lane) for lane in range(full // lanes) for c in range(cells.chunks)]
    shape = (cells.chunks * blocks, rows_out, SLOT_ALIGN)
    out = None
    for c, lane in calls:
        chain = "new" if out is None else "add" if lane else "write"  # chunks: other cells
        specs = [*(_smem_block(w, c, blocks) for w in widths), _resident(cells, lanes, c, lane),
                 pl.BlockSpec((block, lanes), lambda b, groups, lane=lane: (b, lane))]
        kernel = functools.partial(_pair_kernel, cell0=c * blocks, accumulate=chain == "add",
                                   fixed=cells.uniform)
        call = _call(kernel, cells, specs, (None, rows_out, SLOT_ALIGN),
                     lambda b, groups, c=c: (c * blocks + b, 0, 0), shape,
                     [pltpu.VMEM((slots, lanes), jnp.float32)], vmem, chain,
                     interpret)
        out = call(groups, *tables, table, targets, *([] if out is None else [out]))
    return _connection_order(out.reshape(-1), cells, nnz).astype(values.dtype)
