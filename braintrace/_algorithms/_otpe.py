"""OTPE: online training with postsynaptic estimates (Summe, Schaefer & Joshi 2023).

In a feed-forward spiking network a weight ``θ`` of layer ``l`` reaches the
loss through its own neurons' membrane ``u_l`` and then through the neurons
that read their spikes ``s_l``: the next layer, or a leaky readout, whose
membrane integrates ``s_l`` over time. OSTL and OTTT keep that second path at
the current step only. OTPE (arXiv 2311.16151; its equations as the authors'
reference implementation computes them, their ``OTPE`` layer) adds a leaky
estimate of it:

.. math::

    E^t = D^t E^{t-1} + Df^t \\otimes x^t, \\qquad
    \\hat R^t = \\lambda \\hat R^{t-1} + \\frac{\\partial s^t}{\\partial \\theta}
              = \\lambda \\hat R^{t-1} + \\psi^t E^t, \\qquad
    \\nabla_\\theta L = \\sum_t \\frac{\\partial L_t}{\\partial s^t} \\cdot \\hat R^t,

with ``E`` the exact per-layer trace (OSTL's, D-RTRL's), ``ψ^t = ∂s^t/∂u^t``
the surrogate derivative and ``λ`` the postsynaptic leak: the reading layer's
membrane ``Σ_k λ^{t-k} W s^k`` is the leaky sum of the spikes' influence times
``W``, which the signal ``∂L_t/∂s^t`` (pulled back through ``W`` at step ``t``)
supplies.

In braintrace's terms, for a relation ``y = f(x, θ)`` feeding group ``g``, the
layer's spikes are the inputs ``x'_j`` of the operations that read ``g``'s new
state unit by unit (``braintrace._compiler.readers``: ``x'_j[v]`` depends on
``h_g^t[v]`` only; one per reading operation), ``ψ_j = ∂x'_j/∂h_g^t`` and
``g_j = ∂L_t/∂x'_j`` through that operation's read of ``x'_j`` alone (not through
another operation, a second reader or a direct path reading the same value: those
are in ``δ`` and not in ``g_j``, or they would be counted twice). With ``δ^t = ∂L_t/∂h_g^t`` (the new state's signal, which holds the
readers' path at step ``t``), per step

.. math::

    \\hat R_j^t = \\lambda \\hat R_j^{t-1} + \\sum_s \\psi_j^t[s]\\, E_s^t, \\qquad
    \\text{term}^t = \\sum_s \\Big(\\delta^t_s - \\sum_j \\psi^t_{j,s}\\, g^t_j\\Big) \\cdot E^t_s
        + \\sum_j g^t_j \\cdot \\hat R^t_j,

which is the paper's ``g·R̂`` where the spikes are the layer's only way to the
loss, and keeps any other path (a memoryless readout of the spikes, a direct term
of the output, a loss that reads the state) at OSTL's same-step credit. An elementwise operation (a learnable time constant)
keeps its D-RTRL trace ``E`` the same way. Memory ``O(B·|θ|·(S + readers))``:
D-RTRL's, plus one parameter-shaped ``R̂`` per reader.

Exact (equal to BPTT) where the postsynaptic estimate is the reading neurons'
real dynamics (``_otpe_exact``): a layer whose traces are exact, read through
position-by-position spikes by any number of operations, each feeding neurons
whose ``D`` is ``λ·I`` at every step, with a fixed ``Df``, that no further state
reads (one spiking layer under one or several ``LeakyReadout`` of leak ``λ``: the
classifiers of the paper), beside which any other path from the spikes to the
output (a memoryless readout, a direct term) is exact at its own step. With
several layers the estimate of each layer's effect stops at the next layer's
membrane (the paper's approximation); ``strict=True`` refuses that, and a reader
of another leak, and ``report()`` says which state stands in the way.

Where this differs from the authors' code: the spatial signal sent to lower
layers is the exact one of the step (the model's own surrogate derivative at
step ``t``), not their running average ``ḡ`` of it; ``λ`` is a hyperparameter,
as theirs (the layer's own leak there); and a path from the spikes to the loss
other than through a reader keeps its same-step credit, where their layer
sends every path through ``R̂``.

Time-blocked (``block_finish``): the per-step recursion regrouped over a block
of ``K`` steps, so that ``E`` and ``R̂`` are read and written once per block. With
``R̂_j`` entering the block and ``G_{m,j} = Σ_{k≥m} λ^{k-m} g_{k,j}``,

.. math::

    \\sum_k g_k \\cdot \\hat R_k = \\sum_k \\lambda^{k+1} g_k \\cdot \\hat R
        + \\sum_m G_m \\psi_m \\cdot E_m, \\qquad
    \\hat R_{K-1} = \\lambda^K \\hat R + \\sum_m \\lambda^{K-1-m} \\psi_m \\cdot E_m,

so the block's terms are D-RTRL's block with the signal
``u_m = δ_m + Σ_j (G_{m,j} - g_{m,j}) ψ_{m,j}`` read against the updated ``E_m``,
plus ``R̂``'s, and ``R̂`` advances by the same products of ``D`` with the signal
``λ^{K-1-m} ψ_m``, per sample (``_block_algebra``). No windowed mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm, BlockSteps, RelationRule
from braintrace._algorithms._block_algebra import block_coefficients, decay_weights, decayed_sums
from braintrace._algorithms._d_rtrl import DRTRL_ELEMENTWISE, DRTRL_INPUT, contract_y
from braintrace._algorithms._fast_signal import after_update_block
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._otpe_exact import otpe_exact, otpe_obstacles
from braintrace._algorithms._ottt import check_decay
from braintrace._algorithms._signals import NEW_STATE_SIGNAL
from braintrace._algorithms._trace_algebra import group_signal, per_sample, tree_sum
from braintrace._compiler import (
    Approximation,
    ElementwiseRelation,
    ETraceGraph,
    InputRelation,
    Relation,
    reader_list,
    readers,
)

__all__ = ["OTPE", "PostsynapticTrace", "otpe_exact"]


class PostsynapticTrace(NamedTuple):
    """OTPE's state of one relation.

    Attributes:
        eps: D-RTRL's trace ``E`` (its rule's state).
        post: Per reader of the relation's group, ``R̂_j`` (shaped like one state of ``E``).
        psi: Per reader, this step's ``ψ_j`` ``(*V, S)``.
        x: This step's input ``x^t`` (``None`` for an elementwise operation).
        df: This step's ``Df^t``.
    """

    eps: Any
    post: tuple[Any, ...]
    psi: tuple[jax.Array, ...]
    x: jax.Array | None
    df: jax.Array


def _without_readers(signal: jax.Array, psi: Sequence[jax.Array],
                     g: Sequence[jax.Array]) -> jax.Array:
    """``δ_s - Σ_j ψ_{j,s} g_j``: the new state's signal by every path but the readers'."""
    return signal - sum((p * gj[..., None].astype(p.dtype) for p, gj in zip(psi, g)),
                        jnp.zeros_like(signal))


def _immediate(signal: jax.Array, df: jax.Array, dy: jax.Array | None, at_y) -> jax.Array:
    """``dy - Σ_s Df_s δ_s`` at ``y``'s units: the step's own share as the reverse pass has it
    (``dy``; ``None``: an earlier relation of the same equation counts it) in place of the one
    the trace holds, ``Df ⊗ x`` read through ``δ``."""
    held = at_y(jnp.sum(signal * df.astype(signal.dtype), axis=-1))
    return -held if dy is None else dy.astype(held.dtype) - held


def _reader_signals(decay: float, g: Sequence[jax.Array], psi: Sequence[jax.Array],
                    own: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """A block's readers' share of its terms (module docstring): per reader the signal
    ``Σ_k λ^{k+1} g_k`` read against the ``R̂`` entering the block, and the signal on each
    updated ``E_m``, ``u_m = δ_m + λ Σ_j ψ_{m,j} Σ_{k>m} λ^{k-1-m} g_{k,j}`` ``(K, *V, S)``."""
    entering, u = [], own
    for gj, pj in zip(g, psi):
        total, later = decayed_sums(gj, decay)
        entering.append(decay * total)
        u = u + decay * pj.astype(u.dtype) * later[..., None].astype(u.dtype)
    return entering, u


def _read_coefficients(decay: float, psi: jax.Array, d: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """``Σ_m λ^{K-1-m} ψ_m·E_m`` over a block, per sample, as ``β_{-1}·E + Σ_j (β_j·Df_j) ⊗
    x_j`` with ``E`` the trace entering it: ``(β_{-1}, β)``, ``(*V, S)`` and ``(K, *V, S)``
    (``_block_algebra`` with ``u_m = v_m D_m``, ``v_m = λ^{K-1-m} ψ_m``, ``β_j`` plus ``v_j``:
    the signal reads the updated trace)."""
    _, powers = decay_weights(decay, psi.shape[0], psi.dtype)
    v = powers[::-1].reshape(-1, *(1,) * (psi.ndim - 1)) * psi
    beta, _, beta_start, _ = block_coefficients(
        jnp.einsum("k...s,k...st->k...t", v, d.astype(v.dtype)), d)
    return beta_start, beta + v


def _last_reads(reads: Sequence[jax.Array], psi: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """The block's last ``ψ_j``, as the state holds them."""
    return tuple(p[-1].astype(q.dtype) for p, q in zip(reads, psi))


def _input_rule(decay: float) -> RelationRule:
    """OTPE on an operation with an input: D-RTRL's ``E`` and a parameter-shaped ``R̂_j``."""

    def init(graph: ETraceGraph, r: InputRelation, theta) -> PostsynapticTrace:
        eps = DRTRL_INPUT.init(graph, r, theta)
        g = graph.groups[r.group]
        count = len(readers(graph)[r.group])
        psi = jnp.zeros((*g.shape, g.num_states), g.dtype)
        return PostsynapticTrace(eps, (eps[0],) * count, (psi,) * count,
                                 jnp.zeros(r.x_shape, g.dtype),
                                 jnp.zeros((*r.y_shape, g.num_states), g.dtype))

    def update(r: InputRelation, s: PostsynapticTrace, d_reads, df, x, theta):
        """``E = D E + Df ⊗ x``, ``R̂_j = λ R̂_j + Σ_s ψ_{j,s} E_s``."""
        d_g, reads = d_reads
        eps = DRTRL_INPUT.update(r, s.eps, d_g, df, x, theta)
        dt_to_t = r.primitive.rule("dt_to_t")
        scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
        post = []
        for old, psi in zip(s.post, reads):
            psi_y = r.gather_hidden(psi.astype(jax.tree.leaves(old)[0].dtype))
            new = tree_sum([scale(psi_y[..., k], e) for k, e in enumerate(eps)])
            post.append(jax.tree.map(lambda o, n: (decay * o + n).astype(o.dtype), old, new))
        return PostsynapticTrace(eps, tuple(post), tuple(reads), x.astype(s.x.dtype),
                                 df.astype(s.df.dtype))

    def contribution(r: InputRelation, s: PostsynapticTrace, signal, theta):
        own, g, dy = signal
        rest = r.gather_hidden(_without_readers(own, s.psi, g))
        terms = [contract_y(r, s.eps, rest)]
        terms += [contract_y(r, (post,), r.gather_hidden(gj[..., None]))
                  for post, gj in zip(s.post, g)]
        fix = _immediate(r.gather_hidden(own), s.df, dy, lambda a: a)
        xy_to_trace = r.primitive.rules.resolved("xy_to_trace")  # in E's terms, as D-RTRL's
        terms.append(xy_to_trace(s.x, fix, theta, **r.params))
        return tree_sum(terms)

    traces_block = after_update_block(DRTRL_INPUT.block_finish)

    def block_finish(r: InputRelation, s: PostsynapticTrace, steps: BlockSteps, theta):
        """``K`` rounds of ``update`` then ``contribution`` (module docstring)."""
        (own, g, dy), (d_g, reads), df, x = steps.signal, steps.d, steps.df, steps.x
        entering, u = _reader_signals(decay, g, reads, own)
        fix = jax.vmap(lambda o, f, d: _immediate(r.gather_hidden(o), f, d, lambda a: a))(
            own, df, dy)
        eps, term = traces_block(r, s.eps, BlockSteps(u, d_g, df, x, fix), theta)
        terms = [term] + [contract_y(r, (post,), r.gather_hidden(c[..., None]))
                          for post, c in zip(s.post, entering)]
        dt_to_t = r.primitive.rule("dt_to_t")
        scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
        xy_to_trace = r.primitive.rules.resolved("xy_to_trace")
        outer = lambda x, f: xy_to_trace(x, f, theta, **r.params)  # steps summed
        over_steps = jax.vmap(outer, in_axes=(1, 1)) if r.batched else outer
        post, kept = [], decay ** len(df)  # λ^K
        for old, psi in zip(s.post, reads):
            start, beta = _read_coefficients(decay, psi, d_g)
            start = r.gather_hidden(start, feeds_large=True)
            a = jnp.sum(jax.vmap(r.gather_hidden)(beta) * df.astype(beta.dtype), axis=-1)
            new = tree_sum([scale(start[..., k], e) for k, e in enumerate(s.eps)]
                           + [over_steps(x, a)])
            post.append(jax.tree.map(lambda o, n: (kept * o + n).astype(o.dtype), old, new))
        last = PostsynapticTrace(eps, tuple(post), _last_reads(reads, s.psi),
                                 x[-1].astype(s.x.dtype), df[-1].astype(s.df.dtype))
        return last, tree_sum(terms)

    return RelationRule(init=init, update=update, contribution=contribution,
                        finalize=DRTRL_INPUT.finalize, rules=DRTRL_INPUT.rules,
                        block_finish=block_finish)


def _elementwise_rule(decay: float) -> RelationRule:
    """OTPE on the elementwise primitive: its D-RTRL trace ``E`` ``(*V, S)`` and ``R̂_j``
    ``(*V,)``."""

    def init(graph: ETraceGraph, r: ElementwiseRelation, theta) -> PostsynapticTrace:
        eps = DRTRL_ELEMENTWISE.init(graph, r, theta)
        g = graph.groups[r.group]
        count = len(readers(graph)[r.group])
        trace = eps["weight"]
        psi = jnp.zeros((*g.shape, g.num_states), g.dtype)
        return PostsynapticTrace(eps, (trace[..., 0],) * count, (psi,) * count, None,
                                 jnp.zeros((*g.shape, g.num_states), g.dtype))

    def update(r: ElementwiseRelation, s: PostsynapticTrace, d_reads, df, x, theta):
        d_g, reads = d_reads
        eps = DRTRL_ELEMENTWISE.update(r, s.eps, d_g, df, x, theta)
        post = tuple((decay * old + jnp.sum(psi.astype(old.dtype) * eps["weight"], axis=-1)
                      ).astype(old.dtype) for old, psi in zip(s.post, reads))
        return PostsynapticTrace(eps, post, tuple(reads), None, df.astype(s.df.dtype))

    def contribution(r: ElementwiseRelation, s: PostsynapticTrace, signal, theta):
        del theta
        own, g, dy = signal
        rest = _without_readers(own, s.psi, g)
        total = jnp.sum(rest * s.eps["weight"], axis=-1)
        total = total + sum((gj * post for gj, post in zip(g, s.post)), jnp.zeros_like(total))
        return r.scatter_to_y(total) + _immediate(own, s.df, dy, r.scatter_to_y)

    traces_block = after_update_block(DRTRL_ELEMENTWISE.block_finish)

    def block_finish(r: ElementwiseRelation, s: PostsynapticTrace, steps: BlockSteps, theta):
        """``K`` rounds of ``update`` then ``contribution`` (module docstring, ``x = 1``)."""
        (own, g, dy), (d_g, reads) = steps.signal, steps.d
        df = steps.df.astype(own.dtype)
        entering, u = _reader_signals(decay, g, reads, own)
        fix = jax.vmap(lambda o, f, d: _immediate(o, f, d, r.scatter_to_y))(own, df, dy)
        eps, term = traces_block(r, s.eps, BlockSteps(u, d_g, df, None, fix), theta)
        term = term + r.scatter_to_y(sum((c * post for c, post in zip(entering, s.post)),
                                         jnp.zeros(own.shape[1:-1], own.dtype)))
        post = []
        for old, psi in zip(s.post, reads):
            start, beta = _read_coefficients(decay, psi, d_g)
            new = jnp.sum(start * s.eps["weight"], axis=-1) + jnp.sum(beta * df, axis=(0, -1))
            post.append((decay ** len(df) * old + new).astype(old.dtype))
        last = PostsynapticTrace(eps, tuple(post), _last_reads(reads, s.psi), None,
                                 df[-1].astype(s.df.dtype))
        return last, term

    return RelationRule(init=init, update=update, contribution=contribution,
                        finalize=DRTRL_ELEMENTWISE.finalize, rules=DRTRL_ELEMENTWISE.rules,
                        block_finish=block_finish)


class OTPE(AbstractAlgorithm):
    """Online training with postsynaptic estimates: D-RTRL's traces and a leaky estimate
    of their effect on the neurons that read them.

    .. math::

        \\hat R^t = \\lambda \\hat R^{t-1} + \\psi^t E^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\frac{\\partial L_t}{\\partial s^t}\\cdot\\hat R^t

    (module docstring). Exact where a layer is read only by neurons whose leak
    is ``decay`` and that nothing further reads (one spiking layer under one or
    several leaky readouts of that leak, with memoryless readouts or direct paths
    to the output beside them); ``strict=True`` checks it, ``report()`` names
    the Params it approximates elsewhere and the state that stands in the way. Single-step (no ``chunk_size``); per step or
    time-blocked (``block_size``, by default blocks of up to 32 steps), with
    the same gradients.

    Args:
        decay: ``λ``, the leak of the reading neurons' membrane in ``[0, 1)``
            (``exp(-dt/τ)`` of the readout or the next layer).

    Example:
        >>> import math
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4),
        ...                        layers.LeakyReadout(4, 2, tau=10.0, rngs=nnx.Rngs(1)))
        >>> learner = braintrace.compile(model, braintrace.OTPE(decay=math.exp(-0.1)),
        ...                              jnp.ones(3), strict=True)  # exact on this model
        >>> grads = learner.etrace_grad(jnp.ones((5, 3)), jnp.zeros((5, 2)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    name = "otpe"
    supports_windowed = False

    def __init__(self, decay: float = 0.9):
        self.decay = check_decay("OTPE", decay)
        self._rules = {InputRelation: _input_rule(self.decay),
                       ElementwiseRelation: _elementwise_rule(self.decay)}

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(self._rules[type(r)] for r in graph.relations)

    def relation_signal(self, graph: ETraceGraph, delta: Sequence[jax.Array],
                        relation: Relation) -> tuple[Any, ...]:
        """``(δ_g, (g_j, ...), dy)``: the group's new-state signal, its readers' input
        cotangents and the relation's output cotangent, which the loops append after the
        hidden leaves' (``GraphRules.readers``)."""
        hidden = graph.num_hidden
        listed = reader_list(readers(graph))
        own = group_signal(graph, delta[:hidden], relation.group)
        reads = tuple(delta[hidden + k] for k, (g, _) in enumerate(listed)
                      if g == relation.group)
        return own, reads, delta[hidden + len(listed) + relation.index]

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """The bound rules: the new state's signal, the groups' readers."""
        return dataclasses.replace(super().rules(graph), learning_signal=NEW_STATE_SIGNAL,
                                   readers=readers(graph))

    def graph_approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The graph's, but where OTPE is exact (:func:`otpe_exact`): the feed-forward
        coupling into the reading neurons is then what its estimate follows exactly."""
        return () if otpe_exact(graph, self.decay) else graph.approximations

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """Every traced operation that carries credit, unless OTPE is exact on ``graph``
        (:func:`otpe_exact`).

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4),
            ...                        layers.LeakyReadout(4, 2, tau=10.0, rngs=nnx.Rngs(1)))
            >>> graph = braintrace.compile_graph(model, jnp.ones(3))
            >>> [a.kind for a in braintrace.OTPE(0.5).approximations(graph)]
            ['postsynaptic-estimate']
        """
        obstacles = otpe_obstacles(graph, self.decay)
        if not obstacles:
            return ()
        return algorithm_approximation(
            graph, graph.relations, kind="postsynaptic-estimate",
            label=f"OTPE(decay={self.decay:g})",
            what=("keeps the exact per-layer traces and estimates their effect on the neurons "
                  f"that read them as a leak of {self.decay:g} for"),
            detail=("R̂ = λ R̂ + ψ E stands for the reading neurons' membrane; here "
                    + "; ".join(obstacles)),
            remedy=(f"here {'; '.join(obstacles)}. It is exact where a layer's spikes are read "
                    "only by neurons that leak by decay at every step and that nothing further "
                    "reads (any number of leaky readouts of that leak, beside memoryless "
                    "readouts and direct paths to the output); RTRL() is exact at "
                    "O(B·N²·|θ|) cost per step"))
