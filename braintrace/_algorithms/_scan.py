"""The online gradient loop: one fused ``lax.scan`` over time.

Per step ``t`` (memory independent of ``T``), with traces ``ε^{t-1}`` of the
influence of the traced Params on the hidden state ``h^{t-1}``:

.. math::

    \\nabla_\\theta L_t = \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1}}
        + \\frac{\\partial L_t}{\\partial h^{t-1}} \\cdot \\epsilon^{t-1}

1. the VJP of the step's weighted loss ``w_t·L_t`` with respect to the
   Params and ``h^{t-1}`` gives the exact same-step gradient of every Param
   (every path of the step: nothing is ever dropped from it) and the learning
   signal ``δ̄^t = ∂L_t/∂h^{t-1}``, which covers both a loss that reads the new
   state and one that reads the previous state;
2. the algorithm contracts ``δ̄^t`` with ``ε^{t-1}`` (its temporal credit);
3. ``D^t`` and ``Df^t`` at ``(h^{t-1}, x^t)`` advance the traces to ``ε^t``.

Step 3 is deferred: the carry holds this step's Jacobians and relation inputs
(small, ``O(B·(I + O·S))``) and the next step applies them to the traces
*before* contracting. So the large traces are written once and then read,
which XLA does in place; contracting the old traces and writing the new ones
in one step makes XLA copy every loop-carried buffer each step. A sequence
ends with :func:`finish_carry`, which applies the last pending update.

When the traces are exact (D-RTRL on a position-diagonal model) this is
exactly BPTT; at ``T = 1`` it is BPTT for every algorithm and every model.
After the scan, the summed contributions are mapped to the operands
(``finalize``) and through the weight programs to the Params.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm, Jacobians
from braintrace._compiler import ETraceGraph, StepLeaves
from braintrace._compiler import _programs as programs

__all__ = [
    "Pending",
    "ScanCarry",
    "StepTerms",
    "add_same_step",
    "apply_pending",
    "evolve",
    "evolve_step",
    "finish_carry",
    "init_carry",
    "online_gradients",
    "online_step",
    "param_gradients",
    "step_jacobians",
    "step_terms",
]


class Pending(NamedTuple):
    """A trace update not yet applied: one step's Jacobians and relation inputs."""

    d: list[jax.Array]
    df: list[jax.Array]
    rel_x: list[jax.Array | None]


class ScanCarry(NamedTuple):
    """What the time loop carries: model state, traces and gradient sums.

    ``traces`` are ``ε^{t-2}`` until ``pending`` (step ``t-1``'s update) is
    applied; ``fresh`` says there is nothing pending yet.
    """

    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    summed: Any
    same_step: list[jax.Array]
    pending: Pending
    fresh: jax.Array


def step_jacobians(graph: ETraceGraph, algorithm: AbstractAlgorithm,
                   leaves: StepLeaves) -> Jacobians:
    """``D`` (diagonal, coupled or full, as the algorithm needs) and ``Df`` of one step.

    In the full scope every group reads the one per-sample Jacobian ``J``.
    """
    if algorithm.scope == "full":
        jac, df = programs.full_jacobians(graph, leaves, is_batched(graph))
        return Jacobians(d=[jac] * len(graph.groups), df=df)
    d, df = programs.jacobians(graph, leaves)
    if algorithm.scope == "coupled":
        d = programs.coupled_jacobians(graph, leaves)
    return Jacobians(d=d, df=df)


def is_batched(graph: ETraceGraph) -> bool:
    """Whether the step is batched (its relations' primitives carry a leading batch axis)."""
    return any(r.batched for r in graph.relations)


class StepTerms(NamedTuple):
    """What one step gives the online loop, before any trace is touched.

    Attributes:
        hidden, other: The state after the step.
        same_step: ``∂(w_t L_t)/∂θ|_{h^{t-1}}`` per Param leaf (every path of the step).
        signal: ``δ̄^t = ∂(w_t L_t)/∂h^{t-1}`` per hidden leaf.
        jac: ``D^t`` and ``Df^t`` at ``(h^{t-1}, x^t)`` (``None`` with ``responses``).
        rel_x: Each relation's input ``x^t`` (``None`` for elementwise relations).
        loss: ``L_t`` (unweighted).
        dy: With ``probe_outputs``: each relation's output cotangent
            ``∂(w_t L_t)/∂y^t`` (``None`` for a relation sharing an earlier one's
            equation), and ``same_step`` then lacks every relation's own share
            ``xy_to_dw(x^t, dy)`` (left to the caller); otherwise ``None``.
        responses: With ``defer_jacobians`` (diagonal scope only): the Jacobian
            responses that ``assemble_jacobians`` arranges into ``jac``, which is
            then ``None``; otherwise ``None``.
    """

    hidden: list[jax.Array]
    other: list[jax.Array]
    same_step: list[jax.Array]
    signal: list[jax.Array]
    jac: Jacobians | None
    rel_x: list[jax.Array | None]
    loss: jax.Array
    dy: list[jax.Array | None] | None = None
    responses: list[jax.Array] | None = None


def step_terms(graph: ETraceGraph, algorithm: AbstractAlgorithm,
               loss_fn: Callable[[Any, Any], jax.Array], leaves: StepLeaves, y_t: Any,
               weight_t: jax.Array, probe_outputs: bool = False,
               defer_jacobians: bool = False) -> StepTerms:
    """One step's same-step gradient, learning signal and Jacobians (module docstring, 1 and 3).

    ``probe_outputs`` returns the relations' output cotangents instead of
    their share of the same-step gradient; ``defer_jacobians`` the diagonal
    scope's Jacobian responses instead of ``D`` and ``Df`` (see :class:`StepTerms`).
    """
    feedback = algorithm.feedback_operands(graph)
    probes = programs.output_probes(graph) if probe_outputs else None

    def weighted_loss(params, hidden, probes):
        outs, rel_x = programs.forward(graph, leaves._replace(params=params, hidden=hidden),
                                       feedback, probes)
        loss = loss_fn(jax.tree.unflatten(graph.out_treedef, outs.y), y_t)
        if jnp.ndim(loss) != 0:
            raise ValueError(
                f"loss_fn must return a scalar per time step, got shape {jnp.shape(loss)}. "
                "Reduce over the batch and feature axes inside loss_fn.")
        return loss * weight_t, (loss, outs, rel_x)

    weighted, pullback, (loss, outs, rel_x) = jax.vjp(
        weighted_loss, leaves.params, leaves.hidden, probes, has_aux=True)
    same_step, signal, dy = pullback(jnp.ones_like(weighted))  # w_t may be wider than L_t
    if defer_jacobians:
        if algorithm.scope != "diagonal":
            raise ValueError("defer_jacobians needs the diagonal scope's Jacobians.")
        return StepTerms(outs.hidden, outs.other, same_step, signal, None, list(rel_x), loss,
                         dy, programs.jacobian_responses(graph, leaves))
    jac = step_jacobians(graph, algorithm, leaves)
    return StepTerms(outs.hidden, outs.other, same_step, signal, jac, list(rel_x), loss,
                     dy)


def add_same_step(total: Sequence[jax.Array], same_step: Sequence[jax.Array]) -> list[jax.Array]:
    """The running same-step gradient sums, each kept in its Param's dtype."""
    return [a + b.astype(a.dtype) for a, b in zip(total, same_step)]


def online_step(
    graph: ETraceGraph,
    algorithm: AbstractAlgorithm,
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Sequence[jax.Array],
    operands: Sequence[dict[str, jax.Array]],
    carry: ScanCarry,
    x_t: Any,
    y_t: Any,
    weight_t: jax.Array,
) -> tuple[ScanCarry, jax.Array]:
    """One time step of online learning (module docstring); returns the new carry and ``L_t``."""
    leaves = StepLeaves(list(params), list(carry.hidden), list(carry.other),
                        jax.tree.leaves(x_t))
    terms = step_terms(graph, algorithm, loss_fn, leaves, y_t, weight_t)
    traces = apply_pending(graph, algorithm, operands, carry)
    term = algorithm.contribution(graph, traces, terms.signal, operands)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    return ScanCarry(terms.hidden, terms.other, traces, summed,
                     add_same_step(carry.same_step, terms.same_step),
                     Pending(list(terms.jac.d), list(terms.jac.df), terms.rel_x),
                     jnp.zeros((), bool)), terms.loss


def apply_pending(graph: ETraceGraph, algorithm: AbstractAlgorithm,
                  operands: Sequence[dict[str, jax.Array]], carry: ScanCarry) -> Any:
    """The traces with the carry's pending update applied (unchanged when ``fresh``)."""
    pending = carry.pending
    new = algorithm.update(graph, carry.traces, Jacobians(d=pending.d, df=pending.df),
                           pending.rel_x, operands)
    return jax.tree.map(lambda old, upd: jnp.where(carry.fresh, old, upd), carry.traces, new)


def finish_carry(graph: ETraceGraph, algorithm: AbstractAlgorithm,
                 operands: Sequence[dict[str, jax.Array]], carry: ScanCarry) -> ScanCarry:
    """Applies the pending update: the carry's traces become ``ε^T``."""
    return carry._replace(traces=apply_pending(graph, algorithm, operands, carry),
                          fresh=jnp.ones((), bool))


def init_carry(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other,
               traces) -> ScanCarry:
    """A carry with zero gradient sums and nothing pending (shapes by abstract evaluation)."""
    operands = programs.operands(graph, params)
    zero_sums = _zero_contribution(graph, algorithm, params, hidden, other, traces, operands)
    same = [jnp.zeros_like(p) for p in params]
    return ScanCarry(list(hidden), list(other), traces, zero_sums, same,
                     _zero_pending(graph, algorithm, params, hidden, other), jnp.ones((), bool))


def _zero_pending(graph, algorithm, params, hidden, other) -> Pending:
    """A pending update of the right shapes (never applied: the carry is ``fresh``)."""
    leaves = StepLeaves(list(params), list(hidden), list(other),
                        [jnp.zeros(shape, dtype) for shape, dtype in graph.input_avals])

    def shapes():
        jac = step_jacobians(graph, algorithm, leaves)
        return Pending(list(jac.d), list(jac.df), programs.forward(graph, leaves)[1])

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(shapes))


def _zero_contribution(graph, algorithm, params, hidden, other, traces, operands):
    delta = [jnp.zeros_like(h) for h in hidden]
    shapes = jax.eval_shape(lambda t, o: algorithm.contribution(graph, t, delta, o),
                            traces, operands)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def param_gradients(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, operands,
                    carry: ScanCarry) -> list[jax.Array]:
    """Gradients per Param leaf: same-step ones plus the traced sums, finalised and
    mapped through the weight programs."""
    operand_grads = algorithm.finalize(graph, carry.summed, operands)
    traced = programs.operand_pullback(graph, params, operand_grads)
    return [s + t.astype(s.dtype) for s, t in zip(carry.same_step, traced)]


def online_gradients(
    graph: ETraceGraph,
    algorithm: AbstractAlgorithm,
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Sequence[jax.Array],
    hidden: Sequence[jax.Array],
    other: Sequence[jax.Array],
    traces: Any,
    xs: Any,
    ys: Any,
    weights: jax.Array,
) -> tuple[list[jax.Array], ScanCarry, jax.Array]:
    """Online gradients of ``Σ_t w_t L_t`` over a sequence (time axis leading).

    Returns:
        ``(param_grads, final_carry, losses)``: gradients per Param leaf, the
        carry after the last step (hidden state, traces), and each step's loss.
    """
    operands = programs.operands(graph, params)
    carry = init_carry(graph, algorithm, params, hidden, other, traces)

    def body(carry, inputs):
        x_t, y_t, w_t = inputs
        return online_step(graph, algorithm, loss_fn, params, operands, carry, x_t, y_t, w_t)

    carry, losses = jax.lax.scan(body, carry, (xs, ys, weights))
    carry = finish_carry(graph, algorithm, operands, carry)
    return param_gradients(graph, algorithm, params, operands, carry), carry, losses


def evolve_step(graph: ETraceGraph, algorithm: AbstractAlgorithm, operands,
                leaves: StepLeaves, traces) -> tuple[list[jax.Array], list[jax.Array], Any, Any]:
    """One step without gradients: ``(hidden', other', traces', y)``."""
    outs, rel_x = programs.forward(graph, leaves)
    jac = step_jacobians(graph, algorithm, leaves)
    traces = algorithm.update(graph, traces, jac, rel_x, operands)
    return outs.hidden, outs.other, traces, jax.tree.unflatten(graph.out_treedef, outs.y)


def evolve(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other, traces, xs):
    """Advances hidden state and traces over ``xs``; returns ``(ys, hidden, other, traces)``."""
    operands = programs.operands(graph, params)

    def body(carry, x_t):
        hidden, other, traces = carry
        leaves = StepLeaves(list(params), hidden, other, jax.tree.leaves(x_t))
        hidden, other, traces, y = evolve_step(graph, algorithm, operands, leaves, traces)
        return (hidden, other, traces), y

    (hidden, other, traces), ys = jax.lax.scan(body, (list(hidden), list(other), traces), xs)
    return ys, hidden, other, traces
