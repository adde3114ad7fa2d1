r"""``MinLSTMCell``: the minimal LSTM (Feng et al., 2024), learning online."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.recurrent import default_kernel_init
from flax.typing import Dtype, Initializer

from ._cell import AbstractCell
from ._initializers import zeros
from ._linear import ETPLinear

__all__ = ["MinLSTMCell"]


class MinLSTMCell(AbstractCell):
    r"""Minimal long short-term memory cell (minLSTM; Feng et al., 2024), learning online.

    From "Were RNNs all we needed?": the gates and the candidate see only the
    input, and the two gates are normalised to sum to one,

    .. math::

        f = \sigma(W_f x + b_f), \quad i = \sigma(W_i x + b_i), \quad
        \tilde h = W_h x + b_h, \\
        f' = \frac{f}{f + i}, \quad i' = \frac{i}{f + i}, \quad
        h' = f' \odot h + i' \odot \tilde h.

    ``∂h'/∂h = f'`` is diagonal and every weight reaches ``h'`` elementwise, so
    eligibility traces of ``dense_f``, ``dense_i`` and ``dense_h`` are exact
    (D-RTRL equals BPTT). Conventions (initializers, dtypes, carry) follow
    :class:`MinGRUCell`.

    Args:
        in_features: Number of input features.
        hidden_features: Number of hidden units.
        gate_fn: Activation of the forget and input gates (must be positive).
        kernel_init: Initializer of the kernels.
        bias_init: Initializer of the biases.
        dtype: Dtype of the computation.
        param_dtype: Dtype of the parameters and the carry.
        rngs: Random number generators.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.MinLSTMCell(3, 5, rngs=nnx.Rngs(0))
        >>> h = cell.initialize_carry((2, 3))
        >>> h, y = cell(h, jnp.ones((2, 3)))
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

        def dense() -> ETPLinear:
            return ETPLinear(in_features, hidden_features, kernel_init=kernel_init,
                             bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                             rngs=rngs)

        self.dense_f = dense()
        self.dense_i = dense()
        self.dense_h = dense()

    def _advance(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: returns ``(h', h')``."""
        f = self.gate_fn(self.dense_f(inputs))
        i = self.gate_fn(self.dense_i(inputs))
        total = f + i
        new_h = (f / total) * carry + (i / total) * self.dense_h(inputs)
        return new_h, new_h
