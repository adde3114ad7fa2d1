"""The default initialisers of the recurrent cells, shared by their modules.

The same defaults as Flax NNX's recurrent cells (``flax.nnx.nn.recurrent``):
LeCun-normal input kernels, orthogonal recurrent kernels, zero biases.

Example:
    >>> import jax
    >>> from braintrace.layers._initializers import orthogonal, zeros
    >>> w = orthogonal(jax.random.key(0), (3, 3))
    >>> bool(jax.numpy.allclose(w @ w.T, jax.numpy.eye(3), atol=1e-5))
    True
    >>> zeros(jax.random.key(0), (2,)).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

from flax.nnx.nn import initializers

__all__ = ["lecun_normal", "orthogonal", "zeros"]

lecun_normal = initializers.lecun_normal()
"""Input kernels: LeCun normal."""

orthogonal = initializers.orthogonal()
"""Recurrent kernels: orthogonal."""

zeros = initializers.zeros_init()
"""Biases: zeros."""
