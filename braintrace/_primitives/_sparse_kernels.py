"""The sparse primitive's kernels: connections grouped by output, sums without scatters.

A fixed connectivity ``pre[k] -> post[k]`` (``k < nnz``) is also kept grouped by
output unit, the ELL layout (:class:`ByOutput`): row ``o`` lists the ``F``
connections that end at ``o`` (``F`` the largest fan-in; shorter rows padded).
With it every operation of the primitive is a sum of gathers, which XLA fuses
into one pass with no ``(rows, nnz)`` temporary and no scatter:

.. math::

    y[r, o] = \\sum_{j<F} x[r, pre_{o j}]\\, w_{o j}, \\qquad
    dw_{o j} = \\sum_r x[r, pre_{o j}]\\, d[r, o].

A ``segment_sum`` over ``post`` scatters every product into ``y``, and a
reduction over ``rows`` of gathered products makes XLA:CPU materialise the
gathers first (``rows × nnz`` values: 3.75 GiB for a block of 960 rows at
``nnz = 2^20``). How the sums are written decides how XLA:CPU fuses them
(timed by the ``ops`` of ``benchmarks/scale.py``):

* over slots (:func:`slot_product`): in a loop of at least two groups of up to
  :data:`SLOT_GROUP` slots, so that ``y`` is one buffer; written out as one
  expression, XLA copies the cheap sum into each consumer of ``y`` and keeps
  the gathers apart, laid out ``(O, R)``, so that every consumer reads ``F``
  arrays across rows (5-10x slower where ``y`` feeds two states);
* over rows (:func:`sum_rows`): :data:`ROW_GROUP` rows per expression in a
  loop over groups; more rows per expression read more rows of ``x`` at random
  (32 rows: 5x slower at ``N = 131,072``).

When the connections are already in output order with one fan-in for all
(``post = repeat(arange(O), F)``), the weights are the ELL table itself
(``weight.reshape(O, F)``); otherwise the table is gathered from the weights
(padding reads a zero) and the pullback scattered back through ``position``.
A connectivity whose padding would more than triple the work
(``O·F > MAX_FILL·nnz``) is not grouped; its operations gather and
``segment_sum`` over the connection list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_FILL", "ROW_GROUP", "SLOT_GROUP", "ByOutput", "by_output", "group_by", "pullback",
           "slot_product", "sum_rows"]

ROW_GROUP = 8
"""Rows summed in one expression by :func:`sum_rows`."""

SLOT_GROUP = 16
"""The most slots summed in one expression by :func:`slot_product`."""

MAX_FILL = 3.0
"""The largest ``O·F / nnz`` for which the connections are grouped by output."""


class ByOutput(NamedTuple):
    """The connections grouped by output unit (ELL), ``F`` slots per output.

    Attributes:
        pre: ``(O, F)`` input of each slot; padding holds ``num_in``, the zero input
            that :meth:`padded_input` appends.
        slot: ``(O, F)`` connection index of each slot, padding ``nnz``; ``None``
            when the connections are in this order already (``k = o·F + j``).
        position: ``(nnz,)`` flat slot ``o·F + j`` of each connection; ``None``
            likewise.
        padded: Whether some slot is padding.
    """

    pre: np.ndarray
    slot: np.ndarray | None
    position: np.ndarray | None
    padded: bool

    @property
    def width(self) -> int:
        """``F``, the slots per output."""
        return int(self.pre.shape[1])

    def table(self, weight: jax.Array) -> jax.Array:
        """The weights as the ``(O, F)`` table (padding 0)."""
        if self.slot is None:
            return weight.reshape(self.pre.shape)
        return jnp.take(_zero_padded(weight), self.slot, mode="clip")

    def padded_input(self, x: jax.Array) -> jax.Array:
        """``x (..., I)`` with a zero input ``I`` appended when some slot is padding.

        Padding then reads an ordinary zero: no bounds check in every gather.
        """
        return _zero_padded(x) if self.padded else x


def _zero_padded(a: jax.Array) -> jax.Array:
    """``a`` with a zero appended along its last axis."""
    return jnp.concatenate([a, jnp.zeros((*a.shape[:-1], 1), a.dtype)], axis=-1)


def group_by(keys: np.ndarray, values: np.ndarray, num_keys: int, nnz: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """``(values, k)`` grouped by key, ``(num_keys, max count)``; padding ``-1`` and ``nnz``.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_kernels import group_by
        >>> values, index = group_by(np.array([1, 0, 1]), np.array([7, 8, 9]), 2, 3)
        >>> values.tolist(), index.tolist()
        ([[8, -1], [7, 9]], [[1, 3], [0, 2]])
    """
    width = max(int(np.bincount(keys, minlength=num_keys).max(initial=0)), 1)
    out = np.full((num_keys, width), -1, np.int32)
    index = np.full((num_keys, width), nnz, np.int32)
    order = np.argsort(keys, kind="stable")
    starts = np.searchsorted(keys[order], np.arange(num_keys))
    slot = np.arange(nnz) - starts[keys[order]]
    out[keys[order], slot] = values[order]
    index[keys[order], slot] = order
    return out, index


def by_output(pre: np.ndarray, post: np.ndarray, num_in: int, num_out: int
              ) -> ByOutput | None:
    """The ELL layout of ``pre -> post``, or ``None`` when its padding exceeds :data:`MAX_FILL`.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse_kernels import by_output
        >>> layout = by_output(np.array([2, 0, 1, 2]), np.array([0, 0, 1, 1]), 3, 2)
        >>> layout.pre.tolist(), layout.slot is None, layout.padded
        ([[2, 0], [1, 2]], True, False)
    """
    nnz = int(pre.size)
    inputs, index = group_by(post, pre, num_out, nnz)
    if nnz == 0 or inputs.size > MAX_FILL * nnz:
        return None
    padded = bool((index == nnz).any())
    inputs[index == nnz] = num_in
    if not padded and np.array_equal(index.reshape(-1), np.arange(nnz)):
        return ByOutput(inputs, None, None, False)
    position = np.empty(nnz, np.int32)
    filled = index.reshape(-1) < nnz
    position[index.reshape(-1)[filled]] = np.flatnonzero(filled)
    return ByOutput(inputs, index, position, padded)


def _tree_add(terms: list[Any]) -> Any:
    """Pairwise sum of a list of arrays (a balanced tree of adds)."""
    while len(terms) > 1:
        pairs = [terms[k] + terms[k + 1] for k in range(0, len(terms) - 1, 2)]
        terms = pairs + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def sum_rows(term: Callable[..., jax.Array], *arrays: jax.Array) -> jax.Array:
    """``Σ_r term(*[a[r] for a in arrays])`` over the leading axis: :data:`ROW_GROUP` rows per
    expression, groups accumulated in a loop, the remaining rows after it.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives._sparse_kernels import sum_rows
        >>> a = jnp.arange(40.0).reshape(20, 2)
        >>> sum_rows(lambda row: 2 * row, a).tolist()
        [760.0, 800.0]
    """
    count = arrays[0].shape[0]

    def block(start: Any, size: int) -> jax.Array:
        rows = [jax.lax.dynamic_slice_in_dim(a, start, size) for a in arrays]
        return _tree_add([term(*[a[r] for a in rows]) for r in range(size)])

    groups, rest = divmod(count, ROW_GROUP)
    if groups <= 1:
        return block(0, count)
    shape = jax.eval_shape(term, *[a[0] for a in arrays])
    total = jax.lax.fori_loop(0, groups, lambda g, acc: acc + block(g * ROW_GROUP, ROW_GROUP),
                              jnp.zeros(shape.shape, shape.dtype))
    return total + block(groups * ROW_GROUP, rest) if rest else total


def slot_product(x: jax.Array, weight: jax.Array, layout: ByOutput) -> jax.Array:
    """``y[r, o] = Σ_j x[r, pre_{oj}]·w_{oj}`` for ``x (R, I)``; returns ``(R, O)``.

    The slots are summed in a loop of (at least) two groups, so that ``y`` is one buffer
    (module docstring).
    """
    width = layout.width
    table = layout.table(weight).T  # (F, O): a slot's weights contiguous
    inputs, x = layout.pre.T, layout.padded_input(x)
    if width == 1:
        return jnp.take(x, inputs[0], axis=-1, mode="clip") * table[0]
    group = min(SLOT_GROUP, -(-width // 2))
    groups = -(-width // group)
    spare = groups * group - width  # slots of zero weight that fill the last group
    inputs = jnp.asarray(np.pad(inputs, ((0, spare), (0, 0))).reshape(groups, group, -1))
    table = jnp.pad(table, ((0, spare), (0, 0))).reshape(groups, group, -1)

    def add_group(g, total):
        return total + _tree_add([jnp.take(x, inputs[g, j], axis=-1, mode="clip")
                                  * table[g, j] for j in range(group)])

    start = jnp.zeros((x.shape[0], table.shape[-1]), table.dtype)
    return jax.lax.fori_loop(0, groups, add_group, start)


def pullback(x: jax.Array, d: jax.Array, layout: ByOutput) -> jax.Array:
    """``dw[k] = Σ_r x[r, pre[k]]·d[r, post[k]]`` for ``x (R, I)``, ``d (R, O)``: ``(nnz,)``."""
    inputs, x = jnp.asarray(layout.pre), layout.padded_input(x)
    table = sum_rows(lambda xr, dr: jnp.take(xr, inputs, mode="clip") * dr[:, None], x, d)
    flat = table.reshape(-1)
    return flat if layout.position is None else flat[layout.position]
