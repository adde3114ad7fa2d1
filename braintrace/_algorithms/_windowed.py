"""Windowed mode: exact reverse mode inside windows of ``k`` steps, traces carry credit across.

For a window starting at hidden state ``h_0`` with traces ``ε_0``:

.. math::

    \\nabla_\\theta L_w = \\mathrm{BPTT}_w(\\theta)
        + \\frac{\\partial L_w}{\\partial h_0} \\cdot \\epsilon_0

then the traces advance through the window step by step. With ``k = 1`` this
is the single-step rule of ``_scan.py``. Memory grows with ``k``, not with
the sequence length. With :class:`~braintrace.DNI` a synthesiser's prediction
is injected at every window's end and its training gradient added (``_dni.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._dni import DNI
from braintrace._algorithms._scan import ScanCarry, evolve_step, init_carry, param_gradients
from braintrace._compiler import ETraceGraph, StepLeaves
from braintrace._compiler import _programs as programs

__all__ = ["windowed_gradients"]


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
    """Gradients of ``Σ_t w_t L_t`` in windows of ``chunk_size`` steps (module docstring).

    Returns:
        ``(param_grads, final_carry, losses)``, as ``online_gradients``.
    """
    if not algorithm.supports_windowed:
        raise ValueError(
            f"{type(algorithm).__name__} with these settings is a single-step rule (e.g. "
            "EProp(feedback='random')); call etrace_grad without chunk_size.")
    length = weights.shape[0]
    split = lambda a: a.reshape(length // chunk_size, chunk_size, *a.shape[1:])
    operands = programs.operands(graph, params)
    carry = init_carry(graph, algorithm, params, hidden, other, traces)
    dni = algorithm if isinstance(algorithm, DNI) else None

    def advance(state, x_t):
        h, o, tr = state
        h, o, tr, _ = evolve_step(graph, algorithm, operands,
                                  StepLeaves(list(params), h, o, jax.tree.leaves(x_t)), tr)
        return (h, o, tr), None

    def window(carry, inputs):
        xw, yw, ww, t0 = inputs
        total, pullback, losses = jax.vjp(
            lambda p, h: _window_loss(graph, loss_fn, dni, p, h, carry.other, xw, yw, ww,
                                      t0 + chunk_size),
            list(params), list(carry.hidden), has_aux=True)
        g_params, g_hidden = pullback(jnp.ones_like(total))  # w_t may be wider than L_t
        if dni is not None:
            g_hidden, g_params = dni.correct(graph, params, carry.hidden, g_hidden, g_params, t0)
        term = algorithm.contribution(graph, carry.traces, g_hidden, operands)
        summed = jax.tree.map(jnp.add, carry.summed, term)
        same = [a + b.astype(a.dtype) for a, b in zip(carry.same_step, g_params)]
        (h, o, tr), _ = jax.lax.scan(advance, (carry.hidden, carry.other, carry.traces), xw)
        return carry._replace(hidden=h, other=o, traces=tr, summed=summed, same_step=same), losses

    starts = jnp.arange(length // chunk_size, dtype=jnp.int32) * chunk_size
    carry, losses = jax.lax.scan(window, carry, (*(jax.tree.map(split, a)
                                                   for a in (xs, ys, weights)), starts))
    return param_gradients(graph, algorithm, params, operands, carry), carry, losses.reshape(length)


def _window_loss(graph: ETraceGraph, loss_fn: Callable[[Any, Any], jax.Array],
                 dni: DNI | None, params, hidden, other, xw, yw, ww,
                 t_end) -> tuple[jax.Array, jax.Array]:
    """``(Σ_k w_k L_k [+ sg[ŝ(h_K)]·h_K with DNI], losses)`` of one window from ``hidden``."""
    def body(state, inputs):
        h, o = state
        outs, _ = programs.forward(graph, StepLeaves(params, h, o, jax.tree.leaves(inputs[0])))
        return (outs.hidden, outs.other), loss_fn(
            jax.tree.unflatten(graph.out_treedef, outs.y), inputs[1])

    (h_end, _), losses = jax.lax.scan(body, (list(hidden), list(other)), (xw, yw))
    total = jnp.sum(losses * ww)
    if dni is not None:
        total = total + dni.injected(graph, params, h_end, t_end)
    return total, losses
