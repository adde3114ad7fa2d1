r"""``OptimizedLSTMCell``: :class:`flax.nnx.OptimizedLSTMCell` with fused kernels that learn online."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.recurrent import default_kernel_init
from flax.typing import Dtype, Initializer, PromoteDtypeFn
from jax.typing import ArrayLike

from braintrace._primitives import matmul

from ._cell import AbstractCell
from ._checks import check_features
from ._initializers import orthogonal, zeros
from ._linear import ETPLinear

__all__ = ["OptimizedLSTMCell"]


class _PromotingLinear(ETPLinear):
    """An :class:`ETPLinear` with Flax ``Linear``'s ``promote_dtype`` hook."""

    def __init__(self, in_features: int, out_features: int, *,
                 promote_dtype: PromoteDtypeFn, **kwargs: Any):
        super().__init__(in_features, out_features, **kwargs)
        self.promote_dtype = promote_dtype

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """``inputs @ kernel (+ bias)`` after ``promote_dtype``, through the dense primitive."""
        check_features(type(self).__name__, jnp.shape(inputs), self.in_features)
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias),
                                                  dtype=self.dtype)
        return matmul(inputs, kernel, bias, precision=self.precision)


class OptimizedLSTMCell(AbstractCell):
    r"""LSTM cell with fused gate kernels, learning online.

    .. math::

        [i, f, g, o] = W_i x + W_h h + b_h \ \text{(split in four)}, \\
        c' = \sigma(f) \odot c + \sigma(i) \odot \tanh(g), \quad
        h' = \sigma(o) \odot \tanh(c')

    A drop-in for :class:`flax.nnx.OptimizedLSTMCell`: the same constructor,
    Params (``dense_i`` kernel ``(in, 4h)`` without bias, ``dense_h`` kernel
    ``(h, 4h)`` with bias ``(4h,)``, gates in the order ``i, f, g, o``), init
    and outputs, with both fused maps run through the dense ETP primitive.
    The carry is ``(c, h)``. ``initialize_carry`` is Flax's (same RNG draws),
    except that zeros need no ``rngs``. ``W_h`` couples hidden units, so
    D-RTRL approximates its gradient over time (as for :class:`LSTMCell`).

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        gate_fn: Activation of the gates.
        activation_fn: Activation of the cell input and output.
        kernel_init: Initializer of the input kernel.
        recurrent_kernel_init: Initializer of the recurrent kernel.
        bias_init: Initializer of the bias.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        carry_init: Deprecated in Flax: the default ``carry_init`` of ``initialize_carry``.
        promote_dtype: Dtype promotion of ``(inputs, kernel, bias)`` in both maps.
        keep_rngs: Deprecated in Flax: store ``rngs.carry`` for ``initialize_carry``.
        rngs: Random number generators.
        kernel_metadata: Metadata of the input kernel.
        recurrent_kernel_metadata: Metadata of the recurrent kernel.
        bias_metadata: Metadata of the bias.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.OptimizedLSTMCell(3, 5, rngs=nnx.Rngs(0))
        >>> cell.dense_i.kernel.shape, cell.dense_h.kernel.shape, cell.dense_h.bias.shape
        ((3, 20), (5, 20), (20,))
        >>> nnx.RNN(cell)(jnp.ones((2, 7, 3))).shape
        (2, 7, 5)
    """

    carry_size = 2

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        gate_fn: Callable[..., Any] = nnx.sigmoid,
        activation_fn: Callable[..., Any] = nnx.tanh,
        kernel_init: Initializer = default_kernel_init,
        recurrent_kernel_init: Initializer = orthogonal,
        bias_init: Initializer = zeros,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        carry_init: Initializer | None = None,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        keep_rngs: bool = False,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        recurrent_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.gate_fn = gate_fn
        self.activation_fn = activation_fn
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.rngs: nnx.RngStream | None
        if keep_rngs:
            warnings.warn("keep_rngs argument is deprecated. Please use rngs argument in "
                          "__call__ instead ", stacklevel=2)
            self.rngs = rngs.carry.fork()
        else:
            self.rngs = nnx.data(None)
        common = {"dtype": dtype, "param_dtype": param_dtype, "promote_dtype": promote_dtype,
                  "rngs": rngs}
        self.dense_i = _PromotingLinear(in_features, 4 * hidden_features, use_bias=False,
                                        kernel_init=kernel_init,
                                        kernel_metadata=kernel_metadata, **common)
        self.dense_h = _PromotingLinear(hidden_features, 4 * hidden_features, use_bias=True,
                                        kernel_init=recurrent_kernel_init, bias_init=bias_init,
                                        kernel_metadata=recurrent_kernel_metadata,
                                        bias_metadata=bias_metadata, **common)
        if carry_init:
            warnings.warn("carry_init is provided in __init__. Please, use carry_init argument "
                          "in `initialize_carry` method instead to initialize the carry.",
                          stacklevel=2)
        self.carry_init = carry_init

    def _advance(self, carry: tuple[jax.Array, jax.Array], inputs: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """One step: returns ``((c', h'), h')``."""
        c, h = carry
        i, f, g, o = jnp.split(self.dense_i(inputs) + self.dense_h(h), 4, axis=-1)
        new_c = self.gate_fn(f) * c + self.gate_fn(i) * self.activation_fn(g)
        new_h = self.gate_fn(o) * self.activation_fn(new_c)
        return (new_c, new_h), new_h
