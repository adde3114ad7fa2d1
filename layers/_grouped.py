"""``ETPGroupedLinear``: ``G`` independent linear blocks (block-diagonal / multi-head)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init
from flax.typing import Dtype, Initializer, PrecisionLike
from jax.typing import ArrayLike

from braintrace._primitives import grouped_matmul

from ._checks import check_features
from ._params import bias_param

__all__ = ["ETPGroupedLinear", "default_grouped_kernel_init"]

default_grouped_kernel_init: Initializer = nnx.initializers.lecun_normal(batch_axis=(0,))
"""``nnx.Linear``'s default (LeCun normal) applied per block: fan-in ``in_features / G``."""


class ETPGroupedLinear(nnx.Module):
    """``G`` independent linear maps side by side, ``y_g = x_g @ kernel[g] + b_g``, learning online.

    The input's last axis is split into ``num_groups`` contiguous groups of
    ``in_features / G`` features, group ``g`` goes through its own block
    ``kernel[g]`` and the outputs are concatenated: the same map as a linear
    layer with a block-diagonal kernel, without the zero blocks (fewer Params,
    fewer FLOPs, a ``G`` times smaller D-RTRL trace).

    Param tree: ``kernel (G, in/G, out/G)`` and, with ``use_bias``,
    ``bias (out,)`` (the ``G`` block biases concatenated). The default kernel
    initialiser is ``nnx.Linear``'s (LeCun normal) applied per block, i.e. with
    fan-in ``in/G`` (:data:`default_grouped_kernel_init`); the bias starts at zero.
    The D-RTRL trace is shaped like the Params, ``(B, G, in/G, out/G, S)``,
    each entry scaled at the output unit of its own block.

    Args:
        in_features: Number of input features (a multiple of ``num_groups``).
        out_features: Number of output features (a multiple of ``num_groups``).
        num_groups: Number of independent blocks ``G``.
        use_bias: Whether to add a bias.
        dtype: Dtype of the computation (default: inferred from input and params).
        param_dtype: Dtype of the parameters.
        precision: ``jax.lax.Precision`` of the products.
        kernel_init: Initializer of the kernel ``(G, in/G, out/G)``.
        bias_init: Initializer of the bias ``(out,)``.
        rngs: Random number generators.
        kernel_metadata: Metadata of the kernel Param.
        bias_metadata: Metadata of the bias Param.

    Raises:
        ValueError: ``in_features`` or ``out_features`` is not a multiple of ``num_groups``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPGroupedLinear(6, 4, num_groups=2, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.bias.shape
        ((2, 3, 2), (4,))
        >>> layer(jnp.ones((5, 6))).shape
        (5, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_grouped_kernel_init,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        if num_groups < 1 or in_features % num_groups or out_features % num_groups:
            raise ValueError(
                f"ETPGroupedLinear: in_features={in_features} and out_features={out_features} "
                f"must both be multiples of num_groups={num_groups}.")
        shape = (num_groups, in_features // num_groups, out_features // num_groups)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype), **kernel_metadata)
        self.bias: nnx.Param[jax.Array] | None
        self.bias = bias_param(bias_init, rngs, (out_features,) if use_bias else None,
                               param_dtype, bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.num_groups = num_groups
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Applies the blocks to ``inputs (..., in_features)``; returns ``(..., out_features)``."""
        check_features(type(self).__name__, jnp.shape(inputs), self.in_features)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return grouped_matmul(inputs, kernel, bias, precision=self.precision)
