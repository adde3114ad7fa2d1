r"""The spike function: a Heaviside step forward, a surrogate derivative backward.

``spike(x) = H(x)`` (``1`` where ``x > 0``, else ``0``) is wrapped in
:func:`jax.custom_jvp`, whose tangent rule uses a smooth pseudo-derivative
``σ'(x)`` chosen by name (``alpha`` sets its sharpness):

================  ==========================================  =========
name              :math:`σ'(x)`                               ``alpha``
================  ==========================================  =========
``sigmoid``       :math:`α\,s(αx)(1 - s(αx))`, ``s`` logistic  4
``fast_sigmoid``  :math:`1 / (1 + α|x|)^2` (alias              10
                  ``superspike``, Zenke & Ganguli 2018)
``triangle``      :math:`α \max(0, 1 - α|x|)`                  1
``arctan``        :math:`(α/2) / (1 + (παx/2)^2)`              2
================  ==========================================  =========
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["SURROGATES", "spike"]


def _sigmoid(x: jax.Array, alpha: float) -> jax.Array:
    s = jax.nn.sigmoid(alpha * x)
    return alpha * s * (1.0 - s)


def _fast_sigmoid(x: jax.Array, alpha: float) -> jax.Array:
    return 1.0 / (1.0 + alpha * jnp.abs(x)) ** 2


def _triangle(x: jax.Array, alpha: float) -> jax.Array:
    return alpha * jnp.maximum(0.0, 1.0 - alpha * jnp.abs(x))


def _arctan(x: jax.Array, alpha: float) -> jax.Array:
    return (alpha / 2.0) / (1.0 + (math.pi / 2.0 * alpha * x) ** 2)


_DERIVATIVES: dict[str, tuple[Callable[[jax.Array, float], jax.Array], float]] = {
    "sigmoid": (_sigmoid, 4.0),
    "fast_sigmoid": (_fast_sigmoid, 10.0),
    "superspike": (_fast_sigmoid, 10.0),
    "triangle": (_triangle, 1.0),
    "arctan": (_arctan, 2.0),
}

SURROGATES: tuple[str, ...] = tuple(_DERIVATIVES)
"""Names of the available surrogate derivatives."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _heaviside(x: jax.Array, surrogate: str, alpha: float) -> jax.Array:
    del surrogate, alpha
    return (x > 0).astype(x.dtype)


@_heaviside.defjvp
def _heaviside_jvp(surrogate: str, alpha: float, primals, tangents):
    (x,), (dx,) = primals, tangents
    derivative = _DERIVATIVES[surrogate][0](x, alpha).astype(x.dtype)
    return _heaviside(x, surrogate, alpha), derivative * dx


def spike(x: ArrayLike, surrogate: str = "fast_sigmoid", alpha: float | None = None) -> jax.Array:
    """Heaviside step ``H(x)`` whose derivative is replaced by a surrogate.

    Args:
        x: The distance to threshold (e.g. ``v - v_th``), a floating array.
        surrogate: Name of the surrogate derivative, one of :data:`SURROGATES`.
        alpha: Sharpness of the surrogate; ``None`` takes the name's default.

    Returns:
        Spikes: ``1.0`` where ``x > 0``, else ``0.0``, in ``x``'s dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace import layers
        >>> layers.spike(jnp.array([-0.5, 0.0, 0.5]))
        Array([0., 0., 1.], dtype=float32)
        >>> float(jax.grad(lambda x: layers.spike(x, 'fast_sigmoid', 10.0))(0.1))
        0.25
    """
    if surrogate not in _DERIVATIVES:
        raise ValueError(f"spike: unknown surrogate {surrogate!r}; choose one of {SURROGATES}.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return _heaviside(x, surrogate, float(_DERIVATIVES[surrogate][1] if alpha is None else alpha))
