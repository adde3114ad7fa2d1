"""The sparse primitive's sums as XLA:TPU (and GPU) run them fast.

The same sums as ``_sparse_kernels.py`` (the CPU formulation), for
``x (R, I)``, ``d (R, O)`` and ``nnz`` connections ``pre[k] -> post[k]``:

.. math::

    y[r, o] = \\sum_{k:\\, post[k] = o} w[k]\\, x[r, pre[k]], \\qquad
    \\bar x[r, i] = \\sum_{k:\\, pre[k] = i} w[k]\\, \\bar y[r, post[k]], \\qquad
    dw[k] = \\sum_r x[r, pre[k]]\\, d[r, post[k]].

The CPU formulation sums a few rows or slots per expression inside loops: on
XLA:CPU that keeps the gathers in cache, on a TPU every loop iteration is a
handful of tiny operations (measured on a TPU v5e at ``N = 16,384`` neurons,
8 synapses each, ``R = 32`` rows: the pullback 32 ms, over 1,024 rows 1.0 s). Here
each sum is one vectorised expression that XLA:TPU fuses: a gather of whole
columns of ``x`` (``x[:, pre]``, or rows of ``xᵀ`` grouped by output) times a
broadcast of ``d`` or of the weight table, reduced over rows or slots
(measured: 0.9 ms and 2.5 ms). Gathers of single elements, which XLA:TPU runs
one at a time, are avoided where the connections are in output order with one
fan-in (``post = repeat(arange(O), F)``, the weights are the ``(O, F)`` table
itself); otherwise the connection list is used as it is. The cotangent of ``x``
is a scatter-add over ``pre`` (``segment_sum``), the fastest plain formulation
there. No sum goes through the matrix unit, so float32 sums stay float32 at
JAX's default matmul precision.

A sum whose gathered values would exceed :data:`GATHER_BUDGET` bytes is taken
over groups of rows in a loop, so memory stays bounded for long blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["GATHER_BUDGET", "ROWS_FOR_TABLE", "product", "transposed_product", "weight_pullback"]

GATHER_BUDGET = 256 * 2**20
"""The most bytes of gathered values one sum makes at once (larger sums loop over rows)."""

ROWS_FOR_TABLE = 256
"""From this many rows on, a pullback over connections in another order than the outputs'
is taken over the output-grouped table and mapped back with one gather of ``nnz`` elements
(a fixed cost, about 1 ms at ``nnz = 2^17`` on a TPU v5e); below it over the connection list."""


def _over_rows(fn: Any, x: jax.Array, d: jax.Array, width: int, out_shape: tuple[int, ...]
               ) -> jax.Array:
    """``Σ`` of ``fn(x_rows, d_rows)`` over groups of rows, each gathering at most
    :data:`GATHER_BUDGET` bytes (``width`` gathered values per row); one group when it fits."""
    rows = x.shape[0]
    per_row = width * x.dtype.itemsize
    group = max(1, min(rows, GATHER_BUDGET // max(per_row, 1)))
    if group >= rows:
        return fn(x, d)
    groups = -(-rows // group)
    pad = groups * group - rows  # zero rows add nothing to the sums
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(groups, group, -1)
    d = jnp.pad(d, ((0, pad), (0, 0))).reshape(groups, group, -1)
    return jax.lax.fori_loop(0, groups, lambda g, acc: acc + fn(x[g], d[g]),
                             jnp.zeros(out_shape, x.dtype))


def product(x: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``y (R, O)``: per output the gathered columns ``x[:, pre_{oj}]`` times the weight table,
    summed over the slots; ``segment_sum`` over ``post`` without an output grouping."""
    conn = connectivity
    layout = conn.by_output
    if layout is None:
        gathered = jnp.take(x, jnp.asarray(conn.pre), axis=-1) * weight
        return jax.ops.segment_sum(gathered.T, jnp.asarray(conn.post),
                                   num_segments=conn.num_out).T
    rows = jnp.take(layout.padded_input(x).T, jnp.asarray(layout.pre), axis=0)  # (O, F, R)
    return jnp.sum(rows * layout.table(weight)[..., None], axis=1).T


def transposed_product(ct: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``x̄ (R, I)`` for ``ȳ = ct (R, O)``: each connection's ``w[k]·ȳ[:, post[k]]``
    scatter-added into its input ``pre[k]``."""
    conn = connectivity
    if conn.in_output_order:
        spread = jnp.repeat(ct, conn.nnz // conn.num_out, axis=-1)
    else:
        spread = jnp.take(ct, jnp.asarray(conn.post), axis=-1)
    return jax.ops.segment_sum((spread * weight).T, jnp.asarray(conn.pre),
                               num_segments=conn.num_in).T


def weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any) -> jax.Array:
    """``dw (nnz,)``: ``Σ_r x[r, pre[k]]·d[r, post[k]]``, as the ``(O, F)`` table for
    connections in output order (or for many rows), else over the connection list."""
    conn = connectivity
    layout = conn.by_output
    rows = x.shape[0]
    if layout is None or (layout.position is not None and rows < ROWS_FOR_TABLE):
        pre, post = jnp.asarray(conn.pre), jnp.asarray(conn.post)
        listed = lambda xr, dr: jnp.sum(jnp.take(xr, pre, axis=-1) * jnp.take(dr, post, axis=-1),
                                        axis=0)
        return _over_rows(listed, x, d, conn.nnz, (conn.nnz,))
    inputs = jnp.asarray(layout.pre)
    tabled = lambda xr, dr: jnp.sum(jnp.take(layout.padded_input(xr), inputs, axis=-1)
                                    * dr[:, :, None], axis=0)
    table = _over_rows(tabled, x, d, layout.pre.size, layout.pre.shape).reshape(-1)
    return table if layout.position is None else table[jnp.asarray(layout.position)]

