"""The sparse primitive's kernels: connections grouped by output, sums without scatters.

A fixed connectivity ``pre[k] -> post[k]`` (``k < nnz``) is also kept grouped by
output unit, the ELL layout (:class:`ByOutput`): row ``o`` lists the ``F``
connections that end at ``o`` (``F`` the largest fan-in; shorter rows padded).
With it every operation of the primitive is a sum of gathers, which XLA fuses
into one pass with no ``(rows, nnz)`` temporary and no scatter:

.. math::

    y[r, o] = \\sum_{j<F} x[r, pre_{o j}]\\, w_{o j}, \\qquad
    dw_{o j} = \\sum_r x[r, pre_{o j}]\\, d[r, o].

A ``segment_sum`` over ``post`` scatters every product into ``y`` (measured:
4x slower than the slot sum at ``B = 32``, ``O = 16,384``, fan-in 8, see
``benchmarks/README.md``), and a reduction over ``rows`` of gathered products
makes XLA:CPU materialise the gathers first (``rows × nnz`` values: 3.75 GiB
for a block of 960 rows at ``nnz = 2^20``). Sums over many terms are written
out ``GROUP`` terms at a time, in one expression that XLA fuses, and the groups
accumulated by a loop (:func:`sum_terms`).

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

__all__ = ["GROUP", "MAX_FILL", "ByOutput", "by_output", "group_by", "pullback", "slot_product",
           "sum_terms"]

GROUP = 16
"""Terms (rows or slots) summed in one unrolled expression by :func:`sum_terms`."""

MAX_FILL = 3.0
"""The largest ``O·F / nnz`` for which the connections are grouped by output."""


class ByOutput(NamedTuple):
    """The connections grouped by output unit (ELL), ``F`` slots per output.

    Attributes:
        pre: ``(O, F)`` input of each slot; padding holds ``num_in`` (out of range).
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
        return jnp.take(weight, self.slot, mode="fill", fill_value=0)

    def gather_mode(self) -> str:
        """``'fill'`` (padding reads 0) when padded, else ``'clip'`` (no bounds select)."""
        return "fill" if self.padded else "clip"


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


def sum_terms(term: Callable[[Any], jax.Array], count: int) -> jax.Array:
    """``Σ_{i<count} term(i)``, :data:`GROUP` terms per expression, groups in a loop.

    ``term`` receives a Python int in the first group and a traced index in the
    loop; it must index arrays with it (``a[i]``), not NumPy constants.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives._sparse_kernels import sum_terms
        >>> a = jnp.arange(40.0).reshape(20, 2)
        >>> sum_terms(lambda i: a[i], 20).tolist()
        [380.0, 400.0]
    """
    def block(start: Any, size: int) -> jax.Array:
        return _tree_add([term(start + j) for j in range(size)])

    if count <= GROUP:
        return block(0, count)
    groups, rest = divmod(count, GROUP)
    total = jax.lax.fori_loop(1, groups, lambda g, acc: acc + block(g * GROUP, GROUP),
                              block(0, GROUP))
    return total + block(groups * GROUP, rest) if rest else total


def slot_product(x: jax.Array, weight: jax.Array, layout: ByOutput) -> jax.Array:
    """``y[r, o] = Σ_j x[r, pre_{oj}]·w_{oj}`` for ``x (R, I)``; returns ``(R, O)``."""
    table = layout.table(weight).T  # (F, O): a slot's weights contiguous
    inputs = jnp.asarray(layout.pre.T)
    mode = layout.gather_mode()
    return sum_terms(lambda j: jnp.take(x, inputs[j], axis=-1, mode=mode, fill_value=0)
                     * table[j], layout.width)


def pullback(x: jax.Array, d: jax.Array, layout: ByOutput) -> jax.Array:
    """``dw[k] = Σ_r x[r, pre[k]]·d[r, post[k]]`` for ``x (R, I)``, ``d (R, O)``: ``(nnz,)``."""
    inputs = jnp.asarray(layout.pre)
    mode = layout.gather_mode()
    table = sum_terms(lambda r: jnp.take(x[r], inputs, mode=mode, fill_value=0)
                      * d[r][:, None], x.shape[0])
    flat = table.reshape(-1)
    return flat if layout.position is None else flat[layout.position]
