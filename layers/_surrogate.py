r"""The spike function: a Heaviside step forward, a surrogate derivative backward.

``spike(x) = H(x)`` (``1`` where ``x > 0``, else ``0``) is wrapped in
:func:`jax.custom_jvp`, whose tangent rule uses a smooth pseudo-derivative
``σ'(x)`` chosen by name (``alpha`` sets its sharpness):

================  ==============================================  =========
name              :math:`σ'(x)`                                   ``alpha``
================  ==============================================  =========
``sigmoid``       :math:`α\,s(αx)(1 - s(αx))`, ``s`` logistic      4
``fast_sigmoid``  :math:`1 / (1 + α|x|)^2` (alias                  10
                  ``superspike``, Zenke & Ganguli 2018)
``triangle``      :math:`α \max(0, 1 - α|x|)`                      1
``arctan``        :math:`(α/2) / (1 + (παx/2)^2)`                  2
``tanh``          :math:`(α/2)(1 - \tanh^2(αx))`                   2
``boxcar``        :math:`α/2` where :math:`|x| < 1/α`, else 0      1
                  (alias ``rectangular``)
================  ==============================================  =========

All but ``fast_sigmoid`` are the derivative of a smooth step from 0 to 1 (they
integrate to 1). Any other surrogate is a function instead of a name:

* a function ``x -> σ'(x)``, the surrogate derivative (the forward stays the
  Heaviside step), e.g. ``lambda x: jnp.exp(-x ** 2)``;
* a whole spike function of the user's, a :func:`jax.custom_jvp` or
  :func:`jax.custom_vjp` (also under :func:`jax.jit`, and so spyx's
  ``spyx.axn`` activations): it is called as it is, forward and derivative.

Pass a module-level function (it is a static attribute of a neuron: a new
lambda per neuron is a new compiled program). A plain function that looks like
a spike function (``0`` at ``-1``, ``1`` at ``1``) is refused: its derivative
would be a straight-through one nobody asked for.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["SURROGATES", "Surrogate", "check_surrogate", "spike"]

Surrogate = str | Callable[[jax.Array], jax.Array]
"""A surrogate: a name of :data:`SURROGATES`, a derivative ``x -> σ'(x)`` or a spike function."""


def _sigmoid(x: jax.Array, alpha: float) -> jax.Array:
    s = jax.nn.sigmoid(alpha * x)
    return alpha * s * (1.0 - s)


def _fast_sigmoid(x: jax.Array, alpha: float) -> jax.Array:
    return 1.0 / (1.0 + alpha * jnp.abs(x)) ** 2


def _triangle(x: jax.Array, alpha: float) -> jax.Array:
    return alpha * jnp.maximum(0.0, 1.0 - alpha * jnp.abs(x))


def _arctan(x: jax.Array, alpha: float) -> jax.Array:
    return (alpha / 2.0) / (1.0 + (math.pi / 2.0 * alpha * x) ** 2)


def _tanh(x: jax.Array, alpha: float) -> jax.Array:
    return (alpha / 2.0) * (1.0 - jnp.tanh(alpha * x) ** 2)


def _boxcar(x: jax.Array, alpha: float) -> jax.Array:
    return jnp.where(alpha * jnp.abs(x) < 1.0, alpha / 2.0, 0.0)


_DERIVATIVES: dict[str, tuple[Callable[[jax.Array, float], jax.Array], float]] = {
    "sigmoid": (_sigmoid, 4.0),
    "fast_sigmoid": (_fast_sigmoid, 10.0),
    "superspike": (_fast_sigmoid, 10.0),
    "triangle": (_triangle, 1.0),
    "arctan": (_arctan, 2.0),
    "tanh": (_tanh, 2.0),
    "boxcar": (_boxcar, 1.0),
    "rectangular": (_boxcar, 1.0),
}

SURROGATES: tuple[str, ...] = tuple(_DERIVATIVES)
"""Names of the built-in surrogate derivatives."""


def _spike_function(surrogate: Callable) -> Callable | None:
    """The user's custom-derivative spike function in ``surrogate`` (unwrapping ``jax.jit``),
    or ``None`` when ``surrogate`` is a plain function (a derivative)."""
    fn = surrogate
    while fn is not None:
        if isinstance(fn, (jax.custom_jvp, jax.custom_vjp)):
            return surrogate
        fn = getattr(fn, "__wrapped__", None)
    return None


def check_surrogate(surrogate: Surrogate, alpha: float | None = None) -> None:
    """Raises unless ``surrogate`` is a known name or a usable function (module docstring).

    Args:
        surrogate: A name of :data:`SURROGATES`, a derivative ``x -> σ'(x)`` or a spike
            function with its own derivative.
        alpha: The sharpness; only a named surrogate takes one.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace.layers._surrogate import check_surrogate
        >>> check_surrogate('tanh', 3.0)
        >>> check_surrogate(lambda x: (x > 0).astype(x.dtype))
        Traceback (most recent call last):
        ValueError: surrogate <lambda>: returns 0 at -1 and 1 at 1, as a spike function does; ...
    """
    if isinstance(surrogate, str):
        if surrogate not in _DERIVATIVES:
            raise ValueError(f"unknown surrogate {surrogate!r}; choose one of {SURROGATES}, or "
                             f"pass a function x -> σ'(x).")
        return
    if not callable(surrogate):
        raise TypeError(f"surrogate must be a name of {SURROGATES} or a function, got "
                        f"{surrogate!r}.")
    name = getattr(surrogate, "__name__", repr(surrogate))
    if alpha is not None:
        raise ValueError(f"surrogate {name}: alpha={alpha} sets the sharpness of a named "
                         f"surrogate only; put it inside your function.")
    if _spike_function(surrogate) is not None:
        return
    with jax.ensure_compile_time_eval():
        probe = np.asarray(surrogate(jnp.array([-1.0, 1.0])))
    if probe.shape == (2,) and probe[0] == 0 and probe[1] == 1:
        raise ValueError(
            f"surrogate {name}: returns 0 at -1 and 1 at 1, as a spike function does; a plain "
            f"function is taken as the surrogate derivative σ'(x). Pass the derivative, or "
            f"wrap your spike function in jax.custom_jvp (or jax.custom_vjp) to keep its own "
            f"derivative.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _heaviside(x: jax.Array, surrogate: Surrogate, alpha: float) -> jax.Array:
    del surrogate, alpha
    return (x > 0).astype(x.dtype)


@_heaviside.defjvp
def _heaviside_jvp(surrogate: Surrogate, alpha: float, primals, tangents):
    (x,), (dx,) = primals, tangents
    if isinstance(surrogate, str):
        derivative = _DERIVATIVES[surrogate][0](x, alpha)
    else:
        derivative = surrogate(x)
    return _heaviside(x, surrogate, alpha), jnp.asarray(derivative).astype(x.dtype) * dx


def spike(x: ArrayLike, surrogate: Surrogate = "fast_sigmoid",
          alpha: float | None = None) -> jax.Array:
    """Heaviside step ``H(x)`` whose derivative is replaced by a surrogate.

    Args:
        x: The distance to threshold (e.g. ``v - v_th``), a floating array.
        surrogate: A name of :data:`SURROGATES`, a function ``x -> σ'(x)`` (the surrogate
            derivative), or a spike function with its own derivative (a
            :func:`jax.custom_jvp` or :func:`jax.custom_vjp`, called as it is).
        alpha: Sharpness of a named surrogate; ``None`` takes the name's default.

    Returns:
        Spikes: ``1.0`` where ``x > 0``, else ``0.0``, in ``x``'s dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace import layers
        >>> layers.spike(jnp.array([-0.5, 0.0, 0.5]))
        Array([0., 0., 1.], dtype=float32)
        >>> float(jax.grad(lambda x: layers.spike(x, 'fast_sigmoid', 10.0))(0.1))
        0.25
        >>> float(jax.grad(lambda x: layers.spike(x, 'boxcar'))(0.5))
        0.5
        >>> def gaussian(x):
        ...     return jnp.exp(-x ** 2)
        >>> float(jax.grad(lambda x: layers.spike(x, gaussian))(1.0))  # exp(-1)
        0.3678794503211975
    """
    check_surrogate(surrogate, alpha)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    if not isinstance(surrogate, str):
        if _spike_function(surrogate) is not None:
            return surrogate(x)
        return _heaviside(x, surrogate, 0.0)
    return _heaviside(x, surrogate, float(_DERIVATIVES[surrogate][1] if alpha is None else alpha))
