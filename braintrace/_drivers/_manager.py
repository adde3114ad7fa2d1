"""``CheckpointManager``: numbered checkpoints of a run, over orbax's manager.

A thin wrapper over ``orbax.checkpoint.CheckpointManager``: every step is a
subdirectory of the manager's directory (named by its number) holding the
items of :meth:`OnlineLearner.save <braintrace.OnlineLearner.save>`
(``params`` under their Flax paths, ``hidden``, ``other``, ``traces``,
``opt_state``, ``optimizer``, the ``braintrace`` record; see
``_checkpoint.py``) or, for a user's own train step, of a model, an
``nnx.Optimizer`` and an :class:`~braintrace.OnlineState` (``params``,
``hidden``, ``other``, ``optimizer``, ``state_hidden``, ``state_other``,
``state_traces``; see ``_checkpointable.ModelAndState``), orbax's ``metrics``
when given, and the SHA-256 manifest. Orbax numbers and lists the
steps; braintrace deletes the steps that are not kept once a new step is
complete (``_keep.py``: a NaN or infinite metric is never best; a step whose
save failed before its manifest is never listed, best or counted), reads the
directory (not a cached list) where it matters, and adds the integrity checks
and the all-or-nothing restore.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any, Self, overload

import jax
import numpy as np
from flax import nnx

from braintrace._arguments import check_integer
from braintrace._drivers._checkpoint import (
    MANIFEST,
    Item,
    JsonItem,
    damaged,
    restore_args,
    save_args,
    unpack,
    write_manifest,
)
from braintrace._drivers._checkpointable import ModelAndState
from braintrace._drivers._functional import OnlineState
from braintrace._drivers._keep import Saved, keep_rule, score, unkept
from braintrace._drivers._learner import OnlineLearner
from braintrace._drivers._trainer import OnlineTrainer

__all__ = ["CheckpointManager"]

Target = OnlineLearner | OnlineTrainer


class CheckpointManager:
    """Numbered checkpoints of a run: keep the last N, keep the best, resume exactly.

    A thin wrapper over ``orbax.checkpoint.CheckpointManager``. Each saved step
    is a subdirectory of ``directory`` (``directory/<step>``) with the layout of
    :meth:`OnlineLearner.save <braintrace.OnlineLearner.save>`: the Params as the
    orbax item ``params`` (``nnx.state(model, nnx.Param)`` under its Flax paths,
    which plain orbax and Flax restore without braintrace), beside it the items
    ``hidden``, ``other``, ``traces``, ``opt_state`` (a trainer's optax state),
    ``optimizer`` (``nnx.state`` of an ``nnx.Optimizer``: its ``opt_state`` and
    ``step``), ``braintrace`` (the record of every leaf) and orbax's ``metrics``;
    and a SHA-256 manifest of its files, checked by :meth:`restore`. Saving is
    synchronous (the manifest digests finished files).

    It saves a learner or trainer (``save(step, learner)``), or the objects of
    your own ``@nnx.jit`` train step: ``save(step, model=model,
    optimizer=optimizer, state=state)`` with the :class:`~braintrace.OnlineState`
    of :func:`~braintrace.online_grad` (its hidden states, other Variables such
    as the RNG, and traces, as the items ``state_hidden``, ``state_other``,
    ``state_traces``; the model's own Variables as a learner's: ``params``,
    ``hidden``, ``other``). ``restore(model=..., optimizer=..., state=...)``
    fills the model and optimizer and returns ``(step, state)``; the stream
    then continues bit-identically (second example).

    Use it as a context manager, or call :meth:`close` when done.

    Args:
        directory: The root directory (created if missing).
        max_to_keep: Keep the last ``max_to_keep`` steps and delete older ones
            (``None``: keep all; ``0`` with ``best_fn``: keep only the best, as
            orbax's ``BestN``; ``0`` without it, which would keep nothing, is an
            error).
        best_fn: ``best_fn(metrics) -> float``: also keep the ``keep_best``
            steps with the best value (steps saved without metrics are kept).
        best_mode: ``'max'`` or ``'min'``: which value of ``best_fn`` is best.
        keep_best: How many of the best steps to keep besides the last
            ``max_to_keep`` (with ``best_fn``; ``None``: all).
        options: An ``orbax.checkpoint.CheckpointManagerOptions`` used as it is
            instead of the four arguments above (orbax's own semantics: there
            ``max_to_keep`` with ``best_fn`` keeps the best N only).

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> def learner(seed):
        ...     model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(seed)))
        ...     return braintrace.compile(model, 'd_rtrl', jnp.ones((1, 2)), batch_size=1)
        >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
        >>> first = learner(0)
        >>> with braintrace.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
        ...                                   best_fn=lambda m: m['loss'],
        ...                                   best_mode='min') as manager:
        ...     for step in range(4):
        ...         _ = first.etrace_grad(jnp.ones((3, 1, 2)), jnp.ones((3, 1, 3)), mse)
        ...         _ = manager.save(step, first, metrics={'loss': [5.0, 1.0, 4.0, 3.0][step]})
        ...     resumed = learner(1)
        ...     manager.all_steps(), manager.best_step(), manager.restore(resumed)
        ([1, 2, 3], 1, 3)
        >>> kernel = lambda learner: learner.model.cell.dense_i.kernel[...]
        >>> bool(jnp.all(kernel(resumed) == kernel(first)))
        True

        Your own train step (README: "Inside your own train step"), resumed in a
        fresh process: new objects of the same shapes, filled by ``restore``.

        >>> import optax
        >>> def setup(seed):
        ...     model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(seed)),
        ...                            layers.LIF(4))
        ...     learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
        ...     online = braintrace.online_grad(learner, mse)
        ...     optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        ...     @nnx.jit
        ...     def train_step(model, optimizer, state, xs, ys):
        ...         grads, state, stats = online.grad(model, state, xs, ys)
        ...         optimizer.update(model, grads)
        ...         return state, stats.losses
        ...     return model, optimizer, online, train_step
        >>> xs, ys = jnp.ones((5, 2, 3)), jnp.full((5, 2, 4), 0.5)
        >>> model, optimizer, online, train_step = setup(0)
        >>> state = online.init(model)
        >>> directory = tempfile.mkdtemp()
        >>> with braintrace.CheckpointManager(directory, max_to_keep=2) as manager:
        ...     for step in range(3):
        ...         state, losses = train_step(model, optimizer, state, xs, ys)
        ...         _ = manager.save(step, model=model, optimizer=optimizer, state=state)
        >>> model2, optimizer2, online2, train_step2 = setup(seed=1)  # "another process"
        >>> with braintrace.CheckpointManager(directory) as manager:
        ...     step, state2 = manager.restore(model=model2, optimizer=optimizer2,
        ...                                    state=online2.init(model2))
        >>> step, int(optimizer2.step[...])
        (2, 3)
        >>> state, losses = train_step(model, optimizer, state, xs, ys)
        >>> state2, losses2 = train_step2(model2, optimizer2, state2, xs, ys)
        >>> bool(jnp.all(losses == losses2))
        True
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 best_fn: Callable[[Any], float] | None = None, best_mode: str = "max",
                 keep_best: int | None = 1, options: Any = None):
        import orbax.checkpoint as ocp

        if options is None:
            if best_mode not in ("max", "min"):
                raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}.")
            for name, n in (("max_to_keep", max_to_keep), ("keep_best", keep_best)):
                if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                    raise ValueError(f"{name} must be a non-negative int or None, got {n!r}.")
            if max_to_keep == 0 and (best_fn is None or keep_best == 0):
                raise ValueError(
                    "max_to_keep=0 keeps none of the last steps, and without best_fn (or with "
                    "keep_best=0) no step at all: each would be deleted as soon as it is "
                    "saved. Pass max_to_keep >= 1, None (keep all), or best_fn to keep only "
                    "the best keep_best steps.")
            policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
            if best_fn is not None:
                policies.append(ocp.checkpoint_managers.BestN(
                    get_metric_fn=functools.partial(score, best_fn, best_mode), n=keep_best))
            options = ocp.CheckpointManagerOptions(
                best_fn=best_fn, best_mode=best_mode, enable_async_checkpointing=False,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
        self._best_fn, self._best_mode = options.best_fn, options.best_mode
        self._keep = keep_rule(options)
        self._names = options.step_name_format or ocp.step.standard_name_format(
            step_prefix=options.step_prefix,
            step_format_fixed_length=options.step_format_fixed_length)
        # orbax keeps every step; this manager deletes the unkept ones once a new step is complete
        self._manager = ocp.CheckpointManager(
            os.path.abspath(os.fspath(directory)),
            options=dataclasses.replace(
                options, max_to_keep=None, keep_period=None, keep_time_interval=None,
                preservation_policy=ocp.checkpoint_managers.preservation_policy.PreserveAll()))

    @property
    def directory(self) -> str:
        """The root directory."""
        return os.fspath(self._manager.directory)

    def step_directory(self, step: int) -> str:
        """The directory of ``step`` (a braintrace checkpoint, as ``learner.save`` writes)."""
        return os.path.join(self.directory, self._names.build_name(step))

    def all_steps(self) -> list[int]:
        """The saved steps, in increasing order, as the directory holds them now.

        Complete steps only (their manifest written: each restores); a step whose
        save failed midway is not one, and the next complete save deletes it.
        """
        return [step for step in self._orbax_steps() if self._complete(step)]

    def latest_step(self) -> int | None:
        """The newest saved step (the one :meth:`restore` restores by default), or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best saved step by ``best_fn`` (the latest without one), or ``None``.

        A step whose ``best_fn`` value is NaN or infinite is never best: with
        such values only (or no metrics), ``None``. Nor is a step whose save did
        not complete (it would not restore).
        """
        saved = self._saved()
        if self._best_fn is None:
            return saved[-1].step if saved else None
        scored = [(value, s.step) for s in saved if s.metrics is not None
                  and math.isfinite(value := score(self._best_fn, self._best_mode, s.metrics))]
        return max(scored)[1] if scored else None

    def save(self, step: int, target: Target | None = None, *,
             model: nnx.Module | None = None, optimizer: nnx.Optimizer | None = None,
             state: OnlineState | None = None, metrics: Any = None) -> bool:
        """Saves ``target`` (or ``model`` and ``state``) and ``optimizer`` as ``step``.

        Once the step is complete (its manifest written), deletes the steps that
        are not kept (``max_to_keep``, ``best_fn``, judged among the complete
        steps): a save interrupted before then leaves every older step in place,
        is never best, never counts against ``max_to_keep``, and is deleted by
        the next complete save (or replaced, if that saves the same step).

        Args:
            step: The step number, a non-negative int larger than every saved one
                (orbax's rule), e.g. the number of train steps so far.
            target: An :class:`~braintrace.OnlineLearner` or
                :class:`~braintrace.OnlineTrainer` (whose optax state is saved too).
            model: Instead of ``target``, for your own train step: the model,
                saved as a learner's checkpoint of it would be (its Params as the
                item ``params`` under their Flax paths, its other Variables as
                ``hidden`` and ``other``).
            optimizer: An ``nnx.Optimizer``, saved as ``nnx.state(optimizer)``
                (its ``opt_state`` and ``step``) in the item ``optimizer``.
            state: With ``model``: the :class:`~braintrace.OnlineState` your train
                step carries (hidden states, other Variables such as RNG keys,
                traces), saved as the items ``state_hidden``, ``state_other`` and
                ``state_traces``.
            metrics: A pytree of scalars for ``best_fn`` (stored as JSON by orbax).
                A step whose ``best_fn`` value is NaN or infinite is never best.

        Returns:
            Whether the step is kept: ``False`` when orbax skipped it (its
            ``save_interval_steps`` or ``save_decision_policy``), or when no
            keep rule keeps it (with ``max_to_keep=0``, a step that is not
            among the best is deleted at once).

        Raises:
            TypeError: Neither or both of ``target`` and ``model`` are given,
                ``state`` is given with a ``target`` (a learner carries its own),
                an argument has another type, or ``model``, ``optimizer`` or
                ``state`` holds abstract arrays (``jax.eval_shape``); nothing is
                written then.
            ValueError: ``step`` is not a non-negative int, is already saved (by
                this manager or another one on the directory), or is not larger
                than every saved step; ``best_fn`` cannot read ``metrics`` or
                does not return a number; nothing is written then.
        """
        import orbax.checkpoint as ocp

        user = "CheckpointManager.save"
        step = _step(user, step)
        items = _checkpointed(user, target, model, state)._checkpoint_items(optimizer)
        _check_concrete(user, items, "target" if target is not None else "model")
        metrics = self._checked_metrics(user, metrics)
        steps = self.all_steps()
        if step in steps:
            raise ValueError(f"Step {step} is already saved in {self.directory}; save each step "
                             "once (or delete it first); nothing is written.")
        if steps and step < steps[-1]:
            raise ValueError(
                f"{user}: step {step} is not larger than every saved step (the latest is "
                f"{steps[-1]}) in {self.directory}; orbax numbers checkpoints in increasing "
                "order (also after restoring an older one). Save it as a later step, or delete "
                "the later steps first; nothing is written.")
        for failed in self._unfinished(steps):
            if failed >= step:  # a failed save of this step or a later one: replaced by this one
                self._manager.delete(failed)
        saved = self._manager.save(step, args=ocp.args.Composite(**save_args(items)),
                                   metrics=metrics)
        self._manager.wait_until_finished()
        if not saved or step not in self._manager.all_steps():
            return False
        write_manifest(self.step_directory(step))
        self._delete_unkept()
        return step in self._manager.all_steps()

    @overload
    def restore(self, target: Target | int | None = None, step: int | None = None, *,
                model: nnx.Module | None = None, optimizer: nnx.Optimizer | None = None,
                state: None = None) -> int: ...

    @overload
    def restore(self, target: int | None = None, step: int | None = None, *,
                model: nnx.Module, optimizer: nnx.Optimizer | None = None,
                state: OnlineState) -> tuple[int, OnlineState]: ...

    def restore(self, target: Target | int | None = None, step: int | None = None, *,
                model: nnx.Module | None = None, optimizer: nnx.Optimizer | None = None,
                state: OnlineState | None = None) -> int | tuple[int, OnlineState]:
        """Restores ``step`` (default: the latest complete) into what was saved.

        Into ``target`` (a learner or trainer), or into ``model``, with
        ``optimizer`` in both cases; an :class:`~braintrace.OnlineState`, being
        immutable, is returned: pass a ``state`` of the same shapes (e.g.
        ``online.init(model)``, or ``jax.eval_shape(online.init, model)``) and
        get the saved one back. As in orbax,
        ``restore(step, model=...)`` takes the step first when there is no
        ``target``.

        By default the latest step whose manifest was written: a save
        interrupted after orbax finished but before the manifest is skipped.

        The arrays are read onto the devices of ``target`` (or ``model`` and
        ``state``): another mesh restores too. A run resumed from step ``s``
        continues exactly as the run saved at ``s``.

        Returns:
            The step restored; with ``state``, ``(step, restored_state)``.

        Raises:
            TypeError: Neither or both of ``target`` and ``model`` are given, or
                an argument has another type.
            ValueError: ``step`` is not a non-negative int, no step is saved,
                ``step`` is not saved, or its checkpoint is damaged or does not
                match what is given (e.g. saved with a ``state`` or an
                ``optimizer`` and restored without); the message names the file
                or the first offending leaf. Nothing is changed then.
        """
        import orbax.checkpoint as ocp

        if model is not None and target is not None and not isinstance(target, Target):
            if step is not None:
                raise TypeError(f"CheckpointManager.restore: step given twice ({target!r} and "
                                f"step={step!r}).")
            target, step = None, target
        holder = _checkpointed("CheckpointManager.restore", target, model, state)
        steps = self._orbax_steps()  # a failed save too: restoring it says why it cannot
        if step is None:
            if not steps:
                raise ValueError(f"{self.directory} holds no checkpoint to restore.")
            complete = self.all_steps()
            step = complete[-1] if complete else steps[-1]  # the error then says it
        else:
            step = _step("CheckpointManager.restore", step)
            if step not in steps:
                raise ValueError(f"Step {step} is not saved in {self.directory}; saved: "
                                 f"{self.all_steps()}.")
        where = self.step_directory(step)
        items = holder._restore_items(where, optimizer)
        args = restore_args(where, items)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as err:  # any failure to read the arrays means the same thing
            raise damaged(where, err) from err
        holder._load_checkpoint(unpack(where, items, restored), optimizer)
        if isinstance(holder, ModelAndState) and holder.state is not None:
            return step, holder.state
        return step

    def _orbax_steps(self) -> list[int]:
        """Every step orbax lists in the directory now (another manager's too), complete or not."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _complete(self, step: int) -> bool:
        """Whether ``step``'s save completed: its manifest, written last, is there."""
        return os.path.isfile(os.path.join(self.step_directory(step), MANIFEST))

    def _unfinished(self, complete: list[int]) -> list[int]:
        """The steps orbax lists that are not in ``complete``: saves that failed midway."""
        return [step for step in self._orbax_steps() if step not in complete]

    def _saved(self) -> list[Saved]:
        """The complete steps as the directory holds them now (another manager's too), oldest
        first."""
        committed = {m.step: m.commit_timestamp for m in self._names.find_all(self.directory)}
        return [Saved(step, self._manager.metrics(step), committed[step])
                for step in self.all_steps()]

    def _delete_unkept(self) -> None:
        """Deletes the steps that no keep rule keeps among the complete ones, and the older
        failed saves (after a step is complete: ``_keep.unkept``)."""
        complete = self._saved()
        for step in unkept(self._keep, complete,
                           self._unfinished([s.step for s in complete])):
            self._manager.delete(step)

    def _checked_metrics(self, user: str, metrics: Any) -> Any:
        """``metrics`` as JSON values, after checking ``best_fn`` reads a number from them."""
        metrics = _plain(metrics)
        if self._best_fn is None or metrics is None:
            return metrics
        try:
            value = self._best_fn(metrics)
        except Exception as err:  # whatever best_fn raises, metrics lacks what it reads
            raise ValueError(
                f"{user}: best_fn could not read metrics={metrics!r} ({type(err).__name__}: "
                f"{err}). Pass the metrics best_fn reads (e.g. metrics={{'loss': loss}}); "
                "nothing is written.") from err
        if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
            raise ValueError(f"{user}: best_fn(metrics) must be a number, got {value!r} from "
                             f"metrics={metrics!r}; nothing is written.")
        return metrics

    def wait_until_finished(self) -> None:
        """Waits for orbax's background work (saves are synchronous; deletions may not be)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for orbax, then releases its resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, steps={self.all_steps()})"


def _checkpointed(user: str, target: Any, model: Any,
                  state: Any) -> OnlineLearner | OnlineTrainer | ModelAndState:
    """What ``save`` / ``restore`` checkpoint: ``target``, or ``model`` and ``state``."""
    if (target is None) == (model is None):
        got = "both" if model is not None else "neither"
        raise TypeError(
            f"{user} takes a learner or trainer (target), or the model of your own train step "
            f"(model=..., with optimizer=... and state=... as needed); got {got}.")
    if model is not None:
        return ModelAndState(model, state, user)
    if not isinstance(target, OnlineLearner | OnlineTrainer):
        raise TypeError(
            f"{user}: target must be an OnlineLearner (braintrace.compile) or an OnlineTrainer, "
            f"got {type(target).__name__}. For your own train step pass model=... (and "
            "optimizer=..., state=...).")
    if state is not None:
        raise TypeError(
            f"{user}: state=... goes with model=...; the {type(target).__name__} carries its own "
            "hidden states and traces, saved with it.")
    return target


def _step(user: str, step: Any) -> int:
    """``step`` as an int, or an error naming the argument (orbax would write ``-1``, ``2.5``)."""
    return check_integer(f"{user}: step", step, minimum=0, what="a non-negative int",
                         note=" (the number of the checkpoint, e.g. the training step)")


def _check_concrete(user: str, items: dict[str, Item | JsonItem], saved: str) -> None:
    """Refuses abstract arrays (``jax.ShapeDtypeStruct``), naming the argument that holds one."""
    for name, item in items.items():
        if isinstance(item, JsonItem):
            continue
        for leaf_name, leaf in zip(item.names, jax.tree.leaves(item.tree), strict=True):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                argument = ("state" if name.startswith("state_") else
                            "optimizer" if name == "optimizer" else saved)
                raise TypeError(
                    f"{user}: {argument} holds abstract arrays (jax.ShapeDtypeStruct, as "
                    f"jax.eval_shape or nnx.eval_shape make), e.g. '{leaf_name}': there are no "
                    f"values to save. Pass the {argument} your train step uses (for a state, "
                    "online.init(model) or the one online.grad returned); nothing is written.")


def _plain(metrics: Any) -> Any:
    """``metrics`` with every array leaf a Python number or list (JSON for orbax)."""
    if metrics is None:
        return None
    return jax.tree.map(lambda v: np.asarray(v).tolist(), metrics)
