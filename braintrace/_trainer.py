"""``OnlineTrainer``: truly online learning with optax, updates inside the time loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from braintrace._algorithms._scan import init_carry, online_step, param_gradients
from braintrace._checkpoint import restore_leaves, save_leaves
from braintrace._compiler._step import split_model
from braintrace._learner import OnlineLearner

__all__ = ["OnlineTrainer"]


class _TrainCarry(NamedTuple):
    params: list[jax.Array]
    opt_state: Any
    step_carry: Any
    failed_at: jax.Array


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
                 loss_fn: Callable[[Any, Any], jax.Array], update_every: int = 1):
        if update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every}.")
        self.learner = learner
        self.tx = tx
        self.loss_fn = loss_fn
        self.update_every = int(update_every)
        params, _, _ = learner._leaves()  # noqa: SLF001
        self.opt_state = tx.init(params)
        self._run = jax.jit(self._run_impl)

    def step(self, xs: Any, ys: Any, mask: jax.Array | None = None) -> jax.Array:
        """Learns online from one batch of sequences (time axis leading).

        Each update applies the mean gradient of the steps since the last one,
        each step weighted by ``mask[t]`` (all ones by default: steps outside
        a scored window can be given weight 0).

        Hidden state and traces continue from where they are; Params, the
        optimiser state, hidden state and traces are written back.

        Returns:
            Each step's loss ``(T,)``.

        Raises:
            FloatingPointError: The loss became NaN; the Params stay as they
                were before the offending update, and the message names the step.
        """
        learner = self.learner
        length = learner._check_inputs(xs)  # noqa: SLF001
        if length % self.update_every:
            raise ValueError(
                f"The sequence length {length} must be a multiple of update_every="
                f"{self.update_every}.")
        params, hidden, other = learner._leaves()  # noqa: SLF001
        mask = jnp.ones((length,)) if mask is None else jnp.asarray(mask)
        if mask.shape != (length,):
            raise ValueError(f"mask must have shape ({length},), got {mask.shape}.")
        weights = (mask / self.update_every).astype(jnp.result_type(*params))
        out = self._run(params, self.opt_state, hidden, other, learner.traces, xs, ys, weights)
        params, opt_state, hidden, other, traces, losses, failed_at = out
        failed_at = int(failed_at)
        if failed_at >= 0:
            raise FloatingPointError(
                f"The loss became NaN at time step {failed_at}; no update was applied from that "
                "step on and the model keeps its Params. Lower the learning rate or check the "
                "inputs.")
        _, param_state, _, _ = split_model(learner.model)
        nnx.update(learner.model, jax.tree.unflatten(jax.tree.structure(param_state), params))
        learner._write_back(hidden, other)  # noqa: SLF001
        learner.traces = traces
        self.opt_state = opt_state
        return losses

    def save(self, path: str) -> None:
        """Saves Params, hidden state, traces and the optimiser state to ``path``."""
        save_leaves(path, [self.learner.state(), self.opt_state])

    def restore(self, path: str) -> None:
        """Restores what :meth:`save` wrote; the run then continues identically."""
        learner_state, self.opt_state = restore_leaves(path, [self.learner.state(),
                                                              self.opt_state])
        self.learner.load_state(learner_state)

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
        """
        from tqdm.auto import tqdm

        history: list[float] = []
        batches = list(batches)
        bar = tqdm(total=epochs * len(batches), disable=not progress, desc="online training")
        for _ in range(epochs):
            for batch in batches:
                if reset_each_batch:
                    self.learner.reset()
                history.append(float(jnp.mean(self.step(*batch))))
                bar.set_postfix(loss=f"{history[-1]:.4g}")
                bar.update()
        bar.close()
        return history

    def _run_impl(self, params, opt_state, hidden, other, traces, xs, ys, weights):
        graph, algorithm = self.learner.graph, self.learner.algorithm
        k = self.update_every
        length = jax.tree.leaves(xs)[0].shape[0]
        windows = length // k
        split = lambda a: a.reshape(windows, k, *a.shape[1:])  # noqa: E731
        carry = _TrainCarry(list(params), opt_state,
                            init_carry(graph, algorithm, params, hidden, other, traces),
                            jnp.asarray(-1, jnp.int32))

        def window(carry: _TrainCarry, inputs):
            xw, yw, ww, t0 = inputs
            operands = graph.operands(carry.params)
            fresh = init_carry(graph, algorithm, carry.params, carry.step_carry.hidden,
                               carry.step_carry.other, carry.step_carry.traces)

            def body(c, xy):
                return online_step(graph, algorithm, self.loss_fn, carry.params, operands, c,
                                   xy[0], xy[1], xy[2])

            step_carry, losses = jax.lax.scan(body, fresh, (xw, yw, ww))
            grads = param_gradients(graph, algorithm, carry.params, operands, step_carry)
            updates, opt_state = self.tx.update(grads, carry.opt_state, carry.params)
            new_params = optax.apply_updates(carry.params, updates)
            nan = jnp.isnan(losses)
            first_nan = jnp.where(jnp.any(nan), t0 + jnp.argmax(nan), -1).astype(jnp.int32)
            failed_at = jnp.where(carry.failed_at >= 0, carry.failed_at, first_nan)
            ok = failed_at < 0
            keep = lambda new, old: jax.tree.map(  # noqa: E731
                lambda n, o: jnp.where(ok, n, o), new, old)
            return _TrainCarry(keep(new_params, carry.params), keep(opt_state, carry.opt_state),
                               step_carry, failed_at), losses

        starts = jnp.arange(windows, dtype=jnp.int32) * k
        carry, losses = jax.lax.scan(
            window, carry, (jax.tree.map(split, xs), jax.tree.map(split, ys), split(weights),
                            starts))
        sc = carry.step_carry
        return (carry.params, carry.opt_state, sc.hidden, sc.other, sc.traces,
                losses.reshape(length), carry.failed_at)
