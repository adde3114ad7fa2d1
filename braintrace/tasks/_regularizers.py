r"""Activity regularisers: penalties on a layer's spiking activity that keep deep SNNs training.

Each takes a layer's activity ``a`` (``(*batch, N)``: the spikes of one step, or the
spike counts of a :class:`~braintrace.layers.SumOverTime`, or counts divided by the
steps they cover) and a bound in the same units, computes its penalty per sample
and averages it over the batch:

.. math::

    \text{firing rate:}\ \big(\bar a - r^*\big)^2, \qquad
    \text{silent neurons:}\ \frac1N \sum_n \max(0, r_{\min} - a_n)^2, \qquad
    \text{over-activity:}\ \max(0, \bar a - r_{\max})^2,

with ``ā = (1/N) Σ_n a_n`` the layer's mean activity (the lower bound per neuron and
the upper bound on the mean, as in Cramer et al. 2020 for SHD). Per sample, so a
per-sample mask, which calls the loss on one sample, gives the same result.

**How a model adds them.** The per-step loss sees only the step's output, so a model
returns the activity beside its output, ``return logits, z_hidden`` (or the hidden
layer's counts), and the loss adds the penalties:
``lambda y, t: cross_entropy(y[0], t) + 0.1 * firing_rate_penalty(y[1], 0.05)``. The
activity is then computed in the step from the layer's new state, so the compiler sees
the path from the spikes to the loss and the learning signal ``∂L_t/∂h^t`` holds the
penalty's share (through the surrogate derivative) like the output's.
(``nnx.sow`` would not do: what is sown is not an output of the step, and the loss
never sees it.)

**Local in time.** Applied to the spikes ``z_t`` of every step, the penalty
``Σ_t R(z_t)`` is a sum of per-step terms, each depending on its own step's spikes:
its gradient is per-step learning signals, and every rule that is exact for a
per-step loss is exact for it. Applied to the counts of a ``SumOverTime`` at the last
step, it is the sequence's penalty ``R(Σ_t z_t)`` (a firing rate over the whole
sequence), carried online by the count state as in ``braintrace.tasks._losses``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["firing_rate_penalty", "overactivity_penalty", "silent_neuron_penalty"]


def _activity(name: str, activity: ArrayLike) -> jax.Array:
    a = jnp.asarray(activity)
    if a.ndim < 1 or not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name}: activity must be a floating array (*batch, neurons), got "
                         f"shape {a.shape} and dtype {a.dtype}.")
    return a


def firing_rate_penalty(activity: ArrayLike, target: float) -> jax.Array:
    """The squared distance of a layer's mean activity from a target, ``(ā - r*)²``.

    Args:
        activity: ``(*batch, N)``: spikes of a step, counts, or rates.
        target: ``r*``, in the units of ``activity``.

    Returns:
        The penalty, averaged over the batch (a scalar).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> z = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # rates .25 and .5
        >>> float(tasks.firing_rate_penalty(z, 0.25))  # (0 + .25²) / 2
        0.03125
    """
    a = _activity("firing_rate_penalty", activity)
    return jnp.mean((jnp.mean(a, axis=-1) - target) ** 2)


def silent_neuron_penalty(activity: ArrayLike, min_rate: float) -> jax.Array:
    """The mean squared shortfall of each neuron below a minimum, ``(1/N) Σ_n max(0, r_min - a_n)²``.

    Args:
        activity: ``(*batch, N)``: spikes of a step, counts, or rates.
        min_rate: ``r_min``, in the units of ``activity``.

    Returns:
        The penalty, averaged over the batch (a scalar).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> counts = jnp.array([0.0, 1.0, 5.0, 9.0])
        >>> float(tasks.silent_neuron_penalty(counts, 2.0))  # (2² + 1²) / 4
        1.25
    """
    a = _activity("silent_neuron_penalty", activity)
    return jnp.mean(jnp.maximum(0.0, min_rate - a) ** 2)


def overactivity_penalty(activity: ArrayLike, max_rate: float) -> jax.Array:
    """The squared excess of a layer's mean activity over a maximum, ``max(0, ā - r_max)²``.

    Args:
        activity: ``(*batch, N)``: spikes of a step, counts, or rates.
        max_rate: ``r_max``, in the units of ``activity``.

    Returns:
        The penalty, averaged over the batch (a scalar).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> counts = jnp.array([[0.0, 1.0, 5.0, 10.0], [0.0, 0.0, 1.0, 1.0]])  # means 4, .5
        >>> float(tasks.overactivity_penalty(counts, 2.0))  # (2² + 0) / 2
        2.0
    """
    a = _activity("overactivity_penalty", activity)
    return jnp.mean(jnp.maximum(0.0, jnp.mean(a, axis=-1) - max_rate) ** 2)
