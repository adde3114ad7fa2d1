"""``CheckpointManager``: numbered checkpoints of a learner or trainer, over orbax's manager.

A thin wrapper over ``orbax.checkpoint.CheckpointManager``: every step is a
subdirectory of the manager's directory (named by its number) holding the
items of :meth:`OnlineLearner.save <braintrace.OnlineLearner.save>`
(``params`` under their Flax paths, ``hidden``, ``other``, ``traces``,
``opt_state``, ``optimizer``, the ``braintrace`` record; see
``_checkpoint.py``), orbax's ``metrics`` when given, and the SHA-256 manifest.
Orbax numbers, lists and deletes the steps; braintrace adds the integrity
checks and the all-or-nothing restore.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Self

import jax
import numpy as np
from flax import nnx

from braintrace._drivers._checkpoint import (
    MANIFEST,
    damaged,
    restore_args,
    save_args,
    unpack,
    write_manifest,
)
from braintrace._drivers._learner import OnlineLearner
from braintrace._drivers._trainer import OnlineTrainer

__all__ = ["CheckpointManager"]

Target = OnlineLearner | OnlineTrainer


class CheckpointManager:
    """Numbered checkpoints of a learner or trainer: keep the last N, keep the best, resume.

    A thin wrapper over ``orbax.checkpoint.CheckpointManager``. Each saved step
    is a subdirectory of ``directory`` (``directory/<step>``) with the layout of
    :meth:`OnlineLearner.save <braintrace.OnlineLearner.save>`: the Params as the
    orbax item ``params`` (``nnx.state(model, nnx.Param)`` under its Flax paths,
    which plain orbax and Flax restore without braintrace), beside it the items
    ``hidden``, ``other``, ``traces``, ``opt_state`` (a trainer's optax state),
    ``optimizer`` (``nnx.state`` of a user's ``nnx.Optimizer``), ``braintrace``
    (the record of every leaf) and orbax's ``metrics``; and a SHA-256 manifest of
    its files, checked by :meth:`restore`. Saving is synchronous (the manifest
    digests finished files).

    Use it as a context manager, or call :meth:`close` when done.

    Args:
        directory: The root directory (created if missing).
        max_to_keep: Keep the last ``max_to_keep`` steps and delete older ones
            (``None``: keep all).
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
            policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
            if best_fn is not None:
                policies.append(ocp.checkpoint_managers.BestN(
                    get_metric_fn=best_fn, reverse=best_mode == "min", n=keep_best))
            options = ocp.CheckpointManagerOptions(
                best_fn=best_fn, best_mode=best_mode, enable_async_checkpointing=False,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
        self._options = options
        self._names = options.step_name_format or ocp.step.standard_name_format(
            step_prefix=options.step_prefix,
            step_format_fixed_length=options.step_format_fixed_length)
        self._manager = ocp.CheckpointManager(os.path.abspath(os.fspath(directory)),
                                              options=options)

    @property
    def directory(self) -> str:
        """The root directory."""
        return os.fspath(self._manager.directory)

    def step_directory(self, step: int) -> str:
        """The directory of ``step`` (a braintrace checkpoint, as ``learner.save`` writes)."""
        return os.path.join(self.directory, self._names.build_name(step))

    def all_steps(self) -> list[int]:
        """The saved steps, in increasing order."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or ``None``."""
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The best saved step by ``best_fn`` (the latest without one), or ``None``."""
        return self._manager.best_step()

    def save(self, step: int, target: Target, *, optimizer: nnx.Optimizer | None = None,
             metrics: Any = None) -> bool:
        """Saves ``target`` (and ``optimizer``) as ``step``, then deletes what is not kept.

        Args:
            step: The step number (larger than every saved one, by orbax's rules).
            target: An :class:`~braintrace.OnlineLearner` or
                :class:`~braintrace.OnlineTrainer` (whose optax state is saved too).
            optimizer: A user's ``nnx.Optimizer``, saved as ``nnx.state(optimizer)``.
            metrics: A pytree of scalars for ``best_fn`` (stored as JSON by orbax).

        Returns:
            Whether orbax saved the step (its ``save_interval_steps`` or
            ``save_decision_policy`` may skip it).

        Raises:
            ValueError: ``step`` is already saved.
        """
        import orbax.checkpoint as ocp

        items = _target(target)._checkpoint_items(optimizer)
        if step in self._manager.all_steps():
            raise ValueError(f"Step {step} is already saved in {self.directory}; "
                             "save each step once (or delete it first).")
        args = ocp.args.Composite(**save_args(items))
        saved = self._manager.save(step, args=args, metrics=_plain(metrics))
        self._manager.wait_until_finished()
        if saved:
            write_manifest(self.step_directory(step))
        return bool(saved)

    def restore(self, target: Target, step: int | None = None, *,
                optimizer: nnx.Optimizer | None = None) -> int:
        """Restores ``step`` (default: the latest complete) into ``target`` (and ``optimizer``).

        By default the latest step whose manifest was written: a save
        interrupted after orbax finished but before the manifest is skipped.

        The arrays are read onto ``target``'s devices (another mesh restores
        too); a run resumed from step ``s`` continues exactly as the run saved
        at ``s``.

        Returns:
            The step restored.

        Raises:
            ValueError: No step is saved, ``step`` is not saved, or its checkpoint
                is damaged or does not match ``target`` (or ``optimizer``); the
                message names the file or the first offending leaf. Nothing is
                changed then.
        """
        import orbax.checkpoint as ocp

        target = _target(target)
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ValueError(f"{self.directory} holds no checkpoint to restore.")
            complete = [s for s in steps
                        if os.path.isfile(os.path.join(self.step_directory(s), MANIFEST))]
            step = complete[-1] if complete else steps[-1]  # the error then says it
        elif step not in steps:
            raise ValueError(f"Step {step} is not saved in {self.directory}; saved: {steps}.")
        where = self.step_directory(step)
        items = target._checkpoint_items(optimizer)
        args = restore_args(where, items)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as err:  # any failure to read the arrays means the same thing
            raise damaged(where, err) from err
        target._load_checkpoint(unpack(where, items, restored), optimizer)
        return step

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


def _target(target: Any) -> Target:
    if not isinstance(target, OnlineLearner | OnlineTrainer):
        raise TypeError(
            "CheckpointManager saves and restores an OnlineLearner (braintrace.compile) or an "
            f"OnlineTrainer, got {type(target).__name__}.")
    return target


def _plain(metrics: Any) -> Any:
    """``metrics`` with every array leaf a Python number or list (JSON for orbax)."""
    if metrics is None:
        return None
    return jax.tree.map(lambda v: np.asarray(v).tolist(), metrics)
