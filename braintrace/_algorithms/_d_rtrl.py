"""D-RTRL: parameter-dimension eligibility traces (diagonal RTRL).

For a relation ``y = f(x, θ)`` feeding hidden group ``g`` with ``S`` states
per unit, the trace of every trainable input follows

.. math::

    \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t

where ``D^t = ∂h^t/∂h^{t-1}`` ``(S×S`` per unit) and ``Df^t = ∂h^t/∂y^t``,
applied through the primitive's ``dt_to_t`` (``D ε``) and ``xy_to_dw`` (the
outer product) rules, per sample. The gradient is

.. math::

    \\nabla_\\theta L = \\sum_t \\sum_{b} \\sum_{s} \\delta^t_{b,\\cdot,s} \\cdot \\epsilon^t_{b,\\dots,s},
    \\qquad \\delta^t = \\partial L_t / \\partial h^t.

It equals BPTT when the real hidden Jacobian is position-diagonal and
``y -> h`` is elementwise. Memory is ``O(B·|θ|·S)``.

The elementwise primitive (no ``x``) keeps its trace with respect to its
output, shaped like the hidden group: ``ε^t = D^t ε^{t-1} + Df^t``, and maps the
contracted trace to ``w`` through ``xy_to_dw`` once at the end (exact, since
``y = fn(w)`` does not change within a sequence).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import (
    AbstractAlgorithm,
    check_rules,
    group_signal,
    mix_states,
    param_dtypes,
    per_sample,
    sum_over_samples,
    tree_sum,
)
from braintrace._compiler._graph import ETraceGraph, Relation

__all__ = ["D_RTRL", "drtrl_contribution", "drtrl_finalize", "drtrl_init", "drtrl_rules",
           "drtrl_update"]


def drtrl_rules(relation: Relation) -> tuple[str, ...]:
    """The ETP rules D-RTRL calls for ``relation``.

    ``xy_to_trace`` may stand in for ``xy_to_dw`` in the update, but the
    elementwise (no-input) finalisation always needs ``xy_to_dw``.
    """
    prim = relation.primitive
    rules = ["init_drtrl", "dt_to_t"]
    if not relation.has_input or not prim.has_rule("xy_to_trace"):
        rules.append("xy_to_dw")
    return tuple(rules)


def _xy_to_trace(relation: Relation):
    prim = relation.primitive
    return prim.rule("xy_to_trace") if prim.has_rule("xy_to_trace") else prim.rule("xy_to_dw")


def drtrl_init(graph: ETraceGraph, r: Relation, theta: dict[str, jax.Array]) -> Any:
    """A zero D-RTRL trace of relation ``r``, in the Params' dtype.

    For an operation with an input, the trace is a tuple over the group's ``S``
    states, each ``{key: (B?, *θ_key)}`` (the rule's per-sample
    ``(*θ_key, S)``, split along its state axis). One array per state keeps
    the update, the contraction and the loop carry on the same buffer, which
    XLA then updates in place; a stacked state axis makes XLA:CPU copy and
    recompute the whole trace every step (several times slower). The
    elementwise primitive's hidden-shaped trace stays ``(*V, S)``.
    """
    g = graph.groups[r.group]
    init = r.primitive.rule("init_drtrl")
    dtypes = param_dtypes(graph, r)

    def cast(trace):
        if isinstance(trace, dict):
            return {key: jnp.asarray(value, dtypes.get(key, value.dtype))
                    for key, value in trace.items()}
        return jax.tree.map(lambda e: e.astype(jnp.result_type(*dtypes.values())), trace)

    if not r.has_input:
        return cast(init(None, jnp.zeros(g.shape, g.dtype), theta, g.num_states))
    x_shape = r.x_shape[1:] if r.batched else r.x_shape
    y_shape = r.y_shape[1:] if r.batched else r.y_shape
    trace = init(jnp.zeros(x_shape, g.dtype), jnp.zeros(y_shape, g.dtype), theta, g.num_states)
    lead = (r.y_shape[0],) if r.batched else ()
    return tuple(
        cast(jax.tree.map(lambda e, s=s: jnp.broadcast_to(e[..., s], (*lead, *e.shape[:-1])),
                          trace))
        for s in range(g.num_states))


def drtrl_update(r: Relation, eps: Any, d_g: jax.Array, df: jax.Array, x: jax.Array | None,
                 theta: dict[str, jax.Array]) -> Any:
    """``ε^t = D^t ε^{t-1} + Df^t ⊗ x^t`` for relation ``r`` (per sample).

    For each state ``s``: ``ε_s ← Σ_{s'} dt_to_t(D_{s s'}, ε_{s'}) + xy_to_trace(x, Df_s)``,
    each rule applied per sample.
    """
    dt_to_t = r.primitive.rule("dt_to_t")
    if not r.has_input:
        mixed = mix_states(dt_to_t, d_g, eps, **r.params)
        return jax.tree.map(lambda m, i: m + i.astype(m.dtype), mixed, {"weight": df})
    xy_to_trace = _xy_to_trace(r)
    scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
    outer = per_sample(lambda x, d: xy_to_trace(x, d, theta, **r.params), r)
    d_y = r.gather_hidden(d_g)
    new = []
    for s, old in enumerate(eps):
        mixed = tree_sum([scale(d_y[..., s, s2], source) for s2, source in enumerate(eps)])
        new.append(jax.tree.map(lambda m, i, e: (m + i).astype(e.dtype),
                                mixed, outer(x, df[..., s]), old))
    return tuple(new)


def drtrl_contribution(r: Relation, eps: Any, signal: jax.Array) -> Any:
    """``Σ_b Σ_s δ_{b,·,s} · ε_{s,b,…}`` for relation ``r``; ``signal`` is ``δ_g (*V, S)``.

    Per sample, ``Σ_s contract(δ_s, ε_s)`` (the primitive's closed-form
    ``contract`` rule, or ``dt_to_t``, which it equals on one sample), summed
    over the batch by :func:`sum_over_samples`.
    """
    if not r.has_input:
        return r.scatter_to_y(jnp.sum(signal * eps["weight"], axis=-1))
    signal = r.gather_hidden(signal)
    prim = r.primitive
    contract = prim.rule("contract") if prim.has_rule("contract") else prim.rule("dt_to_t")

    def one(states, signal):  # one sample: states[s] is ε_s (*θ), signal (*y, S)
        return tree_sum([contract(signal[..., s], e, **r.params) for s, e in enumerate(states)])

    return sum_over_samples(one, eps, signal) if r.batched else one(eps, signal)


def drtrl_finalize(r: Relation, total: Any, theta: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Maps a summed contribution of relation ``r`` to ``{key: dθ}``."""
    prim = r.primitive
    if not r.has_input:
        return prim.rule("xy_to_dw")(None, total, theta, **r.params)
    if prim.has_rule("trace_to_dw"):
        return prim.rule("trace_to_dw")(total, theta, **r.params)
    return dict(total)


class D_RTRL(AbstractAlgorithm):
    """Diagonal RTRL: exact parameter-dimension eligibility traces.

    .. math::

        \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\delta^t \\cdot \\epsilon^t

    Exact (equal to BPTT) when the hidden Jacobian is position-diagonal and
    each operation's output reaches the hidden state elementwise. Trace memory
    ``O(B·|θ|·S)``.

    Example:
        >>> import braintrace
        >>> braintrace.D_RTRL().name
        'd_rtrl'
    """

    name = "d_rtrl"

    def required_rules(self, relation):
        return drtrl_rules(relation)

    def init(self, graph, operands):
        check_rules(self, graph)
        return [drtrl_init(graph, r, theta) for r, theta in zip(graph.relations, operands)]

    def update(self, graph, state, jac, rel_x, operands):
        return [drtrl_update(r, eps, jac.d[r.group], jac.df[r.index], x, theta)
                for r, eps, x, theta in zip(graph.relations, state, rel_x, operands)]

    def contribution(self, graph, state, delta, operands):
        return [drtrl_contribution(r, eps, group_signal(graph, delta, r.group))
                for r, eps in zip(graph.relations, state)]

    def finalize(self, graph, summed, operands):
        return [drtrl_finalize(r, total, theta)
                for r, total, theta in zip(graph.relations, summed, operands)]
