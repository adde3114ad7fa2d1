"""Callbacks of :meth:`OnlineTrainer.fit`: the hooks, early stopping, periodic and best checkpoints.

A :class:`Callback` is called by ``fit`` at fixed points of every batch
(``on_step`` after it is learnt, ``on_evaluation`` after an evaluation,
``on_batch_end`` after both), once at the start and once at the end. Its state
(:meth:`Callback.state_dict`) is saved in every checkpoint taken during a fit
and loaded back when a fit resumes (:meth:`Callback.load_state_dict`), so that
a resumed run continues exactly: :class:`EarlyStopping` keeps its best value,
its patience and its best Params. :class:`ModelCheckpoint` takes those
checkpoints, through a :class:`~braintrace.CheckpointManager`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._arguments import check_integer
from braintrace._drivers._history import History

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint"]


class Callback:
    """Hooks :meth:`OnlineTrainer.fit` calls; override the ones you need.

    ``on_step`` and ``on_evaluation`` may return ``True`` to stop the training
    (after the current batch). ``record`` is the dict appended to the history.
    ``on_start`` runs first in every ``fit``: a callback that keeps state across
    calls (:class:`EarlyStopping`'s best value) starts it afresh there, so one
    callback object may serve several fits.

    A callback that keeps state a resumed run needs (a best value, a counter)
    returns it from :meth:`state_dict` and takes it back in
    :meth:`load_state_dict`: ``fit`` saves it in every checkpoint taken during
    the fit (:class:`ModelCheckpoint`) and, resuming, calls ``on_start`` and
    then ``load_state_dict`` with it.

    Overriding ``on_step`` has a cost on an accelerator: ``fit`` reads each
    batch's loss on the host before it (``record['loss']``), which waits for the
    device; otherwise it reads it a batch later, while the device works.

    Example:
        >>> class StopAt(Callback):
        ...     def __init__(self, loss):
        ...         self.loss = loss
        ...     def on_start(self, trainer):
        ...         self.batches = 0
        ...     def on_step(self, trainer, record):
        ...         self.batches += 1
        ...         return record['loss'] < self.loss
        ...     def state_dict(self):
        ...         return {'batches': self.batches}
        ...     def load_state_dict(self, state):
        ...         self.batches = state['batches']
        >>> stop = StopAt(0.1)
        >>> stop.on_start(None)
        >>> stop.on_step(None, {'step': 1, 'epoch': 0, 'loss': 0.5}), stop.batches
        (False, 1)
        >>> stop.state_dict()
        {'batches': 1}
    """

    def on_start(self, trainer: Any) -> None:
        """Once, when ``fit`` starts (before the first batch; resuming, before
        :meth:`load_state_dict`)."""
        del trainer

    def on_step(self, trainer: Any, record: dict[str, float]) -> bool | None:
        """After each batch."""
        del trainer, record
        return None

    def on_evaluation(self, trainer: Any, record: dict[str, float]) -> bool | None:
        """After each evaluation on the validation data."""
        del trainer, record
        return None

    def on_batch_end(self, trainer: Any, step: int) -> None:
        """After everything ``fit`` does for batch number ``step`` (its ``on_step``, its
        evaluation and ``on_evaluation``): the trainer, the History and every callback are
        as a checkpoint of the step must hold them."""
        del trainer, step

    def on_end(self, trainer: Any, history: History) -> None:
        """Once, when the training ends: after the last batch, an early stop, or a
        ``KeyboardInterrupt`` (``history.interrupted``); not after an error."""
        del trainer, history

    def state_dict(self) -> dict[str, Any]:
        """The state a resumed fit needs: JSON values (numbers, strings, lists, dicts) and
        arrays (any nesting of dicts and lists of them). None by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`state_dict` returned (arrays as ``jax.Array``)."""
        del state


def _improved(value: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    return value < best - min_delta if mode == "min" else value > best + min_delta


def _check_mode(user: str, mode: Any) -> str:
    if mode not in ("min", "max"):
        raise ValueError(f"{user}: mode must be 'min' or 'max', got {mode!r}.")
    return mode


def _monitored(user: str, monitor: str, record: dict[str, float]) -> float:
    if monitor not in record:
        raise KeyError(f"{user}: the evaluation has no {monitor!r}; it has "
                       f"{sorted(set(record) - {'step'})}.")
    return float(record[monitor])


class EarlyStopping(Callback):
    """Stops when a validation metric has not improved for ``patience`` evaluations.

    Args:
        monitor: The evaluation metric to watch (``'val_loss'``, ``'val_accuracy'``,
            ``'val_<name>'`` of a user metric).
        mode: ``'min'`` (lower is better) or ``'max'``.
        patience: Evaluations without improvement before stopping.
        min_delta: The least change that counts as an improvement.
        restore_best: At the end, write back the Params of the best evaluation
            (not after a ``KeyboardInterrupt``: that run is to be resumed).

    Every ``fit`` starts from scratch (:meth:`on_start`): no best value, no
    waiting, no best Params of an earlier fit (of this or another trainer). A
    resumed fit continues with the best value, the waiting and the best Params
    of the checkpoint (:meth:`state_dict`).

    Example:
        >>> stop = EarlyStopping('val_loss', patience=1)
        >>> [stop.on_evaluation(None, {'val_loss': v}) for v in (1.0, 0.5, 0.7)]
        [False, False, True]
        >>> stop.state_dict()
        {'best': 0.5, 'waited': 1, 'best_params': None}
    """

    def __init__(self, monitor: str = "val_loss", *, mode: str = "min", patience: int = 3,
                 min_delta: float = 0.0, restore_best: bool = False):
        self.mode = _check_mode("EarlyStopping", mode)
        if isinstance(patience, bool) or not isinstance(patience, int | np.integer) \
                or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an integer >= 1, got {patience!r}.")
        self.monitor, self.patience = monitor, int(patience)
        self.min_delta, self.restore_best = float(min_delta), restore_best
        self.on_start(None)

    def on_start(self, trainer: Any) -> None:
        """Forgets any earlier fit: no best value, no waiting, no best Params."""
        del trainer
        self.best = math.inf if self.mode == "min" else -math.inf
        self.waited = 0
        self.best_params: Any = None

    def on_evaluation(self, trainer: Any, record: dict[str, float]) -> bool:
        value = _monitored("EarlyStopping", self.monitor, record)
        if _improved(value, self.best, self.mode, self.min_delta):
            self.best, self.waited = value, 0
            if self.restore_best and trainer is not None:
                self.best_params = jax.tree.map(
                    jnp.copy, nnx.to_pure_dict(nnx.state(trainer.learner.model, nnx.Param)))
            return False
        self.waited += 1
        return self.waited >= self.patience

    def on_end(self, trainer: Any, history: History) -> None:
        if self.restore_best and self.best_params is not None and not history.interrupted:
            params = nnx.state(trainer.learner.model, nnx.Param)
            nnx.replace_by_pure_dict(params, self.best_params)
            nnx.update(trainer.learner.model, params)

    def state_dict(self) -> dict[str, Any]:
        """The best value, the evaluations waited since, and the best Params (with
        ``restore_best``, once there is a best)."""
        return {"best": self.best, "waited": self.waited, "best_params": self.best_params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.waited = float(state["best"]), int(state["waited"])
        self.best_params = state["best_params"]


class ModelCheckpoint(Callback):
    """Saves the trainer and the fit's progress: every ``every`` batches, at each best
    evaluation, and at the end; a fit resumes from any of these checkpoints.

    Each save is ``manager.save(step, trainer, metrics=...)``: ``step`` is the
    batch's number (the History's ``'step'``), ``metrics`` the batch's loss and
    the last evaluation's metrics (``{'loss', 'val_loss', ...}``, for the
    manager's ``best_fn``). It is taken in :meth:`on_batch_end`, after
    everything ``fit`` does for the batch, and ``fit`` calls a
    ``ModelCheckpoint`` after the other callbacks: the checkpoint holds the
    trainer (Params, optimiser state, hidden state, traces), the History and
    every callback's state as they are after the batch. At the end (also after
    a ``KeyboardInterrupt``) the last batch is saved if it is not already.
    Which steps are kept is the manager's choice (``max_to_keep``, ``best_fn``).

    Resume with ``manager.restore(trainer)`` (into a trainer built as before,
    e.g. in a new process), then the same ``trainer.fit(...)`` call: it
    continues the run where the checkpoint left it (:meth:`OnlineTrainer.fit`).

    Args:
        manager: A :class:`~braintrace.CheckpointManager`, on a directory without
            checkpoints of a later step (a new one for a new run).
        every: Save every this many batches, a positive int (``None``: not periodically).
        monitor: Save after each evaluation whose ``monitor`` (``'val_loss'``, ...)
            is the best so far (``None``: not).
        mode: ``'min'`` (lower is better) or ``'max'``, for ``monitor``.

    Example:
        >>> import tempfile
        >>> import braintrace
        >>> manager = braintrace.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
        ...                                        best_fn=lambda m: m['val_loss'],
        ...                                        best_mode='min')
        >>> checkpoint = ModelCheckpoint(manager, every=100, monitor='val_loss')
        >>> checkpoint.state_dict()
        {'best': inf}
        >>> manager.close()
    """

    def __init__(self, manager: Any, *, every: int | None = None, monitor: str | None = None,
                 mode: str = "min"):
        # What it calls of the manager (not an isinstance check: the manager's module
        # imports the trainer's, which imports this one).
        if not all(callable(getattr(manager, name, None))
                   for name in ("save", "latest_step", "restore")):
            raise TypeError("ModelCheckpoint: manager must be a braintrace.CheckpointManager, "
                            f"got {type(manager).__name__}.")
        self.manager = manager
        self.every = None if every is None else check_integer(
            "ModelCheckpoint: every", every, minimum=1, note=" (None: no periodic saves)")
        self.monitor, self.mode = monitor, _check_mode("ModelCheckpoint", mode)
        self.on_start(None)

    def on_start(self, trainer: Any) -> None:
        """Forgets the best value; checks the directory holds no later step than the fit's."""
        self.best = math.inf if self.mode == "min" else -math.inf
        if trainer is None:
            return
        now, latest = _step_of(trainer.history), self.manager.latest_step()
        if latest is not None and latest > now:
            raise ValueError(
                f"ModelCheckpoint: {self.manager.directory} holds step {latest}, later than "
                f"this fit's step {now}. To resume the run it holds, restore it "
                "(manager.restore(trainer)) and call the same fit; a run that had ended "
                "(stopped early, or its budget used up) is not resumed: give a new run a new "
                "directory. Nothing was trained.")

    def on_batch_end(self, trainer: Any, step: int) -> None:
        evaluations = trainer.history.evaluations
        best = False
        if self.monitor is not None and evaluations and evaluations[-1]["step"] == step:
            value = _monitored("ModelCheckpoint", self.monitor, evaluations[-1])
            if _improved(value, self.best, self.mode):
                self.best, best = value, True
        if best or (self.every is not None and step % self.every == 0):
            self._save(trainer, step)

    def on_end(self, trainer: Any, history: History) -> None:
        step = _step_of(history)
        if step > 0 and step != self.manager.latest_step():
            self._save(trainer, step)

    def _save(self, trainer: Any, step: int) -> None:
        trainer.sync()  # the batch's check read (its error raised) and its loss recorded
        history = trainer.history
        metrics = {"loss": history.steps[-1]["loss"]} if history.steps else {}
        if history.evaluations:
            metrics.update({k: v for k, v in history.evaluations[-1].items() if k != "step"})
        self.manager.save(step, trainer, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        """The best value of ``monitor`` so far."""
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])


def _step_of(history: History) -> int:
    """The number of the last batch of ``history`` (0 before the first)."""
    return int(history.steps[-1]["step"]) if history.steps else 0
