"""Time-blocked online learning: the traces touched once per block of ``K`` steps.

A trace that follows ``ε_k = d_k ε_{k-1} + f_k ⊗ x_k`` (per unit, ``d_k`` an
``S×S`` matrix, ``f_k`` an ``S``-vector, ``⊗`` the primitive's instantaneous
term) and is read as ``Σ_k u_kᵀ ε_{k-1}`` (``u_k = δ̄^k``, the step's learning
signal) can take ``K`` steps at once. With ``L(a, j) = d_a d_{a-1} ⋯ d_{j+1}``
(the identity when ``a = j``) and ``ε_{-1}`` the trace entering the block:

.. math::

    \\sum_{k=0}^{K-1} u_k^\\top \\epsilon_{k-1}
        = \\beta_{-1}^\\top \\epsilon_{-1} + \\sum_j (\\beta_j^\\top f_j) \\otimes x_j,
    \\qquad \\beta_j^\\top = \\sum_{k>j} u_k^\\top L(k-1, j)

    \\epsilon_{K-1} = \\Lambda_{-1} \\epsilon_{-1} + \\sum_j (\\Lambda_j f_j) \\otimes x_j,
    \\qquad \\Lambda_j = L(K-1, j)

Both coefficients follow from one backward recursion over the block,
``β_{j-1} = u_j + β_jᵀ d_j`` and ``Λ_{j-1} = Λ_j d_j`` from ``β_{K-1} = 0``,
``Λ_{K-1} = I`` (products only, never a division). The sums over ``j`` are
the primitive's instantaneous term with the leading (step, sample) axes
summed: for a dense weight one matrix product ``Xᵀ A``. So the large trace is
read and written once per block instead of every step, and the outer
products become matrix products; the extra buffers hold ``K`` steps of
``O(B·(I + O·S²))`` values. Exact: it is the per-step recursion regrouped, for
every primitive whose ``dt_to_t`` scales along the output units (the
primitive contract), so ``dt_to_t(a, dt_to_t(b, ε)) = dt_to_t(a·b, ε)`` and
``dt_to_t(a, x ⊗ f) = x ⊗ (a·f)``.

:func:`blocked_run` runs a sequence block by block (a shorter last block
when ``K`` does not divide ``T``): per step only the model, its same-step
gradient, the learning signal, the Jacobians and the algorithm's ``block_step``
(a short recursion such as ES-D-RTRL's ``ε_f``); per block the algorithm's
``block`` rule.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm, BlockSteps
from braintrace._algorithms._scan import ScanCarry, add_same_step, step_terms
from braintrace._compiler import ETraceGraph, StepLeaves
from braintrace._compiler import _programs as programs

__all__ = ["DEFAULT_BLOCK_SIZE", "block_coefficients", "blocked_run", "resolve_block_size"]

DEFAULT_BLOCK_SIZE = 32
"""Steps per block when ``etrace_grad`` is not given ``block_size``."""


def block_coefficients(u: jax.Array, d: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``β_j``, ``Λ_j`` for the steps of a block, and ``β_{-1}``, ``Λ_{-1}`` (module docstring).

    Args:
        u: Learning signals ``(K, *units, S)``.
        d: Per-unit Jacobians ``(K, *units, S, S)``.

    Returns:
        ``(beta, lam, beta_start, lam_start)`` of shapes ``(K, *units, S)``,
        ``(K, *units, S, S)``, ``(*units, S)``, ``(*units, S, S)``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._blocked import block_coefficients
        >>> u = jnp.ones((3, 1, 1))            # three steps, one unit, S = 1
        >>> d = jnp.full((3, 1, 1, 1), 0.5)
        >>> beta, lam, beta0, lam0 = block_coefficients(u, d)
        >>> beta[:, 0, 0].tolist(), float(beta0[0, 0]), float(lam0[0, 0, 0])
        ([1.5, 1.0, 0.0], 1.75, 0.125)
    """
    eye = jnp.broadcast_to(jnp.eye(d.shape[-1], dtype=d.dtype), d.shape[1:])

    def back(carry, step):
        beta, lam = carry
        u_j, d_j = step
        new = (u_j + jnp.einsum("...s,...st->...t", beta, d_j),
               jnp.einsum("...rs,...st->...rt", lam, d_j))
        return new, (beta, lam)

    start = (jnp.zeros(u.shape[1:], jnp.result_type(u, d)), eye)
    (beta0, lam0), (beta, lam) = jax.lax.scan(back, start, (u, d), reverse=True)
    return beta, lam, beta0, lam0


def resolve_block_size(algorithm: AbstractAlgorithm, graph: ETraceGraph,
                       block_size: int | None) -> int:
    """The ``K`` a call runs with: the default where the algorithm has blocked rules, else 1.

    Raises:
        ValueError: ``block_size`` is not a positive int, or is above 1 for an
            algorithm without a blocked form.
    """
    blocks = algorithm.supports_blocks(graph)
    if block_size is None:
        return DEFAULT_BLOCK_SIZE if blocks else 1
    if (isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral)
            or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
    block_size = int(block_size)
    if block_size > 1 and not blocks:
        raise ValueError(
            f"Algorithm '{algorithm.name or type(algorithm).__name__}' has no time-blocked form "
            "for this model; pass block_size=1 (or leave it unset).")
    return block_size


def _run_block(graph: ETraceGraph, algorithm: AbstractAlgorithm, loss_fn: Callable,
               params: Sequence[jax.Array], operands: Sequence[dict[str, jax.Array]],
               carry: ScanCarry, inputs: Any) -> tuple[ScanCarry, jax.Array]:
    """The steps of one block (model, same-step gradient, signal, Jacobians, and the
    algorithm's ``block_step``), then its rule.

    Where the Jacobians pick among colours (fused gates) and no ``block_step`` needs them
    each step, the steps stack the raw Jacobian responses and ``D``, ``Df`` are arranged
    once for the block (``programs.arranges_colours``).
    """
    hooked = [algorithm.relation_rule(r).block_step is not None for r in graph.relations]
    stack_steps = not all(hooked)  # some rule reads the block's stacked signals and Jacobians
    deferred = (not any(hooked) and algorithm.scope == "diagonal"
                and programs.arranges_colours(graph))

    def step(state, step_inputs):
        hidden, other, same, stepped = state
        x_t, y_t, w_t = step_inputs
        leaves = StepLeaves(list(params), list(hidden), list(other), jax.tree.leaves(x_t))
        terms = step_terms(graph, algorithm, loss_fn, leaves, y_t, w_t, probe_outputs=True,
                           defer_jacobians=deferred)
        outs = None
        if any(hooked):
            stepped, outs = algorithm.block_step(graph, stepped, terms.signal, terms.jac)
        if not stack_steps:
            signal, jac = [], ([], [])
        else:
            signal = terms.signal
            jac = terms.responses if deferred else (list(terms.jac.d), list(terms.jac.df))
        stacked = (signal, jac, terms.rel_x, terms.dy, outs)
        return (terms.hidden, terms.other, add_same_step(same, terms.same_step),
                stepped), (stacked, terms.loss)

    # only the block_step relations' states go through the steps
    start = (list(carry.hidden), list(carry.other), list(carry.same_step),
             [s if h else None for s, h in zip(carry.traces, hooked)])
    (hidden, other, same, stepped), ((signal, jac, rel_x, dy, outs), losses) = jax.lax.scan(
        step, start, inputs)
    if deferred:  # the block's responses, arranged for all its steps at once
        jac = jax.vmap(lambda responses: programs.assemble_jacobians(graph, responses))(jac)
    steps = BlockSteps(signal, list(jac[0]), list(jac[1]), rel_x, dy)
    traces, term = algorithm.block(graph, carry.traces, steps, operands,
                                   stepped=(stepped, outs) if any(hooked) else None)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    return carry._replace(hidden=hidden, other=other, traces=traces, summed=summed,
                          same_step=same), losses


def _loss_dtype(graph: ETraceGraph, algorithm: AbstractAlgorithm, loss_fn: Callable,
                params: Sequence[jax.Array], carry: ScanCarry, xs: Any, ys: Any) -> Any:
    """The dtype of ``loss_fn`` on the first step (one forward pass, traced for shapes only)."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)

    def loss():
        leaves = StepLeaves(list(params), list(carry.hidden), list(carry.other),
                            jax.tree.leaves(first(xs)))
        outs, _ = programs.forward(graph, leaves, algorithm.feedback_operands(graph))
        return loss_fn(jax.tree.unflatten(graph.out_treedef, outs.y), first(ys))

    return jax.eval_shape(loss).dtype


def blocked_run(graph: ETraceGraph, algorithm: AbstractAlgorithm, loss_fn: Callable,
                params: Sequence[jax.Array], operands: Sequence[dict[str, jax.Array]],
                carry: ScanCarry, xs: Any, ys: Any, weights: jax.Array,
                block_size: int) -> tuple[ScanCarry, jax.Array]:
    """Runs ``Σ_t w_t L_t``'s online loop in blocks of ``block_size`` steps.

    ``carry`` must have nothing pending (a fresh or finished carry); so has
    the carry returned. Returns it and each step's loss ``(T,)``.
    """
    length = weights.shape[0]
    blocks, rest = divmod(length, block_size)
    run = lambda c, inputs: _run_block(graph, algorithm, loss_fn, params, operands, c,
                                       inputs)
    # Each block reads its steps in place and writes its losses into one (T,) buffer:
    # slicing the sequence to whole blocks, or concatenating the losses, would copy
    # memory that grows with T.
    losses = jnp.zeros((length,), _loss_dtype(graph, algorithm, loss_fn, params, carry, xs, ys))

    def block_at(state, start):
        c, out = state
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, block_size)
        c, block_losses = run(c, jax.tree.map(take, (xs, ys, weights)))
        return (c, jax.lax.dynamic_update_slice_in_dim(out, block_losses.astype(out.dtype),
                                                       start, 0)), None

    if blocks:
        starts = jnp.arange(blocks, dtype=jnp.int32) * block_size
        (carry, losses), _ = jax.lax.scan(block_at, (carry, losses), starts)
    if rest:  # a shorter last block: its buffers (T mod K steps) add to the blocks' ones;
        #          per step it would cost up to K - 1 slow steps per call
        carry, tail_losses = run(carry, jax.tree.map(lambda a: a[length - rest:],
                                                     (xs, ys, weights)))
        losses = losses.at[length - rest:].set(tail_losses.astype(losses.dtype))
    return carry, losses
