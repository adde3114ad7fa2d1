"""``LeakyReadout``: a leaky-integrator readout, ``y_t = α y_{t-1} + W z_t + b``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer
from jax.typing import ArrayLike

from braintrace._hidden import HiddenState

from ._checks import check_step_input
from ._elemwise import decay, time_constant
from ._linear import ETPLinear

__all__ = ["LeakyReadout"]


class LeakyReadout(nnx.Module):
    r"""A leaky-integrator readout of (spiking) activity.

    .. math::

        y_t = \alpha\, y_{t-1} + W z_t + b, \qquad \alpha = \exp(-dt/\tau)

    with ``W``, ``b`` an :class:`ETPLinear` at ``linear``. The output is a
    hidden state, so ``W`` learns by eligibility traces like any other weight.
    Hidden state: ``y``, ``(out_features,)`` per sample.

    Args:
        in_features: Number of input features.
        out_features: Number of outputs.
        tau: Time constant of the integrator.
        dt: Simulation step.
        learn_tau: Whether ``τ`` is a learnable per-output :class:`ETPElemwise`.
        use_bias: Whether the linear map has a bias.
        kernel_init: Initializer of ``W``.
        bias_init: Initializer of ``b``.
        dtype: Dtype of the matmul.
        param_dtype: Dtype of the state and parameters.
        rngs: Random number generators.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> readout = layers.LeakyReadout(4, 2, tau=10.0, rngs=nnx.Rngs(0))
        >>> readout(jnp.ones(4)).shape
        (2,)
        >>> readout.y.shape
        (2,)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tau: float = 20.0,
        dt: float = 1.0,
        learn_tau: bool = False,
        use_bias: bool = True,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.in_features = in_features
        self.out_features = out_features
        self.dt = dt
        self.linear = ETPLinear(in_features, out_features, use_bias=use_bias,
                                kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
        self.tau = time_constant(tau, dt, learn_tau, out_features, param_dtype)
        self.y = HiddenState(jnp.zeros((out_features,), param_dtype))

    def __call__(self, z: ArrayLike) -> jax.Array:
        """One step on ``z`` of shape ``(*batch, in_features)``; returns ``y_t``."""
        check_step_input(type(self).__name__, jnp.shape(z), self.y, self.in_features, "y")
        y = self.y[...]
        new_y = decay(self.tau, self.dt) * y + self.linear(z)
        self.y[...] = new_y.astype(y.dtype)
        return new_y
