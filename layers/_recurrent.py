"""Recurrent cells with the Flax cell protocol whose weights learn online.

``SimpleCell``, ``GRUCell`` and ``LSTMCell`` have the constructors, Param trees
and outputs of their :mod:`flax.nnx` namesakes (so ``nnx.update`` loads a Flax
cell's state into them), with every ``nnx.Linear`` replaced by an
:class:`ETPLinear`. ``MinGRUCell`` is a minimal gated cell whose weights see
only the input, so its hidden Jacobian is diagonal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.recurrent import default_kernel_init, modified_orthogonal
from flax.typing import Dtype, Initializer

from ._cell import AbstractCell
from ._initializers import lecun_normal, orthogonal, zeros
from ._linear import ETPLinear

__all__ = ["GRUCell", "LSTMCell", "MinGRUCell", "SimpleCell"]



class SimpleCell(AbstractCell):
    r"""Simple (Elman) cell, ``h' = act(W_i x + b_i + W_h h)``, learning online.

    Same constructor, Params (``dense_i`` with bias, ``dense_h`` without) and
    outputs as :class:`flax.nnx.SimpleCell`.

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        residual: Whether to add ``h`` before the activation.
        activation_fn: The activation.
        kernel_init: Initializer of the input kernel.
        recurrent_kernel_init: Initializer of the recurrent kernel.
        bias_init: Initializer of the bias.
        rngs: Random number generators.
        kernel_metadata: Metadata of the input kernel.
        recurrent_kernel_metadata: Metadata of the recurrent kernel.
        bias_metadata: Metadata of the bias.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.SimpleCell(3, 5, rngs=nnx.Rngs(0))
        >>> carry = cell.initialize_carry((2, 3))
        >>> carry, y = cell(carry, jnp.ones((2, 3)))
        >>> y.shape
        (2, 5)
        >>> nnx.RNN(cell)(jnp.ones((2, 7, 3))).shape
        (2, 7, 5)
    """

    carry_size = 1

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        residual: bool = False,
        activation_fn: Callable[..., Any] = nnx.tanh,
        kernel_init: Initializer = lecun_normal,
        recurrent_kernel_init: Initializer = orthogonal,
        bias_init: Initializer = zeros,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        recurrent_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.residual = residual
        self.activation_fn = activation_fn
        self.dense_h = ETPLinear(
            hidden_features, hidden_features, use_bias=False, dtype=dtype,
            param_dtype=param_dtype, kernel_init=recurrent_kernel_init, rngs=rngs,
            kernel_metadata=recurrent_kernel_metadata)
        self.dense_i = ETPLinear(
            in_features, hidden_features, use_bias=True, dtype=dtype, param_dtype=param_dtype,
            kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)

    def _advance(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: returns ``(h', h')``."""
        new_carry = self.dense_i(inputs) + self.dense_h(carry)
        if self.residual:
            new_carry = new_carry + carry
        new_carry = self.activation_fn(new_carry)
        return new_carry, new_carry



class GRUCell(AbstractCell):
    r"""Gated recurrent unit, learning online.

    .. math::

        r = \sigma(W_{ir} x + b_{ir} + W_{hr} h), \quad
        z = \sigma(W_{iz} x + b_{iz} + W_{hz} h), \\
        n = \tanh(W_{in} x + b_{in} + r \odot (W_{hn} h)), \quad
        h' = (1 - z) \odot n + z \odot h

    Same constructor, Params (fused ``dense_i (in, 3h)`` with bias, fused
    ``dense_h (h, 3h)`` without) and outputs as :class:`flax.nnx.GRUCell`.

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        gate_fn: Activation of the gates.
        activation_fn: Activation of the candidate.
        kernel_init: Initializer of the input kernel.
        recurrent_kernel_init: Initializer of the recurrent kernel.
        bias_init: Initializer of the bias.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        rngs: Random number generators.
        kernel_metadata: Metadata of the input kernel.
        recurrent_kernel_metadata: Metadata of the recurrent kernel.
        bias_metadata: Metadata of the bias.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.GRUCell(3, 5, rngs=nnx.Rngs(0))
        >>> cell.dense_i.kernel.shape, cell.dense_h.kernel.shape
        ((3, 15), (5, 15))
        >>> nnx.RNN(cell)(jnp.ones((2, 7, 3))).shape
        (2, 7, 5)
    """

    carry_size = 1

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
        self.dense_i = ETPLinear(
            in_features, 3 * hidden_features, use_bias=True, kernel_init=kernel_init,
            bias_init=bias_init, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        self.dense_h = ETPLinear(
            hidden_features, 3 * hidden_features, use_bias=False,
            kernel_init=recurrent_kernel_init, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            kernel_metadata=recurrent_kernel_metadata)

    def _advance(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: returns ``(h', h')``."""
        h = carry
        xi_r, xi_z, xi_n = jnp.split(self.dense_i(inputs), 3, axis=-1)
        hh_r, hh_z, hh_n = jnp.split(self.dense_h(h), 3, axis=-1)
        r = self.gate_fn(xi_r + hh_r)
        z = self.gate_fn(xi_z + hh_z)
        n = self.activation_fn(xi_n + r * hh_n)
        new_h = (1.0 - z) * n + z * h
        return new_h, new_h



class LSTMCell(AbstractCell):
    r"""Long short-term memory cell, learning online.

    .. math::

        i = \sigma(W_{ii} x + W_{hi} h + b_{hi}), \quad
        f = \sigma(W_{if} x + W_{hf} h + b_{hf}), \\
        g = \tanh(W_{ig} x + W_{hg} h + b_{hg}), \quad
        o = \sigma(W_{io} x + W_{ho} h + b_{ho}), \\
        c' = f \odot c + i \odot g, \quad h' = o \odot \tanh(c')

    Same constructor, Params (``ii``, ``if_``, ``ig``, ``io`` without bias;
    ``hi``, ``hf``, ``hg``, ``ho`` with bias) and outputs as
    :class:`flax.nnx.LSTMCell`. The carry is ``(c, h)``, two arrays of one shape.

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        gate_fn: Activation of the gates.
        activation_fn: Activation of the cell input and output.
        kernel_init: Initializer of the input kernels.
        recurrent_kernel_init: Initializer of the recurrent kernels.
        bias_init: Initializer of the biases.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        rngs: Random number generators.
        kernel_metadata: Metadata of the input kernels.
        recurrent_kernel_metadata: Metadata of the recurrent kernels.
        bias_metadata: Metadata of the biases.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.LSTMCell(3, 5, rngs=nnx.Rngs(0))
        >>> c, h = cell.initialize_carry((2, 3))
        >>> (c, h), y = cell((c, h), jnp.ones((2, 3)))
        >>> c.shape, y.shape
        ((2, 5), (2, 5))
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
        recurrent_kernel_init: Initializer = modified_orthogonal,
        bias_init: Initializer = zeros,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
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

        def dense_i() -> ETPLinear:
            return ETPLinear(in_features, hidden_features, use_bias=False,
                             kernel_init=kernel_init, dtype=dtype, param_dtype=param_dtype,
                             rngs=rngs, kernel_metadata=kernel_metadata)

        def dense_h() -> ETPLinear:
            return ETPLinear(hidden_features, hidden_features, use_bias=True,
                             kernel_init=recurrent_kernel_init, bias_init=bias_init, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs,
                             kernel_metadata=recurrent_kernel_metadata,
                             bias_metadata=bias_metadata)

        self.ii = dense_i()
        self.if_ = dense_i()
        self.ig = dense_i()
        self.io = dense_i()
        self.hi = dense_h()
        self.hf = dense_h()
        self.hg = dense_h()
        self.ho = dense_h()

    def _advance(self, carry: tuple[jax.Array, jax.Array], inputs: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """One step: returns ``((c', h'), h')``."""
        c, h = carry
        i = self.gate_fn(self.ii(inputs) + self.hi(h))
        f = self.gate_fn(self.if_(inputs) + self.hf(h))
        g = self.activation_fn(self.ig(inputs) + self.hg(h))
        o = self.gate_fn(self.io(inputs) + self.ho(h))
        new_c = f * c + i * g
        new_h = o * self.activation_fn(new_c)
        return (new_c, new_h), new_h



class MinGRUCell(AbstractCell):
    r"""Minimal gated recurrent unit (minGRU; Feng et al., 2024), learning online.

    .. math::

        z = \sigma(W_z x + b_z), \quad \tilde h = W_n x + b_n, \quad
        h' = (1 - z) \odot h + z \odot \tilde h

    Its weights see only the input, so ``∂h'/∂h = 1 - z`` is diagonal and
    eligibility traces of ``dense_z`` and ``dense_n`` are exact.

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        gate_fn: Activation of the update gate.
        kernel_init: Initializer of the kernels.
        bias_init: Initializer of the biases.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        rngs: Random number generators.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.MinGRUCell(3, 5, rngs=nnx.Rngs(0))
        >>> nnx.RNN(cell)(jnp.ones((2, 7, 3))).shape
        (2, 7, 5)
    """

    carry_size = 1

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        gate_fn: Callable[..., Any] = nnx.sigmoid,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = zeros,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.gate_fn = gate_fn
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.dense_z = ETPLinear(in_features, hidden_features, kernel_init=kernel_init,
                                 bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)
        self.dense_n = ETPLinear(in_features, hidden_features, kernel_init=kernel_init,
                                 bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)

    def _advance(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: returns ``(h', h')``."""
        z = self.gate_fn(self.dense_z(inputs))
        new_h = (1.0 - z) * carry + z * self.dense_n(inputs)
        return new_h, new_h

