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
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._interpret import evaluate

__all__ = [
    "Pending",
    "ScanCarry",
    "apply_pending",
    "finish_carry",
    "evolve",
    "evolve_step",
    "init_carry",
    "online_gradients",
    "online_step",
    "param_gradients",
    "windowed_gradients",
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


def step_jacobians(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other,
                   x_leaves) -> Jacobians:
    """``D`` (diagonal or coupled, as the algorithm needs) and ``Df`` of one step."""
    d, df = graph.jacobians(params, hidden, other, x_leaves)
    if algorithm.scope == "coupled":
        d = graph.coupled_jacobians(params, hidden, other, x_leaves)
    return Jacobians(d=d, df=df)


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
    x_leaves = jax.tree.leaves(x_t)
    hidden, other = carry.hidden, carry.other
    feedback = algorithm.feedback_operands(graph)

    def weighted_loss(params, hidden):
        out, h_out, o_out, rel_x = graph.forward(params, hidden, other, x_leaves, feedback)
        loss = loss_fn(jax.tree.unflatten(graph.out_treedef, out), y_t)
        if jnp.ndim(loss) != 0:
            raise ValueError(
                f"loss_fn must return a scalar per time step, got shape {jnp.shape(loss)}. "
                "Reduce over the batch and feature axes inside loss_fn.")
        return loss * weight_t, (loss, h_out, o_out, rel_x)

    _, pullback, (loss, h_out, o_out, rel_x) = jax.vjp(
        weighted_loss, list(params), list(hidden), has_aux=True)
    same_step, signal = pullback(jnp.ones((), dtype=jnp.result_type(loss)))
    traces = apply_pending(graph, algorithm, operands, carry)
    term = algorithm.contribution(graph, traces, signal, operands)
    jac = step_jacobians(graph, algorithm, params, hidden, other, x_leaves)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    same = [a + b.astype(a.dtype) for a, b in zip(carry.same_step, same_step)]
    return ScanCarry(list(h_out), list(o_out), traces, summed, same,
                     Pending(list(jac.d), list(jac.df), list(rel_x)),
                     jnp.zeros((), bool)), loss


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
    operands = graph.operands(params)
    zero_sums = _zero_contribution(graph, algorithm, params, hidden, other, traces, operands)
    same = [jnp.zeros_like(p) for p in params]
    return ScanCarry(list(hidden), list(other), traces, zero_sums, same,
                     _zero_pending(graph, algorithm, params, hidden, other), jnp.ones((), bool))


def _zero_pending(graph, algorithm, params, hidden, other) -> Pending:
    """A pending update of the right shapes (never applied: the carry is ``fresh``)."""
    x_leaves = [jnp.zeros(shape, dtype) for shape, dtype in graph.input_avals]

    def shapes():
        jac = step_jacobians(graph, algorithm, params, hidden, other, x_leaves)
        return Pending(list(jac.d), list(jac.df),
                       graph.forward(params, hidden, other, x_leaves)[3])

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
    traced = graph.operand_pullback(params, operand_grads)
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
    operands = graph.operands(params)
    carry = init_carry(graph, algorithm, params, hidden, other, traces)

    def body(carry, inputs):
        x_t, y_t, w_t = inputs
        return online_step(graph, algorithm, loss_fn, params, operands, carry, x_t, y_t, w_t)

    carry, losses = jax.lax.scan(body, carry, (xs, ys, weights))
    carry = finish_carry(graph, algorithm, operands, carry)
    return param_gradients(graph, algorithm, params, operands, carry), carry, losses


def evolve_step(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, operands, hidden,
                other, traces, x_t) -> tuple[list[jax.Array], list[jax.Array], Any, Any]:
    """One step without gradients: ``(hidden', other', traces', y)``."""
    x_leaves = jax.tree.leaves(x_t)
    out, h_out, o_out, rel_x = graph.forward(params, hidden, other, x_leaves)
    jac = step_jacobians(graph, algorithm, params, hidden, other, x_leaves)
    traces = algorithm.update(graph, traces, jac, rel_x, operands)
    return list(h_out), list(o_out), traces, jax.tree.unflatten(graph.out_treedef, out)


def evolve(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other, traces, xs):
    """Advances hidden state and traces over ``xs``; returns ``(ys, hidden, other, traces)``."""
    operands = graph.operands(params)

    def body(carry, x_t):
        hidden, other, traces, y = evolve_step(graph, algorithm, params, operands, *carry, x_t)
        return (hidden, other, traces), y

    (hidden, other, traces), ys = jax.lax.scan(body, (list(hidden), list(other), traces), xs)
    return ys, hidden, other, traces


def windowed_gradients(
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
    chunk_size: int,
) -> tuple[list[jax.Array], ScanCarry, jax.Array]:
    """Windowed mode: exact reverse mode inside windows, traces carry credit across.

    For a window starting at hidden state ``h_0`` with traces ``ε_0``:

    .. math::

        \\nabla_\\theta L_w = \\mathrm{BPTT}_w(\\theta)
            + \\frac{\\partial L_w}{\\partial h_0} \\cdot \\epsilon_0

    then the traces advance through the window step by step. Memory grows with
    ``chunk_size``, not with the sequence length.
    """
    if not algorithm.supports_windowed:
        raise ValueError(
            f"{type(algorithm).__name__} with these settings is a single-step rule (e.g. "
            "EProp(feedback='random')); call etrace_grad without chunk_size.")
    length = weights.shape[0]
    windows = length // chunk_size
    split = lambda a: a.reshape(windows, chunk_size, *a.shape[1:])
    xs_w, ys_w, w_w = jax.tree.map(split, xs), jax.tree.map(split, ys), split(weights)
    operands = graph.operands(params)
    carry = init_carry(graph, algorithm, params, hidden, other, traces)
    n_out, n_p, n_h = graph.num_outputs, graph.num_params, graph.num_hidden

    def window_loss(params, hidden, other, xw, yw, ww):
        def body(state, inputs):
            h, o = state
            x_t, y_t = inputs
            outs, _ = evaluate(graph.jaxpr, graph.consts,
                               [*params, *h, *o, *jax.tree.leaves(x_t)])
            y_pred = jax.tree.unflatten(graph.out_treedef, outs[:n_out])
            new_state = (outs[n_out + n_p:n_out + n_p + n_h], outs[n_out + n_p + n_h:])
            return new_state, loss_fn(y_pred, y_t)

        _, losses = jax.lax.scan(body, (list(hidden), list(other)), (xw, yw))
        return jnp.sum(losses * ww), losses

    def window(carry, inputs):
        xw, yw, ww = inputs
        _, pullback, losses = jax.vjp(
            lambda p, h: window_loss(p, h, carry.other, xw, yw, ww), list(params),
            list(carry.hidden), has_aux=True)
        g_params, g_hidden = pullback(jnp.ones((), losses.dtype))
        term = algorithm.contribution(graph, carry.traces, g_hidden, operands)
        summed = jax.tree.map(jnp.add, carry.summed, term)
        same = [a + b.astype(a.dtype) for a, b in zip(carry.same_step, g_params)]

        def advance(state, x_t):
            h, o, tr = state
            h, o, tr, _ = evolve_step(graph, algorithm, params, operands, h, o, tr, x_t)
            return (h, o, tr), None

        (h, o, tr), _ = jax.lax.scan(advance, (carry.hidden, carry.other, carry.traces), xw)
        return carry._replace(hidden=h, other=o, traces=tr, summed=summed, same_step=same), losses

    carry, losses = jax.lax.scan(window, carry, (xs_w, ys_w, w_w))
    grads = param_gradients(graph, algorithm, params, operands, carry)
    return grads, carry, losses.reshape(length)
