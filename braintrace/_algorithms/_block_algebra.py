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
reads the sums :func:`decayed_sums` and :func:`decayed_end` of the stacked steps, as
products with constant ``(K, K)`` and ``(K,)`` weights on the CPU and as the recursions
themselves on accelerators (``braintrace._platform.by_platform``): a product over the step
axis has XLA:TPU lay the stack out with that axis inside its tiles, so that every step's
value is transposed as the steps stack it (ES-D-RTRL on a GRU, hidden 1024, batch 64: two
``(64, 3072)`` values per step); the recursions read and write each step's value as it was
stacked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._platform import by_platform

__all__ = ["block_coefficients", "decay_weights", "decayed_end", "decayed_sums"]

RECURSION_UNROLL = 8
"""Steps per iteration of the accelerators' recursions over a block (a loop of ``K / 8``
iterations: fewer launches than one per step, a program that does not grow with ``K``)."""


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
    lag = np.arange(steps)[None, :] - np.arange(steps)[:, None] - 1  # k - 1 - j
    filt = np.where(lag >= 0, float(decay) ** np.maximum(lag, 0), 0.0)
    return jnp.asarray(filt, dtype), jnp.asarray(float(decay) ** np.arange(steps), dtype)


def _sums_by_products(values: jax.Array, plus: jax.Array | None, *, decay: float
                      ) -> tuple[jax.Array, jax.Array]:
    filt, powers = decay_weights(decay, values.shape[0], values.dtype)
    e = jnp.tensordot(filt, values, axes=1)
    return jnp.tensordot(powers, values, axes=1), e if plus is None else e + plus


def _sums_by_recursion(values: jax.Array, plus: jax.Array | None, *, decay: float
                       ) -> tuple[jax.Array, jax.Array]:
    def back(acc, step):
        v, p = step
        return decay * acc + v, acc if p is None else acc + p

    return jax.lax.scan(back, jnp.zeros_like(values[0]), (values, plus), reverse=True,
                        unroll=RECURSION_UNROLL)


def decayed_sums(values: jax.Array, decay: float, plus: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """``(c, e)`` of a block's stacked steps ``values`` ``(K, ...)``: ``c = Σ_k α^k v_k`` and
    ``e_j = Σ_{k>j} α^{k-1-j} v_k + plus_j``.

    On the CPU two products with the constants of :func:`decay_weights`; on accelerators
    the recursion ``e_{K-1} = 0``, ``e_{j-1} = α e_j + v_j``, ending at ``c = α e_0 + v_0``,
    each step's value read and written once (the module docstring says why).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._block_algebra import decayed_sums
        >>> c, e = decayed_sums(jnp.array([1.0, 2.0, 4.0]), 0.5)
        >>> float(c), e.tolist()
        (3.0, [4.0, 4.0, 0.0])
    """
    return by_platform(cpu=functools.partial(_sums_by_products, decay=decay),
                       accelerator=functools.partial(_sums_by_recursion, decay=decay)
                       )(values, plus)


def _end_by_products(start: jax.Array, values: jax.Array, *, decay: float) -> jax.Array:
    _, powers = decay_weights(decay, values.shape[0], values.dtype)
    return decay ** values.shape[0] * start + jnp.tensordot(powers[::-1], values, axes=1)


def _end_by_recursion(start: jax.Array, values: jax.Array, *, decay: float) -> jax.Array:
    return jax.lax.scan(lambda acc, v: (decay * acc + v, None), start, values,
                        unroll=RECURSION_UNROLL)[0]


def decayed_end(start: jax.Array, values: jax.Array, decay: float) -> jax.Array:
    """``α^K start + Σ_j α^{K-1-j} v_j``: the recursion ``ε ← α ε + v_j`` over a block's
    stacked steps ``values`` ``(K, ...)`` from ``start`` (formulations as
    :func:`decayed_sums`).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._block_algebra import decayed_end
        >>> float(decayed_end(jnp.array(8.0), jnp.array([1.0, 2.0]), 0.5))
        4.5
    """
    return by_platform(cpu=functools.partial(_end_by_products, decay=decay),
                       accelerator=functools.partial(_end_by_recursion, decay=decay)
                       )(start, values)
