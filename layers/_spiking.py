r"""Spiking neuron layers: LIF, ALIF, the exponential synapse and a recurrent spiking layer.

Neurons follow the discrete-time form of Bellec et al. (2020): the spikes of
a step are a function of the hidden state, ``z_t = H(v_t - A_t)``, and the
reset they cause is applied at the next step. A neuron layer therefore keeps
only its membrane (and adaptation) state, and ``z_{t-1}`` is available for
recurrent input (:meth:`LIF.spikes`). For one step with input current ``x_t``:

.. math::

    \tilde v = \begin{cases} v_{t-1} - z_{t-1}(v_{th} - v_{reset}) & \text{soft reset} \\
                             v_{t-1} + z_{t-1}(v_{reset} - v_{t-1}) & \text{hard reset}
               \end{cases}, \qquad
    v_t = \alpha \tilde v + x_t, \qquad z_t = H(v_t - A_t),

with ``α = exp(-dt/τ)`` (the leak is towards 0) and ``A_t = v_th`` for LIF.
With ``detach_reset=True`` the reset's ``z_{t-1}`` passes through
``lax.stop_gradient`` (OTTT's and SLTT's neurons): the values are the same, and
no derivative flows through the spike that resets, so ``∂v_t/∂v_{t-1}`` is the
leak ``α`` with the soft reset, and ``α (1 - z_{t-1})`` with the hard one: 0
after a spike, whose reset sets ``ṽ = v_reset`` whatever ``v_{t-1}`` was (while
a refractory neuron holds ``ṽ``, ``∂ṽ/∂v_{t-1}``: 1, or ``1 - z_{t-1}``).
With ``refractory_steps = R > 0`` a neuron that spiked holds ``ṽ`` and cannot
spike for the next ``R`` steps (a counter state ``ref_steps`` tracks this).
``H`` is :func:`spike`: a Heaviside step with a surrogate derivative.

Time constants are fixed floats, or learnable (``learn_tau=True``) through an
:class:`ETPElemwise` holding ``τ`` per neuron and applying :class:`ExpDecay`.
All hidden states of a neuron share the shape ``(num_neurons,)`` per sample.
"""

from __future__ import annotations

import abc
from typing import Any

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
from ._surrogate import Surrogate, check_surrogate, spike

__all__ = ["ALIF", "LIF", "AbstractLIF", "ExpSynapse", "RecurrentSpiking"]

_RESETS = ("soft", "hard")


def _check_neuron_args(reset: str, refractory_steps: int, surrogate: Surrogate,
                       surrogate_alpha: float | None) -> None:
    if reset not in _RESETS:
        raise ValueError(f"reset must be one of {_RESETS}, got {reset!r}.")
    if not isinstance(refractory_steps, int) or refractory_steps < 0:
        raise ValueError(f"refractory_steps must be a non-negative int, got {refractory_steps!r}.")
    check_surrogate(surrogate, surrogate_alpha)


class AbstractLIF(nnx.Module):
    r"""Leaky integrate-and-fire dynamics with a hook for an adaptive threshold.

    Holds the membrane ``v`` (and ``ref_steps``), the reset, the leak and the
    step of the module docstring. A final neuron says what its threshold
    ``A_t`` is (:meth:`_threshold`), how its adaptation state advances with
    the previous spikes ``z_{t-1}`` (:meth:`_adapt`; :class:`LIF` has none) and
    which current enters the membrane for the step's input ``x_t``
    (:meth:`_current`: ``x_t`` itself, or a synaptic current as in
    :class:`CuBaLIF`). The constructor's arguments are :class:`LIF`'s.

    Attributes:
        detach_reset: Whether the reset passes no derivative (``False`` unless set).

    Example:
        >>> from braintrace import layers
        >>> from braintrace.layers._spiking import AbstractLIF
        >>> isinstance(layers.LIF(3), AbstractLIF), isinstance(layers.ALIF(3), AbstractLIF)
        (True, True)
    """

    def __init__(
        self,
        num_neurons: int,
        *,
        tau: float = 20.0,
        dt: float = 1.0,
        v_th: float = 1.0,
        v_reset: float = 0.0,
        reset: str = "soft",
        refractory_steps: int = 0,
        learn_tau: bool = False,
        surrogate: Surrogate = "fast_sigmoid",
        surrogate_alpha: float | None = None,
        detach_reset: bool = False,
        param_dtype: Dtype = jnp.float32,
    ):
        _check_neuron_args(reset, refractory_steps, surrogate, surrogate_alpha)
        self.num_neurons = num_neurons
        self.dt = dt
        self.v_th = v_th
        self.v_reset = v_reset
        self.reset = reset
        if detach_reset:  # else the class's False: a default neuron's attributes are unchanged
            self.detach_reset = True
        self.refractory_steps = refractory_steps
        self.surrogate = surrogate
        self.surrogate_alpha = surrogate_alpha
        self.tau = time_constant(tau, dt, learn_tau, num_neurons, param_dtype)
        self.v = HiddenState(jnp.zeros((num_neurons,), param_dtype))
        self.ref_steps: HiddenState | None
        if refractory_steps:
            self.ref_steps = HiddenState(jnp.zeros((num_neurons,), param_dtype))
        else:
            self.ref_steps = nnx.data(None)

    detach_reset: bool = False

    @abc.abstractmethod
    def _threshold(self) -> jax.Array | float:
        """The threshold ``A_t`` of the current state."""

    @abc.abstractmethod
    def _adapt(self, z: jax.Array) -> None:
        """Advances the adaptation state (if any) with the previous spikes ``z = z_{t-1}``."""

    @abc.abstractmethod
    def _current(self, x: jax.Array) -> jax.Array:
        """The current ``I_t`` the membrane integrates for the input ``x = x_t`` (advancing
        the synaptic state, if any)."""

    def _fire(self, v: jax.Array, threshold: jax.Array | float,
              ref_steps: jax.Array | None) -> jax.Array:
        z = spike(v - threshold, self.surrogate, self.surrogate_alpha)
        if ref_steps is not None:
            z = z * (ref_steps <= 0).astype(z.dtype)
        return z

    def spikes(self) -> jax.Array:
        """The spikes ``z_t`` of the current state (the output of the last step)."""
        ref_steps = None if self.ref_steps is None else self.ref_steps[...]
        return self._fire(self.v[...], self._threshold(), ref_steps)

    def _integrate(self, x: jax.Array, z: jax.Array) -> None:
        """Resets with ``z = z_{t-1}``, leaks, integrates ``x`` and writes ``v_t``."""
        v = self.v[...]
        reset = jax.lax.stop_gradient(z) if self.detach_reset else z
        if self.reset == "soft":
            v = v - reset * (self.v_th - self.v_reset)
        else:
            v = v + reset * (self.v_reset - v)
        new_v = decay(self.tau, self.dt) * v + x
        if self.ref_steps is not None:
            ref_steps = jnp.where(z > 0, float(self.refractory_steps),
                                  jnp.maximum(self.ref_steps[...] - 1.0, 0.0))
            new_v = jnp.where(ref_steps > 0, v, new_v)
            self.ref_steps[...] = ref_steps.astype(v.dtype)
        self.v[...] = new_v.astype(v.dtype)

    def __call__(self, x: ArrayLike) -> jax.Array:
        """One step: integrates the input current ``x`` (``(*batch, num_neurons)``), returns spikes.

        Args:
            x: Input current, shaped like the membrane state.

        Returns:
            The spikes ``z_t`` (0/1 floats), shaped like ``x``.
        """
        check_step_input(type(self).__name__, jnp.shape(x), self.v, self.num_neurons, "v")
        x = jnp.asarray(x, dtype=self.v[...].dtype)
        return self._advance(x, self.spikes())

    def _advance(self, x: jax.Array, z: jax.Array) -> jax.Array:
        """The step after the input check: ``x = x_t`` and ``z = z_{t-1}`` (:meth:`spikes`,
        which a caller that read it already passes on: one spike function per step, one
        surrogate derivative kept for the backward pass); returns ``z_t``."""
        self._adapt(z)
        self._integrate(self._current(x), z)
        return self.spikes()


class LIF(AbstractLIF):
    r"""A layer of leaky integrate-and-fire neurons; a step maps input current to spikes.

    Hidden state: membrane ``v`` (and, with refractoriness, the counter
    ``ref_steps``), each ``(num_neurons,)`` per sample. See the module
    docstring for the equations.

    Args:
        num_neurons: Number of neurons.
        tau: Membrane time constant ``τ``.
        dt: Simulation step.
        v_th: Firing threshold.
        v_reset: Reset potential.
        reset: ``'soft'`` (subtract ``v_th - v_reset``) or ``'hard'`` (set to ``v_reset``).
        refractory_steps: Steps a neuron is silent and holds its potential after a spike.
        learn_tau: Whether ``τ`` is a learnable per-neuron :class:`ETPElemwise`.
        surrogate: Surrogate derivative of the spike function: a name, a function
            ``x -> σ'(x)`` or a spike function of one's own (see :func:`spike`).
        surrogate_alpha: Sharpness of a named surrogate (``None``: its default).
        detach_reset: Whether the reset passes no derivative (module docstring).
        param_dtype: Dtype of the states and parameters.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> from braintrace import layers
        >>> lif = layers.LIF(3, tau=10.0)
        >>> braintrace.init_states(lif, batch_size=2)
        >>> [lif(jnp.full((2, 3), 0.6))[0, 0].item() for _ in range(3)]
        [0.0, 1.0, 0.0]
    """

    def _threshold(self) -> float:
        """The fixed threshold ``A_t = v_th``."""
        return self.v_th

    def _adapt(self, z: jax.Array) -> None:
        """LIF has no adaptation state."""

    def _current(self, x: jax.Array) -> jax.Array:
        """The input is the current: ``I_t = x_t``."""
        return x


class ALIF(AbstractLIF):
    r"""A layer of adaptive LIF neurons (LSNN; Bellec et al., 2018).

    As :class:`LIF`, with an adaptive threshold ``A_t = v_th + β a_t`` and

    .. math::

        a_t = \rho\, a_{t-1} + (1 - \rho)\, z_{t-1}, \qquad \rho = \exp(-dt/\tau_a).

    Hidden state: membrane ``v`` and adaptation ``a`` (and ``ref_steps`` with
    refractoriness), each ``(num_neurons,)`` per sample.

    Args:
        num_neurons: Number of neurons.
        tau: Membrane time constant.
        tau_a: Adaptation time constant.
        beta: Adaptation strength ``β``.
        learn_tau_a: Whether ``τ_a`` is a learnable per-neuron :class:`ETPElemwise`.
        **kwargs: Further keyword arguments of :class:`LIF`.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> alif = layers.ALIF(3, tau_a=100.0, beta=1.8)
        >>> z = alif(jnp.full(3, 1.5))
        >>> z = alif(jnp.zeros(3))
        >>> alif.a[...]
        Array([0.00995, 0.00995, 0.00995], dtype=float32)
    """

    def __init__(
        self,
        num_neurons: int,
        *,
        tau: float = 20.0,
        tau_a: float = 200.0,
        beta: float = 1.8,
        learn_tau_a: bool = False,
        **kwargs: Any,
    ):
        super().__init__(num_neurons, tau=tau, **kwargs)
        self.beta = beta
        param_dtype = self.v[...].dtype
        self.tau_a = time_constant(tau_a, self.dt, learn_tau_a, num_neurons, param_dtype)
        self.a = HiddenState(jnp.zeros((num_neurons,), param_dtype))

    def _threshold(self) -> jax.Array:
        """The adaptive threshold ``A_t = v_th + β a_t``."""
        return self.v_th + self.beta * self.a[...]

    def _adapt(self, z: jax.Array) -> None:
        """``a_t = ρ a_{t-1} + (1 - ρ) z_{t-1}``."""
        rho = decay(self.tau_a, self.dt)
        a = self.a[...]
        self.a[...] = (rho * a + (1.0 - rho) * z).astype(a.dtype)

    def _current(self, x: jax.Array) -> jax.Array:
        """The input is the current: ``I_t = x_t``."""
        return x


class ExpSynapse(nnx.Module):
    r"""Exponential synapse: a leaky trace of its input, ``g_t = α g_{t-1} + x_t``.

    Hidden state: the conductance ``g``, ``(num_features,)`` per sample.

    Args:
        num_features: Number of synapses (the input's last axis).
        tau: Synaptic time constant (``α = exp(-dt/τ)``).
        dt: Simulation step.
        learn_tau: Whether ``τ`` is a learnable per-synapse :class:`ETPElemwise`.
        param_dtype: Dtype of the state and parameters.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> syn = layers.ExpSynapse(2, tau=1.0)
        >>> syn(jnp.ones(2))
        Array([1., 1.], dtype=float32)
        >>> syn(jnp.zeros(2))
        Array([0.368, 0.368], dtype=float32)
    """

    def __init__(
        self,
        num_features: int,
        *,
        tau: float = 5.0,
        dt: float = 1.0,
        learn_tau: bool = False,
        param_dtype: Dtype = jnp.float32,
    ):
        self.num_features = num_features
        self.dt = dt
        self.tau = time_constant(tau, dt, learn_tau, num_features, param_dtype)
        self.g = HiddenState(jnp.zeros((num_features,), param_dtype))

    def __call__(self, x: ArrayLike) -> jax.Array:
        """One step: returns the new conductance ``g_t``, shaped like ``x``."""
        check_step_input(type(self).__name__, jnp.shape(x), self.g, self.num_features, "g")
        g = self.g[...]
        new_g = decay(self.tau, self.dt) * g + jnp.asarray(x, dtype=g.dtype)
        self.g[...] = new_g.astype(g.dtype)
        return new_g


class RecurrentSpiking(nnx.Module):
    r"""A recurrent spiking layer: ``x_t`` and the layer's own ``z_{t-1}`` drive a neuron layer.

    .. math::

        z_t = \mathrm{neuron}(W_i x_t + b + W_h z_{t-1})

    with ``W_i`` (``dense_i``) and ``W_h`` (``dense_h``, no bias) two
    :class:`ETPLinear`\ s and ``z_{t-1}`` read from the neuron's state
    (:meth:`LIF.spikes`). Hidden state: that of ``neuron``.

    Args:
        in_features: Number of input features.
        neuron: The neuron layer (:class:`LIF`, :class:`ALIF`, :class:`IF` or
            :class:`CuBaLIF`, whose synaptic current the recurrent input enters).
        use_bias: Whether ``dense_i`` has a bias.
        kernel_init: Initializer of ``W_i``.
        recurrent_kernel_init: Initializer of ``W_h``.
        bias_init: Initializer of the bias.
        dtype: Dtype of the matmuls.
        param_dtype: Dtype of the weights.
        rngs: Random number generators.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> layer = layers.RecurrentSpiking(3, layers.ALIF(5), rngs=nnx.Rngs(0))
        >>> layer.dense_h.kernel.shape
        (5, 5)
        >>> layer(jnp.ones(3)).shape
        (5,)
    """

    def __init__(
        self,
        in_features: int,
        neuron: AbstractLIF,
        *,
        use_bias: bool = True,
        kernel_init: Initializer = default_kernel_init,
        recurrent_kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        n = neuron.num_neurons
        self.in_features = in_features
        self.neuron = neuron
        self.dense_i = ETPLinear(in_features, n, use_bias=use_bias, kernel_init=kernel_init,
                                 bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)
        self.dense_h = ETPLinear(n, n, use_bias=False, kernel_init=recurrent_kernel_init,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: ArrayLike) -> jax.Array:
        """One step on ``x`` of shape ``(*batch, in_features)``; returns the spikes ``z_t``."""
        check_step_input(type(self).__name__, jnp.shape(x), self.neuron.v, self.in_features,
                         "neuron.v")
        z = self.neuron.spikes()
        current = self.dense_i(x) + self.dense_h(z)
        return self.neuron._advance(current.astype(self.neuron.v[...].dtype), z)
