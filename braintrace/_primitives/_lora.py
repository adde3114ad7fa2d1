"""The LoRA ETP primitive: ``y = s·(x @ A) @ B (+ bias) (+ x @ K₀)``.

``lora_a (I, r)`` and ``lora_b (r, O)`` as in :class:`flax.nnx.LoRA`;
``K₀`` is an optional frozen base kernel (not trainable here). Registered as
``etp_lora`` (``x: (I,)``) and ``etp_lora_batched`` (``x: (B, I)``).

Rules (per sample ``x: (I,)``, cotangent ``d: (O,)``, ``u = x @ A``):

.. math::

    dA = s\\, x \\otimes (B d), \\qquad dB = s\\, u \\otimes d, \\qquad db = d

The D-RTRL trace of ``lora_a`` cannot be discounted along the output axis
that ``A`` lacks, so it is kept in the space of the effective dense weight
``W = s·A B`` (shape ``(I, O)``), whose instantaneous term is ``x ⊗ d``, and
chained through the current ``B`` when solving: ``dA = s·G_W Bᵀ``. This is
exact because ``h`` depends on ``A`` only through ``W``. The traces of
``lora_b (r, O)`` and ``bias (O,)`` keep the output axis and are discounted
directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import (
    ETPRules,
    outer_sum,
    output_axis_contract,
    scale_output_axis,
    sum_leading,
    zeros_like_output,
)

__all__ = ["LORA_RULES", "etp_lora_batched_p", "etp_lora_p", "lora_matmul"]


def _lora_impl(x, lora_a, lora_b, *rest, has_bias: bool, has_base: bool, scaling: float):
    y = scaling * ((x @ lora_a) @ lora_b)
    rest = list(rest)
    if has_bias:
        y = y + rest.pop(0)
    if has_base:
        y = y + x @ rest.pop(0)
    return y


def _lora_layout(params) -> dict[str, int]:
    layout = {"lora_a": 1, "lora_b": 2}
    if params["has_bias"]:
        layout["bias"] = 3
    return layout


def _lora_b_and_bias(x, d, theta, scaling: float) -> dict[str, jax.Array]:
    """The ``lora_b`` and ``bias`` terms, the same in the pullback and in the trace."""
    terms = {"lora_b": (scaling * jnp.einsum("...r,...o->ro", x @ theta["lora_a"], d)
                        ).astype(theta["lora_b"].dtype)}
    if "bias" in theta:
        terms["bias"] = sum_leading(d).astype(theta["bias"].dtype)
    return terms


def lora_xy_to_dw(x, d, theta, *, scaling: float, **params) -> dict[str, jax.Array]:
    """Pullback of the LoRA map at ``(x, θ)``; leading axes of ``x``/``d`` are summed."""
    del params
    a, b = theta["lora_a"], theta["lora_b"]
    dlora_a = (scaling * jnp.einsum("...i,...r->ir", x, d @ b.T)).astype(a.dtype)
    return {"lora_a": dlora_a, **_lora_b_and_bias(x, d, theta, scaling)}


def lora_xy_to_trace(x, d, theta, *, scaling: float, **params) -> dict[str, jax.Array]:
    """Instantaneous D-RTRL term; ``lora_a``'s lives in the effective-weight space."""
    del params
    w_term = outer_sum(x, d).astype(theta["lora_a"].dtype)
    return {"lora_a": w_term, **_lora_b_and_bias(x, d, theta, scaling)}


def lora_trace_to_dw(g, theta, *, scaling: float, **params) -> dict[str, jax.Array]:
    """Maps contracted traces to gradients: ``dA = s·G_W Bᵀ``, others unchanged."""
    del params
    grads = dict(g)
    grads["lora_a"] = scaling * (g["lora_a"] @ theta["lora_b"].T)
    return grads


def lora_init_drtrl(x, y, theta, num_states: int) -> dict[str, jax.Array]:
    """Per-sample D-RTRL traces: ``lora_a (I, O, S)``, ``lora_b (r, O, S)``, ``bias (O, S)``."""
    del x
    out = jnp.shape(y)[-1]
    a, b = theta["lora_a"], theta["lora_b"]
    trace = {
        "lora_a": jnp.zeros((a.shape[0], out, num_states), a.dtype),
        "lora_b": jnp.zeros((*b.shape, num_states), b.dtype),
    }
    if "bias" in theta:
        trace["bias"] = jnp.zeros((*theta["bias"].shape, num_states), theta["bias"].dtype)
    return trace


LORA_RULES = ETPRules(
    xy_to_dw=lora_xy_to_dw,
    dt_to_t=scale_output_axis,
    init_drtrl=lora_init_drtrl,
    init_pp=functools.partial(zeros_like_output, dtype_of="lora_b"),
    xy_to_trace=lora_xy_to_trace,
    trace_to_dw=lora_trace_to_dw,
    contract=output_axis_contract,
)
"""The LoRA rules: ``lora_a``'s trace kept as the effective weight's, all scaled along ``O``."""

etp_lora_p, etp_lora_batched_p = register_pair(
    "etp_lora", _lora_impl, LORA_RULES, trainable_invars_fn=_lora_layout)


def lora_matmul(
    x: ArrayLike,
    lora_a: ArrayLike,
    lora_b: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    base_kernel: ArrayLike | None = None,
    scaling: float = 1.0,
) -> jax.Array:
    """``scaling·(x @ lora_a) @ lora_b + bias + x @ base_kernel`` as one ETP op.

    Args:
        x: Input ``(..., I)``; any number of leading batch axes.
        lora_a: Down-projection ``(I, r)``.
        lora_b: Up-projection ``(r, O)``.
        bias: Optional bias ``(O,)``.
        base_kernel: Optional frozen kernel ``(I, O)``; it is not trained online.
        scaling: Static scale of the low-rank term.

    Returns:
        The output ``(..., O)``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> braintrace.lora_matmul(jnp.ones(3), jnp.ones((3, 2)), jnp.ones((2, 4)))
        Array([6., 6., 6., 6.], dtype=float32)
    """
    x, lora_a, lora_b = jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b)
    if (lora_a.ndim != 2 or lora_b.ndim != 2 or x.ndim < 1 or x.shape[-1] != lora_a.shape[0]
            or lora_a.shape[1] != lora_b.shape[0]):
        raise ValueError(
            f"braintrace.lora_matmul: shapes x {x.shape}, lora_a {lora_a.shape}, lora_b "
            f"{lora_b.shape} do not chain; expected x (..., I), lora_a (I, r), lora_b (r, O).")
    operands = [x, lora_a, lora_b]
    if bias is not None:
        operands.append(jnp.asarray(bias))
    if base_kernel is not None:
        operands.append(jnp.asarray(base_kernel))
    params = {"has_bias": bias is not None, "has_base": base_kernel is not None,
              "scaling": float(scaling)}
    if x.ndim == 1:
        return etp_lora_p.bind(*operands, **params)
    lead = x.shape[:-1]
    operands[0] = x.reshape(-1, x.shape[-1])
    y = etp_lora_batched_p.bind(*operands, **params)
    return y.reshape(*lead, y.shape[-1])
