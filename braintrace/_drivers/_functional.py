"""Online learning as pure functions, shaped like optax: for your own ``jit``-ed train step.

:func:`online_grad` returns an :class:`OnlineGradient`: a pair of pure functions,

* ``init(model, *, batch_size=KEEP) -> OnlineState``: the state online learning
  carries from one call to the next — the model's hidden states and other
  Variables (RNG counters, batch statistics) as ``nnx.State``\\ s, and the
  algorithm's traces; with ``batch_size``, fresh hidden states at that batch size;
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
each mode is compiled once, then reused). Its Params and hidden states are never
written; its RNG counters and batch statistics advance as a call of the model
advances them (under ``nnx.jit``, or eagerly; ``jax.jit`` drops the write, as for
any Flax module, and the carried state still advances them): so ``state =
online.init(model)`` for every batch draws new Dropout masks each time, as the
stateful learner does, and the same seed gives the same run. Any batch size runs: the state's hidden
states set it (``init(model, batch_size=20)`` for a last, partial batch), and
each batch size is compiled once, then reused. Floating-point inputs of another
width than the compiled example are cast to its dtype, as a Flax layer casts
its input to its compute dtype. Nothing syncs with the host: both functions
run under ``jax.jit``, ``nnx.jit``, ``jax.lax.scan`` (one call per chunk of a
long stream) and with sharded inputs (a learner compiled with ``mesh=`` splits
the batch over it; one compiled without gathers inputs split over a mesh's
explicit axes, ``jax.make_mesh``'s default, and inside ``jit``, where it cannot,
says to pass ``mesh=``). A non-finite loss or gradient is never
hidden: ``stats.finite`` is ``False`` (use ``optax.apply_if_finite`` or check
it), and :class:`OnlineUpdate` skips an update that would make a Param not
finite and reports it. The stateful :class:`~braintrace.OnlineLearner` and
:class:`~braintrace.OnlineTrainer` run the same programs with host-side checks
and clear errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from braintrace._drivers._buffers import own_buffers
from braintrace._drivers._compiled import Entry
from braintrace._drivers._inputs import (
    REDUCTIONS,
    check_inputs,
    check_mask_dtype,
    check_signal_inputs,
    check_targets,
)
from braintrace._drivers._model_state import param_state
from braintrace._drivers._online_state import (
    CheckedState,
    OnlineState,
    check_state,
    compiled_of,
    init_state,
    write_model_variables,
)
from braintrace._drivers._programs import grad_program, train_program
from braintrace._drivers._sharding import gathered
from braintrace._drivers._states import KEEP
from braintrace._loops import check_positive, choose_loop, default_block_size

__all__ = ["GradStats", "OnlineGradient", "OnlineState", "OnlineUpdate", "UpdateStats",
           "online_grad", "online_update", "trace_weights"]


class GradStats(NamedTuple):
    """What :meth:`OnlineGradient.grad` reports besides the gradients.

    Attributes:
        losses: Each step's loss ``L_t``, ``(T,)`` (over its scored samples; 0 at a step
            the mask scores nothing of).
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
        losses: Each step's loss ``L_t``, ``(T,)`` (0 at a step the mask scores nothing of).
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

    init: Callable[..., OnlineState]
    grad: Callable[..., tuple[nnx.State, OnlineState, GradStats]]


class OnlineUpdate(NamedTuple):
    """A pair of pure functions, ``init`` and ``update`` (module docstring)."""

    init: Callable[..., tuple[Any, OnlineState]]
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


def _check_loss_fn(name: str, loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"braintrace.{name}: loss_fn must be a function loss_fn(y_pred, "
                        f"y_target) -> scalar, got a {type(loss_fn).__name__}.")


def _sequence_length(name: str, checked: CheckedState, xs: Any, ys: Any) -> int:
    """The number of steps of ``xs``, after checking ``xs`` and ``ys`` against the state."""
    entry = checked.entry
    hint = (lambda b: f"make its state with online.init(model, batch_size={b}) (each batch "
            "size is compiled once, then reused).")
    try:
        length = check_inputs(xs, entry.example, another_batch=hint)
    except ValueError as err:  # an ArgumentTypeError (a dtype) stays one
        raise type(err)(f"{name}: {err}") from None
    if length == 0:
        raise ValueError(f"{name}: xs has no time steps (T = 0): there is no loss to "
                         "differentiate. Give at least one step.")
    check_targets(ys, length)
    return length


def _whole(name: str, entry: Entry, xs: Any, ys: Any, mask: Any,
           signal_inputs: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The arrays of a call, gathered whole where they are split over a mesh's explicit axes
    and the learner was compiled without one (``_sharding.gathered``)."""
    if entry.layout is not None:
        return xs, ys, mask, signal_inputs
    return (gathered(f"{name}: xs", xs), gathered(f"{name}: ys", ys),
            gathered(f"{name}: mask", mask),
            {key: gathered(f"{name}: {key}", value) for key, value in signal_inputs.items()})


def _new_state(name: str, model: nnx.Module, checked: CheckedState, hidden: list[Any],
               other: list[Any], traces: Any) -> OnlineState:
    """The state after a call; the model's own Variables written into ``model``."""
    write_model_variables(name, model, checked.model_other_def, other)
    return OnlineState(jax.tree.unflatten(checked.hidden_def, hidden),
                       jax.tree.unflatten(checked.other_def, other), traces)


def online_grad(learner: Any, loss_fn: Callable[[Any, Any], jax.Array], *,
                reduction: str = "mean", chunk_size: int | None = None,
                block_size: int | None = None) -> OnlineGradient:
    """Pure ``init`` and ``grad`` functions of a compiled model (module docstring).

    Args:
        learner: The :class:`~braintrace.OnlineLearner` from :func:`braintrace.compile`
            (its analysis of the model is used; its own state is not touched).
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step. Traced when
            ``grad`` is: inside your ``jit``-ed step once per compilation of the step, so
            a value it reads from outside (a global, a closure, an attribute) keeps the
            value it had then (``jax.jit``'s rule). Pass a value that changes as an
            argument of the step, e.g. with the targets: ``ys=(targets, weights)``,
            ``weights`` ``(T,)``, ``loss_fn(y, (t, w)) = w * ...``.
        reduction: ``'mean'`` (divide by the mask's sum, or ``T``) or ``'sum'`` over time.
        chunk_size: Windowed mode with windows of this many steps; ``None``: not windowed.
        block_size: Time blocks of the traces (``None``: where the algorithm has a
            blocked form, as many steps as fit 256 MiB of stacked per-step values, between 2
            and 32 (on a TPU fewer for small traces, up to 64 for traces that bound the
            step), see ``braintrace._loops.default_block_size``; ``1``: per step).

    Returns:
        An :class:`OnlineGradient` ``(init, grad)``:

        * ``init(model, *, batch_size=KEEP) -> OnlineState``: by default the
          model's hidden states as they are; with ``batch_size`` (``None``: per
          sample), every hidden state's initial value at that batch size (the model
          is not changed). Zero traces either way.
        * ``grad(model, state, xs, ys, *, mask=None, **signal_inputs) -> (grads,
          state, stats)`` (``signal_inputs``: an algorithm's own per-step inputs,
          e.g. ThreeFactor's ``modulators=``). It runs at the batch size of
          ``state`` and writes the model's RNG counters and batch statistics after
          the sequence into ``model`` (see the module docstring).

    Raises:
        TypeError: ``learner`` is not a compiled learner (a model, for instance), or
            ``loss_fn`` is not callable. ``grad``: ``state`` is not an
            :class:`~braintrace.OnlineState`; an input's dtype cannot stand for the
            compiled one (a float for integer indices).
        ValueError: ``reduction``, ``chunk_size`` or ``block_size`` is invalid.
            ``grad``: ``xs`` has no steps or another shape than the state's batch
            runs (the message says to make a state for its batch size, or that it
            looks batch-major); the state was made by another learner, algorithm or
            model, or in another mode (the message names what differs). Nothing is
            written then.
        flax.errors.TraceContextError: ``grad`` was traced by a ``jit`` that closed over
            a model with RNG counters or batch statistics (Flax cannot write it there,
            as it cannot call the model there): pass the model as an argument.

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

        A last batch of another size runs from a state made for it (compiled once):

        >>> state = online.init(model, batch_size=3)
        >>> state, losses = train_step(model, optimizer, state, jnp.ones((5, 3, 3)),
        ...                            jnp.zeros((5, 3, 4)))
        >>> state.hidden['layers'][1]['v'].shape
        (3, 4)
    """
    compiled = compiled_of("online_grad", learner)
    _check_loss_fn("online_grad", loss_fn)
    _check_reduction(reduction)
    chunk_size = None if chunk_size is None else check_positive("chunk_size", chunk_size)
    block_size = None if block_size is None else check_positive("block_size", block_size)

    def init(model: nnx.Module, *, batch_size: Any = KEEP) -> OnlineState:
        return init_state(compiled, model, batch_size)

    def grad(model: nnx.Module, state: OnlineState, xs: Any, ys: Any, *, mask: Any = None,
             **signal_inputs: Any) -> tuple[nnx.State, OnlineState, GradStats]:
        checked = check_state("online_grad: grad", compiled, model, state)
        entry, leaves = checked.entry, checked.leaves
        xs, ys, mask, signal_inputs = _whole("online_grad: grad", entry, xs, ys, mask,
                                             signal_inputs)
        length = _sequence_length("online_grad: grad", checked, xs, ys)
        spec = choose_loop(entry.rules, length=length, chunk_size=chunk_size,
                           block_size=block_size)
        weights = trace_weights(mask, length, reduction, jnp.result_type(*leaves.params),
                                entry.batch_size)
        inputs = check_signal_inputs(entry.rules, leaves.hidden, signal_inputs, length)
        out = grad_program(entry, loss_fn, spec, leaves.params, leaves.hidden, leaves.other,
                           state.traces, xs, ys, weights, inputs, masked=mask is not None)
        finite = jnp.all(out.finite) & jnp.all(jnp.isfinite(out.losses))
        return (param_state(model, out.grads),
                _new_state("online_grad: grad", model, checked, out.hidden, out.other,
                           out.traces),
                GradStats(out.losses, finite, out.finite))

    return OnlineGradient(init, grad)


def online_update(learner: Any, loss_fn: Callable[[Any, Any], jax.Array],
                  tx: optax.GradientTransformation, *, update_every: int = 1,
                  block_size: int | None = None) -> OnlineUpdate:
    """Pure ``init`` and ``update`` functions: optax updates inside the time loop.

    Every ``update_every`` steps the gradient accumulated since the last update
    (the mean over those steps, times the mask) is applied with ``tx``; hidden
    state and traces run on across updates. As :func:`online_grad`, it runs at
    the batch size of the state, casts float inputs of another width to the
    compiled dtype, and writes the model's RNG counters and batch statistics
    (never its Params: write ``params`` with ``nnx.update(model, params)``).

    Args:
        learner: The :class:`~braintrace.OnlineLearner` from :func:`braintrace.compile`.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step. Traced when
            ``grad`` is: inside your ``jit``-ed step once per compilation of the step, so
            a value it reads from outside (a global, a closure, an attribute) keeps the
            value it had then (``jax.jit``'s rule). Pass a value that changes as an
            argument of the step, e.g. with the targets: ``ys=(targets, weights)``,
            ``weights`` ``(T,)``, ``loss_fn(y, (t, w)) = w * ...``.
        tx: An optax transformation (``value=`` is passed: the window's loss).
        update_every: Steps between updates; sequence lengths must be multiples of it.
        block_size: Time blocks within a window (``None``: at most 64 steps per block
            where the algorithm has a blocked form; ``1``: per step).

    Returns:
        An :class:`OnlineUpdate`: ``init(model, *, batch_size=KEEP) -> (opt_state,
        state)`` (``batch_size`` as :func:`online_grad`'s ``init``) and
        ``update(model, opt_state, state, xs, ys, *, mask=None, **signal_inputs) ->
        (params, opt_state, state, stats)``, ``params`` an ``nnx.State`` to write
        with ``nnx.update(model, params)``.

    Raises:
        TypeError, ValueError: As :func:`online_grad`; and a sequence length that
            is not a multiple of ``update_every``.

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
        >>> params, opt_state, state, stats = nnx.jit(train.update)(
        ...     model, opt_state, state, jnp.ones((10, 2, 3)), jnp.zeros((10, 2, 4)))
        >>> nnx.update(model, params)
        >>> bool(stats.finite), stats.losses.shape
        (True, (10,))
    """
    compiled = compiled_of("online_update", learner)
    _check_loss_fn("online_update", loss_fn)
    update_every = check_positive("update_every", update_every)
    block_size = None if block_size is None else check_positive("block_size", block_size)
    tx = optax.with_extra_args_support(tx)

    def init(model: nnx.Module, *, batch_size: Any = KEEP) -> tuple[Any, OnlineState]:
        opt_state = own_buffers(tx.init(nnx.state(model, nnx.Param)),
                                jax.tree.leaves(nnx.state(model)))  # it may hold the Params
        return opt_state, init_state(compiled, model, batch_size)

    def update(model: nnx.Module, opt_state: Any, state: OnlineState, xs: Any, ys: Any, *,
               mask: Any = None, **signal_inputs: Any
               ) -> tuple[nnx.State, Any, OnlineState, UpdateStats]:
        checked = check_state("online_update: update", compiled, model, state)
        entry, leaves = checked.entry, checked.leaves
        xs, ys, mask, signal_inputs = _whole("online_update: update", entry, xs, ys, mask,
                                             signal_inputs)
        length = _sequence_length("online_update: update", checked, xs, ys)
        if length % update_every:
            raise ValueError(f"online_update: update: the sequence length {length} must be a "
                             f"multiple of update_every={update_every}.")
        spec = window_loop(entry, update_every, block_size)
        weights = trace_weights(mask, length, "sum", jnp.result_type(*leaves.params),
                                entry.batch_size)
        inputs = check_signal_inputs(entry.rules, leaves.hidden, signal_inputs, length)
        out = train_program(entry, tx, loss_fn, update_every, spec,
                            jax.tree.structure(nnx.state(model, nnx.Param)), leaves.params,
                            opt_state, leaves.hidden, leaves.other, state.traces, xs, ys,
                            weights / update_every, inputs, masked=mask is not None)
        finite = (out.bad_update_at < 0) & jnp.all(jnp.isfinite(out.losses))
        return (param_state(model, out.params), out.opt_state,
                _new_state("online_update: update", model, checked, out.hidden, out.other,
                           out.traces),
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
