"""``ETPLinear``: :class:`flax.nnx.Linear` whose matmul is the dense ETP primitive."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike
from jax.typing import ArrayLike

from braintrace._primitives import matmul

from ._checks import check_features
from ._params import bias_param

__all__ = ["ETPLinear"]


class ETPLinear(nnx.Module):
    """A linear map over the last axis, ``y = x @ kernel + bias``, that learns online.

    A drop-in replacement for :class:`flax.nnx.Linear`: the same constructor,
    the same Params (``kernel (in, out)``, ``bias (out,)``) and the same
    outputs, but the product runs through :func:`braintrace.matmul` so the
    eligibility-trace compiler recognises it. Any number of leading batch axes
    is accepted.

    Args:
        in_features: Number of input features.
        out_features: Number of output features.
        use_bias: Whether to add a bias.
        dtype: Dtype of the computation (default: inferred from input and params).
        param_dtype: Dtype of the parameters.
        precision: ``jax.lax.Precision`` of the matmul.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        rngs: Random number generators.
        kernel_metadata: Metadata of the kernel Param.
        bias_metadata: Metadata of the bias Param.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPLinear(3, 4, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.bias.shape
        ((3, 4), (4,))
        >>> layer(jnp.ones((2, 5, 3))).shape
        (2, 5, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            **kernel_metadata)
        self.bias: nnx.Param[jax.Array] | None
        self.bias = bias_param(bias_init, rngs, (out_features,) if use_bias else None,
                               param_dtype, bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Applies the map to ``inputs`` of shape ``(..., in_features)``.

        Args:
            inputs: The input array.

        Returns:
            The output of shape ``(..., out_features)``.
        """
        check_features(type(self).__name__, jnp.shape(inputs), self.in_features)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return matmul(inputs, kernel, bias, precision=self.precision)
