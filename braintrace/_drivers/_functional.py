"""Online learning as pure functions, shaped like optax: for your own ``jit``-ed train step.

:func:`online_grad` returns an :class:`OnlineGradient`: a pair of pure functions,

* ``init(model) -> OnlineState``: the state online learning carries from one
  call to the next — the model's hidden states and other Variables (RNG
  counters, batch statistics) as ``nnx.State``\\ s, and the algorithm's traces;
* ``grad(model, state, xs, ys, *, mask=None) -> (grads, state, stats)``: the
  online gradient of a sequence (time axis leading) from ``state``, as an
  ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)`` (what
  ``nnx.Optimizer.update(model, grads)`` takes), the state after the sequence,
  and :class:`GradStats` (each step's loss, finiteness flags).

:func:`online_update` returns an :class:`OnlineUpdate`: the same with an optax
update every ``k`` steps *inside* the time loop (``init(model) -> (opt_state,
state)``, ``update(model, opt_state, state, xs, ys) -> (params, opt_state,
state, stats)``).

``model`` supplies the Params and the mode (``model.eval()``/``model.train()``:
each mode is compiled once, then reused); it is read, never written. Nothing
syncs with the host: both functions run under ``jax.jit``, ``nnx.jit``,
``jax.lax.scan`` (one call per chunk of a long stream) and with sharded inputs.
A non-finite loss or gradient is never hidden: ``stats.finite`` is ``False``
(use ``optax.apply_if_finite`` or check it), and :class:`OnlineUpdate` skips an
update that would make a Param not finite and reports it. The stateful
:class:`~braintrace.OnlineLearner` and :class:`~braintrace.OnlineTrainer` run the
same programs with host-side checks and clear errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from braintrace._compiler import split_model
from braintrace._drivers._compiled import CompiledModel, Entry
from braintrace._drivers._inputs import (
    REDUCTIONS,
    check_inputs,
    check_mask_dtype,
    check_signal_inputs,
    check_targets,
)
from braintrace._drivers._model_state import Leaves, check_leaves, param_state, strong
from braintrace._drivers._programs import grad_program, train_program
from braintrace._loops import check_positive, choose_loop, default_block_size

__all__ = ["GradStats", "OnlineGradient", "OnlineState", "OnlineUpdate", "UpdateStats",
           "online_grad", "online_update", "trace_weights"]


class OnlineState(NamedTuple):
    """What online learning carries from one call to the next (a pytree).

    Attributes:
        hidden: The model's differentiable hidden states, an ``nnx.State``.
        other: Its other Variables (RNG counters, batch statistics, integer
            states), an ``nnx.State``.
        traces: The algorithm's eligibility traces.
    """

    hidden: nnx.State
    other: nnx.State
    traces: Any


class GradStats(NamedTuple):
    """What :meth:`OnlineGradient.grad` reports besides the gradients.

    Attributes:
        losses: Each step's loss ``L_t``, ``(T,)``.
        finite: Whether every loss and every gradient is finite (a scalar).
        param_finite: Per Param leaf (in ``nnx.state(model, nnx.Param)`` leaf order),
            whether its gradient is finite.
    """

    losses: jax.Array
    finite: jax.Array
    param_finite: jax.Array


class UpdateStats(NamedTuple):
    """What :meth:`OnlineUpdate.update` reports besides the new state.

    Attributes:
        losses: Each step's loss ``L_t``, ``(T,)``.
        finite: Whether every loss is finite and every update was applied.
        bad_update_at: The last step of the first update that would have made a
            Param not finite (it and every later update were skipped), or ``-1``.
        bad_params: Per Param leaf, whether that update made it not finite.
    """

    losses: jax.Array
    finite: jax.Array
    bad_update_at: jax.Array
    bad_params: jax.Array


class OnlineGradient(NamedTuple):
    """A pair of pure functions, ``init`` and ``grad`` (module docstring)."""

    init: Callable[[nnx.Module], OnlineState]
    grad: Callable[..., tuple[nnx.State, OnlineState, GradStats]]


class OnlineUpdate(NamedTuple):
    """A pair of pure functions, ``init`` and ``update`` (module docstring)."""

    init: Callable[[nnx.Module], tuple[Any, OnlineState]]
    update: Callable[..., tuple[nnx.State, Any, OnlineState, UpdateStats]]


def trace_weights(mask: Any, length: int, reduction: str, dtype: Any,
                  batch_size: int | None = None) -> jax.Array:
    """The weights ``w_t`` of ``Σ_t w_t L_t`` from a (possibly traced) mask.

    A ``(T,)`` mask weighs steps; a ``(T, B)`` mask (batched learners) weighs
    each step of each sample, divided by ``B`` (see the stateful learner's
    ``step_weights``). ``'mean'`` divides by the weights' sum (by ``T``
    without a mask), so that it is the mean over the scored (step, sample)
    pairs; an all-zero mask gives zero weights (the gradient is zero).

    Example:
        >>> trace_weights(jnp.array([[1., 0.], [1., 0.]]), 2, 'mean', jnp.float32, 2).tolist()
        [[0.5, 0.0], [0.5, 0.0]]

    Raises:
        ValueError: The mask has another shape, or is not real (see
            :func:`~braintrace._drivers._inputs.check_mask_dtype`).
    """
    if mask is not None:
        check_mask_dtype(mask if hasattr(mask, "dtype") else np.asarray(mask))
    weights = jnp.ones((length,), dtype) if mask is None else jnp.asarray(mask, dtype)
    shapes = [(length,)] + ([] if batch_size is None else [(length, batch_size)])
    if weights.shape not in shapes:
        per_sample = "" if batch_size is None else f" or ({length}, {batch_size}) per sample"
        raise ValueError(f"mask must have shape ({length},){per_sample}, got {weights.shape}.")
    if weights.ndim == 2:
        weights = weights / batch_size
    if reduction == "mean":
        total = jnp.sum(weights)
        weights = jnp.where(total != 0, weights / jnp.where(total != 0, total, 1), 0)
    return weights


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")


def _entry_and_leaves(compiled: CompiledModel, model: nnx.Module,
                      state: OnlineState) -> tuple[Entry, Leaves, Any, Any]:
    """The entry of ``model``'s mode at the state's batch size, and the flat leaves."""
    _, params, hidden_tree, other_tree = split_model(model)
    del hidden_tree, other_tree
    hidden = [strong(h) for h in jax.tree.leaves(state.hidden)]
    other = jax.tree.leaves(state.other)
    batch_size = compiled.batch_size_of(hidden)
    entry = compiled.entry_of(model, batch_size)
    leaves = check_leaves(Leaves(jax.tree.leaves(params), hidden, other), entry.graph,
                          entry.leaf_avals, batch_size)
    return (entry, leaves, jax.tree.structure(state.hidden), jax.tree.structure(state.other))


def _init(compiled: CompiledModel, model: nnx.Module) -> OnlineState:
    """The model's hidden states and other Variables as they are, and zero traces."""
    _, params, hidden, other = split_model(model)
    hidden = jax.tree.map(strong, hidden)
    batch_size = compiled.batch_size_of(jax.tree.leaves(hidden))
    entry = compiled.entry_of(model, batch_size)
    return OnlineState(hidden, other, compiled.zero_traces(entry, jax.tree.leaves(params)))


def online_grad(learner: Any, loss_fn: Callable[[Any, Any], jax.Array], *,
                reduction: str = "mean", chunk_size: int | None = None,
                block_size: int | None = None) -> OnlineGradient:
    """Pure ``init`` and ``grad`` functions of a compiled model (module docstring).

    Args:
        learner: The :class:`~braintrace.OnlineLearner` from :func:`braintrace.compile`
            (its analysis of the model is used; its own state is not touched).
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        reduction: ``'mean'`` (divide by the mask's sum, or ``T``) or ``'sum'`` over time.
        chunk_size: Windowed mode with windows of this many steps; ``None``: not windowed.
        block_size: Time blocks of the traces (``None``: where the algorithm has a
            blocked form, as many steps as fit 256 MiB of stacked per-step values, between 2
            and 32, see ``braintrace._loops.default_block_size``; ``1``: per step).

    Returns:
        An :class:`OnlineGradient` ``(init, grad)``; ``grad(model, state, xs, ys, *,
        mask=None, **signal_inputs)`` (``signal_inputs``: an algorithm's own per-step
        inputs, e.g. ThreeFactor's ``modulators=``).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
        >>> online = braintrace.online_grad(learner, lambda y, t: jnp.mean((y - t) ** 2))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> @nnx.jit
        ... def train_step(model, optimizer, state, xs, ys):
        ...     grads, state, stats = online.grad(model, state, xs, ys)
        ...     optimizer.update(model, grads)
        ...     return state, stats.losses
        >>> state = online.init(model)
        >>> state, losses = train_step(model, optimizer, state, jnp.ones((5, 2, 3)),
        ...                            jnp.zeros((5, 2, 4)))
        >>> losses.shape
        (5,)
    """
    _check_reduction(reduction)
    chunk_size = None if chunk_size is None else check_positive("chunk_size", chunk_size)
    block_size = None if block_size is None else check_positive("block_size", block_size)
    compiled: CompiledModel = learner.compiled

    def grad(model: nnx.Module, state: OnlineState, xs: Any, ys: Any, *, mask: Any = None,
             **signal_inputs: Any) -> tuple[nnx.State, OnlineState, GradStats]:
        entry, leaves, hidden_def, other_def = _entry_and_leaves(compiled, model, state)
        length = check_inputs(xs, entry.example)
        check_targets(ys, length)
        spec = choose_loop(entry.rules, length=length, chunk_size=chunk_size,
                           block_size=block_size)
        weights = trace_weights(mask, length, reduction, jnp.result_type(*leaves.params),
                                entry.batch_size)
        inputs = check_signal_inputs(entry.rules, leaves.hidden, signal_inputs, length)
        out = grad_program(entry, loss_fn, spec, leaves.params, leaves.hidden, leaves.other,
                           state.traces, xs, ys, weights, inputs, masked=mask is not None)
        new_state = OnlineState(jax.tree.unflatten(hidden_def, out.hidden),
                                jax.tree.unflatten(other_def, out.other), out.traces)
        finite = jnp.all(out.finite) & jnp.all(jnp.isfinite(out.losses))
        return (param_state(model, out.grads), new_state,
                GradStats(out.losses, finite, out.finite))

    return OnlineGradient(lambda model: _init(compiled, model), grad)


def online_update(learner: Any, loss_fn: Callable[[Any, Any], jax.Array],
                  tx: optax.GradientTransformation, *, update_every: int = 1,
                  block_size: int | None = None) -> OnlineUpdate:
    """Pure ``init`` and ``update`` functions: optax updates inside the time loop.

    Every ``update_every`` steps the gradient accumulated since the last update
    (the mean over those steps, times the mask) is applied with ``tx``; hidden
    state and traces run on across updates.

    Args:
        learner: The :class:`~braintrace.OnlineLearner` from :func:`braintrace.compile`.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        tx: An optax transformation (``value=`` is passed: the window's loss).
        update_every: Steps between updates; sequence lengths must be multiples of it.
        block_size: Time blocks within a window (``None``: at most 64 steps per block
            where the algorithm has a blocked form; ``1``: per step).

    Returns:
        An :class:`OnlineUpdate`: ``init(model) -> (opt_state, state)`` and
        ``update(model, opt_state, state, xs, ys, *, mask=None, **signal_inputs) ->
        (params, opt_state, state, stats)``, ``params`` an ``nnx.State`` to write
        with ``nnx.update(model, params)``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
        >>> train = braintrace.online_update(learner, lambda y, t: jnp.mean((y - t) ** 2),
        ...                                  optax.sgd(0.1), update_every=5)
        >>> opt_state, state = train.init(model)
        >>> params, opt_state, state, stats = jax.jit(train.update)(
        ...     model, opt_state, state, jnp.ones((10, 2, 3)), jnp.zeros((10, 2, 4)))
        >>> nnx.update(model, params)
        >>> bool(stats.finite), stats.losses.shape
        (True, (10,))
    """
    update_every = check_positive("update_every", update_every)
    block_size = None if block_size is None else check_positive("block_size", block_size)
    compiled: CompiledModel = learner.compiled
    tx = optax.with_extra_args_support(tx)

    def init(model: nnx.Module) -> tuple[Any, OnlineState]:
        return tx.init(nnx.state(model, nnx.Param)), _init(compiled, model)

    def update(model: nnx.Module, opt_state: Any, state: OnlineState, xs: Any, ys: Any, *,
               mask: Any = None, **signal_inputs: Any
               ) -> tuple[nnx.State, Any, OnlineState, UpdateStats]:
        entry, leaves, hidden_def, other_def = _entry_and_leaves(compiled, model, state)
        length = check_inputs(xs, entry.example)
        check_targets(ys, length)
        if length % update_every:
            raise ValueError(f"The sequence length {length} must be a multiple of "
                             f"update_every={update_every}.")
        spec = window_loop(entry, update_every, block_size)
        weights = trace_weights(mask, length, "sum", jnp.result_type(*leaves.params),
                                entry.batch_size)
        inputs = check_signal_inputs(entry.rules, leaves.hidden, signal_inputs, length)
        out = train_program(entry, tx, loss_fn, update_every, spec,
                            jax.tree.structure(nnx.state(model, nnx.Param)), leaves.params,
                            opt_state, leaves.hidden, leaves.other, state.traces, xs, ys,
                            weights / update_every, inputs, masked=mask is not None)
        new_state = OnlineState(jax.tree.unflatten(hidden_def, out.hidden),
                                jax.tree.unflatten(other_def, out.other), out.traces)
        finite = (out.bad_update_at < 0) & jnp.all(jnp.isfinite(out.losses))
        return (param_state(model, out.params), out.opt_state, new_state,
                UpdateStats(out.losses, finite, out.bad_update_at, out.bad_params))

    return OnlineUpdate(init, update)


MAX_BLOCK_SIZE = 64
"""The longest time block the trainer uses between two updates by default (fewer steps where
they would not fit the loops' memory budget, ``_loops.BLOCK_MEMORY_BUDGET``)."""


def window_loop(entry: Entry, update_every: int, block_size: int | None) -> Any:
    """The loop that runs each window of ``update_every`` steps between two updates.

    Windowed algorithms (BPTT, DNI) take the window as theirs; others run it in
    time blocks where they have a blocked form, else per step: unless
    ``block_size`` is given, ``n = ⌈k/K⌉`` blocks of ``⌊k/n⌋`` steps and one of
    the rest, ``K = default_block_size(rules, most=64)`` (64 steps, fewer for a
    network whose stacked steps exceed the memory budget).
    """
    rules = entry.rules
    if rules.needs_window:
        return choose_loop(rules, length=update_every, chunk_size=update_every)
    if block_size is None:
        most = default_block_size(rules, most=MAX_BLOCK_SIZE)
        blocks = -(-update_every // most)  # equal blocks and a short one
        block_size = update_every // blocks if rules.supports_blocks else 1
    return choose_loop(rules, length=update_every, block_size=block_size)
