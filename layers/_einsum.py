"""``ETPEinsum`` and ``ETPLinearGeneral``: Flax's einsum and general linear layers, learning online."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike
from jax.typing import ArrayLike

from braintrace._primitives import einsum, split_spec

from ._params import bias_param

__all__ = ["ETPEinsum", "ETPLinearGeneral"]


class ETPEinsum(nnx.Module):
    """``y = einsum(einsum_str, x, kernel) + bias`` that learns online.

    A drop-in replacement for :class:`flax.nnx.Einsum`: the same constructor
    (``einsum_str``, ``kernel_shape``, ``bias_shape``), the same Params (the
    kernel and bias in the shapes given, initialised identically under the
    same ``rngs``) and the same outputs, computed by :func:`braintrace.einsum`
    with the kernel as the primitive's trainable operand. Input axes that the
    kernel lacks (and the output keeps) are batch axes and must lead the
    output; every other output axis must be a kernel axis, and every kernel
    axis an input or output axis (``'nta,hab->nthb'``, ``'...d,dhk->...hk'``).
    Other strings are refused with a clear error. Flax's ``einsum_op`` and
    ``preferred_element_type`` options are not offered.

    Args:
        einsum_str: ``'x,kernel->y'``; may also be given at call time.
        kernel_shape: Shape of the kernel.
        bias_shape: Shape of the bias, or ``None`` for no bias.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters.
        precision: ``jax.lax.Precision`` of the contraction.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        promote_dtype: Dtype promotion function, as in Flax.
        rngs: Random number generators.
        kernel_metadata: Metadata of the kernel Param.
        bias_metadata: Metadata of the bias Param.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPEinsum('nta,hab->nthb', (8, 2, 4), (8, 4), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((16, 11, 2))).shape
        (16, 11, 8, 4)
    """

    def __init__(
        self,
        einsum_str: str,
        kernel_shape: Sequence[int],
        bias_shape: Sequence[int] | None = None,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        promote_dtype: Any = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        einsum_str = einsum_str.replace(" ", "")
        split_spec(einsum_str)
        self.kernel = nnx.Param(kernel_init(rngs.params(), tuple(kernel_shape), param_dtype),
                                **kernel_metadata)
        self.bias = bias_param(bias_init, rngs, None if bias_shape is None else tuple(bias_shape),
                                param_dtype, bias_metadata)
        self.einsum_str = einsum_str
        self.kernel_shape = tuple(kernel_shape)
        self.bias_shape = None if bias_shape is None else tuple(bias_shape)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype

    def __call__(self, inputs: ArrayLike, einsum_str: str | None = None) -> jax.Array:
        """Applies the contraction (``einsum_str`` if given here, else the constructor's).

        Raises:
            ValueError: The string cannot be traced (see :func:`braintrace.einsum`),
                or neither string is given.
        """
        spec = einsum_str if einsum_str is not None else self.einsum_str
        if spec is None:
            raise ValueError("ETPEinsum: no einsum_str, neither in the constructor nor in the "
                             "call; give one of them.")
        spec = spec.replace(" ", "")
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias),
                                                  dtype=self.dtype)
        return einsum(spec, inputs, kernel, bias, precision=self.precision)


def _canonical(value: int | Sequence[int]) -> tuple[int, ...]:
    return (int(value),) if np.ndim(value) == 0 else tuple(int(v) for v in value)


def _reshaped_init(init: Initializer, flat_shape: tuple[int, ...]) -> Initializer:
    """``init`` on ``flat_shape`` reshaped to the requested shape (Flax's ``*_init_wrap``)."""
    return lambda key, shape, dtype: jnp.reshape(init(key, flat_shape, dtype), shape)


class ETPLinearGeneral(nnx.Module):
    """A linear map over several input axes to several output axes, learning online.

    A drop-in replacement for :class:`flax.nnx.LinearGeneral` (without
    ``batch_axis``): the same constructor, the same Params (``kernel
    (*in_features, *out_features)``, ``bias (*out_features,)``, initialised
    identically under the same ``rngs``) and outputs ``(*other input axes,
    *out_features)``, computed by :func:`braintrace.einsum` with the kernel as
    the primitive's trainable operand. A non-empty ``batch_axis`` (a kernel
    per batch entry) is refused, as are custom ``dot_general`` functions.

    Args:
        in_features: Sizes of the contracted input axes.
        out_features: Sizes of the output axes.
        axis: The contracted input axes, matching ``in_features``.
        batch_axis: Must be empty.
        use_bias: Whether to add a bias.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters.
        kernel_init: Initializer of the kernel (applied to its ``(in, out)``
            flattening, as Flax does).
        bias_init: Initializer of the bias.
        precision: ``jax.lax.Precision`` of the contraction.
        promote_dtype: Dtype promotion function, as in Flax.
        rngs: Random number generators.
        kernel_metadata: Metadata of the kernel Param.
        bias_metadata: Metadata of the bias Param.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPLinearGeneral((2, 3), (4, 5), axis=(-2, -1), rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.bias.shape
        ((2, 3, 4, 5), (4, 5))
        >>> layer(jnp.ones((7, 2, 3))).shape
        (7, 4, 5)
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        batch_axis: Mapping[int, int] = MappingProxyType({}),
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        precision: PrecisionLike = None,
        promote_dtype: Any = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.in_features, self.out_features = _canonical(in_features), _canonical(out_features)
        self.axis = _canonical(axis)
        if batch_axis:
            raise ValueError("ETPLinearGeneral: batch_axis is not supported (a kernel per batch "
                             "entry has no per-sample trace here); use vmap over ETPLinearGeneral "
                             "or a grouped/einsum layer instead.")
        if len(self.in_features) != len(self.axis):
            raise ValueError(f"ETPLinearGeneral: in_features {self.in_features} and axis "
                             f"{self.axis} must have the same length.")
        flat = (int(np.prod(self.in_features)), int(np.prod(self.out_features)))
        self.kernel = nnx.Param(_reshaped_init(kernel_init, flat)(
            rngs.params(), (*self.in_features, *self.out_features), param_dtype),
            **kernel_metadata)
        self.bias = bias_param(_reshaped_init(bias_init, (flat[1],)), rngs,
                                self.out_features if use_bias else None, param_dtype,
                                bias_metadata)
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype

    def einsum_spec(self, ndim: int) -> str:
        """The contraction for an input with ``ndim`` axes, e.g. ``'abc,bcde->ade'``."""
        axes = tuple(a % ndim for a in self.axis)
        if len(set(axes)) != len(axes) or any(not -ndim <= a < ndim for a in self.axis):
            raise ValueError(f"ETPLinearGeneral: axis {self.axis} does not fit an input with "
                             f"{ndim} axes.")
        letters = string.ascii_letters
        x = letters[:ndim]
        out = letters[ndim:ndim + len(self.out_features)]
        kernel = "".join(x[a] for a in axes) + out
        y = "".join(c for i, c in enumerate(x) if i not in axes) + out
        return f"{x},{kernel}->{y}"

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Contracts ``inputs`` along ``axis``: the output is ``(*other axes, *out_features)``."""
        inputs = jnp.asarray(inputs)
        spec = self.einsum_spec(inputs.ndim)
        for a, size in zip(self.axis, self.in_features, strict=True):
            if inputs.shape[a] != size:
                raise ValueError(f"ETPLinearGeneral: input of shape {inputs.shape} has size "
                                 f"{inputs.shape[a]} on axis {a}; expected {size}.")
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias),
                                                  dtype=self.dtype)
        return einsum(spec, inputs, kernel, bias, precision=self.precision)
