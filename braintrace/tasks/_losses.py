r"""Per-step classification losses for spiking readouts, and the mask that scores the last step.

An online rule sees one step at a time: ``L_t = loss_fn(y_t, target_t)``, weighed by the
mask. Which spiking loss that makes depends on the readout the model returns and on
the steps the mask scores:

* rate-coded (snnTorch's ``ce_rate_loss``): the output layer's spikes ``z_t``, every
  step scored;
* spike count (``ce_count_loss``): a :class:`~braintrace.layers.SumOverTime` of the output
  spikes, the last step scored;
* membrane integral (spyx's ``integral_crossentropy``): a ``SumOverTime`` of a
  ``LeakyReadout``, the last step scored;
* maximum membrane over time: a :class:`~braintrace.layers.MaxOverTime` of a
  ``LeakyReadout``, the last step scored;
* last-step membrane: a ``LeakyReadout``, the last step scored.

The rate-coded loss is a sum of per-step losses. The others are losses of the whole
sequence, ``CE(Σ_t z_t)`` or ``CE(max_t v_t)``, which are not: the readout keeps the
sum or the maximum in a hidden state, and the loss at the last step scores it, so
the per-step loss at the last step *is* the sequence loss (BPTT's gradient of it is
exactly that loss's gradient). An online rule follows the accumulator as one more
state of the layer it reads, exact wherever it is exact on that layer
(``braintrace.layers._over_time``). With sequences of different lengths (padding),
:func:`last_step_mask` scores each sample at its own last step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

__all__ = ["cross_entropy", "last_step_mask"]


def cross_entropy(logits: ArrayLike, labels: ArrayLike, *,
                  label_smoothing: float = 0.0) -> jax.Array:
    r"""Softmax cross-entropy of one step with integer labels, the mean over samples.

    .. math::

        L = -\frac{1}{B}\sum_b \sum_c q_{bc} \log \operatorname{softmax}(\ell_b)_c, \qquad
        q_b = (1 - \varepsilon)\,\mathrm{onehot}(y_b) + \varepsilon / C

    with label smoothing ``ε`` (spyx's ``integral_crossentropy`` uses 0.3). Works on a
    batch ``(B, C)`` and on one sample ``(C,)`` (a per-sample mask calls the loss per
    sample). The logits are whatever readout the model returns: spikes, spike counts,
    a membrane, its maximum (module docstring).

    Args:
        logits: ``(*batch, C)``.
        labels: Integer labels ``(*batch,)``.
        label_smoothing: ``ε`` in ``[0, 1)``.

    Returns:
        The mean cross-entropy, a scalar.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> counts = jnp.array([[3.0, 0.0], [1.0, 1.0]])  # spike counts of two classes
        >>> round(float(tasks.cross_entropy(counts, jnp.array([0, 1]))), 4)
        0.3709
        >>> round(float(tasks.cross_entropy(counts[0], jnp.array(0), label_smoothing=0.3)), 4)
        0.4986
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1), got "
                         f"{label_smoothing}.")
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy: labels of shape {labels.shape} do not fit logits of shape "
            f"{logits.shape}; expected integer labels of shape {logits.shape[:-1]} (one per "
            f"sample; a per-sample mask calls the loss on one sample).")
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype),
                                  label_smoothing)
    return jnp.mean(optax.softmax_cross_entropy(logits, targets))


def last_step_mask(lengths: ArrayLike, num_steps: int) -> jax.Array:
    """A per-sample mask ``(T, B)`` that scores each sample at its last step, ``lengths[b] - 1``.

    For sequences padded to ``num_steps`` (``T``): the loss of a readout over time
    (:class:`~braintrace.layers.SumOverTime`, :class:`~braintrace.layers.MaxOverTime`)
    is read where each sample ends, not after its padding. A length of 0 scores nothing.

    Args:
        lengths: Integer lengths ``(B,)``, each in ``[0, T]``.
        num_steps: ``T``.

    Returns:
        A float32 ``(T, B)`` array of zeros with one 1 per non-empty sample.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> tasks.last_step_mask(jnp.array([2, 4, 0]), 4)
        Array([[0., 0., 0.],
               [1., 0., 0.],
               [0., 0., 0.],
               [0., 1., 0.]], dtype=float32)
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1 or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"last_step_mask: lengths must be a 1-D integer array (one length per "
                         f"sample), got shape {lengths.shape} and dtype {lengths.dtype}.")
    return (jnp.arange(num_steps)[:, None] == lengths[None, :] - 1).astype(jnp.float32)
