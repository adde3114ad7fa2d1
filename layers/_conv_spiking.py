r"""``ConvLIF``: a convolution driving LIF neurons, one per output position and channel.

For one step with input frame ``x_t`` (``(*spatial, in_features)`` per sample):

.. math::

    I_t = \mathrm{conv}(x_t, K) + b, \qquad
    \tilde v = v_{t-1} - z_{t-1}(v_{th} - v_{reset}), \qquad
    v_t = \alpha \tilde v + I_t, \qquad z_t = H(v_t - v_{th}),

the dynamics of :class:`LIF` (soft reset shown; hard reset and refractoriness
as there) applied at every output position and channel. The membrane ``v`` is
a :class:`braintrace.HiddenState` of shape ``(*out_spatial, out_features)``
per sample. There is no recurrent convolution, so the hidden Jacobian is
diagonal and D-RTRL on the kernel is exact (its trace is kept per output
position by the conv primitive).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from flax.typing import Dtype, Initializer, PaddingLike, PrecisionLike
from jax.typing import ArrayLike

from braintrace._hidden import HiddenState

from ._conv import ETPConv
from ._spiking import LIF
from ._surrogate import Surrogate

__all__ = ["ConvLIF"]


def _per_position_lif(shape: tuple[int, ...], lif: LIF) -> LIF:
    """``lif`` with its states widened from ``(C,)`` to ``shape = (*out_spatial, C)``."""
    dtype = lif.v[...].dtype
    lif.v = HiddenState(jnp.zeros(shape, dtype))
    if lif.ref_steps is not None:
        lif.ref_steps = HiddenState(jnp.zeros(shape, dtype))
    return lif


class ConvLIF(nnx.Module):
    r"""A convolutional spiking layer: :class:`ETPConv` input current into a :class:`LIF` grid.

    Hidden state: the membrane ``neuron.v`` (and ``neuron.ref_steps`` with
    refractoriness), ``(*out_spatial, out_features)`` per sample, where
    ``out_spatial`` is the convolution's output size for frames of
    ``input_size``. See the module docstring for the equations.

    Args:
        in_features: Input channels.
        out_features: Output channels (neurons per position).
        kernel_size: Window size, an int (1-D) or one per spatial axis.
        input_size: Spatial size of the input frames, e.g. ``(8, 8)``.
        strides: Window strides.
        padding: Padding of the convolution (as :class:`ETPConv`).
        kernel_dilation: Kernel dilation.
        feature_group_count: Channel groups of the convolution.
        use_bias: Whether the convolution adds a bias.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Dtype of the convolution.
        param_dtype: Dtype of the Params and the states.
        precision: ``jax.lax.Precision`` of the convolution.
        tau: Membrane time constant.
        dt: Simulation step.
        v_th: Firing threshold.
        v_reset: Reset potential.
        reset: ``'soft'`` or ``'hard'``.
        refractory_steps: Silent steps after a spike.
        learn_tau: Whether ``τ`` is a learnable per-channel Param.
        surrogate: Surrogate derivative of the spike (see :func:`spike`).
        surrogate_alpha: Its sharpness.
        detach_reset: Whether the reset passes no derivative (see :class:`LIF`).
        rngs: Random number generators.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> layer = layers.ConvLIF(1, 4, (3, 3), input_size=(8, 8), strides=2,
        ...                        rngs=nnx.Rngs(0))
        >>> layer.neuron.v.shape
        (4, 4, 4)
        >>> braintrace.init_states(layer, batch_size=2)
        >>> layer(jnp.ones((2, 8, 8, 1))).shape
        (2, 4, 4, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        *,
        input_size: Sequence[int],
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        kernel_dilation: int | Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
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
        rngs: nnx.Rngs,
    ):
        self.conv = ETPConv(in_features, out_features, kernel_size, strides, padding=padding,
                            kernel_dilation=kernel_dilation,
                            feature_group_count=feature_group_count, use_bias=use_bias,
                            kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                            param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.input_size = tuple(input_size)
        if len(self.input_size) != len(self.conv.kernel_size):
            raise ValueError(
                f"ConvLIF: input_size={tuple(input_size)} must have one entry per spatial axis "
                f"of kernel_size={self.conv.kernel_size}.")
        frame = jax.ShapeDtypeStruct((*self.input_size, in_features), param_dtype)
        out = jax.eval_shape(self.conv, frame).shape
        lif = LIF(out_features, tau=tau, dt=dt, v_th=v_th, v_reset=v_reset, reset=reset,
                  refractory_steps=refractory_steps, learn_tau=learn_tau, surrogate=surrogate,
                  surrogate_alpha=surrogate_alpha, detach_reset=detach_reset,
                  param_dtype=param_dtype)
        self.neuron = _per_position_lif(out, lif)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """``(*out_spatial, out_features)``: the per-sample shape of the spikes and the state."""
        return tuple(self.neuron.v.get_metadata("sample_shape"))

    def spikes(self) -> jax.Array:
        """The spikes ``z_t`` of the current state (the output of the last step)."""
        return self.neuron.spikes()

    def __call__(self, x: ArrayLike) -> jax.Array:
        """One step on frames ``x (*batch, *input_size, in_features)``; returns the spikes.

        Args:
            x: Input frames, channels last.

        Returns:
            The spikes ``z_t`` (0/1 floats), ``(*batch, *out_spatial, out_features)``.
        """
        frame = (*self.input_size, self.conv.in_features)
        shape = tuple(jnp.shape(x))
        if shape[len(shape) - len(frame):] != frame:
            raise ValueError(
                f"ConvLIF: input of shape {shape} does not end with the frame shape {frame} "
                "(input_size, in_features) the layer was built for; expected "
                f"(*batch, {', '.join(map(str, frame))}).")
        return self.neuron(self.conv(x))
