"""The batch every task returns, and the accuracy of a classifier on it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Batch", "accuracy"]


class Batch(NamedTuple):
    """A batch of sequences, time axis leading.

    Attributes:
        xs: Inputs ``(T, B, I)``, float32 (spikes are 0/1).
        ys: Targets: integer labels ``(T, B)`` for a classification task,
            float ``(T, B, O)`` for a regression task.
        mask: ``(T,)`` weights of the steps that are scored (1 where the
            model must answer, 0 elsewhere).
    """

    xs: jax.Array
    ys: jax.Array
    mask: jax.Array


def accuracy(outputs: jax.Array, batch: Batch) -> jax.Array:
    """Fraction of sequences whose mask-weighted mean output picks the right class.

    Each sample's votes are its outputs summed over its scored steps, weighted
    by the mask: with raw spikes scored at every step, its spike counts (a
    rate-coded accuracy); with a readout scored at the last step alone
    (:class:`~braintrace.layers.SumOverTime`, :class:`~braintrace.layers.MaxOverTime`,
    a membrane), that readout's value there. Outputs at steps the mask weighs 0
    are never read (a NaN there changes nothing). A per-sample mask ``(T, B)``
    scores each sample at its own steps; a sample it never scores (all padding)
    is left out of the fraction.

    Args:
        outputs: Logits ``(T, B, C)`` of a classification task.
        batch: The batch they answer; each sample's label is read at its last
            scored step. Its mask is ``(T,)`` or per sample ``(T, B)``.

    Returns:
        A scalar in ``[0, 1]``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace.tasks import Batch, accuracy
        >>> batch = Batch(jnp.zeros((3, 2, 1)), jnp.array([[0, 1]] * 3), jnp.array([0., 1, 1]))
        >>> logits = jnp.array([[[0., 9], [9, 0]], [[1, 0], [0, 1]], [[1, 0], [1, 0]]])
        >>> float(accuracy(logits, batch))
        0.5
        >>> per_sample = jnp.array([[0., 0], [0, 1], [1, 0]])  # sample 1 ends at step 1
        >>> float(accuracy(logits, batch._replace(mask=per_sample)))
        1.0
    """
    steps, size = outputs.shape[:2]
    mask = jnp.broadcast_to(batch.mask.reshape(steps, -1), (steps, size))
    scored = mask != 0
    votes = jnp.einsum("tb,tbc->bc", mask,
                       jnp.where(scored[..., None], outputs, 0))  # 0 · nan would be nan
    last = steps - 1 - jnp.argmax(scored[::-1], axis=0)
    labels = batch.ys[last, jnp.arange(size)]
    counted = jnp.any(scored, axis=0)
    right = (jnp.argmax(votes, axis=-1) == labels) & counted
    return jnp.sum(right) / jnp.maximum(jnp.sum(counted), 1)
