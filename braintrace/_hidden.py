"""Hidden state: the recurrent state that eligibility traces follow through time."""

from __future__ import annotations

from flax import nnx

__all__ = ["HiddenState"]


class HiddenState(nnx.Variable):
    """A recurrent state variable of a model step (membrane potential, RNN carry).

    A subclass of :class:`flax.nnx.Variable` but not of :class:`flax.nnx.Param`,
    so optimisers created with ``wrt=nnx.Param`` skip it. A model step reads its
    hidden states at ``t-1`` and writes them at ``t``; the compiler finds them
    by type.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> class Leaky(nnx.Module):
        ...     def __init__(self):
        ...         self.h = braintrace.HiddenState(jnp.zeros(3))
        ...     def __call__(self, x):
        ...         self.h[...] = 0.9 * self.h[...] + x
        ...         return self.h[...]
        >>> model = Leaky()
        >>> model(jnp.ones(3))
        Array([1., 1., 1.], dtype=float32)
        >>> len(nnx.state(model, nnx.Param))
        0
    """
