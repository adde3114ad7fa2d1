"""``OnlineTrainer``: truly online learning with optax, updates inside the time loop.

A thin shell over ``_driver_programs.train_program``: it checks its arguments
through the learner's public methods, runs the program and writes the results
back with ``learner.load_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from braintrace._checkpoint import leaf_names, restore_arrays, save_arrays
from braintrace._driver_programs import TrainResult, train_program
from braintrace._inputs import check_algorithm_inputs, step_weights
from braintrace._learner import OnlineLearner
from braintrace._learner_state import named_arrays, state_from_arrays
from braintrace._sharding import host_array, place

__all__ = ["MAX_BLOCK_SIZE", "OnlineTrainer"]

MAX_BLOCK_SIZE = 64
"""The longest time block the trainer uses between two updates."""


class OnlineTrainer:
    """Online learning: an optax update every ``update_every`` steps, inside the scan.

    Within a sequence the Params change while it runs, as in the brain: every
    ``update_every`` steps the gradient accumulated since the last update is
    applied with ``tx``. Hidden state, traces and the optimiser state are
    carried through the scan. Traces are not reset by an update (the usual
    online approximation).

    Args:
        learner: A learner from :func:`braintrace.compile`.
        tx: An optax gradient transformation.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        update_every: Steps between updates (``k``); sequence lengths must be
            multiples of it.
        blocked: Advance the traces of the steps between updates in time
            blocks (exactly the per-step result, with matrix products;
            ``n = ⌈k/64⌉`` blocks of ``⌊k/n⌋`` steps and one of the rest).
            ``None``: wherever the algorithm has a blocked form (D_RTRL,
            ES_D_RTRL) and ``update_every > 1``.

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
                 loss_fn: Callable[[Any, Any], jax.Array], update_every: int = 1,
                 blocked: bool | None = None):
        if update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every}.")
        if blocked and not learner.algorithm.supports_blocks(learner.graph):
            raise ValueError(
                f"Algorithm '{learner.algorithm.name}' has no time-blocked form for this model; "
                "use blocked=False (or leave it unset).")
        self.blocked = blocked
        self.learner = learner
        self.tx = tx
        self.loss_fn = loss_fn
        self.update_every = int(update_every)
        self.opt_state = self._placed(tx.init(learner.state()["params"]))
        self._run = jax.jit(self._train_program)

    def _placed(self, opt_state: Any) -> Any:
        """The optimiser state replicated over the learner's mesh (as it is without one)."""
        lay = self.learner._layout_now
        if lay is None:
            return opt_state
        return place(opt_state, jax.tree.map(lambda _: lay.replicated, opt_state))

    def step(self, xs: Any, ys: Any, mask: jax.Array | None = None,
             modulators: dict[str, jax.Array] | None = None) -> jax.Array:
        """Learns online from one batch of sequences (time axis leading).

        Each update applies the mean gradient of the steps since the last one,
        each step weighted by ``mask[t]`` (all ones by default: steps outside
        a scored window can be given weight 0; an all-zero mask gives zero
        gradients, which optax then applies as usual).

        Hidden state and traces continue from where they are; Params, the
        optimiser state, hidden state and traces are written back.
        ``modulators`` are :class:`~braintrace.ThreeFactor`'s third factor
        (required there, as in ``OnlineLearner.etrace_grad``).

        Returns:
            Each step's loss ``(T,)``.

        Raises:
            ValueError: ``xs`` has no steps, a length that is not a multiple of
                ``update_every``, a bad shape, or ``mask`` is invalid.
            FloatingPointError: A step's loss, or the Params after an update,
                are not finite. The whole call is then discarded: Params,
                optimiser state, hidden state and traces stay as they were
                before it; the message names the first offending step.
        """
        learner = self.learner
        xs, ys = learner._place_inputs(xs), learner._place_inputs(ys)
        length = learner.check_inputs(xs)
        if length == 0 or length % self.update_every:
            raise ValueError(
                f"The sequence length {length} must be a positive multiple of update_every="
                f"{self.update_every}.")
        params, hidden, other = learner.leaves()
        mods = check_algorithm_inputs(learner.algorithm, learner.graph, hidden, modulators,
                                      None, length, trainer=True)
        weights = jnp.asarray(step_weights(mask, length) / self.update_every,
                              jnp.result_type(*params))
        lay = learner._layout_now
        if lay is not None:
            weights = place(weights, lay.replicated)
            mods = None if mods is None else learner._place_inputs(mods)
        out = self._run(params, self._placed(self.opt_state), hidden, other, learner.traces,
                        xs, ys, weights, mods)
        self._raise_if_not_finite(host_array(out.losses), int(host_array(out.bad_update_at)),
                                  host_array(out.bad_params))
        learner.load_state({"params": out.params, "hidden": out.hidden, "other": out.other,
                            "traces": out.traces})
        self.opt_state = out.opt_state
        return out.losses

    def _train_program(self, params, opt_state, hidden, other, traces, xs, ys,
                       weights, modulators=None) -> TrainResult:
        """:func:`train_program` on the learner's current graph (read when ``jit`` traces)."""
        graph, algorithm = self.learner.graph, self.learner.algorithm
        blocked = (algorithm.supports_blocks(graph) if self.blocked is None else self.blocked)
        blocks = -(-self.update_every // MAX_BLOCK_SIZE)  # equal blocks and a short one
        block_size = self.update_every // blocks if blocked else 1
        return train_program(graph, algorithm, self.tx, self.loss_fn, self.update_every, params,
                             opt_state, hidden, other, traces, xs, ys, weights,
                             layout=self.learner._layout_now, block_size=block_size,
                             modulators=modulators)

    def _raise_if_not_finite(self, losses: np.ndarray, bad_update_at: int,
                             bad_params: np.ndarray) -> None:
        discarded = ("the whole call was discarded: the model's Params, the optimiser state, "
                     "hidden state and traces are as they were before it")
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size and (bad_update_at < 0 or bad[0] <= bad_update_at):
            raise FloatingPointError(
                f"The loss at time step {int(bad[0])} of this call is {losses[bad[0]]}, not "
                f"finite; {discarded}. Check the inputs and targets at that step, or lower the "
                "learning rate.")
        if bad_update_at >= 0:
            names = ", ".join(f"'{self.learner.graph.param_paths[i]}'"
                              for i in np.flatnonzero(bad_params))
            raise FloatingPointError(
                f"The update after time step {bad_update_at} of this call made Param {names} "
                f"not finite although every loss up to it was finite; {discarded}. Lower the "
                "learning rate or clip the gradients (optax.clip_by_global_norm).")

    def _checkpoint_template(self) -> dict[str, Any]:
        named = named_arrays(self.learner.graph, self.learner.state())
        names = leaf_names("opt_state", self.opt_state)
        return {**named, **dict(zip(names, jax.tree.leaves(self.opt_state), strict=True))}

    def save(self, path: str) -> None:
        """Saves Params, hidden state, traces and the optimiser state to ``path``.

        ``path`` becomes an orbax checkpoint directory, as for
        :meth:`OnlineLearner.save`, with a SHA-256 digest checked by :meth:`restore`.
        """
        save_arrays(path, self._checkpoint_template())

    def restore(self, path: str) -> None:
        """Restores what :meth:`save` wrote; the run then continues identically.

        Raises:
            ValueError: The checkpoint is damaged or not one, or it does not
                match this trainer; the message names the file and the first
                offending leaf. Nothing is changed then.
        """
        leaves = restore_arrays(path, self._checkpoint_template())
        learner = self.learner
        split = len(named_arrays(learner.graph, learner.state()))
        learner.load_state(state_from_arrays(learner.graph, learner.traces, leaves[:split]))
        self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state), leaves[split:])

    def fit(self, batches: Iterable[tuple[Any, Any]], *, epochs: int = 1,
            reset_each_batch: bool = True, progress: bool = True) -> list[float]:
        """Trains over an iterable of ``(xs, ys)`` batches for ``epochs`` passes.

        Args:
            batches: ``(xs, ys)`` or ``(xs, ys, mask)`` tuples (e.g. the
                :class:`braintrace.tasks.Batch` of a built-in task), time axis
                leading.
            epochs: Number of passes.
            reset_each_batch: Start every batch from fresh hidden state and traces
                (independent sequences).
            progress: Show a tqdm progress bar with the running loss.

        Returns:
            The mean loss of every batch, in order.

        Raises:
            ValueError, FloatingPointError: As :meth:`step`, with a note naming
                the epoch and batch. The batches before it stay learnt; the
                failing batch is discarded.
        """
        from tqdm.auto import tqdm

        history: list[float] = []
        batches = list(batches)
        with tqdm(total=epochs * len(batches), disable=not progress,
                  desc="online training") as bar:
            for epoch in range(epochs):
                for i, batch in enumerate(batches):
                    if reset_each_batch:
                        self.learner.reset()
                    try:
                        losses = self.step(*batch)
                    except (ValueError, FloatingPointError) as err:
                        err.add_note(f"OnlineTrainer.fit: epoch {epoch}, batch {i}; "
                                     f"{len(history)} earlier batch(es) stay learnt.")
                        raise
                    history.append(float(jnp.mean(losses)))
                    bar.set_postfix(loss=f"{history[-1]:.4g}")
                    bar.update()
        return history
