"""The per-step loop: one fused ``lax.scan`` over time.

Per step ``t`` (memory independent of ``T``), with traces ``ε^{t-1}`` of the
influence of the traced Params on the hidden state ``h^{t-1}``:

.. math::

    \\nabla_\\theta L_t = \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1}}
        + \\frac{\\partial L_t}{\\partial h^{t-1}} \\cdot \\epsilon^{t-1}

1. the step's loss terms (``_step.py``): the exact same-step gradient of every
   Param and the learning signal ``δ̄^t = ∂L_t/∂h^{t-1}``;
2. the algorithm contracts ``δ̄^t`` with ``ε^{t-1}`` (its temporal credit);
3. ``D^t`` and ``Df^t`` at ``(h^{t-1}, x^t)`` advance the traces to ``ε^t``.

Where the traces are larger than one step's Jacobians and relation inputs
(D-RTRL's ``O(B·|θ|·S)`` against ``O(B·(I + O·S))``), step 3 is deferred: the
carry holds this step's Jacobians and relation inputs and the next step
applies them to the traces *before* contracting. So the large traces are
written once and then read, which XLA does in place; contracting the old
traces and writing the new ones in one step makes XLA copy every
loop-carried buffer each step. A run ends with :func:`finish_carry`, which
applies the last pending update. Traces no larger than that (ES-D-RTRL's are
the size of one step's relation inputs and ``Df``) are updated in the step
itself: carrying the update would move more than it saves.

Where every relation's rule can add its own share of the same-step gradient
to its term (``GraphRules.adds_share``), step 1 takes each relation's output
cotangent ``∂L_t/∂y^t`` from the reverse pass instead of its Params' share of
the same-step gradient, and step 2 adds that share to the relation's term:
the same sum, with ES-D-RTRL's two products of each weight's shape one
product on accelerators.

On accelerators the loop runs several steps per iteration (``_groups.py``).

A learning signal that is contracted after the update (``after_update``,
ThreeFactor's modulators, the fast signal ``∂L_t/∂h^t`` of ``signal='fast'``)
advances the traces first and contracts ``ε^t`` with the signal the
algorithm's hook returns; then nothing is pending. The output form
(``OutputSignal``, OTTT's) contracts ``ε^t`` with each relation's output
cotangent ``∂L_t/∂y^t`` and adds the same-step gradient without the relations'
share.

When the traces are exact (D-RTRL on a position-diagonal model) this is
exactly BPTT; at ``T = 1`` it is BPTT for every algorithm and every model.
After the loop, the summed contributions are mapped to the operands
(``finalize``) and through the weight programs to the Params
(:func:`param_gradients`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms import GraphRules, Jacobians
from braintrace._compiler import StepLeaves, programs, reader_list
from braintrace._loops._context import LoopContext
from braintrace._loops._groups import scan_grouped
from braintrace._loops._masks import ignore_masked
from braintrace._loops._step import (
    LossTerms,
    add_same_step,
    loss_terms,
    output_loss_terms,
    probed_loss_terms,
    reader_probes,
    step_jacobians,
    step_leaves,
)
from braintrace._primitives import silent_fallback

__all__ = ["Pending", "ScanCarry", "accumulator_dtype", "evolve", "finish_carry", "init_carry",
           "keep_dtype", "param_gradients", "restart_sums", "run_per_step"]


class Pending(NamedTuple):
    """A trace update not yet applied: one step's Jacobians and relation inputs."""

    d: list[jax.Array]
    df: list[jax.Array]
    rel_x: list[jax.Array | None]


class ScanCarry(NamedTuple):
    """What every loop carries: model state, traces and gradient sums.

    ``traces`` are ``ε^{t-2}`` until ``pending`` (step ``t-1``'s update) is
    applied; ``fresh`` says there is nothing pending. Every loop takes and
    returns a carry with nothing pending.
    """

    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    summed: Any
    same_step: list[jax.Array]
    pending: Pending
    fresh: jax.Array

    def typed_as(self, entering: ScanCarry) -> ScanCarry:
        """This carry with every leaf in the dtype of ``entering``'s (the carry a loop
        iteration started from).

        A carry's dtypes are fixed once, by :func:`init_carry` from the state entering the
        sequence; each loop hands its iteration's result through this, so a writer that
        computes wider (a step computed in float32 for a bfloat16 state, a block's products
        in float32 for bfloat16 sums, float64 data into a float32 state) is rounded to the
        carry's dtype where it is stored, whichever loop or rule wrote it.
        """
        return jax.tree.map(keep_dtype, self, entering)


def keep_dtype(new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` in ``old``'s dtype (``new`` itself, weak type and all, when they agree)."""
    return new if new.dtype == old.dtype else new.astype(old.dtype)


def accumulator_dtype(dtype: Any) -> Any:
    """The dtype gradient sums over time are kept in: ``dtype``, at least float32 when it is
    floating. A bfloat16 sum of ``T`` per-step terms would be rounded to 8 significant bits
    ``T`` times (RTRL per step on a bfloat16 model, 40 steps: 4.0% off BPTT's gradient
    summed in float32, 2.5% with float32 sums); :func:`param_gradients` returns each
    gradient in its Param's dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> accumulator_dtype(jnp.bfloat16), accumulator_dtype(jnp.float64)
        (dtype('float32'), dtype('float64'))
    """
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(dtype, jnp.float32)
    return jnp.dtype(dtype)


def init_carry(ctx: LoopContext, hidden: Sequence[jax.Array], other: Sequence[jax.Array],
               traces: Any, *, pending: bool = False) -> ScanCarry:
    """A carry with zero gradient sums and nothing pending.

    Args:
        ctx: The run's context.
        hidden, other: The state entering the sequence.
        traces: The algorithm's traces entering the sequence.
        pending: Give the carry room for the per-step loop's deferred update
            (zeros of one step's Jacobians and relation inputs, whose shapes
            take an abstract trace of one step). The per-step loop makes that
            room itself when the carry has none (:func:`run_per_step`); only a
            caller that carries its carry across pieces of a sequence in a scan
            of its own (``OnlineTrainer``'s windows) needs it up front. The
            other loops defer nothing.
    """
    rules = ctx.rules
    if rules.learning_signal.reads_outputs:
        dy = programs.output_probes(ctx.graph)
        shapes = jax.eval_shape(lambda t, o: rules.contribution_from_outputs(t, dy, o), traces,
                                ctx.operands)
    else:
        delta = [jnp.zeros_like(h) for h in hidden]
        if rules.readers:  # the readers' input and the relations' output cotangents too
            delta += [*reader_probes(ctx.graph, reader_list(rules.readers)),
                      *programs.output_probes(ctx.graph)]
        shapes = jax.eval_shape(lambda t, o: rules.contribution(t, delta, o), traces,
                                ctx.operands)
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, accumulator_dtype(s.dtype)), shapes)
    same = [jnp.zeros(jnp.shape(p), accumulator_dtype(jnp.result_type(p))) for p in ctx.params]
    room = _zero_pending(ctx, hidden, other, traces) if pending else _NOTHING_PENDING
    return ScanCarry(list(hidden), list(other), traces, zero_sums, same, room,
                     jnp.ones((), bool))


def restart_sums(carry: ScanCarry) -> ScanCarry:
    """``carry`` with zero gradient sums: the state, traces and any pending update run on
    into the next piece of the sequence."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return carry._replace(summed=zeros(carry.summed), same_step=zeros(carry.same_step))


_NOTHING_PENDING = Pending([], [], [])


def _has_room(carry: ScanCarry) -> bool:
    """Whether the carry holds (room for) a deferred update: each relation's ``Df``."""
    return bool(carry.pending.df)


def _zero_pending(ctx: LoopContext, hidden, other, traces) -> Pending:
    """A pending update of the right shapes (never applied: the carry is ``fresh``), or
    nothing when the loop does not defer updates: a signal contracted after the update, or
    traces no larger than one step's update (:func:`_nbytes`; module docstring)."""
    if not ctx.rules.traced or ctx.rules.learning_signal.after_update:
        return _NOTHING_PENDING
    graph = ctx.graph
    leaves = StepLeaves(list(ctx.params), list(hidden), list(other),
                        [jnp.zeros(shape, dtype) for shape, dtype in graph.input_avals])

    def shapes():
        jac = step_jacobians(ctx.rules, leaves)
        return Pending(list(jac.d), list(jac.df), programs.forward(graph, leaves)[1])

    room = jax.eval_shape(shapes)
    if _nbytes(traces) <= _nbytes(room):
        return _NOTHING_PENDING
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), room)


def _nbytes(tree: Any) -> int:
    """The bytes of a pytree's arrays (or of their shapes)."""
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def apply_pending(ctx: LoopContext, carry: ScanCarry, operands: Any = None) -> Any:
    """The traces with the carry's pending update applied (unchanged when ``fresh`` or
    when the carry has no room for one).

    ``operands``: those of the Params the pending step ran with, when they are
    not ``ctx``'s (``OnlineTrainer``'s next window applies the last one's).
    """
    if not _has_room(carry):
        return carry.traces
    pending = carry.pending
    new = ctx.rules.update(carry.traces, Jacobians(d=pending.d, df=pending.df), pending.rel_x,
                           ctx.operands if operands is None else operands)
    return jax.tree.map(lambda old, upd: jnp.where(carry.fresh, old, upd), carry.traces, new)


def finish_carry(ctx: LoopContext, carry: ScanCarry, operands: Any = None) -> ScanCarry:
    """Applies the pending update: the carry's traces become ``ε^T``.

    ``operands``: as :func:`apply_pending` (default ``ctx``'s).
    """
    return carry._replace(traces=apply_pending(ctx, carry, operands), fresh=jnp.ones((), bool))


def _loss_terms(ctx: LoopContext, leaves: StepLeaves, y_t: Any, w_t: jax.Array
                ) -> tuple[LossTerms, list[jax.Array | None] | None]:
    """The step's loss terms, and each relation's output cotangent ``dy^t`` where the rules
    add their share of the same-step gradient themselves (``GraphRules.adds_share``: the
    terms' same-step gradient is then without it), else ``None``."""
    signal = ctx.rules.learning_signal
    if signal.reads_outputs:
        return output_loss_terms(ctx, leaves, y_t, w_t), None
    if ctx.rules.adds_share:
        t = probed_loss_terms(ctx, leaves, y_t, w_t)
        return LossTerms(t.hidden, t.other, t.same_step_rest, t.signal, t.rel_x, t.loss), t.dy
    return loss_terms(ctx, leaves, y_t, w_t, new_state=signal.reads_new_state), None


def _step(ctx: LoopContext, keep: Sequence[bool], carry: ScanCarry,
          inputs: Any) -> tuple[ScanCarry, jax.Array]:
    """One time step (module docstring); returns the new carry and ``L_t``."""
    x_t, y_t, w_t, inputs_t, reaches_t = inputs
    x_t, y_t = ignore_masked(x_t, y_t, w_t, reaches_t)  # what a mask ignores is never read
    rules, signal = ctx.rules, ctx.rules.learning_signal
    leaves = step_leaves(ctx, carry.hidden, carry.other, x_t)
    terms, dy = _loss_terms(ctx, leaves, y_t, w_t)
    same = add_same_step(carry.same_step, terms.same_step, keep)
    traces, pending, fresh = carry.traces, carry.pending, carry.fresh
    updated = traces  # the traces after this step's update
    if not rules.traced:  # no traces (as _zero_pending): no Jacobians, nothing ever pending
        pass
    elif signal.after_update:  # ε^t now; nothing is ever pending
        traces = updated = rules.update(traces, step_jacobians(rules, leaves), terms.rel_x,
                                        ctx.operands)
    elif _has_room(carry):  # apply the last step's update, hold this one's
        traces = updated = apply_pending(ctx, carry)
        jac = step_jacobians(rules, leaves)
        pending, fresh = Pending(list(jac.d), list(jac.df), terms.rel_x), jnp.zeros((), bool)
    else:  # contract ε^{t-1}, carry ε^t
        updated = rules.update(traces, step_jacobians(rules, leaves), terms.rel_x, ctx.operands)
    if signal.reads_outputs:  # the relations' output cotangents ∂L_t/∂y^t
        term = rules.contribution_from_outputs(traces, terms.signal, ctx.operands)
    elif dy is not None:  # with each relation's share of the same-step gradient
        term = rules.contribution_with_share(traces, signal.signal(terms.signal, inputs_t, w_t),
                                             terms.rel_x, dy, ctx.operands)
    else:
        term = rules.contribution(traces, signal.signal(terms.signal, inputs_t, w_t),
                                  ctx.operands)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    return (ScanCarry(terms.hidden, terms.other, updated, summed, same, pending, fresh)
            .typed_as(carry), terms.loss)


def run_per_step(ctx: LoopContext, carry: ScanCarry, xs: Any, ys: Any, weights: jax.Array,
                 signal_inputs: Any = None, *, finish: bool = True,
                 reaches: jax.Array | None = None) -> tuple[ScanCarry, jax.Array]:
    """The per-step loop over a sequence: the carry after it and each step's loss ``(T,)``.

    Args:
        ctx, carry, xs, ys, weights, reaches: As :func:`braintrace._loops.run`.
        signal_inputs: The learning signal's per-step inputs (time axis leading), or ``None``.
        finish: Apply the last step's pending update (:func:`finish_carry`).
            ``False`` leaves it pending in the returned carry, for a caller that
            finishes it in its next loop iteration (``OnlineTrainer``'s windows:
            applied in the iteration that computed its Jacobians, the update is
            fused with them and XLA:CPU recomputes them for every trace element).
    """
    keep = ctx.rules.learning_signal.keeps_same_step(ctx.graph)
    if not _has_room(carry):  # fresh (only a carry with room can hold an update)
        carry = carry._replace(pending=_zero_pending(ctx, carry.hidden, carry.other,
                                                     carry.traces))
    carry, losses = scan_grouped(lambda c, i: _step(ctx, keep, c, i), carry,
                                 (xs, ys, weights, signal_inputs, reaches))
    return (finish_carry(ctx, carry) if finish else carry), losses


def param_gradients(ctx: LoopContext, carry: ScanCarry) -> list[jax.Array]:
    """Gradients per Param leaf, in its dtype: same-step sums plus the traced sums, finalised
    and mapped through the weight programs."""
    if not ctx.rules.traced:
        return [s.astype(jnp.result_type(p)) for s, p in zip(carry.same_step, ctx.params)]
    operand_grads = ctx.rules.finalize(carry.summed, ctx.operands)
    traced = programs.operand_pullback(ctx.graph, ctx.params, operand_grads)
    return [(s + t.astype(s.dtype)).astype(jnp.result_type(p))
            for s, t, p in zip(carry.same_step, traced, ctx.params)]


def evolve(rules: GraphRules, params: Sequence[jax.Array], hidden: Sequence[jax.Array],
           other: Sequence[jax.Array], traces: Any, xs: Any
           ) -> tuple[Any, list[jax.Array], list[jax.Array], Any]:
    """Advances hidden state and traces over ``xs`` without gradients.

    Returns:
        ``(ys, hidden, other, traces)``: the outputs (time axis leading) and the state after.
    """
    graph = rules.graph
    operands = programs.operands(graph, params)

    def body(state, x_t):
        hidden, other, traces = state
        leaves = StepLeaves(list(params), hidden, other, jax.tree.leaves(x_t))
        outs, rel_x = programs.forward(graph, leaves)
        if rules.traced:
            traces = rules.update(traces, step_jacobians(rules, leaves), rel_x, operands)
        return (outs.hidden, outs.other, traces), jax.tree.unflatten(graph.out_treedef, outs.y)

    with silent_fallback():  # a step compiled already: a vmap of it loses nothing
        (hidden, other, traces), ys = jax.lax.scan(body, (list(hidden), list(other), traces),
                                                   xs)
    return ys, hidden, other, traces
