"""The sparse primitive's sums on a TPU: the Pallas kernels over the connectivity's cells.

The same three sums as ``_sparse_accelerator.py`` (the XLA formulation, which stays the
reference and the fallback), for ``x (R, I)``, cotangent ``ȳ (R, O)``, ``d (R, O)``:

* the product ``y = gather_sum(xᵀ)ᵀ`` over each output's incoming connections;
* the ``x``-cotangent ``x̄ = gather_sum(ȳᵀ)ᵀ`` over each input's outgoing connections;
* the weight pullback ``dw = pair_sum(xᵀ, dᵀ)`` over the incoming connections.

Each side is cut into cells once per :class:`~braintrace._primitives._sparse.Connectivity`
(``Connectivity.cells``): source chunks of at most :data:`CHUNK_ROWS` rows (by default as
many 128-value rows as ``_sparse_pallas.VMEM_BUDGET`` holds: 163,832, so one chunk up to
that many neurons), target blocks of :data:`BLOCK_ROWS` rows (by default a power of two
from 256 to 4,096 near :data:`CELL_SLOTS` slots per cell). A float32 sum whose
connectivity cuts into cells runs the kernels; another dtype, or connections too uneven to
cut (``_sparse_cells.MAX_FILL``), the XLA formulation.

:data:`KERNELS` chooses between the sets of kernels: ``'cells'`` (``_sparse_pallas.py``:
rows added into registers times scalar weights, eight targets in lockstep, ``v`` transposed
and padded by XLA around each call), ``'staged'`` (``_sparse_staged.py`` over the lane
tiles of ``_sparse_tiles.py``: one index load and one row copy per connection, then dense
sums; ``v`` and the results in their own layout, transposed in the kernel) and ``'packed'``,
the default: ``'staged'`` whose sums, where their values have at most 64 rows, pack ``P =
4`` (at most 32 rows) or 2 sources per row of the staged table where that saves chunks (a
gather-sum whose sources span several chunks unpacked; the pair-sum always): at 1,048,576
neurons, batch 32, 2 chunks, not 7. Its pair-sum sums each staged row's products over its
own quarter's lanes. Where a side has no lane tiles (connections too uneven,
``_sparse_tiles.MAX_FILL``) it takes the cells' kernels, and so does the weight pullback
where the staged pair-sum does not apply (connections not in output order, or several chunks
without :data:`CHUNKED_PAIR`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from braintrace._platform import interpreting
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives._sparse_cells import Cells

__all__ = ["BLOCK_ROWS", "CELL_SLOTS", "CHUNKED_PAIR", "CHUNK_ROWS", "KERNELS",
           "OWN_CHUNK_PAIR", "PACKED_ROWS", "PACK_ONE_CHUNK", "VARIANTS", "cut", "packing",
           "product", "staged_tiles", "transposed_product", "weight_pullback"]

VARIANTS = ("cells", "staged", "packed")
"""The sets of kernels :data:`KERNELS` chooses from (module docstring)."""

PACKED_ROWS = {4: 32, 2: 64}
"""``'packed'``: ``P`` sources per table row (the first that fits) for a staged sum's values
of at most this many rows."""

KERNELS = "packed"
"""The kernels a TPU runs, one of :data:`VARIANTS`. ``'staged'``: on a TPU v5e (131,072 neurons,
8 synapses each, batch 32; ``benchmarks/results/sparse_kernels_tpu.json``) the forward sum in
2.52 ms (XLA 4.37), the weight pullback in 2.27 ms (XLA 4.67), each within 3e-7 of XLA's values
relative to its largest. ``'packed'`` (the default) is ``'staged'`` with several sources per
table row where that saves chunks (:func:`packing`): at 1,048,576 neurons, batch 32, with
:data:`CHUNKED_PAIR`, the forward sum 90.6 ms a call (staged 125.1; of which XLA's gather of
the weights into slot order, done once per time loop, 67.7 and 92.8), the weight pullback
25.7 ms (staged 125.1, XLA 100.9), within 2.4e-7 of XLA's; ES-D-RTRL's update over 30 steps
3.47 s (``benchmarks/results/scale_tpu_1m_packed.json``; staged 4.40). At 131,072 neurons it
packs only the pair-sum (2.20 ms; its gather-sums fit one chunk unpacked). (A first staged
version, whose index rows were 2-D SMEM blocks, gave wrong sums on the chip while right in
Pallas' interpreters; its index rows are 1-D blocks since, as the cells' kernels' always
were.)"""

CHUNKED_PAIR: bool = True
"""Whether the weight pullback of uniform connections (one fan-in, in output order) whose
sources span several chunks runs the staged pair-sum, one call per chunk, each staging every
connection (those of other chunks read the zero row: ``chunks × nnz`` staged rows) and
adding into the last one's output, in connection order; ``False``: the cells' pair-sum,
whose slot-ordered output an XLA gather of all ``nnz`` values puts back in connection order
(on a TPU v5e at 1,048,576 neurons, 8 synapses each, batch 32, 7 chunks: 58 ms for that
gather, 47 ms for the kernel calls; compiled for a v5e, ES-D-RTRL over 30 steps, XLA's peak
9.37 GiB against 7.63 with the chunked form). Under ``'packed'`` a pair-sum of at most 64
rows packs too, ``P`` times fewer chunks: there the weight pullback at batch 32 takes 25.7 ms
(2 chunks) against 125.1 (cells and gather). ES-D-RTRL's block product at that size (``(K +
1)·B = 96`` rows) does not pack and runs 7 chunks."""

OWN_CHUNK_PAIR: bool = True
"""Whether each chunk's call of the chunked pair-sum (:data:`CHUNKED_PAIR`) stages only the
connections whose source lies in its chunk (``nnz`` staged rows over all the calls, each
read through two indices, its table row and its staged row; every call zeroes its staged rows
first where it does not pack, and still sums every staged row) instead of every connection
(``chunks × nnz``, those of other chunks reading the zero row). On one TPU v5e at 1,048,576
neurons, 8 synapses each, batch 32 (``benchmarks/results/sparse_kernels_tpu_own.json``):
ES-D-RTRL's block product (128 rows, 7 chunk calls) 54.4 ms against 87.4 staging every
connection (XLA's gathers 77.6), the packed weight pullback (2 calls) 27.0 against 25.9;
ES-D-RTRL's update over 30 steps 2.96 s against 3.47 (``scale_tpu_1m_own.json``,
``scale_tpu_1m_packed.json``)."""

PACK_ONE_CHUNK: bool = False
"""Whether ``'packed'`` packs a gather-sum whose sources fit one chunk unpacked too
(:func:`packing`; the tests of the packed kernels at small sizes set it)."""

CHUNK_ROWS: int | None = None
"""Table rows per chunk (source rows; of packed tiles, ``P`` sources per row);
``None``: ``_sparse_pallas.chunk_rows()``, balanced over chunks."""

BLOCK_ROWS: int | None = None
"""Target rows per block (a multiple of 8); ``None``: chosen from :data:`CELL_SLOTS`."""

CELL_SLOTS = 8192
"""About this many connections per cell when the block is chosen (one grid step's work)."""

INTERPRET: Any = True
"""The ``interpret`` argument of the kernels' calls off a TPU (``formulation('pallas')``):
JAX's interpreter; the tests of the kernels alone set Pallas' TPU interpreter
(``pltpu.InterpretParams``, which raises on a read out of bounds but whose callbacks the
learners' programs do not take)."""


def cut(connectivity: Any, side: str) -> Cells | None:
    """The cells of ``connectivity``'s ``'incoming'`` (sources ``pre``, targets ``post``) or
    ``'outgoing'`` side (the reverse), with this module's chunk and block sizes.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse import Connectivity
        >>> from braintrace._primitives._sparse_tpu import cut
        >>> conn = Connectivity.from_indices(np.arange(4), np.repeat(np.arange(2), 2), 4, 2)
        >>> c = cut(conn, "incoming")
        >>> c.uniform, c.chunks, c.blocks
        (2, 1, 1)
    """
    conn = connectivity
    sources, targets = (conn.num_in, conn.num_out) if side == "incoming" else (conn.num_out,
                                                                                conn.num_in)
    from braintrace._primitives._sparse_pallas import chunk_rows  # Pallas: imported on use

    most = CHUNK_ROWS or chunk_rows()
    chunks = -(-max(sources, 1) // most)
    chunk = -(-max(sources, 1) // chunks)
    if CHUNK_ROWS is None:
        chunk = -(-chunk // 8) * 8
    block = BLOCK_ROWS
    if block is None:
        per_target = conn.nnz / max(targets * chunks, 1)
        block = 1 << max(int(CELL_SLOTS / max(per_target, 1.0)).bit_length() - 1, 0)
        block = min(max(block, 256), 4096)
    return conn.cells(side, chunk, block)


def _staged_sizes(connectivity: Any, side: str, pack: int = 1) -> tuple[int, int]:
    """Source rows per chunk (a multiple of 1,024 when there are several; ``pack`` per table
    row: up to ``pack`` times as many, a multiple of ``pack``·1,024, or of ``pack``·128 in one
    chunk, so that each quarter's columns start at a multiple of 128) and target rows per
    block (a power of two from 512 to 8,192 near :data:`CELL_SLOTS` connections per cell)
    of the staged kernels' tiles of ``side``."""
    conn = connectivity
    sources, targets = (conn.num_out, conn.num_in) if side == "outgoing" else (conn.num_in,
                                                                               conn.num_out)
    from braintrace._primitives._sparse_pallas import chunk_rows  # Pallas: imported on use

    most = (CHUNK_ROWS or chunk_rows()) * pack
    chunks = -(-max(sources, 1) // most)
    chunk = -(-max(sources, 1) // chunks)
    if (chunks > 1 or pack > 1) and CHUNK_ROWS is None:
        align = (1024 if chunks > 1 else 128) * pack
        chunk = -(-chunk // align) * align
    block = BLOCK_ROWS
    if block is None:
        per_target = conn.nnz / max(targets * chunks, 1)
        block = 1 << max(int(CELL_SLOTS / max(per_target, 1.0)).bit_length() - 1, 0)
        block = min(max(block, 512), 8192)
    return chunk, -(-block // 128) * 128


def staged_tiles(connectivity: Any, side: str, pack: int = 1) -> Any:
    """The lane tiles of the staged kernels (``_sparse_tiles.py``) for ``side``:
    ``'incoming'`` or ``'outgoing'`` (gather-sums) or ``'pair'`` (the weight pullback over
    the incoming connections in output order, in one source chunk unless
    :data:`CHUNKED_PAIR`), ``pack`` sources per table row; ``None`` where they do not
    apply.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse import Connectivity
        >>> from braintrace._primitives._sparse_tpu import staged_tiles
        >>> conn = Connectivity.from_indices(np.arange(4), np.repeat(np.arange(2), 2), 4, 2)
        >>> staged_tiles(conn, "incoming").uniform, staged_tiles(conn, "pair").kind
        (2, 'pair')
    """
    chunk, block = _staged_sizes(connectivity, side, pack)
    if side == "pair" and chunk < connectivity.num_in and not CHUNKED_PAIR:
        return None
    return connectivity.tiles(side, chunk, block, pack, side == "pair" and OWN_CHUNK_PAIR)


def packing(rows: int, sources: int | None = None) -> int:
    """Sources per table row of the staged sums (gather-sum or pair-sum) of values with
    ``rows`` rows under :data:`KERNELS`: 1 but for ``'packed'`` (:data:`PACKED_ROWS`).
    Given ``sources`` (a gather-sum's source rows), 1 where they fit one chunk unpacked:
    packing then only adds each staged row's quarter selection (on a TPU v5e at 131,072
    neurons, batch 32: forward 2.80 ms packed, 2.52 unpacked).

    Example:
        >>> from braintrace._primitives import _sparse_tpu as tpu
        >>> tpu.KERNELS, tpu.packing(32), tpu.packing(96), tpu.packing(32, sources=1000)
        ('packed', 4, 1, 1)
    """
    if KERNELS != "packed":
        return 1
    if sources is not None and not PACK_ONE_CHUNK:
        from braintrace._primitives._sparse_pallas import chunk_rows  # Pallas: on use

        if sources <= (CHUNK_ROWS or chunk_rows()):
            return 1
    return next((p for p, most in PACKED_ROWS.items() if rows <= most), 1)


def _float32(*arrays: jax.Array) -> bool:

    return all(a.dtype == jnp.float32 for a in arrays)


def _row_major(a: jax.Array) -> jax.Array:
    """``a (R, N)`` laid out row-major. The kernels read ``aᵀ`` and write a transposed result;
    left to itself XLA:TPU makes those transposes free by laying ``a`` out column-major, where
    its minor axis of ``R`` values fills whole 128-lane tiles: 4× the memory at ``R = 32``, in
    every step a time loop stores (BPTT at 131,072 neurons, batch 32, compiled for a v5e:
    6.7 GiB of temporaries, 2.2 GiB row-major)."""
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(a, Layout(major_to_minor=(0, 1)))


def _kernels():
    """``_sparse_pallas`` (imported on first use: Pallas is not needed off a TPU) and the
    ``interpret`` argument of its calls (:data:`INTERPRET` off a TPU)."""
    from braintrace._primitives import _sparse_pallas

    return _sparse_pallas, INTERPRET if interpreting() else False


def _staged(kernel: str, connectivity: Any, side: str, *arrays: jax.Array) -> Any:
    """The staged kernel ``kernel``, the tiles of ``side`` and the ``interpret`` argument, or
    ``None`` (other :data:`KERNELS`, no tiles, or not float32). ``'packed'``: the tiles pack
    ``P`` sources per table row where the values (``arrays[0]``) have at most
    :data:`PACKED_ROWS` ``[P]`` rows and, for a gather-sum, the sources span several
    chunks (:func:`packing`)."""
    if KERNELS not in ("staged", "packed") or not _float32(*arrays):
        return None
    conn = connectivity
    sources = None if side == "pair" else conn.num_out if side == "outgoing" else conn.num_in
    pack = packing(arrays[0].shape[0], sources)
    tiles = staged_tiles(connectivity, side, pack)
    if tiles is None:
        return None
    from braintrace._primitives import _sparse_staged  # Pallas: imported on use

    return getattr(_sparse_staged, kernel), tiles, INTERPRET if interpreting() else False


def _gather_sum(values: jax.Array, weight: jax.Array, connectivity: Any, side: str,
                fallback: Any) -> jax.Array:
    """``(R, ·)``: the gather-sum of ``valuesᵀ`` over ``side``'s connections (``'incoming'``:
    each output's, ``'outgoing'``: each input's), by the staged kernels, the cells' or, where
    neither applies, ``fallback`` (the XLA formulation)."""
    staged = _staged("gather_sum", connectivity, side, values, weight)
    if staged:
        kernel, tiles, interpret = staged
        return _row_major(kernel(_row_major(values), weight, tiles, interpret=interpret))
    cells = cut(connectivity, side)
    if cells is None or not _float32(values, weight):
        return fallback(values, weight, connectivity)
    kernels, interpret = _kernels()
    return _row_major(kernels.gather_sum(_row_major(values).T, weight, cells,
                                         interpret=interpret).T)


def product(x: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``y (R, O)``: the gather-sum of ``xᵀ`` over each output's incoming connections."""
    return _gather_sum(x, weight, connectivity, "incoming", accelerator.product)


def transposed_product(ct: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``x̄ (R, I)`` for ``ȳ = ct (R, O)``: the gather-sum of ``ȳᵀ`` over each input's
    outgoing connections."""
    return _gather_sum(ct, weight, connectivity, "outgoing", accelerator.transposed_product)


def weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any) -> jax.Array:
    """``dw (nnz,)``: the pair-sum of ``xᵀ`` and ``dᵀ`` over the incoming connections."""
    staged = _staged("pair_sum", connectivity, "pair", x, d)
    if staged:
        kernel, tiles, interpret = staged
        return kernel(_row_major(x), _row_major(d), tiles, connectivity.nnz, interpret=interpret)
    cells = cut(connectivity, "incoming")
    if cells is None or not _float32(x, d):
        return accelerator.weight_pullback(x, d, connectivity)
    kernels, interpret = _kernels()
    return kernels.pair_sum(_row_major(x).T, _row_major(d).T, cells, connectivity.nnz,
                            interpret=interpret)
