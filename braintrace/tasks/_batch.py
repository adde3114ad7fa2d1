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

    Outputs at steps the mask weighs 0 are never read (a NaN there changes nothing).

    Args:
        outputs: Logits ``(T, B, C)`` of a classification task.
        batch: The batch they answer; its labels are read at the last scored step.

    Returns:
        A scalar in ``[0, 1]``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace.tasks import Batch, accuracy
        >>> batch = Batch(jnp.zeros((3, 2, 1)), jnp.array([[0, 1]] * 3), jnp.array([0., 1, 1]))
        >>> logits = jnp.array([[[0., 9], [9, 0]], [[1, 0], [0, 1]], [[1, 0], [1, 0]]])
        >>> float(accuracy(logits, batch))
        0.5
    """
    weights = batch.mask / jnp.sum(batch.mask)
    scored = jnp.where((batch.mask != 0)[:, None, None], outputs, 0)  # 0 · nan would be nan
    votes = jnp.einsum("t,tbc->bc", weights, scored)
    last = jnp.max(jnp.nonzero(batch.mask, size=batch.mask.shape[0], fill_value=0)[0])
    return jnp.mean(jnp.argmax(votes, axis=-1) == batch.ys[last])
