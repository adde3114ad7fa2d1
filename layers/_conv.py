"""``ETPConv``: :class:`flax.nnx.Conv` whose convolution is the conv ETP primitive."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PaddingLike, PrecisionLike
from jax.typing import ArrayLike

from braintrace._primitives import conv

from ._params import bias_param

__all__ = ["ETPConv"]


def _check_supported(conv_general_dilated: Any, preferred_element_type: Any) -> None:
    if conv_general_dilated is not jax.lax.conv_general_dilated:
        raise ValueError(
            "ETPConv: a custom conv_general_dilated is not supported (the convolution is the "
            "braintrace conv ETP primitive); leave conv_general_dilated at its default.")
    if preferred_element_type is not None:
        raise ValueError(
            "ETPConv: preferred_element_type is not supported; pass dtype= to choose the "
            "dtype of the computation instead.")


def _kernel_shape(kernel_size: tuple[int, ...], in_features: int, out_features: int,
                  groups: Any, mask: jax.Array | None) -> tuple[int, ...]:
    """``(*kernel_size, in // groups, out)``, after checking ``groups`` and ``mask`` against it."""
    if not isinstance(groups, int) or groups < 1 or in_features % groups or out_features % groups:
        raise ValueError(
            f"ETPConv: feature_group_count={groups!r} must be a positive int dividing "
            f"in_features={in_features} and out_features={out_features}.")
    shape = (*kernel_size, in_features // groups, out_features)
    if mask is not None and tuple(jnp.shape(mask)) != shape:
        raise ValueError(
            f"ETPConv: mask of shape {tuple(jnp.shape(mask))} must have the kernel's "
            f"shape {shape}.")
    return shape


class ETPConv(nnx.Module):
    """A channels-last convolution that learns online; a drop-in for :class:`flax.nnx.Conv`.

    The same constructor, the same Params (``kernel (*kernel_size, in // groups,
    out)``, ``bias (out,)``, initialised in the same order from the same
    ``rngs``) and the same outputs as :class:`flax.nnx.Conv`, but the
    convolution runs through :func:`braintrace.conv`, so the eligibility-trace
    compiler recognises it. Inputs are ``(*batch, *spatial, in_features)``;
    no batch axis is fine. ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'``
    padding and ``mask`` behave as in Flax (they act outside the primitive).

    Args:
        in_features: Number of input channels.
        out_features: Number of output channels.
        kernel_size: Window size, an int (1-D) or one int per spatial axis.
        strides: Window strides, an int or one per spatial axis.
        padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``,
            ``'CAUSAL'`` (1-D), an int, or one int or ``(low, high)`` pair per axis.
        input_dilation: Input dilation, an int or one per spatial axis.
        kernel_dilation: Kernel dilation, an int or one per spatial axis.
        feature_group_count: Number of channel groups ``G`` (``in_features`` and
            ``out_features`` must be divisible by it).
        use_bias: Whether to add a bias.
        mask: Optional fixed mask multiplied into the kernel (the kernel's shape).
        dtype: Dtype of the computation (default: inferred from input and params).
        param_dtype: Dtype of the parameters.
        precision: ``jax.lax.Precision`` of the convolution.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        conv_general_dilated: Must be ``jax.lax.conv_general_dilated`` (Flax's
            default); other functions are refused.
        promote_dtype: Promotes ``(inputs, kernel, bias)`` to the computation dtype.
        preferred_element_type: Must be ``None``; use ``dtype`` instead.
        rngs: Random number generators.
        kernel_metadata: Metadata of the kernel Param.
        bias_metadata: Metadata of the bias Param.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPConv(3, 4, kernel_size=(3, 3), strides=2, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.bias.shape
        ((3, 3, 3, 4), (4,))
        >>> layer(jnp.ones((2, 8, 8, 3))).shape
        (2, 4, 4, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] | None = 1,
        *,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] | None = 1,
        kernel_dilation: int | Sequence[int] | None = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        mask: jax.Array | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        conv_general_dilated: Any = jax.lax.conv_general_dilated,
        promote_dtype: Any = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_supported(conv_general_dilated, preferred_element_type)
        kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        self.kernel_shape = _kernel_shape(kernel_size, in_features, out_features,
                                          feature_group_count, mask)
        self.kernel = nnx.Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype),
                                **kernel_metadata)
        self.bias: nnx.Param[jax.Array] | None
        self.bias = bias_param(bias_init, rngs, (out_features,) if use_bias else None,
                               param_dtype, bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.input_dilation = input_dilation
        self.kernel_dilation = kernel_dilation
        self.feature_group_count = feature_group_count
        self.use_bias = use_bias
        self.mask = mask
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype

    def _check_input(self, shape: tuple[int, ...]) -> None:
        num_spatial = len(self.kernel_size)
        if len(shape) < num_spatial + 1 or shape[-1] != self.in_features:
            raise ValueError(
                f"ETPConv: input of shape {tuple(shape)} does not fit a {num_spatial}-D "
                f"convolution with {self.in_features} input channels; expected "
                f"(*batch, {', '.join(['spatial'] * num_spatial)}, {self.in_features}).")

    def __call__(self, inputs: ArrayLike, out_sharding: Any = None) -> jax.Array:
        """Convolves ``inputs`` of shape ``(*batch, *spatial, in_features)``.

        Args:
            inputs: The input array (channels last).
            out_sharding: Must be ``None`` (explicit output sharding is not supported).

        Returns:
            The output ``(*batch, *out_spatial, out_features)``.
        """
        if out_sharding is not None:
            raise ValueError("ETPConv: out_sharding is not supported; shard the inputs instead.")
        self._check_input(jnp.shape(inputs))
        kernel = self.kernel[...]
        if self.mask is not None:
            kernel = kernel * self.mask
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return conv(inputs, kernel, bias, strides=self.strides, padding=self.padding,
                    input_dilation=self.input_dilation, kernel_dilation=self.kernel_dilation,
                    feature_group_count=self.feature_group_count, precision=self.precision)
