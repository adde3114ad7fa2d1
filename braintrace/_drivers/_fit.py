"""``OnlineTrainer.fit``: a streaming training loop with validation, metrics and callbacks.

The loop a Flax user would otherwise write around :meth:`OnlineTrainer.step`:
it takes batches from any iterable (a list, a data loader, a generator that
never ends, or a function of the batch to start from), evaluates on
validation data every ``eval_every`` batches with the model in evaluation
mode, keeps a :class:`~braintrace.History` that is easy to plot, calls
callbacks after each batch, each evaluation and at the end, and stops early
when a callback says so (:class:`~braintrace.EarlyStopping`).

A run can be resumed: a checkpoint taken during it (``ModelCheckpoint``)
holds its progress (``_fit_run.py``), and after ``manager.restore(trainer)``
the same ``fit`` call continues it from the next batch. Ctrl+C finishes the
batch in flight, runs every ``on_end`` (a ``ModelCheckpoint`` saves there) and
raises ``KeyboardInterrupt``, the History kept as ``trainer.history``.

The loop does not wait for the device at every batch: a batch's loss is
read on the host when something needs it (``_fit_run.FitRun.read_losses``),
and the trainer's finiteness check of a batch is read by the next batch's step
(``_deferred.py``); an error found so is reported against its own batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._drivers._callbacks import Callback, ModelCheckpoint
from braintrace._drivers._fit_arguments import (
    Metric,
    batch_stream,
    check_callbacks,
    check_counts,
    check_metrics,
    unpack,
    validation_batches,
)
from braintrace._drivers._fit_run import FitRun
from braintrace._drivers._history import History, scored_mean
from braintrace._drivers._interrupt import DeferredInterrupt
from braintrace._drivers._spike_rates import log_spike_rates

__all__ = ["fit", "validation_metrics"]


def validation_metrics(trainer: Any, batches: Sequence[Any],
                       metrics: dict[str, Metric] | None) -> dict[str, float]:
    """The mean over ``batches`` of the validation loss, accuracy and user metrics.

    The model runs in evaluation mode (``model.eval()``; ``model.train()`` after),
    from fresh hidden states (:func:`braintrace.evaluate`), touching nothing.
    The loss and the accuracy count the scored steps only; the accuracy is
    reported where the model's output is one array and the targets are integer
    labels of its last axis (a model returning several outputs, e.g. logits and
    the spikes a regulariser reads, gets its accuracy from ``metrics``). A
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
            if isinstance(outputs, jax.Array) and isinstance(ys, jax.Array | np.ndarray) \
                    and jnp.issubdtype(ys.dtype, jnp.integer) and outputs.ndim == ys.ndim + 1:
                right = jnp.argmax(outputs, axis=-1) == ys
                totals.setdefault("val_accuracy", []).append(scored_mean(right, mask))
            for name, metric in (metrics or {}).items():
                totals.setdefault(f"val_{name}", []).append(float(metric(outputs, batch)))
    finally:
        model.train()
    if not totals:
        return {"val_loss": math.nan}
    return {name: float(np.mean(values)) for name, values in totals.items()}


def fit(trainer: Any, batches: Any, *, epochs: int = 1, steps: int | None = None,
        validation: Any = None, eval_every: int | None = None,
        metrics: dict[str, Metric] | None = None, callbacks: Sequence[Callback] = (),
        reset_each_batch: bool = True, progress: bool = True) -> History:
    """The loop of :meth:`OnlineTrainer.fit` (see there)."""
    from tqdm.auto import tqdm

    epochs, steps, eval_every = check_counts(epochs, steps, eval_every)
    metrics, callbacks = check_metrics(metrics), check_callbacks(callbacks)
    validation = validation_batches(validation)
    resumed = trainer._resume if trainer._resume is not None and not trainer._resume.ended \
        else None
    run = FitRun(dataclasses.replace(resumed.history, stopped_early=False, interrupted=False)
                 if resumed is not None else History(), callbacks)
    stream = batch_stream(batches, epochs, steps, run.step,
                          mark_epoch_ends=validation is not None and eval_every is None)
    trainer._run, trainer.history = run, run.history
    # checkpoints after the other callbacks, so that they save those callbacks' state after
    # the batch (as Lightning orders its ModelCheckpoint)
    ordered = ([c for c in callbacks if not isinstance(c, ModelCheckpoint)]
               + [c for c in callbacks if isinstance(c, ModelCheckpoint)])
    for callback in ordered:
        callback.on_start(trainer)
    if resumed is not None:
        resumed.load_into(callbacks)
    trainer._resume = None
    last = steps if steps is not None else (epochs * len(batches)
                                            if isinstance(batches, Sequence) else None)
    loop = _Loop(trainer, run, ordered, validation, eval_every, metrics, reset_each_batch, last)
    with tqdm(total=last, initial=run.step, disable=not progress,
              desc="online training") as loop.bar:
        interrupted = loop.learn(stream)
        loop.finish(interrupted)
    if interrupted:
        raise KeyboardInterrupt
    trainer._run = None
    return run.history


class _Loop:
    """The state of one :func:`fit` call's loop (its arguments, checked) and its steps."""

    def __init__(self, trainer: Any, run: FitRun, callbacks: Sequence[Callback],
                 validation: list[Any] | None, eval_every: int | None,
                 metrics: dict[str, Metric], reset: bool, last: int | None):
        self.trainer, self.run, self.callbacks = trainer, run, callbacks
        self.validation, self.eval_every, self.metrics = validation, eval_every, metrics
        self.reset, self.last = reset, last
        self.reads_on_step = any(type(c).on_step is not Callback.on_step for c in callbacks)
        self.pending: tuple[int, int] | None = None  # (step, epoch) of the unchecked batch
        self.last_xs: Any = None  # the inputs of the last batch learnt
        self.bar: Any = None

    def learn(self, stream: Any) -> bool:
        """Learns from the stream until it ends, a callback stops, or Ctrl+C; returns whether
        it was interrupted (a ``KeyboardInterrupt``)."""
        try:
            with DeferredInterrupt() as interrupt:
                for n, (epoch, batch, ends_epoch) in enumerate(stream, start=self.run.step + 1):
                    if self._batch(n, epoch, batch, ends_epoch) or interrupt.requested:
                        return interrupt.requested
        except KeyboardInterrupt:
            return True
        return False

    def _batch(self, n: int, epoch: int, batch: Any, ends_epoch: bool) -> bool:
        """Learns batch ``n`` and runs what follows it; returns whether a callback stops."""
        trainer, run = self.trainer, self.run
        xs, ys, mask = unpack(batch)
        if self.reset:
            trainer.learner.reset()
        with self._check_errors():
            try:
                losses = trainer.step(xs, ys, mask)
            except ValueError as err:
                err.add_note(self._note(n, epoch))
                raise
            self.pending, self.last_xs = (n, epoch), xs
            run.read_losses(ready_only=True)  # the last batch's: checked by this step
            record = run.record(n, epoch, losses, mask)
            if n == 1:
                log_spike_rates(trainer, run.history, xs, n, self.bar)
            if self.reads_on_step:
                trainer.sync()
            stops = [bool(c.on_step(trainer, record)) for c in self.callbacks]  # all of them
            stop = any(stops)
            if self.validation is not None and (
                    ends_epoch if self.eval_every is None else n % self.eval_every == 0):
                stop |= self._evaluate(n)
            run.ended = stop or (self.last is not None and n >= self.last)
            run.history.stopped_early = stop
            for callback in self.callbacks:
                callback.on_batch_end(trainer, n)
        self._show()
        self.bar.update()
        return stop

    def _evaluate(self, n: int) -> bool:
        """Evaluates after batch ``n`` (once its check is read); whether a callback stops."""
        self.trainer.sync()
        record = {"step": n, **validation_metrics(self.trainer, self.validation, self.metrics)}
        self.run.history.evaluations.append(record)
        self._show()
        stops = [bool(c.on_evaluation(self.trainer, record)) for c in self.callbacks]
        return any(stops)

    def finish(self, interrupted: bool) -> None:
        """Reads the last batch's check, evaluates if that batch was not, runs ``on_end``."""
        run, history = self.run, self.run.history
        with self._check_errors():
            self.trainer.sync()  # the last batch's check
        evaluated = bool(history.evaluations) and history.evaluations[-1]["step"] == run.step
        if self.validation is not None and history.steps and not evaluated and \
                not history.stopped_early and not interrupted:
            self._evaluate(run.step)
        if run.step > 1 and self.last_xs is not None and not interrupted:
            log_spike_rates(self.trainer, history, self.last_xs, run.step, self.bar)
        history.interrupted, run.ended = interrupted, not interrupted
        for callback in self.callbacks:
            callback.on_end(self.trainer, history)

    @contextlib.contextmanager
    def _check_errors(self) -> Iterator[None]:
        """Notes on a ``FloatingPointError`` raised by the trainer's check of a batch (read
        one call late: ``_deferred.py``) which batch it is, and removes that batch's record
        from the History (the trainer discarded it); any other error passes as it is."""
        try:
            yield
        except FloatingPointError as err:
            if err is self.trainer.learner._deferred.failed and self.pending is not None:
                checked, epoch = self.pending
                steps = self.run.history.steps
                if steps and steps[-1]["step"] == checked:
                    self.run.drop_last()
                err.add_note(self._note(checked, epoch))
            raise

    def _note(self, n: int, epoch: int) -> str:
        return (f"OnlineTrainer.fit: epoch {epoch}, batch {n - 1}; {len(self.run.history)} "
                "earlier batch(es) stay learnt.")

    def _show(self) -> None:
        """The progress bar's figures: the last loss read, the last evaluation's metrics."""
        if self.bar.disable:
            return
        history = self.run.history
        shown = {}
        loss = next((r["loss"] for r in reversed(history.steps) if "loss" in r), None)
        if loss is not None:
            shown["loss"] = f"{loss:.4g}"
        if history.evaluations:
            shown.update({k: f"{v:.4g}" for k, v in history.evaluations[-1].items()
                          if k != "step"})
        self.bar.set_postfix(shown, refresh=False)
