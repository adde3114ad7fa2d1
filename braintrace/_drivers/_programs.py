"""The drivers' programs: pure functions over flat lists of arrays, one implementation.

Each takes the :class:`~braintrace._drivers._compiled.Entry` it runs (graph,
rules, layout) and static choices first, then arrays: Params, hidden states and
other Variables in the graph's leaf order, the traces, the sequence. The pure
public functions (``_functional.py``) and the stateful shells
(:class:`~braintrace.OnlineLearner`, :class:`~braintrace.OnlineTrainer`) both run
these, under ``jax.jit`` (:data:`GRAD_PROGRAM`, :data:`TRAIN_PROGRAM`,
:data:`EVOLVE_PROGRAM`) or inside a caller's own ``jit``.

* :func:`grad_program`: the online gradient of ``Σ_t w_t L_t`` over a sequence;
* :func:`train_program`: an optax update after every ``k`` steps, inside the loop;
* :func:`evolve_program`: hidden state and traces advanced without gradients;
* :func:`checked_grad_program`, :func:`checked_train_program`: the first two as
  the stateful shells run them, returning no gradient or Params that is not
  finite (they read the flags a call later: ``_deferred.py``).

Floating-point inputs of another width are cast to the compiled input's dtype
(:func:`~braintrace._drivers._inputs.cast_inputs`). With a mesh (data parallel)
the state keeps its shardings from entry to exit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from braintrace._drivers._compiled import Entry
from braintrace._drivers._inputs import cast_inputs
from braintrace._drivers._sharding import (
    Layout,
    constrain,
    input_shardings,
    on_mesh,
    opt_state_shardings,
)
from braintrace._loops import (
    LoopContext,
    LoopSpec,
    ScanCarry,
    evolve,
    finish_carry,
    init_carry,
    param_gradients,
    reaches_scored,
    restart_sums,
    run,
)

__all__ = ["CHECKED_GRAD_PROGRAM", "CHECKED_TRAIN_PROGRAM", "EVOLVE_PROGRAM", "GRAD_PROGRAM",
           "TRAIN_PROGRAM", "GradArgs", "GradResult", "TrainResult", "checked_grad_program",
           "checked_train_program", "evolve_program", "grad_program", "train_program"]


class GradArgs(NamedTuple):
    """The array arguments of the compiled ``etrace_grad`` program, in order.

    Attributes:
        params: The Params, in the order of ``graph.param_paths``.
        hidden: The hidden states, in the order of ``graph.hidden_paths``.
        other: The other Variables, in the order of ``graph.other_paths``.
        traces: The algorithm's trace state.
        xs: Inputs, time axis leading.
        ys: Targets, time axis leading.
        weights: ``(T,)`` weights ``w_t`` of the loss ``Σ_t w_t L_t``.
        signal_inputs: The algorithm's own per-step inputs (ThreeFactor's
            modulators, one ``(T, *state_shape)`` array per hidden state), or ``None``.
    """

    params: list[jax.Array]
    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    xs: Any
    ys: Any
    weights: jax.Array
    signal_inputs: Any = None


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


def _on_its_mesh(program: Callable[..., Any]) -> Callable[..., Any]:
    """``program(entry, ...)`` traced under the entry's mesh (:func:`on_mesh`)."""
    @functools.wraps(program)
    def traced(entry: Entry, *args: Any, **kwargs: Any) -> Any:
        with on_mesh(entry.layout):
            return program(entry, *args, **kwargs)

    return traced


def _constrain_inputs(layout: Layout, tree: Any) -> Any:
    return constrain(tree, input_shardings(layout, tree))


def _constrain_state(layout: Layout, params, hidden, other, traces) -> tuple[Any, ...]:
    """Params (or their gradients), hidden state and traces on their layout's shardings."""
    return (constrain(list(params), layout.params), constrain(list(hidden), layout.hidden),
            constrain(list(other), layout.other), constrain(traces, layout.traces))


def _opt_shardings(lay: Layout, tx: Any, opt_state: Any, params_def: Any) -> Any:
    return opt_state_shardings(lay, tx, opt_state,
                               jax.tree.unflatten(params_def, lay.params))


@_on_its_mesh
def grad_program(entry: Entry, loss_fn: Callable[[Any, Any], jax.Array], spec: LoopSpec,
                 params, hidden, other, traces, xs, ys, weights,
                 signal_inputs=None, masked: bool = False) -> GradResult:
    """The online gradient of ``Σ_t w_t L_t`` over a sequence, in the loop ``spec``.

    Args:
        entry: What was compiled for this mode and batch size.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        spec: The loop (``braintrace._loops.choose_loop``).
        params, hidden, other: Flat leaves in the graph's order.
        traces: The algorithm's trace state.
        xs, ys: Inputs and targets, time axis leading.
        weights: ``(T,)`` weights ``w_t``.
        signal_inputs: The learning signal's per-step inputs, or ``None``.
        masked: The weights come from a mask and may be 0: what they weigh 0 is then never
            read (``braintrace._loops.ignore_masked``, each step's inputs and targets as the
            loop reads them, from flags ``(T,)`` or ``(T, B)`` computed once here).
            ``False`` (no mask: no weight is 0) skips it.
    """
    xs = cast_inputs(xs, entry.example)
    lay = entry.layout
    if lay is not None:
        params, hidden, other, traces = _constrain_state(lay, params, hidden, other, traces)
        xs, ys = _constrain_inputs(lay, xs), _constrain_inputs(lay, ys)
    reaches = reaches_scored(weights) if masked else None  # what the mask ignores is never read
    ctx = LoopContext.build(entry.rules, loss_fn, params)
    carry, losses = run(ctx, spec, init_carry(ctx, hidden, other, traces), xs, ys, weights,
                        signal_inputs, reaches=reaches)
    grads = param_gradients(ctx, carry)
    finite = jnp.stack([_all_finite(g) for g in grads])
    hidden, other, traces = carry.hidden, carry.other, carry.traces
    if lay is not None:
        grads, hidden, other, traces = _constrain_state(lay, grads, hidden, other, traces)
    return GradResult(grads, hidden, other, traces, losses, finite)


@_on_its_mesh
def evolve_program(entry: Entry, params, hidden, other, traces, xs) -> tuple[Any, ...]:
    """Outputs, hidden state, other Variables and traces after ``xs`` (no gradients)."""
    xs = cast_inputs(xs, entry.example)
    lay = entry.layout
    if lay is None:
        return evolve(entry.rules, params, hidden, other, traces, xs)
    params, hidden, other, traces = _constrain_state(lay, params, hidden, other, traces)
    ys, hidden, other, traces = evolve(entry.rules, params, hidden, other, traces,
                                       _constrain_inputs(lay, xs))
    _, hidden, other, traces = _constrain_state(lay, params, hidden, other, traces)
    return _constrain_inputs(lay, ys), hidden, other, traces


class TrainResult(NamedTuple):
    """What :func:`train_program` returns: the state after the sequence, and its checks.

    Attributes:
        params: The Params after the last update.
        opt_state: The optimiser state after the last update.
        hidden: The hidden states after the last step.
        other: The other Variables after the last step.
        traces: The traces after the last step.
        losses: Each step's loss, ``(T,)``.
        bad_update_at: The last step of the first update that made (or, skipped, would
            have made) a Param not finite, or ``-1``. With ``skip_non_finite`` (the default)
            that update and every later one were skipped. Without it, only the Params
            after the last update are checked: the last step of the sequence if one of
            them is not finite (some update made it so), else ``-1``.
        bad_params: Which Params that update made (would have made) not finite; without
            ``skip_non_finite``, which Params are not finite after the last update.
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
    steps: ScanCarry  # hidden, other, traces (and a pending trace update) across windows
    operands: list[dict[str, jax.Array]]  # those the pending trace update was computed with
    bad_update_at: jax.Array
    bad_params: jax.Array
    grads: list[jax.Array]  # the last window's gradient, its update not yet applied
    value: jax.Array  # the last window's loss, given to ``tx`` as ``value=``
    pending: jax.Array  # whether ``grads`` wait to be applied (not before the first window)


@_on_its_mesh
def train_program(entry: Entry, tx: optax.GradientTransformationExtraArgs,
                  loss_fn: Callable[[Any, Any], jax.Array], update_every: int, spec: LoopSpec,
                  params_def: Any, params, opt_state, hidden, other, traces, xs, ys, weights,
                  signal_inputs=None, skip_non_finite: bool = True,
                  masked: bool = False) -> TrainResult:
    """Online learning over a sequence: an optax update after every ``update_every`` steps.

    The sequence is cut into windows of ``update_every`` steps. In each window
    the gradient of ``Σ_t w_t L_t`` is accumulated online by the loop ``spec``
    (the Params fixed), then applied with ``tx`` (which is given the window's
    loss as ``value=``, for transformations such as
    ``optax.contrib.reduce_on_plateau``); hidden state and traces run on across
    windows (an update does not reset the traces). A window whose weights are
    all zero (the mask scores none of its steps) has a zero gradient and makes
    no update: the optimiser's state (Adam's moments, its count) does not move
    (except with a window hook, DNI, whose gradient does not come from the
    weighted loss). An update that would make a Param not finite is skipped,
    and so is every later one (the first is reported: ``bad_update_at``). With
    ``skip_non_finite=False`` every update is applied and only the Params after
    the last one are checked, for a caller that discards the whole result if
    one is not finite and can run the call again to name the first such update
    (:class:`~braintrace.OnlineTrainer`).
    That one check is enough: an update adds to a Param (``optax.apply_updates``),
    and ``p + u`` is not finite for every ``u`` once ``p`` is not. (The check
    after every update costs about a tenth of a step with an update every step:
    ES-D-RTRL with Adam on the benchmark models, 80 µs of 860 on the GRU and 76
    of 770 on the SNN.) ``tx`` sees the Params in the structure
    ``params_def`` (that of ``nnx.state(model, nnx.Param)``), so transformations
    that select Params by path (``optax.masked``, ``optax.multi_transform``) work.

    A window's update is applied at the start of the next window's loop
    iteration (:func:`_apply_update`; the last one after the loop), before that
    window's first step: the same sequence of Params, with the gradient passed
    between iterations in the loop's carry. Applied in the iteration that
    computes it, XLA:CPU fuses the gradient's sum over the batch into each
    consumer of it and so computes it once per optimiser moment (Adam, D-RTRL on
    the benchmark GRU, an update every step: 1.95 ms per step against 1.64).
    """
    xs = cast_inputs(xs, entry.example)
    lay = entry.layout
    if lay is not None:
        params, hidden, other, traces = _constrain_state(lay, params, hidden, other, traces)
        opt_state = constrain(opt_state, _opt_shardings(lay, tx, opt_state, params_def))
        xs, ys = _constrain_inputs(lay, xs), _constrain_inputs(lay, ys)
    # what the mask ignores is never read (as grad_program's ``masked``); the flags are those
    # of the whole sequence, each window's steps reading theirs
    reaches = reaches_scored(weights) if masked else None
    k = update_every
    length = weights.shape[0]
    split = lambda a: a.reshape(length // k, k, *a.shape[1:])
    ctx = LoopContext.build(entry.rules, loss_fn, params)
    dtype = jnp.result_type(*params) if params else jnp.float32
    carry = _TrainCarry(list(params), opt_state,
                        init_carry(ctx, hidden, other, traces, pending=spec.defers),
                        list(ctx.operands), jnp.asarray(-1, jnp.int32),
                        jnp.zeros((len(params),), bool), [jnp.zeros_like(p) for p in params],
                        jnp.zeros((), dtype), jnp.zeros((), bool))
    ends = jnp.arange(1, length // k + 1, dtype=jnp.int32) * k - 1
    window = functools.partial(_train_window, entry, tx, loss_fn, spec, params_def,
                               skip_non_finite)
    carry, losses = jax.lax.scan(window, carry, (*(jax.tree.map(split, a) for a in (
        xs, ys, weights, signal_inputs, reaches)), ends))
    carry = _apply_update(tx, params_def, skip_non_finite, carry, length - 1)
    params, opt_state = carry.params, carry.opt_state
    bad_update_at, bad_params = carry.bad_update_at, carry.bad_params
    if not skip_non_finite:
        bad_params = _not_finite(params)
        bad_update_at = jnp.where(jnp.any(bad_params), length - 1, -1).astype(jnp.int32)
    steps = finish_carry(ctx, carry.steps, carry.operands)
    hidden, other, traces = steps.hidden, steps.other, steps.traces
    if lay is not None:
        params, hidden, other, traces = _constrain_state(lay, params, hidden, other, traces)
        opt_state = constrain(opt_state, _opt_shardings(lay, tx, opt_state, params_def))
    return TrainResult(params, opt_state, hidden, other, traces, losses.reshape(length),
                       bad_update_at, bad_params)


def _apply_update(tx: optax.GradientTransformationExtraArgs, params_def: Any,
                  skip_non_finite: bool, carry: _TrainCarry, ended: Any) -> _TrainCarry:
    """The carry with its pending update applied; with ``skip_non_finite``, the first update
    that makes a Param not finite recorded (as ``ended``, the last step of its window) and
    skipped, with every later one (without it, :func:`train_program` checks the Params
    once, after the last update).

    The choices are ``lax.cond``: on XLA:CPU a ``where`` over the Params and the
    optimiser state makes one more pass over each. To skip, the new Params are computed
    before the choice (their finiteness decides it), which then passes one of two values
    on; otherwise the choice is only whether an update is pending (none before the first
    window), and its branch computes it.
    """
    tree = lambda leaves: jax.tree.unflatten(params_def, leaves)

    def updated() -> tuple[list[jax.Array], Any]:
        updates, opt_state = tx.update(tree(carry.grads), carry.opt_state, tree(carry.params),
                                       value=carry.value)
        return jax.tree.leaves(optax.apply_updates(tree(carry.params), updates)), opt_state

    if not skip_non_finite:
        params, opt_state = jax.lax.cond(carry.pending, updated,
                                         lambda: (carry.params, carry.opt_state))
        return carry._replace(params=params, opt_state=opt_state, pending=jnp.zeros((), bool))
    new_params, new_state = updated()
    bad = _not_finite(new_params)
    first = carry.pending & (carry.bad_update_at < 0) & jnp.any(bad)
    skip = ~carry.pending | (carry.bad_update_at >= 0) | first
    params, opt_state = jax.lax.cond(skip, lambda: (carry.params, carry.opt_state),
                                     lambda: (new_params, new_state))
    return carry._replace(params=params, opt_state=opt_state,
                          bad_update_at=jnp.where(first, ended, carry.bad_update_at),
                          bad_params=jnp.where(first, bad, carry.bad_params),
                          pending=jnp.zeros((), bool))


def _not_finite(params: list[jax.Array]) -> jax.Array:
    """Per Param, whether it has an entry that is not finite, ``(len(params),)``."""
    return ~jnp.stack([_all_finite(p) for p in params]) if params else jnp.zeros((0,), bool)


def _all_finite(a: jax.Array) -> jax.Array:
    """Whether every entry of ``a`` is finite, as ``Σ 0·a == 0``.

    ``0·a`` is ``0`` where ``a`` is finite and NaN where it is ``±inf`` or NaN, so
    the sum is finite exactly when every entry is (it cannot overflow). XLA:CPU
    sums floats in one vectorised pass; ``jnp.all(jnp.isfinite(a))`` reduces
    booleans about 2.4× slower (40 against 93 µs for the benchmark GRU's Params).

    Example:
        >>> import jax.numpy as jnp
        >>> bool(_all_finite(jnp.array([1e38, 3e38]))), bool(_all_finite(jnp.array([1.0, jnp.inf])))
        (True, False)
    """
    return jnp.isfinite(jnp.sum(a * 0))


def _train_window(entry: Entry, tx: optax.GradientTransformationExtraArgs,
                  loss_fn: Callable[[Any, Any], jax.Array], spec: LoopSpec, params_def: Any,
                  skip_non_finite: bool, carry: _TrainCarry, inputs: Any
                  ) -> tuple[_TrainCarry, jax.Array]:
    """One window: the last window's update, then this window's gradient, accumulated online.

    The per-step loop leaves the window's last trace update pending; the next
    window applies it first, with the operands of the Params it was computed
    with (``carry.operands``; after the last window, :func:`train_program`).
    Applied in the iteration that computes its Jacobians, XLA:CPU fuses their
    computation into the trace-sized update and recomputes it per trace element
    (D-RTRL on the benchmark GRU with an update every step: 27 ms/step instead of 4).
    """
    xw, yw, ww, sw, rw, t_end = inputs
    previous_end = t_end - ww.shape[0]  # the last step of the window whose update is pending
    carry = _apply_update(tx, params_def, skip_non_finite, carry, previous_end)
    ctx = LoopContext.build(entry.rules, loss_fn, carry.params)
    previous = finish_carry(ctx, carry.steps, carry.operands)
    step_carry, losses = run(ctx, spec, restart_sums(previous), xw, yw, ww, sw, finish=False,
                             reaches=rw)
    grads = param_gradients(ctx, step_carry)
    step_weights = ww if ww.ndim == 1 else jnp.sum(ww, axis=-1)  # a (T, B) mask: per step
    value = jnp.sum(losses * step_weights.astype(losses.dtype))
    # a window the mask scores nothing of has no gradient to apply: no update (Adam's moments,
    # weight decay and schedules do not move), unless a window hook (DNI) makes one anyway
    scored = jnp.any(ww != 0) | (entry.rules.window is not None)
    return carry._replace(steps=step_carry, operands=list(ctx.operands), grads=grads,
                          value=value.astype(carry.value.dtype), pending=scored), losses


@_on_its_mesh
def checked_grad_program(entry: Entry, loss_fn: Callable[[Any, Any], jax.Array], spec: LoopSpec,
                         params, hidden, other, traces, xs, ys, weights,
                         signal_inputs=None, masked: bool = False) -> GradResult:
    """:func:`grad_program` that returns no gradient that is not finite, for
    ``learner.etrace_grad``.

    Its ``finite`` says, per Param, whether its gradient *and every loss* are
    finite (the one flag the driver reads, a call later: ``_deferred.py``).
    Where one is not, the gradients are zeros: an optimiser that applies them
    before the driver reads the flag adds nothing non-finite to the Params. The
    hidden state and traces are returned as computed: the driver puts back
    those it gave when it reads the flag (a selection here would cost a pass
    over the traces at every call).
    """
    out = grad_program(entry, loss_fn, spec, params, hidden, other, traces, xs, ys, weights,
                       signal_inputs, masked)
    finite = out.finite & jnp.all(jnp.isfinite(out.losses))
    ok = jnp.all(finite)
    return out._replace(grads=[jnp.where(ok, g, jnp.zeros_like(g)) for g in out.grads],
                        finite=finite)


@_on_its_mesh
def checked_train_program(entry: Entry, tx: optax.GradientTransformationExtraArgs,
                          loss_fn: Callable[[Any, Any], jax.Array], update_every: int,
                          spec: LoopSpec, params_def: Any, params, opt_state, hidden, other,
                          traces, xs, ys, weights, signal_inputs=None,
                          masked: bool = False) -> TrainResult:
    """:func:`train_program` (every update applied) that returns no Params that are not
    finite, for ``OnlineTrainer.step``.

    Where a loss or the Params after the last update are not finite
    (``losses`` and ``bad_update_at`` say so), it returns the Params and the
    optimiser state it was given: the model never holds Params a discarded call
    made. The hidden state and traces are returned as computed (the driver puts
    back those it gave when it reads the flags, ``_deferred.py``). To name the
    first update that went wrong, the driver runs the call again with
    ``skip_non_finite=True``.
    """
    out = train_program(entry, tx, loss_fn, update_every, spec, params_def, params, opt_state,
                        hidden, other, traces, xs, ys, weights, signal_inputs,
                        skip_non_finite=False, masked=masked)
    ok = (out.bad_update_at < 0) & jnp.all(jnp.isfinite(out.losses))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    params, opt_state = keep(out.params, list(params)), keep(out.opt_state, opt_state)
    lay = entry.layout
    if lay is not None:
        params = constrain(params, lay.params)
        opt_state = constrain(opt_state, _opt_shardings(lay, tx, opt_state, params_def))
    return out._replace(params=params, opt_state=opt_state)


GRAD_PROGRAM = jax.jit(grad_program, static_argnames=("entry", "loss_fn", "spec", "masked"))
""":func:`grad_program` under ``jax.jit`` (compiled once per entry, loss, loop and shapes)."""

TRAIN_PROGRAM = jax.jit(train_program, static_argnames=("entry", "tx", "loss_fn", "update_every",
                                                      "spec", "params_def", "skip_non_finite",
                                                      "masked"))
""":func:`train_program` under ``jax.jit``."""

EVOLVE_PROGRAM = jax.jit(evolve_program, static_argnames=("entry",))
""":func:`evolve_program` under ``jax.jit``."""

CHECKED_GRAD_PROGRAM = jax.jit(checked_grad_program,
                               static_argnames=("entry", "loss_fn", "spec", "masked"))
""":func:`checked_grad_program` under ``jax.jit`` (what ``learner.etrace_grad`` runs)."""

CHECKED_TRAIN_PROGRAM = jax.jit(checked_train_program, static_argnames=(
    "entry", "tx", "loss_fn", "update_every", "spec", "params_def", "masked"))
""":func:`checked_train_program` under ``jax.jit`` (what ``OnlineTrainer.step`` runs)."""
