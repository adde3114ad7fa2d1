r"""``CuBaLIF``: current-based LIF neurons, a synaptic current and a membrane per neuron.

For one step with input ``x_t`` (soft reset shown; hard reset and
refractoriness as in :class:`LIF`):

.. math::

    I_t = \alpha_s I_{t-1} + x_t, \qquad
    v_t = \alpha\,\big(v_{t-1} - z_{t-1}(v_{th} - v_{reset})\big) + I_t, \qquad
    z_t = H(v_t - v_{th}),

with ``α_s = exp(-dt/τ_syn)`` and ``α = exp(-dt/τ)``: the input is filtered by
the synapse before the membrane integrates it (the ``CubaLIF`` of NIR, spyx and
snnTorch's ``Synaptic``; :class:`ExpSynapse` followed by :class:`LIF` in one
layer). Both states are per neuron and couple only within a neuron, so a hidden
group has two states per neuron (``S = 2``) and its Jacobian is
position-diagonal: without recurrent weights D-RTRL is exact. Inside
:class:`RecurrentSpiking` the recurrent input enters the synaptic current
(spyx's ``RCuBaLIF``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from braintrace._hidden import HiddenState

from ._elemwise import decay, time_constant
from ._spiking import AbstractLIF

__all__ = ["CuBaLIF"]


class CuBaLIF(AbstractLIF):
    r"""A layer of current-based LIF neurons: an exponential synaptic current drives the membrane.

    Hidden state: membrane ``v`` and synaptic current ``i`` (and ``ref_steps``
    with refractoriness), each ``(num_neurons,)`` per sample. See the module
    docstring for the equations.

    Args:
        num_neurons: Number of neurons.
        tau: Membrane time constant ``τ``.
        tau_syn: Synaptic time constant ``τ_syn``.
        learn_tau_syn: Whether ``τ_syn`` is a learnable per-neuron :class:`ETPElemwise`.
        **kwargs: Further keyword arguments of :class:`LIF` (``v_th``, ``reset``,
            ``learn_tau``, ``surrogate``, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> neuron = layers.CuBaLIF(1, tau=10.0, tau_syn=5.0)
        >>> [neuron(jnp.full(1, x)).item() for x in (0.6, 0.0, 0.0, 0.0)]  # fires late
        [0.0, 1.0, 0.0, 0.0]
        >>> neuron.i[...].round(3)  # 0.6 · exp(-3/5): the current still decays
        Array([0.329], dtype=float32)
    """

    def __init__(
        self,
        num_neurons: int,
        *,
        tau: float = 20.0,
        tau_syn: float = 5.0,
        learn_tau_syn: bool = False,
        **kwargs: Any,
    ):
        super().__init__(num_neurons, tau=tau, **kwargs)
        param_dtype = self.v[...].dtype
        self.tau_syn = time_constant(tau_syn, self.dt, learn_tau_syn, num_neurons, param_dtype)
        self.i = HiddenState(jnp.zeros((num_neurons,), param_dtype))

    def _threshold(self) -> float:
        """The fixed threshold ``A_t = v_th``."""
        return self.v_th

    def _adapt(self, z: jax.Array) -> None:
        """CuBaLIF has no adaptation state."""

    def _current(self, x: jax.Array) -> jax.Array:
        """``I_t = α_s I_{t-1} + x_t``, written to ``i`` and returned."""
        i = self.i[...]
        new_i = (decay(self.tau_syn, self.dt) * i + x).astype(i.dtype)
        self.i[...] = new_i
        return new_i
