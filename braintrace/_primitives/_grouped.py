"""The grouped (block-diagonal) ETP primitive: ``G`` independent linear maps side by side.

``x (..., I)`` is split into ``G`` groups of ``I/G`` features, group ``g`` is
mapped by its own block ``kernel[g] (I/G, O/G)`` and the ``G`` results are
concatenated to ``y (..., O)`` (multi-head projections, grouped GRUs). It equals
``x @ blockdiag(kernel[0], …, kernel[G-1])`` without storing the zero blocks.
Registered as ``etp_grouped`` (``x: (I,)``) and ``etp_grouped_batched``
(``x: (B, I)``).

Rules (per sample; ``x_g = x.reshape(G, I/G)``, ``d_g = d.reshape(G, O/G)``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dK[g, i, o] = x_g[g, i]\\, d_g[g, o], \\qquad db = d

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon_K[g, i, o] \\mapsto \\epsilon_K[g, i, o]\\, d_g[g, o],
    \\qquad \\epsilon_b[o] \\mapsto \\epsilon_b[o]\\, d[o]

Every kernel entry feeds exactly one output unit (``(g, o)``), so the D-RTRL
trace is shaped like the kernel, ``(G, I/G, O/G, S)`` per sample: ``|θ|·S``,
``G`` times smaller than the trace of the equivalent dense block-diagonal kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import (
    ETPRules,
    sum_leading,
    zeros_like_output,
    zeros_like_params,
)

__all__ = ["GROUPED_RULES", "etp_grouped_batched_p", "etp_grouped_p", "grouped_matmul"]


def _split_groups(a: jax.Array, num_groups: int) -> jax.Array:
    """``(..., G·n) -> (..., G, n)``."""
    return a.reshape(*a.shape[:-1], num_groups, a.shape[-1] // num_groups)


def _grouped_impl(x, kernel, *bias, has_bias: bool, precision):
    del has_bias
    num_groups = kernel.shape[0]
    y = jnp.einsum("...gi,gio->...go", _split_groups(x, num_groups), kernel, precision=precision)
    y = y.reshape(*y.shape[:-2], -1)
    if bias:
        y = y + bias[0]
    return y


def _grouped_layout(params) -> dict[str, int]:
    return {"kernel": 1, "bias": 2} if params["has_bias"] else {"kernel": 1}


def grouped_xy_to_dw(x, d, theta, **params) -> dict[str, jax.Array]:
    """Pullback at ``(x, θ)`` of a cotangent ``d``: ``dK[g,i,o] = Σ_lead x_g[g,i] d_g[g,o]``."""
    del params
    kernel = theta["kernel"]
    num_groups = kernel.shape[0]
    xg, dg = _split_groups(x, num_groups), _split_groups(d, num_groups)
    grads = {"kernel": jnp.einsum("...gi,...go->gio", xg, dg.astype(xg.dtype)
                                  ).astype(kernel.dtype)}
    if "bias" in theta:
        grads["bias"] = sum_leading(d).astype(theta["bias"].dtype)
    return grads


def grouped_dt_to_t(d, trace, **params) -> dict[str, jax.Array]:
    """``ε_K[..., g, i, o]·d_g[..., g, o]`` and ``ε_b[..., o]·d[..., o]``."""
    del params
    out = {}
    for key, value in trace.items():
        if key == "kernel":
            dg = _split_groups(d, value.shape[-3])
            out[key] = value * dg[..., :, None, :]
        else:
            out[key] = value * d
    return out


def grouped_contract(d, trace, **params) -> dict[str, jax.Array]:
    """``Σ_lead grouped_dt_to_t(d, trace)`` as one einsum per key."""
    del params
    out = {}
    for key, value in trace.items():
        if key == "kernel":
            dg = _split_groups(d, value.shape[-3]).astype(value.dtype)
            out[key] = jnp.einsum("...gio,...go->gio", value, dg)
        else:
            out[key] = jnp.einsum("...o,...o->o", value, d.astype(value.dtype))
    return out


GROUPED_RULES = ETPRules(
    xy_to_dw=grouped_xy_to_dw,
    dt_to_t=grouped_dt_to_t,
    init_drtrl=zeros_like_params,
    init_pp=functools.partial(zeros_like_output, dtype_of="kernel"),
    contract=grouped_contract,
)
"""The grouped rules: traces shaped like ``θ``, scaled along each block's output axis."""

etp_grouped_p, etp_grouped_batched_p = register_pair(
    "etp_grouped", _grouped_impl, GROUPED_RULES, trainable_invars_fn=_grouped_layout)


def grouped_matmul(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    precision=None,
) -> jax.Array:
    """Block-diagonal ``x @ blockdiag(kernel[0], …, kernel[G-1]) + bias`` as one ETP op.

    Args:
        x: Input ``(..., G·i)``; any number of leading batch axes.
        kernel: The ``G`` blocks, ``(G, i, o)``.
        bias: Optional bias ``(G·o,)``.
        precision: ``jax.lax.Precision`` of the products.

    Returns:
        The output ``(..., G·o)``; group ``g`` occupies features ``g·o … (g+1)·o - 1``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> kernel = jnp.stack([jnp.ones((2, 1)), 2 * jnp.ones((2, 1))])  # G=2, i=2, o=1
        >>> braintrace.grouped_matmul(jnp.array([1.0, 1.0, 1.0, 0.0]), kernel)
        Array([2., 2.], dtype=float32)
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if kernel.ndim != 3 or x.ndim < 1 or x.shape[-1] != kernel.shape[0] * kernel.shape[1]:
        raise ValueError(
            f"braintrace.grouped_matmul: x of shape {x.shape} does not match kernel of shape "
            f"{kernel.shape}; expected kernel (G, i, o) and x (..., G·i).")
    if bias is not None and jnp.shape(bias) != (kernel.shape[0] * kernel.shape[2],):
        raise ValueError(
            f"braintrace.grouped_matmul: bias of shape {jnp.shape(bias)} does not match "
            f"kernel of shape {kernel.shape}; expected bias (G·o,) = "
            f"({kernel.shape[0] * kernel.shape[2]},).")
    operands = [x, kernel] if bias is None else [x, kernel, jnp.asarray(bias)]
    params = {"has_bias": bias is not None, "precision": precision}
    if x.ndim == 1:
        return etp_grouped_p.bind(*operands, **params)
    lead = x.shape[:-1]
    operands[0] = x.reshape(-1, x.shape[-1])
    y = etp_grouped_batched_p.bind(*operands, **params)
    return y.reshape(*lead, y.shape[-1])
