"""The online gradient loop: one fused ``lax.scan`` over time.

Per step ``t`` (memory independent of ``T``):

1. run the step with a zero perturbation ``p`` at every ``h^t``; the VJP of
   ``w_t·L_t`` gives the learning signal ``δ^t = ∂L_t/∂p`` and the same-step
   gradient of every Param that is not traced;
2. compute ``D^t`` and ``Df^t`` at ``(h^{t-1}, x^t)``;
3. update the traces and add the algorithm's gradient contribution.

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

__all__ = ["ScanCarry", "init_carry", "online_gradients", "online_step"]


class ScanCarry(NamedTuple):
    """What the time loop carries: model state, traces and gradient sums."""

    hidden: list[jax.Array]
    other: list[jax.Array]
    traces: Any
    summed: Any
    same_step: list[jax.Array]


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
    """One time step of online learning; returns the new carry and ``L_t``."""
    x_leaves = jax.tree.leaves(x_t)
    hidden, other = carry.hidden, carry.other
    zeros = [jnp.zeros_like(h) for h in hidden]

    def weighted_loss(params, perturbation):
        out, h_out, o_out, rel_x = graph.forward(params, hidden, other, x_leaves, perturbation)
        loss = loss_fn(jax.tree.unflatten(graph.out_treedef, out), y_t)
        if jnp.ndim(loss) != 0:
            raise ValueError(
                f"loss_fn must return a scalar per time step, got shape {jnp.shape(loss)}. "
                "Reduce over the batch and feature axes inside loss_fn.")
        return loss * weight_t, (loss, h_out, o_out, rel_x)

    _, pullback, (loss, h_out, o_out, rel_x) = jax.vjp(
        weighted_loss, list(params), zeros, has_aux=True)
    same_step, delta = pullback(jnp.ones((), dtype=jnp.result_type(loss)))
    jac = step_jacobians(graph, algorithm, params, hidden, other, x_leaves)
    traces = algorithm.update(graph, carry.traces, jac, rel_x, operands)
    term = algorithm.contribution(graph, traces, delta, operands)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    same = [a + b.astype(a.dtype) for a, b in zip(carry.same_step, same_step)]
    return ScanCarry(list(h_out), list(o_out), traces, summed, same), loss


def init_carry(graph: ETraceGraph, algorithm: AbstractAlgorithm, params, hidden, other,
               traces) -> ScanCarry:
    """A carry with zero gradient sums (shapes found by abstract evaluation)."""
    operands = graph.operands(params)
    zero_sums = _zero_contribution(graph, algorithm, params, hidden, other, traces, operands)
    same = [jnp.zeros_like(p) for p in params]
    return ScanCarry(list(hidden), list(other), traces, zero_sums, same)


def _zero_contribution(graph, algorithm, params, hidden, other, traces, operands):
    delta = [jnp.zeros_like(h) for h in hidden]
    shapes = jax.eval_shape(lambda t, o: algorithm.contribution(graph, t, delta, o),
                            traces, operands)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


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
    operand_grads = algorithm.finalize(graph, carry.summed, operands)
    traced = graph.operand_pullback(params, operand_grads)
    grads = [s + t.astype(s.dtype) for s, t in zip(carry.same_step, traced)]
    return grads, carry, losses
