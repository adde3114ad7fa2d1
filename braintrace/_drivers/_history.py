"""``History``: what :meth:`OnlineTrainer.fit` measured, one record per batch and per evaluation.

Losses are averaged over the *scored* steps only (:func:`scored_mean`): with a
mask ``m`` of one weight per step, a batch's loss is ``Σ_t m_t L_t / Σ_t m_t``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = ["History", "scored_mean"]


@dataclasses.dataclass
class History:
    """What :meth:`OnlineTrainer.fit` measured: one record per batch and per evaluation.

    It is also the sequence of the batches' losses (``history[-1]``,
    ``len(history)``), as ``fit`` returned before. A resumed fit (see
    :meth:`OnlineTrainer.fit`) continues the History of the run it resumes.

    Attributes:
        steps: ``{'step', 'epoch', 'loss'}`` per batch (``loss``: the scored mean).
        evaluations: ``{'step', 'val_loss', ...}`` per evaluation; ``val_accuracy``
            for classification and ``val_<name>`` for each user metric.
        stopped_early: Whether a callback stopped the training.
        interrupted: Whether a ``KeyboardInterrupt`` (Ctrl+C) stopped it.
        spike_rates: ``{'step', <layer path>: rate, ...}``: each spiking layer's mean rate
            on the first batch and on the last, each after its update, for a model with
            spiking layers (:func:`braintrace.spike_rates`).

    Example:
        >>> history = History(steps=[{'step': 1, 'epoch': 0, 'loss': 0.5},
        ...                          {'step': 2, 'epoch': 0, 'loss': 0.25}])
        >>> history.losses.tolist(), history[-1], len(history)
        ([0.5, 0.25], 0.25, 2)
    """

    steps: list[dict[str, float]] = dataclasses.field(default_factory=list)
    evaluations: list[dict[str, float]] = dataclasses.field(default_factory=list)
    stopped_early: bool = False
    interrupted: bool = False
    spike_rates: list[dict[str, float]] = dataclasses.field(default_factory=list)

    @property
    def losses(self) -> np.ndarray:
        """The scored mean loss of every batch, in order."""
        return np.array([r["loss"] for r in self.steps])

    def metric(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of an evaluation metric (e.g. ``'val_loss'``), for plotting.

        Raises:
            KeyError: No evaluation recorded ``name``.
        """
        records = [r for r in self.evaluations if name in r]
        if not records:
            known = sorted({k for r in self.evaluations for k in r} - {"step"})
            raise KeyError(f"No evaluation recorded {name!r}; recorded: {known}.")
        return (np.array([r["step"] for r in records]), np.array([r[name] for r in records]))

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: Any) -> Any:
        return self.losses.tolist()[index]


def scored_mean(values: jax.Array, mask: Any) -> float:
    """``Σ_t m_t v_t / Σ_t m_t`` over the steps (the plain mean without a mask).

    A ``(T, B)`` mask weighs per-sample values ``(T, B)`` alike, and per-step
    values ``(T,)`` (each the mean of its scored samples) by ``Σ_b m_tb``. A
    value where the mask is 0 is never read, even a NaN (``0 · nan`` would be NaN).

    Example:
        >>> import jax.numpy as jnp
        >>> scored_mean(jnp.array([jnp.nan, 2.0, 1.0]), jnp.array([0.0, 1.0, 1.0]))
        1.5
    """
    values = np.asarray(values, np.float64)
    if mask is None:
        return float(np.mean(values))
    mask = np.asarray(mask, np.float64)
    if mask.ndim == values.ndim + 1:  # a (T, B) mask and per-step values: weigh each step
        mask = mask.sum(axis=-1)      # by its scored samples (values are their mean)
    mask = np.broadcast_to(mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim)),
                           values.shape)
    weighted = np.where(mask != 0, values * mask, 0.0)  # an unscored NaN adds nothing
    return float(np.sum(weighted) / max(np.sum(mask), 1e-300))
