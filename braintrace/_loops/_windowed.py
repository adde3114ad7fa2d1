"""The windowed loop: exact reverse mode inside windows of ``k`` steps, traces carry credit across.

For a window starting at hidden state ``h_0`` with traces ``ε_0``:

.. math::

    \\nabla_\\theta L_w = \\mathrm{BPTT}_w(\\theta)
        + \\frac{\\partial L_w}{\\partial h_0} \\cdot \\epsilon_0

then the traces advance through the window step by step. With ``k = 1`` this
is the per-step rule of ``_per_step.py``; with no traces (BPTT) it is
truncated BPTT, and one window over the whole sequence is BPTT. Memory grows
with ``k``, not with the sequence length. An algorithm's window hook
(``GraphRules.window``, DNI's synthetic gradients) adds to each window's loss at
its end (``injected``) and corrects its start (``correct``).

What the reverse pass keeps per step (:data:`RESIDUAL_POLICY`): the state the step starts
from and the outputs of its matrix products and convolutions; the elementwise
rest (spikes, surrogate derivatives, gates) is recomputed from them, and the
steps' losses are taken after the scan, over the window's stacked outputs. On
the LIF network of ``benchmarks/spyx_compare.py`` (700 inputs, 256 neurons,
batch 64) that keeps two neuron-sized arrays a step where every derivative kept
took three, at the same time per step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from braintrace._compiler import StepLeaves, programs
from braintrace._loops._context import LoopContext
from braintrace._loops._masks import ignore_masked_inputs, ignore_masked_targets
from braintrace._loops._per_step import ScanCarry
from braintrace._loops._step import step_jacobians, step_leaves, step_loss

__all__ = ["RESIDUAL_POLICY", "run_windowed"]

RESIDUAL_POLICY = jax.checkpoint_policies.dots_saveable
"""What a window's reverse pass keeps of each step (module docstring): the outputs of its matrix
products and convolutions, and the state the step starts from."""


def run_windowed(ctx: LoopContext, carry: ScanCarry, xs: Any, ys: Any, weights: jax.Array,
                 window: int, *, reaches: jax.Array | None = None
                 ) -> tuple[ScanCarry, jax.Array]:
    """Runs ``Σ_t w_t L_t`` in windows of ``window`` steps (module docstring).

    ``window`` divides the sequence length. ``carry`` has nothing pending, and
    so has the carry returned. Returns it and each step's loss ``(T,)``.
    ``reaches``: as :func:`braintrace._loops.run` (each step cleans its own
    inputs, each step's loss its own targets).
    """
    length = weights.shape[0]
    split = lambda a: a.reshape(length // window, window, *a.shape[1:])
    rules = ctx.rules
    hooks = rules.window

    def advance(state, step_inputs):
        h, o, tr = state
        x_t, reaches_t = step_inputs
        leaves = step_leaves(ctx, h, o, ignore_masked_inputs(x_t, reaches_t))
        outs, rel_x = programs.forward(ctx.graph, leaves)
        tr = rules.update(tr, step_jacobians(rules, leaves), rel_x, ctx.operands)
        return (outs.hidden, outs.other, tr), None

    def one_window(carry, inputs):
        xw, yw, ww, rw, t0 = inputs
        total, pullback, (losses, h_end, o_end) = jax.vjp(
            lambda p, h: _window_loss(ctx, p, h, carry.other, xw, yw, ww, rw, t0 + window),
            list(ctx.params), list(carry.hidden), has_aux=True)
        g_params, g_hidden = pullback(jnp.ones_like(total))  # w_t may be wider than L_t
        if hooks is not None:
            g_hidden, g_params = hooks.correct(ctx.params, carry.hidden, g_hidden, g_params, t0)
        term = rules.contribution(carry.traces, g_hidden, ctx.operands)
        summed = jax.tree.map(jnp.add, carry.summed, term)
        same = [a + b.astype(a.dtype) for a, b in zip(carry.same_step, g_params)]
        if rules.traced:  # the traces advance through the window (the state with them)
            (h_end, o_end, traces), _ = jax.lax.scan(
                advance, (carry.hidden, carry.other, carry.traces), (xw, rw))
        else:
            traces = carry.traces
        return carry._replace(hidden=list(h_end), other=list(o_end), traces=traces,
                              summed=summed, same_step=same).typed_as(carry), losses

    starts = jnp.arange(length // window, dtype=jnp.int32) * window
    carry, losses = jax.lax.scan(one_window, carry, (*(jax.tree.map(split, a)
                                                       for a in (xs, ys, weights, reaches)),
                                                     starts))
    return carry, losses.reshape(length)


def _window_loss(ctx: LoopContext, params, hidden, other, xw, yw, ww, rw,
                 t_end) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
    """``Σ_k w_k L_k`` of one window from ``hidden`` (plus the window hook's injection at its
    end); aux: the losses and the state at the window's end. ``rw``: the window's
    ``reaches`` (:func:`run_windowed`), or ``None``.

    The steps run under ``jax.checkpoint`` with :data:`RESIDUAL_POLICY`; ``loss_fn`` runs once
    over the window's outputs (``jax.vmap`` over its steps), not inside the scan.
    """
    graph = ctx.graph

    def body(state, step_inputs):
        h, o = state
        x_t = ignore_masked_inputs(*step_inputs)  # what a mask ignores is never read
        outs, _ = programs.forward(graph, StepLeaves(params, h, o, jax.tree.leaves(x_t)))
        return (outs.hidden, outs.other), jax.tree.unflatten(graph.out_treedef, outs.y)

    step = jax.checkpoint(body, policy=RESIDUAL_POLICY, prevent_cse=False)
    (h_end, o_end), y = jax.lax.scan(step, (list(hidden), list(other)), (xw, rw))

    def loss(y_k, t_k, w_k):
        if rw is not None:
            t_k = ignore_masked_targets(t_k, w_k)
        return step_loss(ctx.loss_fn, y_k, t_k, w_k)

    weighted, losses = jax.vmap(loss)(y, yw, ww)
    total = jnp.sum(weighted)
    if ctx.rules.window is not None:
        total = total + ctx.rules.window.injected(params, h_end, t_end)
    return total, (losses, h_end, o_end)
