"""``ETPLoRA`` and ``ETPLoRALinear``: Flax's LoRA layers on the LoRA ETP primitive."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.lora import default_a_initializer, default_b_initializer
from flax.typing import Dtype, Initializer
from jax.typing import ArrayLike

from braintrace._primitives import lora_matmul

from ._checks import check_features
from ._linear import ETPLinear

__all__ = ["ETPLoRA", "ETPLoRALinear"]


class ETPLoRA(nnx.Module):
    """A low-rank adapter ``y = (x @ lora_a) @ lora_b (+ base_module(x))`` that learns online.

    A drop-in replacement for :class:`flax.nnx.LoRA`: the same constructor and
    Params (``lora_a (in, r)``, ``lora_b (r, out)``, both
    :class:`flax.nnx.LoRAParam` by default, ``lora_b`` zero-initialised). The
    low-rank product runs through :func:`braintrace.lora_matmul`; a base module
    (e.g. an :class:`ETPLinear`) is called as its own operation and its output
    added.

    Args:
        in_features: Number of input features.
        lora_rank: Rank ``r`` of the adapter.
        out_features: Number of output features.
        base_module: Optional module whose output on the same input is added.
        dtype: Dtype of the computation (default: inferred from input and params).
        param_dtype: Dtype of the parameters.
        a_initializer: Initializer of ``lora_a``.
        b_initializer: Initializer of ``lora_b``.
        lora_param_type: Variable type of ``lora_a`` and ``lora_b``.
        rngs: Random number generators.
        a_metadata: Metadata of ``lora_a``.
        b_metadata: Metadata of ``lora_b``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> lora = layers.ETPLoRA(3, 2, 4, rngs=nnx.Rngs(0))
        >>> lora.lora_a.shape, lora.lora_b.shape
        ((3, 2), (2, 4))
        >>> type(lora.lora_a).__name__
        'LoRAParam'
        >>> lora(jnp.ones((16, 3))).shape
        (16, 4)
    """

    def __init__(
        self,
        in_features: int,
        lora_rank: int,
        out_features: int,
        *,
        base_module: Callable[[jax.Array], jax.Array] | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        a_initializer: Initializer = default_a_initializer,
        b_initializer: Initializer = default_b_initializer,
        lora_param_type: type[nnx.Variable] = nnx.LoRAParam,
        rngs: nnx.Rngs,
        a_metadata: Mapping[str, Any] = MappingProxyType({}),
        b_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.lora_param_type = lora_param_type
        self.base_module = base_module
        self.lora_a = lora_param_type(
            a_initializer(rngs.params(), (in_features, lora_rank), param_dtype), **a_metadata)
        self.lora_b = lora_param_type(
            b_initializer(rngs.params(), (lora_rank, out_features), param_dtype), **b_metadata)

    def __call__(self, x: ArrayLike) -> jax.Array:
        """Applies the adapter (and the base module) to ``x`` of shape ``(..., in_features)``.

        Args:
            x: The input array.

        Returns:
            The output of shape ``(..., out_features)``.
        """
        check_features(type(self).__name__, jnp.shape(x), self.in_features)
        x, lora_a, lora_b = dtypes.promote_dtype(
            (x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        out = lora_matmul(x, lora_a, lora_b)
        if self.base_module is not None:
            out = out + self.base_module(x)
        return out


class ETPLoRALinear(ETPLinear):
    """An :class:`ETPLinear` plus a LoRA adapter on the same input, both learning online.

    A drop-in replacement for :class:`flax.nnx.LoRALinear`: the Params of
    :class:`ETPLinear` (``kernel``, ``bias``) and an :class:`ETPLoRA` at
    ``lora``; the output is ``x @ kernel + bias + (x @ lora_a) @ lora_b``, the
    dense and low-rank parts being two ETP operations.

    Args:
        in_features: Number of input features.
        out_features: Number of output features.
        lora_rank: Rank of the adapter.
        lora_dtype: Dtype of the adapter's computation.
        lora_param_dtype: Dtype of the adapter's parameters.
        a_initializer: Initializer of ``lora_a``.
        b_initializer: Initializer of ``lora_b``.
        lora_param_type: Variable type of ``lora_a`` and ``lora_b``.
        rngs: Random number generators.
        a_metadata: Metadata of ``lora_a``.
        b_metadata: Metadata of ``lora_b``.
        **kwargs: Keyword arguments of :class:`ETPLinear`.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.lora.lora_a.shape
        ((3, 4), (3, 2))
        >>> layer(jnp.ones((16, 3))).shape
        (16, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        lora_rank: int,
        lora_dtype: Dtype | None = None,
        lora_param_dtype: Dtype = jnp.float32,
        a_initializer: Initializer = default_a_initializer,
        b_initializer: Initializer = default_b_initializer,
        lora_param_type: type[nnx.Variable] = nnx.LoRAParam,
        rngs: nnx.Rngs,
        a_metadata: Mapping[str, Any] = MappingProxyType({}),
        b_metadata: Mapping[str, Any] = MappingProxyType({}),
        **kwargs: Any,
    ):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.lora = ETPLoRA(
            in_features, lora_rank, out_features, dtype=lora_dtype,
            param_dtype=lora_param_dtype, a_initializer=a_initializer,
            b_initializer=b_initializer, lora_param_type=lora_param_type, rngs=rngs,
            a_metadata=a_metadata, b_metadata=b_metadata)

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Applies the dense map plus the adapter to ``inputs`` of shape ``(..., in_features)``.

        Args:
            inputs: The input array.

        Returns:
            The output of shape ``(..., out_features)``.
        """
        return super().__call__(inputs) + self.lora(inputs)
