"""The drivers' programs as pure functions over flat arrays.

:class:`~braintrace.OnlineLearner` and :class:`~braintrace.OnlineTrainer` are
thin shells: they check their arguments, read the model's arrays
(``_learner_state``), run one of these programs under ``jax.jit`` and write the
results back.

* :func:`grad_program` is ``etrace_grad``: the online gradient of
  ``Σ_t w_t L_t`` over a sequence, in single-step or windowed mode.
* :func:`train_program` is ``OnlineTrainer.step``: every ``k`` steps the
  gradient accumulated since the last update is applied with optax, inside the
  scan, so the Params change while the sequence runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from braintrace._algorithms import AbstractAlgorithm
from braintrace._algorithms._blocked import blocked_run
from braintrace._algorithms._dni import DNI
from braintrace._algorithms._scan import (
    ScanCarry,
    evolve,
    finish_carry,
    init_carry,
    online_gradients,
    online_step,
    param_gradients,
)
from braintrace._algorithms._three_factor import three_factor_run
from braintrace._algorithms._windowed import windowed_gradients
from braintrace._compiler import ETraceGraph
from braintrace._compiler import _programs as programs
from braintrace._sharding import Layout, constrain, input_shardings

__all__ = ["GradArgs", "GradResult", "TrainResult", "evolve_program", "grad_program",
           "train_program"]


class GradArgs(NamedTuple):
    """The arguments of the compiled ``etrace_grad`` program (:func:`grad_program`), in order.

    Attributes:
        params: The Params, in the order of ``graph.param_paths``.
        hidden: The hidden states, in the order of ``graph.hidden_paths``.
        other: The other Variables, in the order of ``graph.other_paths``.
        traces: The algorithm's trace state.
        xs: Inputs, time axis leading.
        ys: Targets, time axis leading.
        weights: ``(T,)`` weights ``w_t`` of the loss ``Σ_t w_t L_t``.
        modulators: :class:`~braintrace.ThreeFactor`'s modulators, one
            ``(T, *state_shape)`` array per hidden state, or ``None``.
    """

    params: list[jax.Array]
    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    xs: Any
    ys: Any
    weights: jax.Array
    modulators: list[jax.Array] | None = None


class GradResult(NamedTuple):
    """What :func:`grad_program` returns.

    Attributes:
        grads: A gradient per Param leaf.
        hidden: The hidden states after the last step.
        other: The other Variables after the last step.
        traces: The traces after the last step.
        losses: Each step's loss ``L_t``, ``(T,)``.
        finite: Whether each Param's gradient is finite, ``(num_params,)``.
    """

    grads: list[jax.Array]
    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    losses: jax.Array
    finite: jax.Array


def grad_program(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other, traces,
                 xs, ys, weights, modulators=None, *,
                 loss_fn: Callable[[Any, Any], jax.Array], chunk_size: int | None,
                 block_size: int = 1, layout: Layout | None = None) -> GradResult:
    """The online gradient of ``Σ_t w_t L_t`` (``etrace_grad``), on the :class:`GradArgs`.

    ``chunk_size=None`` is single-step mode, with the traces advanced in
    blocks of ``block_size`` steps (``1``: every step); an int is windowed
    mode with exact reverse mode inside windows of that many steps. With a
    ``layout`` (data parallel) the state keeps its shardings from entry to exit.
    ``modulators`` (``ThreeFactor``) run :func:`three_factor_run` instead.
    """
    if layout is not None:
        params, hidden, other, traces = _constrain_state(layout, params, hidden, other, traces)
        xs, ys = _constrain_inputs(layout, xs), _constrain_inputs(layout, ys)
    if modulators is not None:
        operands = programs.operands(graph, params)
        carry, losses = three_factor_run(
            graph, algorithm, loss_fn, params, operands,
            init_carry(graph, algorithm, params, hidden, other, traces), xs, ys, weights,
            modulators)
        grads = param_gradients(graph, algorithm, params, operands, carry)
    elif chunk_size is None and block_size > 1:
        operands = programs.operands(graph, params)
        carry, losses = blocked_run(
            graph, algorithm, loss_fn, params, operands,
            init_carry(graph, algorithm, params, hidden, other, traces), xs, ys, weights,
            block_size)
        grads = param_gradients(graph, algorithm, params, operands, carry)
    elif chunk_size is None:
        grads, carry, losses = online_gradients(
            graph, algorithm, loss_fn, params, hidden, other, traces, xs, ys, weights)
    else:
        grads, carry, losses = windowed_gradients(
            graph, algorithm, loss_fn, params, hidden, other, traces, xs, ys, weights,
            chunk_size)
    finite = jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads])
    if layout is None:
        return GradResult(grads, carry.hidden, carry.other, carry.traces, losses, finite)
    grads, hidden, other, traces = _constrain_state(layout, grads, carry.hidden, carry.other,
                                                    carry.traces)
    return GradResult(grads, hidden, other, traces, losses, finite)


def _constrain_inputs(layout: Layout, tree: Any) -> Any:
    return constrain(tree, input_shardings(layout, tree))


def _constrain_state(layout: Layout, params, hidden, other, traces) -> tuple[Any, ...]:
    """Params (or their gradients) replicated, hidden state and traces batch-sharded."""
    return (constrain(list(params), layout.params), constrain(list(hidden), layout.hidden),
            constrain(list(other), layout.other), constrain(traces, layout.traces))


def evolve_program(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other,
                   traces, xs, *, layout: Layout | None = None) -> tuple[Any, ...]:
    """``etrace_evolve``: :func:`evolve` (outputs, hidden, other, traces), sharded by ``layout``."""
    if layout is None:
        return evolve(graph, algorithm, params, hidden, other, traces, xs)
    params, hidden, other, traces = _constrain_state(layout, params, hidden, other, traces)
    ys, hidden, other, traces = evolve(graph, algorithm, params, hidden, other, traces,
                                       _constrain_inputs(layout, xs))
    _, hidden, other, traces = _constrain_state(layout, params, hidden, other, traces)
    return _constrain_inputs(layout, ys), hidden, other, traces


class TrainResult(NamedTuple):
    """What :func:`train_program` returns: the state after the sequence, and its checks.

    Attributes:
        params: The Params after the last update.
        opt_state: The optimiser state after the last update.
        hidden: The hidden states after the last step.
        other: The other Variables after the last step.
        traces: The traces after the last step.
        losses: Each step's loss, ``(T,)``.
        bad_update_at: The last step of the first update that made a Param not
            finite, or ``-1``.
        bad_params: Which Params that update made not finite.
    """

    params: list[jax.Array]
    opt_state: Any
    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    losses: jax.Array
    bad_update_at: jax.Array
    bad_params: jax.Array


class _TrainCarry(NamedTuple):
    params: list[jax.Array]
    opt_state: Any
    step_carry: ScanCarry
    bad_update_at: jax.Array
    bad_params: jax.Array


def train_program(graph: ETraceGraph, algorithm: AbstractAlgorithm,
                  tx: optax.GradientTransformation, loss_fn: Callable[[Any, Any], jax.Array],
                  update_every: int, params, opt_state, hidden, other, traces, xs, ys,
                  weights, layout: Layout | None = None, block_size: int = 1,
                  modulators: list[jax.Array] | None = None) -> TrainResult:
    """Online learning over a sequence: an optax update after every ``update_every`` steps.

    The sequence is cut into windows of ``update_every`` steps. In each window
    the gradient of ``Σ_t w_t L_t`` is accumulated online (the Params fixed),
    then applied with ``tx``; hidden state and traces run on across windows
    (an update does not reset the traces).

    Args:
        graph, algorithm: The learner's compiled graph and algorithm.
        tx: The optax transformation; ``opt_state`` is its state.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        update_every: Steps per window; it divides the sequence length.
        params, hidden, other, traces: As in :class:`GradArgs`.
        xs, ys: Inputs and targets, time axis leading.
        weights: ``(T,)`` step weights.
        layout: Data parallel: the shardings of the state, kept from entry to
            exit (the optimiser state is replicated like the Params).
        block_size: Time blocks within a window (``_blocked.py``); ``1`` is per step.
        modulators: :class:`~braintrace.ThreeFactor`'s modulators (one
            ``(T, *state_shape)`` array per hidden state), or ``None``.

    With :class:`~braintrace.DNI` each window of ``update_every`` steps is one
    DNI window (windowed mode, ``chunk_size = update_every``).
    """
    if layout is not None:
        params, hidden, other, traces = _constrain_state(layout, params, hidden, other, traces)
        opt_state = constrain(opt_state, jax.tree.map(lambda _: layout.replicated, opt_state))
        xs, ys = _constrain_inputs(layout, xs), _constrain_inputs(layout, ys)
    k = update_every
    length = jax.tree.leaves(xs)[0].shape[0]
    windows = length // k
    split = lambda a: a.reshape(windows, k, *a.shape[1:])
    carry = _TrainCarry(list(params), opt_state,
                        init_carry(graph, algorithm, params, hidden, other, traces),
                        jnp.asarray(-1, jnp.int32), jnp.zeros((len(params),), bool))
    ends = jnp.arange(1, windows + 1, dtype=jnp.int32) * k - 1
    window = functools.partial(_train_window, graph, algorithm, tx, loss_fn, block_size)
    carry, losses = jax.lax.scan(
        window, carry, (jax.tree.map(split, xs), jax.tree.map(split, ys), split(weights), ends,
                        jax.tree.map(split, modulators)))
    sc = carry.step_carry
    params, hidden, other, traces, opt_state = (carry.params, sc.hidden, sc.other, sc.traces,
                                                carry.opt_state)
    if layout is not None:
        params, hidden, other, traces = _constrain_state(layout, params, hidden, other, traces)
        opt_state = constrain(opt_state, jax.tree.map(lambda _: layout.replicated, opt_state))
    return TrainResult(params, opt_state, hidden, other, traces, losses.reshape(length),
                       carry.bad_update_at, carry.bad_params)


def _train_window(graph: ETraceGraph, algorithm: AbstractAlgorithm,
                  tx: optax.GradientTransformation, loss_fn: Callable[[Any, Any], jax.Array],
                  block_size: int, carry: _TrainCarry, inputs: Any
                  ) -> tuple[_TrainCarry, jax.Array]:
    """One window: accumulate its gradient online, apply it, note the first bad update."""
    xw, yw, ww, t_end, mw = inputs
    operands = programs.operands(graph, carry.params)
    fresh = init_carry(graph, algorithm, carry.params, carry.step_carry.hidden,
                       carry.step_carry.other, carry.step_carry.traces)

    def body(c, xy):
        return online_step(graph, algorithm, loss_fn, carry.params, operands, c,
                           xy[0], xy[1], xy[2])

    dni = isinstance(algorithm, DNI)
    if dni:  # one DNI window per update: chunk_size = update_every
        grads, step_carry, losses = windowed_gradients(
            graph, algorithm, loss_fn, carry.params, fresh.hidden, fresh.other, fresh.traces,
            xw, yw, ww, ww.shape[0])
    elif mw is not None:
        step_carry, losses = three_factor_run(graph, algorithm, loss_fn, carry.params, operands,
                                              fresh, xw, yw, ww, mw)
    elif block_size > 1:
        step_carry, losses = blocked_run(graph, algorithm, loss_fn, carry.params, operands,
                                         fresh, xw, yw, ww, block_size)
    else:
        step_carry, losses = jax.lax.scan(body, fresh, (xw, yw, ww))
        step_carry = finish_carry(graph, algorithm, operands, step_carry)
    if not dni:
        grads = param_gradients(graph, algorithm, carry.params, operands, step_carry)
    updates, opt_state = tx.update(grads, carry.opt_state, carry.params)
    new_params = optax.apply_updates(carry.params, updates)
    bad = ~jnp.stack([jnp.all(jnp.isfinite(p)) for p in new_params])
    first = (carry.bad_update_at < 0) & jnp.any(bad)
    return _TrainCarry(new_params, opt_state, step_carry,
                       jnp.where(first, t_end, carry.bad_update_at),
                       jnp.where(first, bad, carry.bad_params)), losses
