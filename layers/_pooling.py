r"""Pooling of channels-last frames: the sum or the mean of each window, per channel.

For a frame ``x`` of shape ``(H, W, C)``, windows of ``k = (k_h, k_w)`` moved
by ``s`` over the frame zero-padded by ``p`` on both sides of each axis:

.. math::

    \mathrm{SumPool}(x)_{ijc} = \sum_{a < k_h,\ b < k_w} \tilde x_{i s_h + a,\ j s_w + b,\ c},
    \qquad \mathrm{AvgPool}(x) = \frac{\mathrm{SumPool}(x)}{k_h k_w},

with ``x̃`` the padded frame; the output has
``⌊(H + 2p_h - k_h)/s_h⌋ + 1`` rows (likewise columns). The stride defaults to
the window (non-overlapping windows) and the padding counts in the mean, as in
PyTorch's ``SumPool2d``/``AvgPool2d`` and NIR's nodes of those names (to and
from which these export and import, :mod:`braintrace.nir`). No weights and no
state: a spiking convolutional network pools its spikes between
:class:`ConvLIF` layers, and the compiler sees the pooling as part of the
next layer's input.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

__all__ = ["AvgPool2d", "SumPool2d"]


def _pair(value: int | Sequence[int], name: str, cls: str, smallest: int) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= smallest for v in pair):
        raise ValueError(f"{cls}: {name} must be an int >= {smallest} or two of them (rows, "
                         f"columns), got {value!r}.")
    return pair


class _Pool2d(nnx.Module):
    """Window size, strides and padding, and the window sum they define."""

    def __init__(self, kernel_size: int | Sequence[int],
                 strides: int | Sequence[int] | None = None, padding: int | Sequence[int] = 0):
        cls = type(self).__name__
        self.kernel_size = _pair(kernel_size, "kernel_size", cls, 1)
        self.strides = self.kernel_size if strides is None else _pair(strides, "strides", cls, 1)
        self.padding = _pair(padding, "padding", cls, 0)

    def _window_sum(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim < 3:
            raise ValueError(f"{type(self).__name__}: input of shape {x.shape} is not a frame "
                             f"(*batch, rows, columns, channels).")
        lead = (1,) * (x.ndim - 3)
        pads = ((0, 0),) * (x.ndim - 3) + tuple((p, p) for p in self.padding) + ((0, 0),)
        zero = np.zeros((), x.dtype)  # concrete: lax takes its differentiable window sum
        return jax.lax.reduce_window(x, zero, jax.lax.add,
                                     lead + self.kernel_size + (1,), lead + self.strides + (1,),
                                     pads)

    def output_shape(self, frame: Sequence[int]) -> tuple[int, int, int]:
        """The pooled frame shape ``(rows, columns, channels)`` of a frame ``(H, W, C)``."""
        rows, cols, channels = frame
        size = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(
            (rows, cols), self.kernel_size, self.strides, self.padding, strict=True)]
        return (*size, channels)


class SumPool2d(_Pool2d):
    r"""The sum of each window of a channels-last frame, per channel (a spike count per window).

    Args:
        kernel_size: Window ``(k_h, k_w)``, or one int for both.
        strides: Window step; default: the window (non-overlapping).
        padding: Zeros added on both sides of each spatial axis.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> pool = layers.SumPool2d(2)
        >>> spikes = jnp.ones((8, 4, 6, 3))  # (batch, rows, columns, channels)
        >>> pool(spikes).shape, float(pool(spikes)[0, 0, 0, 0])
        ((8, 2, 3, 3), 4.0)
    """

    def __call__(self, x: ArrayLike) -> jax.Array:
        """Pools frames ``x (*batch, H, W, C)``."""
        return self._window_sum(x)


class AvgPool2d(_Pool2d):
    r"""The mean of each window of a channels-last frame, per channel (padding counts as zeros).

    Args:
        kernel_size: Window ``(k_h, k_w)``, or one int for both.
        strides: Window step; default: the window (non-overlapping).
        padding: Zeros added on both sides of each spatial axis.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> pool = layers.AvgPool2d(2, padding=1)
        >>> pool(jnp.ones((2, 2, 1)))[..., 0]  # each window holds one of the four ones
        Array([[0.25, 0.25],
               [0.25, 0.25]], dtype=float32)
    """

    def __call__(self, x: ArrayLike) -> jax.Array:
        """Pools frames ``x (*batch, H, W, C)``."""
        return self._window_sum(x) / (self.kernel_size[0] * self.kernel_size[1])
