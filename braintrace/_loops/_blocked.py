"""The time-blocked loop: the traces touched once per block of ``K`` steps.

Per step only the model, its same-step gradient, the learning signal, the
Jacobians and the rules' ``block_step`` (a short recursion such as ES-D-RTRL's
``ε_f``) run; per block, every relation's ``block_finish`` advances its trace
``K`` steps at once with matrix products and adds the block's gradient terms
(the equations: ``braintrace/_algorithms/_block_algebra.py``). So the large
trace is read and written once per block instead of every step; the extra
buffers hold ``K`` steps of ``O(B·(I + O·S²))`` values. It is the per-step
recursion regrouped: the same gradients.

:func:`run_blocked` runs a sequence block by block (a shorter last block when
``K`` does not divide ``T``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithms import BlockSteps, GraphRules
from braintrace._arguments import call_loss
from braintrace._compiler import programs
from braintrace._loops._context import LoopContext
from braintrace._loops._groups import scan_grouped
from braintrace._loops._masks import ignore_masked
from braintrace._loops._per_step import ScanCarry, keep_dtype
from braintrace._loops._step import add_same_step, probed_loss_terms, step_jacobians, step_leaves

__all__ = ["run_blocked", "stacked_bytes_per_step"]


def stacked_bytes_per_step(rules: GraphRules) -> int:
    """What one step adds to a block's stacked buffers, in bytes, from the graph's shapes.

    :func:`run_blocked` stacks per step and relation the input ``x`` and the same-step share
    ``dy`` (``y``-shaped; none with a signal that reads the new state, the fast signal,
    whose relations' share is in their updated traces); for a relation with a ``block_step``
    its output (counted as one ``y``-shaped value, ES-D-RTRL's output factor ``d``), for the
    others the learning signal (every group's states ``V·S``) and the Jacobians ``D``
    (``V·S²`` per group) and ``Df`` (``y·S`` per relation). A relation that shares its
    leader's output (``GraphRules.leaders``) stacks no ``dy`` and no output. Each counted in
    its hidden group's dtype; batch axes included. Rules that read the groups' readers
    (``GraphRules.readers``) also stack each reader's ``ψ`` and input cotangent and each
    relation's output cotangent.

    Example:
        >>> import braintrace, jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> from braintrace._loops._blocked import stacked_bytes_per_step
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'es_d_rtrl', jnp.ones((3,)))
        >>> stacked_bytes_per_step(learner.rules)  # x (3) + dy (4) + d (4), float32
        44
    """
    graph = rules.graph
    groups = graph.groups
    size = lambda shape: int(np.prod(shape, dtype=np.int64))
    itemsize = lambda g: np.dtype(g.dtype).itemsize
    stacks_dy = not rules.learning_signal.reads_new_state  # probed_loss_terms' dy
    total = 0
    for i, (r, rule) in enumerate(zip(rules.relations, rules.relation_rules)):
        g = groups[r.group]
        x = size(r.x_shape) if r.has_input else 0
        y = size(r.y_shape)
        shared = rules.leader(i) is not None  # its d and dy are its leader's
        if rule.block_step is None:
            extra = y * g.num_states if rules.reads_jacobians and not shared else 0  # Df
        else:  # d
            extra = 0 if shared else y
        total += (x + (y if stacks_dy and not shared else 0) + extra) * itemsize(g)
    if rules.reads_stacked_steps:  # the signal and D (D: when a rule reads it)
        states = lambda g: g.num_states + (g.num_states ** 2 if rules.reads_jacobians else 0)
        total += sum(g.size * states(g) * itemsize(g) for g in groups)
    if rules.readers:  # per reader ψ (V·S) and its input cotangent (V); each output's cotangent
        total += sum(len(rs) * g.size * (g.num_states + 1) * itemsize(g)
                     for g, rs in zip(groups, rules.readers))
        total += sum(size(r.y_shape) * itemsize(groups[r.group]) for r in rules.relations)
    return total


def _relation_steps(rules: GraphRules, signal: Any, d: Any, df: Any, reads: Any, rel_x: Any,
                    dy: Any, stepped: Any, outs: Any) -> list[BlockSteps]:
    """Each relation's view of the block's stacked steps (``d``: with readers, the pair
    ``(D_g, reads_g)``, as ``GraphRules.update`` hands it)."""
    views = []
    for i, (r, rule) in enumerate(zip(rules.relations, rules.relation_rules)):
        if rule.block_step is None:
            rel_signal = jax.vmap(lambda delta, r=r: rules.signal(delta, r))(signal)
            d_g = (d[r.group], reads[r.group]) if rules.readers else d[r.group]
            views.append(BlockSteps(rel_signal, d_g, rules.df(df, r.index), rel_x[i], dy[i]))
        else:
            views.append(BlockSteps(None, None, None, rel_x[i], dy[i], stepped[i], outs[i]))
    return views


def _run_block(ctx: LoopContext, carry: ScanCarry, inputs: Any) -> tuple[ScanCarry, jax.Array]:
    """The steps of one block (model, same-step gradient, signal, Jacobians, and the
    rules' ``block_step``), then every relation's ``block_finish``.

    Where the Jacobians pick among colours (fused gates) and no ``block_step`` needs them
    each step, the steps stack the raw Jacobian responses and ``D``, ``Df`` are arranged
    once for the block (``programs.arranges_colours``).
    """
    rules, graph = ctx.rules, ctx.graph
    hooked = [rule.block_step is not None for rule in rules.relation_rules]
    stack_steps = rules.reads_stacked_steps
    deferred = (not any(hooked) and rules.reads_jacobians and rules.scope == "diagonal"
                and not rules.readers and programs.arranges_colours(graph))
    new_state = rules.learning_signal.reads_new_state  # the rules' blocks take δ^t then
    unread = rules.unread_df

    def step(state, step_inputs):
        hidden, other, same, stepped = state
        x_t, y_t, w_t, reaches_t = step_inputs
        x_t, y_t = ignore_masked(x_t, y_t, w_t, reaches_t)  # what a mask ignores is never read
        leaves = step_leaves(ctx, hidden, other, x_t)
        terms = probed_loss_terms(ctx, leaves, y_t, w_t, new_state=new_state)
        jac = None if deferred else step_jacobians(rules, leaves)
        outs = None
        if any(hooked):
            stepped, outs = rules.block_step(stepped, terms.signal, jac)
        if not stack_steps:
            signal, stacked_jac = [], ([], [])
        elif deferred:
            signal, stacked_jac = terms.signal, programs.jacobian_responses(graph, leaves,
                                                                            unread)
        else:
            signal, stacked_jac = terms.signal, (list(jac.d), list(jac.df))
        reads = list(jac.reads) if stack_steps and rules.readers else []  # not deferred then
        stacked = (signal, stacked_jac, reads, terms.rel_x, rules.unshared(terms.dy), outs)
        new = (terms.hidden, terms.other, add_same_step(same, terms.same_step_rest), stepped)
        return jax.tree.map(keep_dtype, new, state), (stacked, terms.loss)

    # only the block_step relations' states go through the steps
    start = (list(carry.hidden), list(carry.other), list(carry.same_step),
             [s if h else None for s, h in zip(carry.traces, hooked)])
    # the output side's stacks (dy, and a block_step's outputs) are read sample by sample
    output_side = ((False,) * 4 + (True, True), False)
    (hidden, other, same, stepped), ((signal, jac, reads, rel_x, dy, outs), losses) = (
        scan_grouped(step, start, inputs, steps_second=output_side))
    if deferred:  # the block's responses, arranged for all its steps at once
        jac = jax.vmap(lambda responses: programs.assemble_jacobians(graph, responses,
                                                                     unread))(jac)
    views = _relation_steps(rules, signal, list(jac[0]), list(jac[1]), reads, rel_x, dy,
                            stepped, outs if any(hooked) else [None] * len(hooked))
    traces, term = rules.block_finish(carry.traces, views, ctx.operands)
    summed = jax.tree.map(jnp.add, carry.summed, term)
    return carry._replace(hidden=hidden, other=other, traces=traces, summed=summed,
                          same_step=same).typed_as(carry), losses


def _loss_dtype(ctx: LoopContext, carry: ScanCarry, xs: Any, ys: Any) -> Any:
    """The dtype of ``loss_fn`` on the first step (one forward pass, traced for shapes only)."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)

    def loss():
        leaves = step_leaves(ctx, carry.hidden, carry.other, first(xs))
        outs, _ = programs.forward(ctx.graph, leaves, ctx.rules.feedback)
        return call_loss(ctx.loss_fn, jax.tree.unflatten(ctx.graph.out_treedef, outs.y),
                         first(ys))

    return jax.eval_shape(loss).dtype


def run_blocked(ctx: LoopContext, carry: ScanCarry, xs: Any, ys: Any, weights: jax.Array,
                block_size: int, *, reaches: jax.Array | None = None
                ) -> tuple[ScanCarry, jax.Array]:
    """Runs ``Σ_t w_t L_t``'s online loop in blocks of ``block_size`` steps.

    ``reaches``: as :func:`braintrace._loops.run` (each step cleans its own inputs).

    ``carry`` must have nothing pending (a fresh or finished carry); so has
    the carry returned. Returns it and each step's loss ``(T,)``.
    """
    length = weights.shape[0]
    blocks, rest = divmod(length, block_size)
    # Each block reads its steps in place and writes its losses into one (T,) buffer:
    # slicing the sequence to whole blocks, or concatenating the losses, would copy
    # memory that grows with T.
    losses = jnp.zeros((length,), _loss_dtype(ctx, carry, xs, ys))

    def block_at(state, start):
        c, out = state
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, block_size)
        c, block_losses = _run_block(ctx, c, jax.tree.map(take, (xs, ys, weights, reaches)))
        return (c, jax.lax.dynamic_update_slice_in_dim(out, block_losses.astype(out.dtype),
                                                       start, 0)), None

    if blocks:
        starts = jnp.arange(blocks, dtype=jnp.int32) * block_size
        (carry, losses), _ = jax.lax.scan(block_at, (carry, losses), starts)
    if rest:  # a shorter last block: its buffers (T mod K steps) add to the blocks' ones;
        #          per step it would cost up to K - 1 slow steps per call
        carry, tail_losses = _run_block(ctx, carry, jax.tree.map(lambda a: a[length - rest:],
                                                                 (xs, ys, weights, reaches)))
        losses = jax.lax.dynamic_update_slice_in_dim(losses, tail_losses.astype(losses.dtype),
                                                     length - rest, 0)  # not a scatter
    return carry, losses
