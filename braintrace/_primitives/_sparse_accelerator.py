"""The sparse primitive's sums as XLA runs them fast on accelerators: gathers only.

The formulation of GPUs, and on a TPU the reference and fallback of the Pallas kernels
(``_sparse_tpu.py``), which read the gathered rows from the core's memory instead.

The same sums as ``_sparse_kernels.py`` (the CPU formulation), for ``x (R, I)``,
``d (R, O)``, cotangent ``ȳ (R, O)`` and ``nnz`` connections ``pre[k] -> post[k]``:

.. math::

    y[r, o] = \\sum_{k:\\, post[k] = o} w[k]\\, x[r, pre[k]], \\qquad
    \\bar x[r, i] = \\sum_{k:\\, pre[k] = i} w[k]\\, \\bar y[r, post[k]], \\qquad
    dw[k] = \\sum_r x[r, pre[k]]\\, d[r, post[k]].

Every sum is a gather of whole rows of ``xᵀ``, ``ȳᵀ`` or ``dᵀ`` (one row of ``R``
values per index) times weights, summed: never a scatter, which XLA:TPU runs several
times slower than the gather it transposes (a TPU v5e at 131,072 neurons, 8 synapses
each, ``R = 32``: the forward's gather 2.9 ms, the ``x``-cotangent as JAX transposes
it, a scatter-add, 15.9 ms; as a gather over each input's outgoing connections 4.0 ms).
A gather there costs per index, so the layouts keep the indices near ``nnz``:

* ``y`` and ``x̄`` are the same sum over the connections grouped by output
  (``Connectivity.incoming``) or by input (``Connectivity.outgoing``), in slices of one
  width each (``_sparse_slices.py``); the weights of a slice are a slice of ``w`` when
  its connections are in order (a uniform fan-in in output order: the forward's
  table is ``w`` itself), else gathered once per call from ``w``, a value that does
  not change within a time loop;
* ``dw`` gathers, per connection, the row of ``xᵀ`` at ``pre[k]`` and the row of ``dᵀ``
  at ``post[k]``; for connections in output order with one fan-in, ``dᵀ``'s row is a
  broadcast over the fan-in.

On a TPU the rows a sum gathers are padded with zeros to a whole number of
:data:`TPU_LANES` values: an array ``(S, R)`` with ``R`` below 128 occupies whole 128-lane
rows there either way, but above the core's on-chip memory XLA:TPU lays a narrow one out
column-major (``{0,1}``), where each gathered row is ``R`` separate reads (a v5e at
1,048,576 neurons, ``R = 32``: a sum of 8 M connections 316 ms; padded to 128 lanes, row-major,
98 ms; at 131,072 neurons, where the table fits on chip, 4.2 ms either way). Other accelerators
gather the rows unpadded.

A sum whose gathered values would exceed :data:`GATHER_BUDGET` bytes runs over groups of
its target rows (or connections) in a loop, each index read once: memory stays bounded
at a million neurons without reading the indices again per group of samples. No sum
goes through the matrix unit, so float32 sums stay float32 at JAX's default matmul
precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._primitives._sparse_slices import Slices

__all__ = ["GATHER_BUDGET", "TPU_LANES", "product", "transposed_product", "weight_pullback"]

GATHER_BUDGET = 32 * 2**20
"""The most bytes of gathered values one sum makes at once (larger sums loop over groups)."""

TPU_LANES = 128
"""On a TPU, the rows a sum gathers are padded to a multiple of this many values (its
vector lanes): XLA:TPU then keeps the table row-major (module docstring)."""


def _by_lanes(fn: Callable[..., jax.Array], *args: jax.Array, **static: Any) -> jax.Array:
    """``fn(*args, lanes=TPU_LANES, **static)`` in a program lowered for a TPU, ``lanes=1``
    (rows as they are) elsewhere."""
    return jax.lax.platform_dependent(
        *args, tpu=functools.partial(fn, lanes=TPU_LANES, **static),
        default=functools.partial(fn, lanes=1, **static))


def _lane_padded(values: jax.Array, lanes: int, extra_rows: int = 0) -> jax.Array:
    """``values (S, R)`` with ``extra_rows`` zero rows below and zero columns up to a multiple
    of ``lanes``."""
    width = values.shape[1]
    return jnp.pad(values, ((0, extra_rows), (0, -(-width // lanes) * lanes - width)))


def _in_groups(fn: Callable[..., jax.Array], tables: list[np.ndarray], values: list[jax.Array],
               row_bytes: int) -> jax.Array:
    """``fn(*tables, *values)`` over the shared leading axis, in groups of rows that gather
    at most :data:`GATHER_BUDGET` bytes each (``row_bytes`` per row); one call when it fits.

    ``tables`` are index tables (NumPy, constants of the program), ``values`` arrays; the
    rows that fill the last group read index 0 and zeros, and are dropped.
    """
    rows = tables[0].shape[0]
    group = max(1, GATHER_BUDGET // max(row_bytes, 1))
    if group >= rows:
        return fn(*[jnp.asarray(t) for t in tables], *values)
    groups = -(-rows // group)
    pad = [(0, groups * group - rows)]
    grouped = lambda a: a.reshape(groups, group, *a.shape[1:])
    tables = [grouped(np.pad(t, pad + [(0, 0)] * (t.ndim - 1))) for t in tables]
    values = [grouped(jnp.pad(v, pad + [(0, 0)] * (v.ndim - 1))) for v in values]
    out = jax.lax.map(lambda xs: fn(*xs[0], *xs[1]), ([jnp.asarray(t) for t in tables], values))
    return out.reshape(groups * group, *out.shape[2:])[:rows]


def _slice_weights(weight: jax.Array, items: np.ndarray, first: int | None) -> jax.Array:
    """The weights of a slice's slots ``(rows, width)``, padding 0."""
    if first is not None:
        return jax.lax.slice_in_dim(weight, first, first + items.size).reshape(items.shape)
    padded = jnp.concatenate([weight, jnp.zeros((1,), weight.dtype)])
    return jnp.take(padded, jnp.asarray(items), mode="clip")


def _gathered_sum(sources: jax.Array, weights: jax.Array, values: jax.Array) -> jax.Array:
    """``Σ_j values[sources[:, j]]·weights[:, j]`` for ``values (S, R)``: ``(rows, R)``."""
    rows = jnp.take(values, sources, axis=0, mode="clip")  # (rows, width, R)
    return jnp.sum(rows * weights[..., None], axis=1)


def _sliced_sum(values: jax.Array, weight: jax.Array, source: np.ndarray, layout: Slices,
                num_targets: int, lanes: int = 1) -> jax.Array:
    """``z[t] = Σ_{k: target[k]=t} w[k]·values[source[k]]`` for ``values (S, R)``:
    ``(targets, R)``, over the slices of ``layout`` (grouped by target); the rows gathered
    padded to a multiple of ``lanes`` values."""
    num_sources, width = values.shape
    padded = _lane_padded(values, lanes, extra_rows=1)  # row S: what padding reads
    zero = jnp.zeros((1, padded.shape[1]), values.dtype)
    source = np.append(np.asarray(source, np.int32), np.int32(num_sources))
    parts = []
    for items, first in zip(layout.items, layout.first, strict=True):
        weights = _slice_weights(weight, items, first)
        row_bytes = items.shape[1] * width * values.dtype.itemsize
        parts.append(_in_groups(lambda s, w: _gathered_sum(s, w, padded), [source[items]],
                                [weights], row_bytes))
    rows = sum(int(items.shape[0]) for items in layout.items)
    if layout.order is None and rows == num_targets:
        summed = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    elif layout.order is None:
        summed = jnp.concatenate([*parts, zero])[:num_targets]
    else:
        stacked = jnp.concatenate([*parts, zero])
        summed = jnp.take(stacked, jnp.asarray(layout.order), axis=0, mode="clip")
    return summed[:, :width]


def _product(x: jax.Array, weight: jax.Array, connectivity: Any, lanes: int) -> jax.Array:
    conn = connectivity
    return _sliced_sum(x.T, weight, conn.pre, conn.incoming, conn.num_out, lanes).T


def product(x: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``y (R, O)``: per output, the rows of ``xᵀ`` at its inputs times their weights,
    summed (``Connectivity.incoming``)."""
    return _by_lanes(_product, x, weight, connectivity=connectivity)


def _transposed_product(ct: jax.Array, weight: jax.Array, connectivity: Any,
                        lanes: int) -> jax.Array:
    conn = connectivity
    return _sliced_sum(ct.T, weight, conn.post, conn.outgoing, conn.num_in, lanes).T


def transposed_product(ct: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``x̄ (R, I)`` for ``ȳ = ct (R, O)``: per input, the rows of ``ȳᵀ`` at its outputs
    times their weights, summed (``Connectivity.outgoing``)."""
    return _by_lanes(_transposed_product, ct, weight, connectivity=connectivity)


def weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any) -> jax.Array:
    """``dw (nnz,)``: per connection the rows of ``xᵀ`` at ``pre[k]`` and of ``dᵀ`` at
    ``post[k]`` multiplied and summed over the rows; ``dᵀ``'s row a broadcast for
    connections in output order with one fan-in."""
    return _by_lanes(_weight_pullback, x, d, connectivity=connectivity)


def _weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any, lanes: int) -> jax.Array:
    """:func:`weight_pullback`, the rows gathered padded to a multiple of ``lanes`` values
    (zeros, which add nothing to the sums over the rows)."""
    conn = connectivity
    x_t, d_t = _lane_padded(x.T, lanes), _lane_padded(d.T, lanes)
    itemsize = x.dtype.itemsize
    if conn.in_output_order:
        pre = conn.pre.reshape(conn.num_out, -1)  # (O, F)
        per_output = lambda p, d_rows: jnp.sum(jnp.take(x_t, p, axis=0, mode="clip")
                                               * d_rows[:, None, :], axis=-1)
        table = _in_groups(per_output, [pre], [d_t], pre.shape[1] * x.shape[0] * itemsize)
        return table.reshape(-1)
    per_connection = lambda p, q: jnp.sum(jnp.take(x_t, p, axis=0, mode="clip")
                                          * jnp.take(d_t, q, axis=0, mode="clip"), axis=-1)
    return _in_groups(per_connection, [conn.pre, conn.post], [], 2 * x.shape[0] * itemsize)
