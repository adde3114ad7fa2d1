"""The elementwise ETP primitive: ``y = fn(w)`` with no input ``x``.

For learnable time constants, gains and thresholds. The primitive is
gradient-enabled, and its traces are shaped like the hidden group its output
feeds (``y`` broadcast to that group's shape), so a scalar or per-neuron
parameter shared across a batch is traced exactly.

Rules (per sample, ``d`` and traces shaped like the broadcast ``y``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dw = \\mathrm{fn}'(w)^\\top\\, \\mathrm{sum\\_to\\_y}(d),
    \\qquad \\mathrm{dt\\_to\\_t}: \\quad \\epsilon \\mapsto \\epsilon \\odot d
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._core import ETPPrimitive
from braintrace._primitives._register import register_primitive
from braintrace._primitives._rules import ETPRules, scale_output_axis, zeros_like_output

__all__ = ["ELEMWISE_RULES", "element_wise", "etp_elemwise_p"]


def _identity(w):
    return w


def _elemwise_impl(weight, *, fn):
    return fn(weight)


def _sum_to_shape(d: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums ``d`` over the axes along which ``shape`` was broadcast to ``d.shape``."""
    extra = d.ndim - len(shape)
    d = jnp.sum(d, axis=tuple(range(extra))) if extra > 0 else d
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and d.shape[i] != 1)
    return jnp.sum(d, axis=axes, keepdims=True) if axes else d


def elemwise_xy_to_dw(x, d, theta, *, fn, **params) -> dict[str, jax.Array]:
    """Pullback of ``fn`` at ``w`` of a cotangent ``d`` shaped like (a broadcast of) ``y``."""
    del x, params
    w = theta["weight"]
    y, pullback = jax.vjp(fn, w)
    (dw,) = pullback(_sum_to_shape(d, y.shape).astype(y.dtype))
    return {"weight": dw}


def elemwise_init_drtrl(x, y, theta, num_states: int) -> dict[str, jax.Array]:
    """Per-sample trace shaped like ``y`` broadcast to the hidden group: ``(*y.shape, S)``."""
    return {"weight": zeros_like_output(x, y, theta, num_states, dtype_of="weight")}


ELEMWISE_RULES = ETPRules(
    xy_to_dw=elemwise_xy_to_dw,
    dt_to_t=scale_output_axis,
    init_drtrl=elemwise_init_drtrl,
    init_pp=functools.partial(zeros_like_output, dtype_of="weight"),
)
"""The elementwise rules: one trace shaped like the hidden group, scaled elementwise."""

etp_elemwise_p: ETPPrimitive = register_primitive(
    "etp_elemwise", _elemwise_impl, gradient_enabled=True,
    trainable_invars_fn=lambda params: {"weight": 0}, x_invar_index=None)
etp_elemwise_p.register_etp_rules(ELEMWISE_RULES)


def element_wise(weight: ArrayLike, fn: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """``fn(weight)`` through the elementwise ETP primitive.

    Args:
        weight: The trainable parameter (any shape broadcastable to the hidden
            state it feeds).
        fn: A static elementwise transform, e.g. ``lambda tau: jnp.exp(-dt / tau)``.
            Pass the same function object each call so compiled programs are
            reused. ``None`` is the identity.

    Returns:
        ``fn(weight)``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> braintrace.element_wise(jnp.array([0.0, 1.0]), jnp.exp)
        Array([1.       , 2.7182817], dtype=float32)
    """
    return etp_elemwise_p.bind(jnp.asarray(weight), fn=_identity if fn is None else fn)
