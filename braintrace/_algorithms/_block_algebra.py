"""Products of per-unit Jacobians over a block of ``K`` steps (the time-blocked rules).

A trace that follows ``ε_k = d_k ε_{k-1} + f_k ⊗ x_k`` (per unit, ``d_k`` an
``S×S`` matrix, ``f_k`` an ``S``-vector, ``⊗`` the primitive's instantaneous
term) and is read as ``Σ_k u_kᵀ ε_{k-1}`` (``u_k = δ̄^k``, the step's learning
signal) can take ``K`` steps at once. With ``L(a, j) = d_a d_{a-1} ⋯ d_{j+1}``
(the identity when ``a = j``) and ``ε_{-1}`` the trace entering the block:

.. math::

    \\sum_{k=0}^{K-1} u_k^\\top \\epsilon_{k-1}
        = \\beta_{-1}^\\top \\epsilon_{-1} + \\sum_j (\\beta_j^\\top f_j) \\otimes x_j,
    \\qquad \\beta_j^\\top = \\sum_{k>j} u_k^\\top L(k-1, j)

    \\epsilon_{K-1} = \\Lambda_{-1} \\epsilon_{-1} + \\sum_j (\\Lambda_j f_j) \\otimes x_j,
    \\qquad \\Lambda_j = L(K-1, j)

Both coefficients follow from one backward recursion over the block,
``β_{j-1} = u_j + β_jᵀ d_j`` and ``Λ_{j-1} = Λ_j d_j`` from ``β_{K-1} = 0``,
``Λ_{K-1} = I`` (products only, never a division). The sums over ``j`` are
the primitive's instantaneous term with the leading (step, sample) axes
summed: for a dense weight one matrix product ``Xᵀ A``. Exact: it is the
per-step recursion regrouped, for every primitive whose ``dt_to_t`` scales along
the output units (the primitive contract), so ``dt_to_t(a, dt_to_t(b, ε)) =
dt_to_t(a·b, ε)`` and ``dt_to_t(a, x ⊗ f) = x ⊗ (a·f)``.

ES-D-RTRL's input side is a scalar recursion, ``ε_x^k = α ε_x^{k-1} + x_k``: its block
reads the sums :func:`decayed_sums` and :func:`decayed_end` of the stacked steps, products
with constant ``(K, K)`` and ``(K,)`` weights (sums term by term in blocks of up to
:data:`SUMMED_STEPS` steps). (Written as the recursions themselves on
accelerators, to spare XLA:TPU a transpose of the stacked steps, and with the block's two
products of a dense weight merged into one, ES-D-RTRL on a GRU at hidden 1024, batch 64 took
31.4 µs of device time per step on a TPU v5e, against 25.4 µs with these products; the two
changes were not measured apart, and neither is kept for dense weights.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._platform import tpu_formulations

__all__ = ["block_coefficients", "decay_weights", "decayed_end", "decayed_sums"]

def block_coefficients(u: jax.Array, d: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``β_j``, ``Λ_j`` for the steps of a block, and ``β_{-1}``, ``Λ_{-1}`` (module docstring).

    Args:
        u: Learning signals ``(K, *units, S)``.
        d: Per-unit Jacobians ``(K, *units, S, S)``.

    Returns:
        ``(beta, lam, beta_start, lam_start)`` of shapes ``(K, *units, S)``,
        ``(K, *units, S, S)``, ``(*units, S)``, ``(*units, S, S)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._block_algebra import block_coefficients
        >>> u = jnp.ones((3, 1, 1))            # three steps, one unit, S = 1
        >>> d = jnp.full((3, 1, 1, 1), 0.5)
        >>> beta, lam, beta0, lam0 = block_coefficients(u, d)
        >>> beta[:, 0, 0].tolist(), float(beta0[0, 0]), float(lam0[0, 0, 0])
        ([1.5, 1.0, 0.0], 1.75, 0.125)
    """
    eye = jnp.broadcast_to(jnp.eye(d.shape[-1], dtype=d.dtype), d.shape[1:])

    def back(carry, step):
        beta, lam = carry
        u_j, d_j = step
        new = (u_j + jnp.einsum("...s,...st->...t", beta, d_j),
               jnp.einsum("...rs,...st->...rt", lam, d_j))
        return new, (beta, lam)

    start = (jnp.zeros(u.shape[1:], jnp.result_type(u, d)), eye)
    (beta0, lam0), (beta, lam) = jax.lax.scan(back, start, (u, d), reverse=True)
    return beta, lam, beta0, lam0


def decay_weights(decay: float, steps: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The weights of :func:`decayed_sums` as constants of the block length: ``filt[j, k] =
    α^{k-1-j}`` for ``k > j`` (else 0) and ``powers[k] = α^k``.

    Example:
        >>> from braintrace._algorithms._block_algebra import decay_weights
        >>> filt, powers = decay_weights(0.5, 3, "float32")
        >>> filt.tolist(), powers.tolist()
        ([[0.0, 1.0, 0.5], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], [1.0, 0.5, 0.25])
    """
    filt, powers = _decay_weights(decay, steps)
    return jnp.asarray(filt, dtype), jnp.asarray(powers, dtype)


def _decay_weights(decay: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`decay_weights` as NumPy constants (float64)."""
    lag = np.arange(steps)[None, :] - np.arange(steps)[:, None] - 1  # k - 1 - j
    filt = np.where(lag >= 0, float(decay) ** np.maximum(lag, 0), 0.0)
    return filt, float(decay) ** np.arange(steps)


SUMMED_STEPS = 4
"""In a TPU's programs (``_platform.tpu_formulations``), blocks of up to this many steps take
:func:`decayed_sums` and :func:`decayed_end` as elementwise sums of the steps (one pass that
XLA fuses, exact in the values' dtype); longer blocks, and other platforms, as products with
the constants of :func:`decay_weights` at JAX's default matmul precision, as the model's own
products (on a TPU it rounds float32 inputs to bfloat16 unless
``jax.default_matmul_precision`` asks for more). A product over a block's few steps is no use
to a matrix unit: XLA:TPU ran the product of two steps of ``(128, 131072)`` values as a
convolution over a 128-wide window with its inputs rounded to bfloat16 (ES-D-RTRL at 131,072
neurons, batch 128: estimated 2.0M cycles per block of two steps, for 128 MiB read and 128
MiB written). Summed at 8 steps (ES-D-RTRL at hidden 1024, batch 64, compiled for a v5e)
the block's estimated cycles were 6% (GRU) and 13% (LIF) more than with the products."""


def _weighted(weights: np.ndarray, values: jax.Array) -> jax.Array:
    """``Σ_k weights[k] v_k`` over the leading axis, term by term (zero weights skipped)."""
    terms = [float(w) * values[k] for k, w in enumerate(weights) if w != 0.0]
    if not terms:
        return jnp.zeros(values.shape[1:], values.dtype)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total.astype(values.dtype)


def _product(weights: np.ndarray, values: jax.Array) -> jax.Array:
    """``weights · values`` over the leading axis: in a TPU's programs summed term by term for
    up to :data:`SUMMED_STEPS` steps, else a product."""
    if values.shape[0] <= SUMMED_STEPS and tpu_formulations():
        if weights.ndim == 1:
            return _weighted(weights, values)
        return jnp.stack([_weighted(row, values) for row in weights])
    return jnp.tensordot(jnp.asarray(weights, values.dtype), values, axes=1)


def decayed_sums(values: jax.Array, decay: float, plus: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """``(c, e)`` of a block's stacked steps ``values`` ``(K, ...)``: ``c = Σ_k α^k v_k`` and
    ``e_j = Σ_{k>j} α^{k-1-j} v_k + plus_j``.

    The weights are :func:`decay_weights`' (sums term by term up to :data:`SUMMED_STEPS`
    steps, else products).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._block_algebra import decayed_sums
        >>> c, e = decayed_sums(jnp.array([1.0, 2.0, 4.0]), 0.5)
        >>> float(c), e.tolist()
        (3.0, [4.0, 4.0, 0.0])
    """
    filt, powers = _decay_weights(decay, values.shape[0])
    e = _product(filt, values)
    return _product(powers, values), e if plus is None else e + plus


def decayed_end(start: jax.Array, values: jax.Array, decay: float) -> jax.Array:
    """``α^K start + Σ_j α^{K-1-j} v_j``: the recursion ``ε ← α ε + v_j`` over a block's
    stacked steps ``values`` ``(K, ...)`` from ``start``, with the weights of
    :func:`decay_weights` (as :func:`decayed_sums`).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._block_algebra import decayed_end
        >>> float(decayed_end(jnp.array(8.0), jnp.array([1.0, 2.0]), 0.5))
        4.5
    """
    _, powers = _decay_weights(decay, values.shape[0])
    return decay ** values.shape[0] * start + _product(powers[::-1], values)
