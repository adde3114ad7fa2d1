r"""``Flatten``: a channels-last frame as one vector, in NIR's and PyTorch's order.

A frame ``x`` of shape ``(*spatial, C)`` becomes the vector of its channels-first
copy ``(C, *spatial)``: entry ``(c, i, j)`` of a 2-D frame goes to position
``(c·H + i)·W + j``. That is the order of ``torch.flatten`` on PyTorch's
channels-first tensors and of NIR's ``Flatten`` node, so a weight after it
means the same in braintrace, in NIR and in the tools that wrote or read the
graph (:mod:`braintrace.nir`): nothing is permuted on export or import. The
order is a convention of the next layer's weights; a network trained from
scratch learns the same either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

__all__ = ["Flatten"]


class Flatten(nnx.Module):
    r"""Flattens the last ``ndim`` axes, a channels-last frame, into one, channels first.

    No weights and no state (module docstring for the order).

    Args:
        ndim: Axes of a frame: 3 for ``(H, W, C)``, 2 for ``(L, C)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> frame = jnp.arange(12).reshape(2, 3, 2)  # (rows, columns, channels)
        >>> layers.Flatten()(frame)  # channel 0's six entries, then channel 1's
        Array([ 0,  2,  4,  6,  8, 10,  1,  3,  5,  7,  9, 11], dtype=int32)
        >>> layers.Flatten()(jnp.ones((5, 4, 4, 3))).shape  # a batch of frames
        (5, 48)
    """

    def __init__(self, ndim: int = 3):
        if not isinstance(ndim, int) or ndim < 1:
            raise ValueError(f"Flatten: ndim must be a positive int (the axes of a frame), got "
                             f"{ndim!r}.")
        self.ndim = ndim

    def __call__(self, x: ArrayLike) -> jax.Array:
        """Flattens frames ``x (*batch, *spatial, C)`` to ``(*batch, C·prod(spatial))``."""
        x = jnp.asarray(x)
        if x.ndim < self.ndim:
            raise ValueError(f"Flatten: input of shape {x.shape} has fewer than ndim={self.ndim} "
                             f"axes (a frame (*spatial, channels)).")
        batch = x.shape[:x.ndim - self.ndim]
        return jnp.moveaxis(x, -1, len(batch)).reshape(*batch, -1)
