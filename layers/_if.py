r"""``IF``: integrate-and-fire neurons, the LIF dynamics without a leak.

For one step with input current ``x_t`` (soft reset shown; hard reset and
refractoriness as in :class:`LIF`):

.. math::

    v_t = v_{t-1} - z_{t-1}(v_{th} - v_{reset}) + x_t, \qquad z_t = H(v_t - v_{th}).

The membrane keeps what it integrates until it fires: its Jacobian
``∂v_t/∂v_{t-1}`` is ``1`` but for the reset's term (see :class:`LIF` with
``α = 1``). Without recurrent weights D-RTRL is exact on it, as on
:class:`LIF`; :class:`RecurrentSpiking` makes the recurrent variant (spyx's ``RIF``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.typing import Dtype

from ._spiking import AbstractLIF
from ._surrogate import Surrogate

__all__ = ["IF"]


class IF(AbstractLIF):
    r"""A layer of integrate-and-fire neurons (no leak); a step maps input current to spikes.

    Hidden state: membrane ``v`` (and, with refractoriness, ``ref_steps``), each
    ``(num_neurons,)`` per sample. See the module docstring for the equations.

    Args:
        num_neurons: Number of neurons.
        v_th: Firing threshold.
        v_reset: Reset potential.
        reset: ``'soft'`` (subtract ``v_th - v_reset``) or ``'hard'`` (set to ``v_reset``).
        refractory_steps: Steps a neuron is silent and holds its potential after a spike.
        surrogate: Surrogate derivative of the spike function (see :func:`spike`).
        surrogate_alpha: Sharpness of a named surrogate (``None``: its default).
        detach_reset: Whether the reset passes no derivative (see :class:`LIF`).
        param_dtype: Dtype of the states.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> neuron = layers.IF(1, v_th=1.0)
        >>> [neuron(jnp.full(1, 0.4)).item() for _ in range(6)]  # v: .4 .8 1.2 .6 1.0 1.4
        [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    """

    def __init__(
        self,
        num_neurons: int,
        *,
        v_th: float = 1.0,
        v_reset: float = 0.0,
        reset: str = "soft",
        refractory_steps: int = 0,
        surrogate: Surrogate = "fast_sigmoid",
        surrogate_alpha: float | None = None,
        detach_reset: bool = False,
        param_dtype: Dtype = jnp.float32,
    ):
        super().__init__(num_neurons, tau=math.inf, dt=1.0, v_th=v_th, v_reset=v_reset,
                         reset=reset, refractory_steps=refractory_steps, learn_tau=False,
                         surrogate=surrogate, surrogate_alpha=surrogate_alpha,
                         detach_reset=detach_reset, param_dtype=param_dtype)

    def _threshold(self) -> float:
        """The fixed threshold ``A_t = v_th``."""
        return self.v_th

    def _adapt(self, z: jax.Array) -> None:
        """IF has no adaptation state."""

    def _current(self, x: jax.Array) -> jax.Array:
        """The input is the current: ``I_t = x_t``."""
        return x
