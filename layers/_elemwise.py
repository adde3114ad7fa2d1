"""``ETPElemwise``: a learnable elementwise parameter behind a transform, and ``ExpDecay``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype
from jax.typing import ArrayLike

from braintrace._primitives import element_wise

__all__ = ["ETPElemwise", "ExpDecay"]


@dataclasses.dataclass(frozen=True)
class ExpDecay:
    """The transform ``tau -> exp(-dt / tau)`` from a time constant to a per-step decay.

    A frozen dataclass, so equal step sizes give equal (hashable) transforms
    and compiled programs are reused.

    Attributes:
        dt: The simulation step, in the units of ``tau``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> layers.ExpDecay(dt=1.0)(jnp.array([1.0, 10.0])).round(3)
        Array([0.368, 0.905], dtype=float32)
    """

    dt: float = 1.0

    def __call__(self, tau: jax.Array) -> jax.Array:
        """Returns ``exp(-dt / tau)``."""
        return jnp.exp(-self.dt / tau)


class ETPElemwise(nnx.Module):
    """A learnable parameter ``weight`` read through a transform: ``fn(weight)``.

    The read runs through :func:`braintrace.element_wise`, so the compiler
    follows ``weight`` into the hidden states it scales (learnable time
    constants, gains, gates). ``fn`` must be elementwise and is stored as a
    static attribute: pass a module-level function or a frozen dataclass such
    as :class:`ExpDecay`, not a fresh lambda per layer call.

    Args:
        value: Initial value of ``weight``; its shape is the parameter's shape
            (a scalar or e.g. ``(n,)``, broadcast against the state it feeds).
        fn: The elementwise transform; ``None`` is the identity.
        param_dtype: Dtype of ``weight``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace import layers
        >>> gate = layers.ETPElemwise(jnp.zeros(3), jax.nn.sigmoid)
        >>> gate()
        Array([0.5, 0.5, 0.5], dtype=float32)
        >>> tau = layers.ETPElemwise(jnp.full(2, 10.0), layers.ExpDecay(dt=1.0))
        >>> tau.weight.shape, tau().shape
        ((2,), (2,))
    """

    def __init__(
        self,
        value: ArrayLike,
        fn: Callable[[jax.Array], jax.Array] | None = None,
        *,
        param_dtype: Dtype = jnp.float32,
    ):
        self.weight = nnx.Param(jnp.asarray(value, dtype=param_dtype))
        self.fn = fn

    def __call__(self) -> jax.Array:
        """Returns ``fn(weight)``."""
        return element_wise(self.weight[...], self.fn)


def time_constant(tau: float, dt: float, learn: bool, size: int,
                  param_dtype: Dtype) -> float | ETPElemwise:
    """A fixed time constant (a float) or a learnable one (an :class:`ETPElemwise`)."""
    if not tau > 0 or not dt > 0:
        raise ValueError(f"time constants and dt must be positive, got tau={tau}, dt={dt}.")
    if learn:
        return ETPElemwise(jnp.full((size,), tau), ExpDecay(dt), param_dtype=param_dtype)
    return float(tau)


def decay(tau: float | ETPElemwise, dt: float) -> jax.Array | float:
    """The per-step decay ``exp(-dt/τ)`` of a time constant made by :func:`time_constant`."""
    if isinstance(tau, ETPElemwise):
        return tau()
    return math.exp(-dt / tau)
