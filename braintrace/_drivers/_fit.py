"""``OnlineTrainer.fit``: a streaming training loop with validation, metrics and callbacks.

The loop a Flax user would otherwise write around :meth:`OnlineTrainer.step`:
it takes batches from any iterable (a list, a data loader, a generator that
never ends), evaluates on validation data every ``eval_every`` batches with
the model in evaluation mode, keeps a :class:`History` that is easy to plot,
calls callbacks after each batch, each evaluation and at the end, and stops
early when a callback says so (:class:`EarlyStopping`).

Losses are averaged over the *scored* steps only: with a mask ``m`` of one
weight per step, a batch's loss is ``Σ_t m_t L_t / Σ_t m_t``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._arguments import check_integer
from braintrace._drivers._spike_rates import log_spike_rates

__all__ = ["Callback", "EarlyStopping", "History", "fit", "scored_mean", "validation_metrics"]

Metric = Callable[[jax.Array, Any], jax.Array]
"""``metric(outputs, batch) -> scalar``: ``outputs`` time-major, ``batch`` as given."""


@dataclasses.dataclass
class History:
    """What :meth:`OnlineTrainer.fit` measured: one record per batch and per evaluation.

    It is also the sequence of the batches' losses (``history[-1]``,
    ``len(history)``), as ``fit`` returned before.

    Attributes:
        steps: ``{'step', 'epoch', 'loss'}`` per batch (``loss``: the scored mean).
        evaluations: ``{'step', 'val_loss', ...}`` per evaluation; ``val_accuracy``
            for classification and ``val_<name>`` for each user metric.
        stopped_early: Whether a callback stopped the training.
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


class Callback:
    """Hooks :meth:`OnlineTrainer.fit` calls; override the ones you need.

    ``on_step`` and ``on_evaluation`` may return ``True`` to stop the training
    (after the current batch). ``record`` is the dict appended to the history.
    ``on_start`` runs first in every ``fit``: a callback that keeps state across
    calls (:class:`EarlyStopping`'s best value) starts it afresh there, so one
    callback object may serve several fits.

    Example:
        >>> class StopAt(Callback):
        ...     def __init__(self, loss):
        ...         self.loss = loss
        ...     def on_start(self, trainer):
        ...         self.batches = 0
        ...     def on_step(self, trainer, record):
        ...         self.batches += 1
        ...         return record['loss'] < self.loss
        >>> stop = StopAt(0.1)
        >>> stop.on_start(None)
        >>> stop.on_step(None, {'step': 1, 'epoch': 0, 'loss': 0.5}), stop.batches
        (False, 1)
    """

    def on_start(self, trainer: Any) -> None:
        """Once, when ``fit`` starts (before the first batch)."""
        del trainer

    def on_step(self, trainer: Any, record: dict[str, float]) -> bool | None:
        """After each batch."""
        del trainer, record
        return None

    def on_evaluation(self, trainer: Any, record: dict[str, float]) -> bool | None:
        """After each evaluation on the validation data."""
        del trainer, record
        return None

    def on_end(self, trainer: Any, history: History) -> None:
        """Once, when the training ends (also after an early stop)."""
        del trainer, history


class EarlyStopping(Callback):
    """Stops when a validation metric has not improved for ``patience`` evaluations.

    Args:
        monitor: The evaluation metric to watch (``'val_loss'``, ``'val_accuracy'``,
            ``'val_<name>'`` of a user metric).
        mode: ``'min'`` (lower is better) or ``'max'``.
        patience: Evaluations without improvement before stopping.
        min_delta: The least change that counts as an improvement.
        restore_best: At the end, write back the Params of the best evaluation.

    Every ``fit`` starts from scratch (:meth:`on_start`): no best value, no
    waiting, no best Params of an earlier fit (of this or another trainer).

    Example:
        >>> stop = EarlyStopping('val_loss', patience=1)
        >>> [stop.on_evaluation(None, {'val_loss': v}) for v in (1.0, 0.5, 0.7)]
        [False, False, True]
    """

    def __init__(self, monitor: str = "val_loss", *, mode: str = "min", patience: int = 3,
                 min_delta: float = 0.0, restore_best: bool = False):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}.")
        if isinstance(patience, bool) or not isinstance(patience, int | np.integer) \
                or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an integer >= 1, got {patience!r}.")
        self.monitor, self.mode, self.patience = monitor, mode, int(patience)
        self.min_delta, self.restore_best = float(min_delta), restore_best
        self.on_start(None)

    def on_start(self, trainer: Any) -> None:
        """Forgets any earlier fit: no best value, no waiting, no best Params."""
        del trainer
        self.best = math.inf if self.mode == "min" else -math.inf
        self.waited = 0
        self.best_params: Any = None

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_evaluation(self, trainer: Any, record: dict[str, float]) -> bool:
        if self.monitor not in record:
            raise KeyError(f"EarlyStopping: the evaluation has no {self.monitor!r}; it has "
                           f"{sorted(set(record) - {'step'})}.")
        value = float(record[self.monitor])
        if self._improved(value):
            self.best, self.waited = value, 0
            if self.restore_best and trainer is not None:
                self.best_params = jax.tree.map(jnp.copy,
                                                nnx.state(trainer.learner.model, nnx.Param))
            return False
        self.waited += 1
        return self.waited >= self.patience

    def on_end(self, trainer: Any, history: History) -> None:
        if self.restore_best and self.best_params is not None:
            nnx.update(trainer.learner.model, self.best_params)


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """``(xs, ys, mask)`` of a batch: a pair, a triple or a :class:`~braintrace.tasks.Batch`."""
    if isinstance(batch, tuple | list) and len(batch) in (2, 3):
        return (*batch, None) if len(batch) == 2 else tuple(batch)
    raise ValueError("A batch must be (xs, ys) or (xs, ys, mask) (a braintrace.tasks.Batch "
                     f"is one), got {type(batch).__name__}.")


def scored_mean(values: jax.Array, mask: Any) -> float:
    """``Σ_t m_t v_t / Σ_t m_t`` over the steps (the plain mean without a mask).

    A ``(T, B)`` mask weighs per-sample values ``(T, B)`` alike, and per-step
    values ``(T,)`` (each the mean of its scored samples) by ``Σ_b m_tb``. A
    value where the mask is 0 is never read, even a NaN (``0 · nan`` would be NaN).

    Example:
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


def validation_metrics(trainer: Any, batches: Sequence[Any],
                       metrics: dict[str, Metric] | None) -> dict[str, float]:
    """The mean over ``batches`` of the validation loss, accuracy and user metrics.

    The model runs in evaluation mode (``model.eval()``; ``model.train()`` after),
    from fresh hidden states (:func:`braintrace.evaluate`), touching nothing.
    The loss and the accuracy count the scored steps only; the accuracy is
    reported where the targets are integer labels of the outputs' last axis. A
    batch whose mask weighs every position 0 scores nothing: it adds nothing to
    any metric (nor to the number of batches it is averaged over); when no batch
    scores anything, ``val_loss`` is NaN.
    """
    model = trainer.learner.model
    totals: dict[str, list[float]] = {}
    model.eval()
    try:
        for batch in batches:
            xs, ys, mask = unpack(batch)
            if mask is not None and not np.any(np.asarray(mask) != 0):
                continue  # scores nothing
            outputs = trainer.learner.evaluate(xs)
            per_sample = mask is not None and np.ndim(mask) == 2  # losses per (step, sample)
            loss_fn = jax.vmap(trainer.loss_fn) if per_sample else trainer.loss_fn
            losses = jax.vmap(loss_fn)(outputs, ys)
            totals.setdefault("val_loss", []).append(scored_mean(losses, mask))
            if jnp.issubdtype(jnp.result_type(ys), jnp.integer) and \
                    np.ndim(outputs) == np.ndim(ys) + 1:
                right = jnp.argmax(outputs, axis=-1) == ys
                totals.setdefault("val_accuracy", []).append(scored_mean(right, mask))
            for name, metric in (metrics or {}).items():
                totals.setdefault(f"val_{name}", []).append(float(metric(outputs, batch)))
    finally:
        model.train()
    if not totals:
        return {"val_loss": math.nan}
    return {name: float(np.mean(values)) for name, values in totals.items()}


def _stream(batches: Iterable[Any], epochs: int, steps: int | None) -> Iterator[tuple[int, Any]]:
    """``(epoch, batch)`` pairs: ``epochs`` passes, at most ``steps`` batches in all."""
    if iter(batches) is batches and epochs > 1 and steps is None:
        raise ValueError("fit: batches is a one-shot iterator (a generator), which can be "
                         "passed over once; give steps=N (a budget of batches) or epochs=1.")
    pairs = ((epoch, batch) for epoch in range(epochs) for batch in batches)
    return pairs if steps is None else itertools.islice(pairs, steps)


def _validation_batches(validation: Any) -> list[Any] | None:
    """``validation`` as a list of batches, each checked to be ``(xs, ys)`` or ``(xs, ys, mask)``.

    A tuple of 2 or 3 is one batch (its inputs may be a tuple, as training's),
    unless every element of it is a batch itself: then it is a tuple of batches.
    """
    if validation is None:
        return None
    if hasattr(validation, "shape"):
        raise ValueError(
            "fit: validation is one array (inputs without targets?); pass validation=(xs, ys) "
            "or (xs, ys, mask), or a list of such batches. Nothing was trained.")
    one = isinstance(validation, tuple) and len(validation) in (2, 3) and \
        not all(_is_batch(part) for part in validation)
    batches = [validation] if one else list(validation)
    for i, batch in enumerate(batches):
        if not _is_batch(batch):
            raise ValueError(
                f"fit: validation[{i}] must be a batch (xs, ys) or (xs, ys, mask) (a "
                f"braintrace.tasks.Batch is one), got a {type(batch).__name__}; validation is "
                "one batch or a list of them. Nothing was trained.")
    return batches


def _is_batch(batch: Any) -> bool:
    return isinstance(batch, tuple | list) and len(batch) in (2, 3)


def _check_metrics(metrics: Any) -> dict[str, Metric]:
    """``metrics`` (``None``: none), after checking it is ``{name: metric}`` of functions."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            "fit: metrics must be a dict {name: metric(outputs, batch) -> scalar}, got a "
            f"{type(metrics).__name__}. Nothing was trained.")
    for name, metric in metrics.items():
        if not callable(metric):
            raise TypeError(f"fit: metrics[{name!r}] must be a function metric(outputs, batch) "
                            f"-> scalar, got a {type(metric).__name__}. Nothing was trained.")
    return dict(metrics)


def _check_callbacks(callbacks: Any) -> Sequence[Callback]:
    """``callbacks``, after checking it is a list or tuple (not one callback)."""
    if not isinstance(callbacks, list | tuple):
        name = type(callbacks).__name__
        raise TypeError(
            f"fit: callbacks must be a list or tuple of Callback objects, got a {name}"
            + (f": pass callbacks=[{name}(...)]" if isinstance(callbacks, Callback) else "")
            + ". Nothing was trained.")
    return callbacks


def fit(trainer: Any, batches: Iterable[Any], *, epochs: int = 1, steps: int | None = None,
        validation: Any = None, eval_every: int | None = None,
        metrics: dict[str, Metric] | None = None, callbacks: Sequence[Callback] = (),
        reset_each_batch: bool = True, progress: bool = True) -> History:
    """The loop of :meth:`OnlineTrainer.fit` (see there)."""
    from tqdm.auto import tqdm

    epochs, steps, eval_every = _check_counts(epochs, steps, eval_every)
    metrics, callbacks = _check_metrics(metrics), _check_callbacks(callbacks)
    validation = _validation_batches(validation)
    pairs = _stream(batches, epochs, steps)
    for callback in callbacks:
        callback.on_start(trainer)
    history, last_epoch, stopped = History(), None, False
    total = steps if steps is not None else (epochs * len(batches)
                                             if isinstance(batches, Sequence) else None)
    with tqdm(total=total, disable=not progress, desc="online training") as bar:
        for n, (epoch, batch) in enumerate(pairs, start=1):
            at_epoch_end = eval_every is None and last_epoch not in (None, epoch)
            if validation is not None and at_epoch_end and \
                    _evaluate(trainer, history, n - 1, validation, metrics, callbacks, bar):
                stopped = True
                break
            last_epoch = epoch
            record = _train_batch(trainer, history, n, epoch, batch, reset_each_batch)
            if n == 1:
                log_spike_rates(trainer, history, unpack(batch)[0], n, bar)
            bar.set_postfix(loss=f"{record['loss']:.4g}", refresh=False)
            bar.update()
            stop = any(bool(c.on_step(trainer, record)) for c in callbacks)
            if validation is not None and eval_every is not None and n % eval_every == 0:
                stop |= _evaluate(trainer, history, n, validation, metrics, callbacks, bar)
            if stop:
                stopped = True
                break
        evaluated = bool(history.evaluations) and \
            history.evaluations[-1]["step"] == len(history)
        if validation is not None and history.steps and not stopped and not evaluated:
            _evaluate(trainer, history, len(history), validation, metrics, callbacks, bar)
        if len(history) > 1:
            log_spike_rates(trainer, history, unpack(batch)[0], len(history), bar)
    history.stopped_early = stopped
    for callback in callbacks:
        callback.on_end(trainer, history)
    return history


def _check_counts(epochs: Any, steps: Any, eval_every: Any
                  ) -> tuple[int, int | None, int | None]:
    """``epochs``, ``steps`` and ``eval_every`` as ints (``None`` kept), checked before any
    batch is learnt.

    Raises:
        ValueError: One is not a positive int (a float or a bool is not one: then an
            ``ArgumentTypeError``, also a ``TypeError``); the message names it.
    """
    untouched = ". Nothing was trained"
    epochs = check_integer("fit: epochs", epochs, minimum=1, note=untouched)
    if steps is not None:
        steps = check_integer("fit: steps", steps, minimum=1,
                              note=" (None: no budget)" + untouched)
    if eval_every is not None:
        eval_every = check_integer("fit: eval_every", eval_every, minimum=1,
                                   note=" (None: after each epoch)" + untouched)
    return epochs, steps, eval_every


def _train_batch(trainer: Any, history: History, n: int, epoch: int, batch: Any,
                 reset: bool) -> dict[str, float]:
    xs, ys, mask = unpack(batch)
    if reset:
        trainer.learner.reset()
    try:
        losses = trainer.step(xs, ys, mask)
    except (ValueError, FloatingPointError) as err:
        err.add_note(f"OnlineTrainer.fit: epoch {epoch}, batch {n - 1}; {len(history)} "
                     "earlier batch(es) stay learnt.")
        raise
    record = {"step": n, "epoch": epoch, "loss": scored_mean(losses, mask)}
    history.steps.append(record)
    return record


def _evaluate(trainer: Any, history: History, n: int, validation: list[Any],
              metrics: dict[str, Metric] | None, callbacks: Sequence[Callback], bar: Any) -> bool:
    record = {"step": n, **validation_metrics(trainer, validation, metrics)}
    history.evaluations.append(record)
    bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k != "step"}, refresh=False)
    return any(bool(c.on_evaluation(trainer, record)) for c in callbacks)
