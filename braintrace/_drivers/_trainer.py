"""``OnlineTrainer``: truly online learning with optax, updates inside the time loop.

A thin shell over ``_programs.train_program`` (the program the pure
:func:`~braintrace.online_update` runs): it checks its arguments on the host,
runs the program under ``jax.jit`` and writes the results back; a call that
fails changes nothing. It never waits for the device: a call's finiteness check
is read by the next call of the trainer or its learner, or by :meth:`sync`
(``_deferred.py``); a call that went wrong kept the Params and optimiser state on
the device, and its hidden state and traces are put back when its check is read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from braintrace._algorithms import BPTT
from braintrace._drivers._callbacks import Callback
from braintrace._drivers._checked_calls import CheckedCalls, call_signature
from braintrace._drivers._checkpoint import Item, JsonItem, leaf_names
from braintrace._drivers._checkpointable import Checkpointable
from braintrace._drivers._compiled import Entry
from braintrace._drivers._fit import fit
from braintrace._drivers._fit_arguments import Metric
from braintrace._drivers._fit_run import FitRun, Resumed, restore_template
from braintrace._drivers._functional import window_loop
from braintrace._drivers._grad_call import device_weights
from braintrace._drivers._history import History
from braintrace._drivers._inputs import (
    check_inputs,
    check_signal_inputs,
    refuse_traced,
    step_weights,
)
from braintrace._drivers._learner import OnlineLearner
from braintrace._drivers._not_finite import raise_if_update_not_finite
from braintrace._drivers._programs import CHECKED_TRAIN_PROGRAM, TRAIN_PROGRAM, TrainResult
from braintrace._drivers._sharding import host_arrays, opt_state_shardings, place
from braintrace._loops import LoopSpec, check_positive

__all__ = ["OnlineTrainer"]


class OnlineTrainer(Checkpointable):
    """Online learning: an optax update every ``update_every`` steps, inside the scan.

    Within a sequence the Params change while it runs, as in the brain: every
    ``update_every`` steps the gradient accumulated since the last update is
    applied with ``tx``. Hidden state, traces and the optimiser state are
    carried through the scan. Traces are not reset by an update (the usual
    online approximation). A window of steps the mask scores none of makes no
    update: with only the last step of a sequence scored (classification), the
    default ``update_every=1`` makes one update per sequence, at that step,
    not ``T - 1`` optimiser steps on zero gradients before it (which Adam's
    momentum and AdamW's weight decay would turn into drift). BPTT keeps no
    traces, so an update every step would give it no credit across steps (a
    truncation to one step): with ``BPTT`` the default is one update per
    sequence, full backpropagation through it.

    No call waits for the device (as :class:`~braintrace.OnlineLearner`'s): a
    call whose loss, or whose Params after an update, are not finite keeps the
    Params and optimiser state it started from (on the device: the model never
    holds Params it made), and when its check is read — by the next call of the
    trainer or its learner (which then changes nothing), or by :meth:`sync` or
    a save, whichever comes first — the hidden state and traces it started
    from are put back and its ``FloatingPointError`` is raised.

    Args:
        learner: A learner from :func:`braintrace.compile`.
        tx: An optax gradient transformation.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step (traced once per
            function object, as in ``OnlineLearner.etrace_grad``: pass values that change
            with the targets).
        update_every: Steps between updates (``k``); sequence lengths must be
            multiples of it. ``None`` (default): every step (``1``), and with
            ``BPTT`` once per sequence (``k = T``; an explicit ``k`` is truncated
            BPTT over windows of ``k`` steps).
        blocked: Advance the traces of the steps between updates in time
            blocks (exactly the per-step result, with matrix products;
            ``n = ⌈k/K⌉`` blocks of ``⌊k/n⌋`` steps and one of the rest, ``K``
            64 steps or fewer where 64 stacked steps exceed the 256 MiB block
            memory budget).
            ``None``: wherever the algorithm has a blocked form (D_RTRL,
            ES_D_RTRL) and ``update_every > 1``.

    Attributes:
        history: The :class:`~braintrace.History` of the last :meth:`fit` (also while
            it runs, and after it raised or was interrupted), or ``None``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.Stateful(layers.GRUCell(2, 8, rngs=nnx.Rngs(0))),
        ...                        layers.ETPLinear(8, 1, rngs=nnx.Rngs(1)))
        >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((4, 2)), batch_size=4)
        >>> trainer = braintrace.OnlineTrainer(
        ...     learner, optax.adam(1e-2), loss_fn=lambda y, t: jnp.mean((y - t) ** 2))
        >>> xs = jax.random.normal(jax.random.key(0), (20, 4, 2))
        >>> losses = trainer.step(xs, jnp.cumsum(xs[..., :1], axis=0) / 5)
        >>> losses.shape
        (20,)
    """

    def __init__(self, learner: OnlineLearner, tx: optax.GradientTransformation, *,
                 loss_fn: Callable[[Any, Any], jax.Array], update_every: int | None = None,
                 blocked: bool | None = None):
        self.update_every = (None if update_every is None
                             else check_positive("OnlineTrainer: update_every", update_every))
        if blocked is not None and not isinstance(blocked, bool):
            raise ValueError(f"OnlineTrainer: blocked must be True, False or None, got "
                             f"{blocked!r}.")
        if blocked and learner.rules.traced and not learner.rules.supports_blocks:
            raise ValueError(
                f"Algorithm '{learner.algorithm.name}' has no time-blocked form for this model; "
                "use blocked=False (or leave it unset).")
        self.blocked = blocked
        self.learner = learner
        self._checked = CheckedCalls()
        self.tx = optax.with_extra_args_support(tx)
        self.loss_fn = loss_fn
        self.opt_state = self._placed(self.tx.init(nnx.state(learner.model, nnx.Param)),
                                      learner._entry())
        self.history: History | None = None
        self._run: FitRun | None = None  # the fit running, or interrupted: saved with the trainer
        self._resume: Resumed | None = None  # a fit's progress restored, for the next fit

    def _window(self, length: int) -> int:
        """The steps between updates for a sequence of ``length`` steps (``update_every``)."""
        if self.update_every is not None:
            return self.update_every
        return max(length, 1) if isinstance(self.learner.algorithm, BPTT) else 1

    def _placed(self, opt_state: Any, entry: Entry) -> Any:
        """The optimiser state on ``entry``'s mesh (as it is without one): replicated, or
        split as the Params are under neuron parallel."""
        lay = entry.layout
        if lay is None:
            return opt_state
        params = nnx.state(self.learner.model, nnx.Param)
        return place(opt_state, opt_state_shardings(lay, self.tx, opt_state, params))

    def step(self, xs: Any, ys: Any, mask: jax.Array | None = None,
             **signal_inputs: Any) -> jax.Array:
        """Learns online from one batch of sequences (time axis leading).

        Each update applies the mean gradient of the steps since the last one,
        each step weighted by ``mask[t]`` (all ones by default: steps outside
        a scored window can be given weight 0). A window whose weights are all
        zero makes no update at all: the Params and the optimiser state (Adam's
        moments and count, a schedule's step) stay as they are (with
        :class:`~braintrace.DNI`, whose synthetic gradients do not come from
        the loss, every window updates). What a mask weighs 0 is never read
        when it is not finite: NaN targets there, and NaN inputs after a
        sample's last scored step, add nothing. ``tx`` is given the
        window's loss as ``value=`` (for ``optax.contrib.reduce_on_plateau``).

        Hidden state and traces continue from where they are; Params, the
        optimiser state, hidden state and traces are written back.
        ``signal_inputs`` are an algorithm's own per-step inputs
        (:class:`~braintrace.ThreeFactor`'s ``modulators=``).

        Returns:
            Each step's loss ``(T,)``.

        Raises:
            ValueError: ``xs`` has no steps, a length that is not a multiple of
                ``update_every``, a bad shape, or ``mask`` is invalid.
            FloatingPointError: The *last* call's loss at a step, or its Params after
                an update, were not finite: that call was discarded (Params,
                optimiser state, hidden state and traces are as they were before
                it); the message names its first offending step, and the first
                non-finite input that reaches a scored step, if any. This call
                then changes nothing. The error of this call itself is raised by
                the next call or :meth:`sync`.
        """
        refuse_traced("OnlineTrainer.step", xs, ys, mask)
        learner = self.learner
        view, entry = learner._view_entry()
        xs, ys = learner._place_inputs(entry, xs), learner._place_inputs(entry, ys)
        blocked = self.blocked

        def checks() -> tuple[int, jax.Array, LoopSpec, int]:
            length = check_inputs(xs, entry.example)
            k = self._window(length)
            if length == 0 or length % k:
                raise ValueError(
                    f"The sequence length {length} must be a positive multiple of update_every="
                    f"{k}.")
            weights = device_weights(step_weights(mask, length, entry.batch_size) / k,
                                     entry.param_dtype, entry.layout, reuse=mask is None)
            block_size = None if blocked is None else (None if blocked else 1)
            return length, weights, window_loop(entry, k, block_size), k

        signature = (None if mask is not None
                     else call_signature(xs, statics=(self.update_every, blocked)))
        length, weights, spec, k = self._checked.check(entry, signature, checks)
        params, hidden, other = learner._leaves(entry, view)
        inputs = check_signal_inputs(entry.rules, hidden, signal_inputs, length)
        if entry.layout is not None:
            inputs = None if inputs is None else learner._place_inputs(entry, inputs)
        args = (entry, self.tx, self.loss_fn, k, spec, view.params_def, params,
                self._placed(self.opt_state, entry), hidden, other,
                learner._checked_traces(entry), xs, ys, weights, inputs)
        deferred = learner._deferred
        out: TrainResult = CHECKED_TRAIN_PROGRAM(*args, masked=mask is not None)
        deferred.settle()  # the last call's check, while the device runs this call
        view.write_params(out.params)  # on the mesh already, as the program returns them
        view.write_state(out.hidden, out.other)
        learner._set_traces(out.traces, entry)
        self.opt_state = out.opt_state
        put_back = functools.partial(learner._put_back, out.traces, hidden, other, args[10])
        deferred.defer((out.losses, out.bad_update_at), functools.partial(
            _update_verdict, args, mask is not None, out.bad_params, put_back))
        return out.losses

    def sync(self) -> None:
        """Waits for the calls dispatched so far; raises the error of one that went wrong.

        As :meth:`OnlineLearner.sync <braintrace.OnlineLearner.sync>`: after it,
        every call so far has finished and none applied anything non-finite.

        Raises:
            FloatingPointError: The last call's loss, or its Params after an
                update, were not finite (see :meth:`step`). Raised once.
        """
        self.learner.sync()
        jax.block_until_ready(self.opt_state)
        if self._run is not None:
            self._run.read_losses()

    def _checkpoint_items(self, optimizer: nnx.Optimizer | None = None
                          ) -> dict[str, Item | JsonItem]:
        """The learner's checkpoint items (once the last call's check is read), the optax
        state (item ``opt_state``) and, during a fit (or after one was interrupted), its
        progress (items ``fit``, ``fit_arrays``: ``_fit_run.py``)."""
        items: dict[str, Item | JsonItem] = dict(self.learner._checkpoint_items(optimizer))
        items["opt_state"] = Item(self.opt_state, leaf_names("opt_state", self.opt_state),
                                  flax=False)
        if self._run is not None:
            items.update(self._run.checkpoint_items())
        return items

    def _restore_items(self, path: str, optimizer: nnx.Optimizer | None = None
                       ) -> dict[str, Item | JsonItem]:
        """The items to restore from ``path``: the learner's, the optax state, and a fit's
        progress if the checkpoint holds one."""
        items: dict[str, Item | JsonItem] = dict(self.learner._restore_items(path, optimizer))
        items["opt_state"] = Item(self.opt_state, leaf_names("opt_state", self.opt_state),
                                  flax=False)
        items.update(restore_template(path))
        return items

    def _load_checkpoint(self, restored: dict[str, Any],
                         optimizer: nnx.Optimizer | None = None) -> None:
        """Writes the restored items back; a fit's progress among them is kept for the next
        :meth:`fit`, which continues that run (unless it had ended)."""
        self.learner._load_checkpoint(restored, optimizer)
        self.opt_state = restored["opt_state"]
        self._resume = Resumed.of(restored) if "fit" in restored else None

    def fit(self, batches: Iterable[Any] | Callable[[int], Iterable[Any]], *, epochs: int = 1,
            steps: int | None = None,
            validation: Any = None, eval_every: int | None = None,
            metrics: dict[str, Metric] | None = None, callbacks: Sequence[Callback] = (),
            reset_each_batch: bool = True, progress: bool = True) -> History:
        """Trains on a stream of batches, with validation, metrics, callbacks, early stopping.

        Each batch is one :meth:`step`: an optax update every ``update_every``
        steps of its sequences (the trainer's; by default every step, with
        ``BPTT`` once per batch), inside the time loop, except after steps its
        mask scores none of. So with an update every step, a batch whose mask
        scores every step makes ``T`` updates (truly online), one that scores
        only its last step (a classification) makes one, at the last step, as a
        Flax train step makes one per batch; an answer period of ``k`` steps
        makes ``k``. For one update per batch whatever the mask, construct the
        trainer with ``update_every=T``.

        **Resuming.** A checkpoint taken during a fit (by
        :class:`~braintrace.ModelCheckpoint`, or any ``manager.save(step,
        trainer)`` in a callback) holds the trainer and the fit's progress: its
        History and every callback's :meth:`~braintrace.Callback.state_dict`.
        Restored into a trainer built as before (``manager.restore(trainer)``,
        e.g. in a new process), it makes the next ``fit`` continue that run: the
        History goes on from the checkpoint's, each callback gets ``on_start``
        then its saved state (``EarlyStopping`` its best value, patience and
        best Params), ``steps`` and ``epochs`` count from the run's start, and
        the batches start at the first one not learnt (``n``, the History's last
        ``'step'``): a list is indexed there, a function is called as
        ``batches(n)``, any other iterable is read from its start and its first
        ``n`` batches dropped. Given the same batches, the resumed run's History
        is that of a run never interrupted, bit for bit. A checkpoint of a run
        that had ended (stopped by a callback, or its budget used up) starts a
        new run instead.

        **Ctrl+C** (``KeyboardInterrupt``) finishes the batch in flight (a second
        one stops at once), runs every callback's ``on_end`` (a
        ``ModelCheckpoint`` saves the last batch there; ``history.interrupted``
        is set), then raises the ``KeyboardInterrupt``; the History is
        :attr:`history`. After an error ``on_end`` is not run; the History
        is :attr:`history` too.

        Args:
            batches: Any iterable of ``(xs, ys)`` or ``(xs, ys, mask)`` batches (a
                :class:`braintrace.tasks.Batch` is one), time axis leading: a
                list, a data loader, a generator that never ends; or a function
                ``batches(start)`` returning the batches from the ``start``-th on
                (0 for a new run; one stream: ``epochs=1``).
            epochs: Passes over ``batches``, a positive int (a generator can be
                passed over once).
            steps: At most this many batches in all, a positive int (``None``: no
                budget).
            validation: A batch (``(xs, ys)`` or ``(xs, ys, mask)``, its inputs
                any pytree, as in ``batches``) or a list of batches to evaluate on,
                with the model in evaluation mode (``model.eval()``, then
                ``model.train()``), from fresh hidden states. A batch whose mask
                weighs every position 0 adds nothing to any metric.
            eval_every: Evaluate every this many batches, a positive int
                (``None``: after each epoch). The last batch is always followed
                by an evaluation.
            metrics: ``{name: metric(outputs, batch) -> scalar}`` evaluated on
                the validation batches besides the built-in ``val_loss`` and
                (integer labels) ``val_accuracy``; recorded as ``val_<name>``.
                A metric sees every step's outputs, also those the mask
                ignores: weigh them by the batch's mask.
            callbacks: :class:`~braintrace.Callback` objects (e.g.
                :class:`~braintrace.EarlyStopping`,
                :class:`~braintrace.ModelCheckpoint`); ``on_start`` runs first (an
                ``EarlyStopping`` forgets any earlier fit there), ``on_step`` or
                ``on_evaluation`` returning ``True`` stops the training.
                ``ModelCheckpoint`` objects are called after the others.
            reset_each_batch: Start every batch from fresh hidden state and traces
                (independent sequences); ``False`` carries them on (one stream).
            progress: A tqdm progress bar with the loss and the last evaluation.

        Returns:
            A :class:`~braintrace.History`: per batch its loss averaged over the
            scored steps (``Σ_t m_t L_t / Σ_t m_t``), per evaluation its
            metrics (also over the scored steps); it is also the sequence of the
            batches' losses. Positions a mask weighs 0 add nothing to either,
            even NaN targets or padding.

        Raises:
            ValueError: ``epochs``, ``steps`` or ``eval_every`` is not a positive
                int (a float or bool raises an ``ArgumentTypeError``, also a
                ``TypeError``), ``validation`` is not a batch or a list of
                batches (inputs without targets, for instance), or ``batches`` is a
                generator with ``epochs > 1`` and no ``steps``; before anything is
                trained.
            TypeError: ``metrics`` is not a dict of functions, or ``callbacks`` is
                not a list or tuple; before anything is trained.
            ValueError: A resumed run's callbacks are not those it was saved
                with (their classes, in order); before anything is trained.
            ValueError, FloatingPointError: As :meth:`step`, with a note naming
                the epoch and batch. The batches before it stay learnt; the
                failing batch is discarded (and left out of the History). The
                ``FloatingPointError`` of a batch is raised when its check is read:
                by the next batch's step, before an evaluation or a save, before
                a callback's ``on_step``, or at the end.
            KeyboardInterrupt: Ctrl+C, after ``on_end`` (see above).

        Example:
            >>> import itertools, jax, jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((4, 2)), batch_size=4)
            >>> trainer = braintrace.OnlineTrainer(
            ...     learner, optax.adam(1e-2), loss_fn=lambda y, t: jnp.mean((y - t) ** 2))
            >>> def stream():                       # never ends
            ...     for i in itertools.count():
            ...         xs = jax.random.uniform(jax.random.key(i), (6, 4, 2))
            ...         yield xs, jnp.zeros((6, 4, 3))
            >>> history = trainer.fit(stream(), steps=6, eval_every=3, progress=False,
            ...                       validation=next(stream()))
            >>> len(history), [r['step'] for r in history.evaluations]
            (6, [3, 6])
        """
        return fit(self, batches, epochs=epochs, steps=steps, validation=validation,
                   eval_every=eval_every, metrics=metrics, callbacks=callbacks,
                   reset_each_batch=reset_each_batch, progress=progress)


def _update_verdict(args: tuple[Any, ...], masked: bool, bad_params: jax.Array,
                    put_back: Callable[[], None], losses: np.ndarray,
                    bad_update_at: np.ndarray) -> None:
    """Reads the flags of a trainer's call of ``args`` on the host (``losses``,
    ``bad_update_at``; ``bad_params`` read only then): if it was discarded, puts back the
    hidden state and traces it started from (``put_back``; its program kept the Params and
    optimiser state) and raises.

    Its program applied every update and checked the Params after the last one
    only; to name the first update that made a Param not finite, the call runs
    again on its own arguments (``args``), checked after every update.
    """
    bad_update_at = int(bad_update_at)
    if bad_update_at < 0 and np.isfinite(losses).all():
        return
    put_back()
    bad_params = host_arrays(bad_params)[0]
    if bad_update_at >= 0:
        checked: TrainResult = TRAIN_PROGRAM(*args, skip_non_finite=True, masked=masked)
        at, checked_bad_params = host_arrays(checked.bad_update_at, checked.bad_params)
        if int(at) >= 0:
            bad_update_at, bad_params = int(at), checked_bad_params
    entry, xs, weights = args[0], args[11], args[13]
    raise_if_update_not_finite(
        "OnlineTrainer.step (the last call, checked by the next call or trainer.sync())",
        entry.graph.param_paths, losses, bad_update_at, bad_params, xs=xs, weights=weights)
