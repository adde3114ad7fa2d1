"""The dense ETP primitive: ``y = x @ T(kernel) (+ bias)`` and its trace rules.

``kernel`` has shape ``(I, O)`` as in :class:`flax.nnx.Linear`; ``T`` is an
optional static, elementwise kernel transform (a fixed mask, a sign
constraint) whose Jacobian the rules include. Two primitives are registered:
``etp_dense`` for ``x: (I,)`` and ``etp_dense_batched`` for ``x: (B, I)``.

Rules (per sample ``x: (I,)``, output cotangent ``d: (O,)``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dK = T'(K)^\\top (x \\otimes d), \\qquad db = d

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon_K[i, o] \\mapsto \\epsilon_K[i, o]\\, d[o],
    \\qquad \\epsilon_b[o] \\mapsto \\epsilon_b[o]\\, d[o]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
    zeros_like_params,
)

__all__ = ["DENSE_RULES", "etp_dense_batched_p", "etp_dense_p", "matmul"]


def _dense_impl(x, kernel, *bias, has_bias: bool, kernel_transform, precision):
    del has_bias
    if kernel_transform is not None:
        kernel = kernel_transform(kernel)
    y = jnp.matmul(x, kernel, precision=precision)
    if bias:
        y = y + bias[0]
    return y


def _dense_layout(params) -> dict[str, int]:
    return {"kernel": 1, "bias": 2} if params["has_bias"] else {"kernel": 1}


def _transform_pullback(kernel: jax.Array, dkernel: jax.Array, kernel_transform) -> jax.Array:
    if kernel_transform is None:
        return dkernel
    _, pullback = jax.vjp(kernel_transform, kernel)
    return pullback(dkernel.astype(kernel.dtype))[0]


def dense_xy_to_dw(x, d, theta, *, kernel_transform=None, **params) -> dict[str, jax.Array]:
    """Pullback of the dense map at ``(x, θ)`` with output cotangent ``d``.

    ``x: (..., I)`` and ``d: (..., O)``; leading axes are summed over.
    """
    del params
    kernel = theta["kernel"]
    dkernel = outer_sum(x, d).astype(kernel.dtype)
    grads = {"kernel": _transform_pullback(kernel, dkernel, kernel_transform)}
    if "bias" in theta:
        grads["bias"] = sum_leading(d).astype(theta["bias"].dtype)
    return grads


DENSE_RULES = ETPRules(
    xy_to_dw=dense_xy_to_dw,
    dt_to_t=scale_output_axis,
    init_drtrl=zeros_like_params,
    init_pp=functools.partial(zeros_like_output, dtype_of="kernel"),
    contract=output_axis_contract,
)
"""The dense rules: traces shaped like ``θ``, scaled along their output axis."""

etp_dense_p, etp_dense_batched_p = register_pair(
    "etp_dense", _dense_impl, DENSE_RULES, trainable_invars_fn=_dense_layout)


def matmul(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    kernel_transform: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
) -> jax.Array:
    """``x @ kernel_transform(kernel) + bias`` through the dense ETP primitive.

    Any number of leading batch axes is accepted: ``x: (I,)`` binds the
    per-sample primitive, ``x: (..., I)`` the batched one on ``x`` reshaped
    to ``(B, I)``.

    Args:
        x: Input of shape ``(..., I)``; integer inputs (spike counts) are fine.
        kernel: Weight of shape ``(I, O)``.
        bias: Optional bias of shape ``(O,)``.
        kernel_transform: Optional static elementwise transform of the kernel
            (e.g. ``jnp.abs`` for a sign constraint). Pass the same function
            object each call so compiled programs are reused.
        precision: ``jax.lax.Precision`` of the matmul.

    Returns:
        The output of shape ``(..., O)``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> braintrace.matmul(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones(4))
        Array([[4., 4., 4., 4.],
               [4., 4., 4., 4.]], dtype=float32)
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"braintrace.matmul: x of shape {x.shape} does not match kernel of shape "
            f"{kernel.shape}; expected x (..., I) and kernel (I, O).")
    operands = [x, kernel] if bias is None else [x, kernel, jnp.asarray(bias)]
    params = {"has_bias": bias is not None, "kernel_transform": kernel_transform,
              "precision": precision}
    if x.ndim == 1:
        return etp_dense_p.bind(*operands, **params)
    lead = x.shape[:-1]
    operands[0] = x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x
    y = etp_dense_batched_p.bind(*operands, **params)
    return y.reshape(*lead, y.shape[-1]) if x.ndim > 2 else y
