r"""Readouts over time: the running sum and the running maximum of a layer's output.

An online rule scores one step at a time, ``L_t = loss_fn(y_t, target_t)``. A
loss of the whole sequence, such as the cross-entropy of the spike counts or of
the maximum membrane potential over time, is not a sum of per-step losses. It
becomes one when the quantity it scores is kept in a hidden state and the loss
reads that state at the last step (weight 1 there, 0 elsewhere):

.. math::

    c_t = c_{t-1} + u_t \quad (\text{SumOverTime}), \qquad
    m_t = \max(m_{t-1}, u_t) \quad (\text{MaxOverTime}),

with ``c_0 = 0`` and ``m_0 = -∞``: at the last step ``T``, ``c_T = Σ_t u_t`` (the spike
count, when ``u`` are spikes; spyx's "integral" of a membrane, when ``u`` is one) and
``m_T = max_t u_t``. Scoring ``loss_fn(c_T, label)`` then is the sequence loss itself,
and its gradient by BPTT is the sequence loss's gradient.

Online, the accumulator is one more state of the layer whose output it reads: it is
computed from that layer's new state elementwise, so it joins that layer's hidden
group (one more state per position). Where a rule is exact on the layer, it stays
exact with the accumulator: D-RTRL on a layer without recurrent weights (the
weights driving the neurons whose output is summed), RTRL everywhere. Weights
further back reach the accumulator only through another trainable operation, as
they reach any readout: D-RTRL approximates them, as it does without an accumulator.
The ``max`` passes the derivative to the step that holds the maximum (half each to
two equal ones, as :func:`jax.numpy.maximum` does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype
from jax.typing import ArrayLike

from braintrace._hidden import HiddenState

from ._checks import check_step_input

__all__ = ["MaxOverTime", "SumOverTime"]


class SumOverTime(nnx.Module):
    r"""The running sum ``c_t = c_{t-1} + u_t`` of its input: a spike count, an integral.

    Hidden state: ``c``, ``(num_features,)`` per sample, ``0`` at the start.
    Score ``c_T`` at the last step for a loss of the counts (module docstring).

    Args:
        num_features: Number of inputs (the input's last axis).
        param_dtype: Dtype of the state.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> count = layers.SumOverTime(2)
        >>> for z in ([1.0, 0.0], [1.0, 1.0], [0.0, 1.0]):
        ...     c = count(jnp.array(z))
        >>> c
        Array([2., 2.], dtype=float32)
    """

    def __init__(self, num_features: int, *, param_dtype: Dtype = jnp.float32):
        self.num_features = num_features
        self.c = HiddenState(jnp.zeros((num_features,), param_dtype))

    def __call__(self, u: ArrayLike) -> jax.Array:
        """One step: adds ``u`` (``(*batch, num_features)``) and returns the sum so far."""
        check_step_input(type(self).__name__, jnp.shape(u), self.c, self.num_features, "c")
        c = self.c[...]
        new_c = (c + jnp.asarray(u, c.dtype)).astype(c.dtype)
        self.c[...] = new_c
        return new_c


class MaxOverTime(nnx.Module):
    r"""The running maximum ``m_t = max(m_{t-1}, u_t)`` of its input (e.g. a membrane potential).

    Hidden state: ``m``, ``(num_features,)`` per sample, ``-∞`` at the start (the
    first step's output is its input). Score ``m_T`` at the last step for a loss of
    the maximum over time (module docstring).

    Args:
        num_features: Number of inputs (the input's last axis).
        param_dtype: Dtype of the state.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import layers
        >>> peak = layers.MaxOverTime(2)
        >>> for v in ([-1.0, 0.5], [-2.0, 2.0], [-0.5, 1.0]):
        ...     m = peak(jnp.array(v))
        >>> m
        Array([-0.5,  2. ], dtype=float32)
    """

    def __init__(self, num_features: int, *, param_dtype: Dtype = jnp.float32):
        self.num_features = num_features
        self.m = HiddenState(jnp.full((num_features,), -jnp.inf, param_dtype))

    def __call__(self, u: ArrayLike) -> jax.Array:
        """One step on ``u`` (``(*batch, num_features)``); returns the maximum so far."""
        check_step_input(type(self).__name__, jnp.shape(u), self.m, self.num_features, "m")
        m = self.m[...]
        new_m = jnp.maximum(m, jnp.asarray(u, m.dtype)).astype(m.dtype)
        self.m[...] = new_m
        return new_m
