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

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import (
    AbstractAlgorithm,
    Jacobians,
    contract_states,
    group_signal,
    mix_states,
    per_sample,
)
from braintrace._compiler._graph import ETraceGraph, Relation

__all__ = ["D_RTRL", "drtrl_contribution", "drtrl_finalize", "drtrl_init", "drtrl_update"]


def _xy_to_trace(relation: Relation):
    prim = relation.primitive
    return prim.rule("xy_to_trace") if prim.has_rule("xy_to_trace") else prim.rule("xy_to_dw")


def _relation_init(graph: ETraceGraph, r: Relation, theta: dict[str, jax.Array]) -> Any:
    g = graph.groups[r.group]
    init = r.primitive.rule("init_drtrl")
    if not r.has_input:
        return init(None, jnp.zeros(g.shape, g.dtype), theta, g.num_states)
    x_shape = r.x_shape[1:] if r.batched else r.x_shape
    y_shape = r.y_shape[1:] if r.batched else r.y_shape
    trace = init(jnp.zeros(x_shape, g.dtype), jnp.zeros(y_shape, g.dtype), theta,
                 g.num_states)
    if r.batched:
        trace = jax.tree.map(lambda e: jnp.broadcast_to(e, (r.y_shape[0], *e.shape)), trace)
    return trace


def drtrl_init(graph: ETraceGraph, operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
    """Zero D-RTRL traces, one pytree per relation."""
    return [_relation_init(graph, r, theta) for r, theta in zip(graph.relations, operands)]


def drtrl_update(graph: ETraceGraph, traces: Sequence[Any], jac: Jacobians,
                 rel_x: Sequence[jax.Array | None], operands: Sequence[dict[str, jax.Array]],
                 d_list: Sequence[jax.Array] | None = None) -> list[Any]:
    """``ε^t = D^t ε^{t-1} + Df^t ⊗ x^t`` for every relation."""
    d_list = jac.d if d_list is None else d_list
    new = []
    for r, eps, x, theta in zip(graph.relations, traces, rel_x, operands):
        dt_to_t = r.primitive.rule("dt_to_t")
        d_g, df = d_list[r.group], jac.df[r.index]
        if not r.has_input:
            mixed = mix_states(dt_to_t, d_g, eps, **r.params)
            new.append(jax.tree.map(jnp.add, mixed, {"weight": df.astype(d_g.dtype)}))
            continue
        xy_to_trace = _xy_to_trace(r)
        d_y = r.gather_hidden(d_g)

        def one(eps, x, df, d_y, r=r, dt_to_t=dt_to_t, xy_to_trace=xy_to_trace, theta=theta):
            mixed = mix_states(dt_to_t, d_y, eps, **r.params)
            inst = [xy_to_trace(x, df[..., s], theta, **r.params) for s in range(df.shape[-1])]
            inst = jax.tree.map(lambda *a: jnp.stack(a, axis=-1), *inst)
            return jax.tree.map(lambda m, i: m + i.astype(m.dtype), mixed, inst)

        new.append(per_sample(one, r)(eps, x, df, d_y))
    return new


def drtrl_contribution(graph: ETraceGraph, traces: Sequence[Any], delta: Sequence[jax.Array]
                       ) -> list[Any]:
    """``Σ_b Σ_s δ_{b,·,s} · ε_{b,…,s}`` per relation (trace space)."""
    terms = []
    for r, eps in zip(graph.relations, traces):
        dt_to_t = r.primitive.rule("dt_to_t")
        signal = group_signal(graph, delta, r.group)
        if not r.has_input:
            weighted = jnp.sum(signal * eps["weight"], axis=-1)
            terms.append(r.scatter_to_y(weighted))
            continue
        contract = per_sample(
            lambda e, s, r=r, f=dt_to_t: contract_states(f, s, e, **r.params), r)
        term = contract(eps, r.gather_hidden(signal))
        if r.batched:
            term = jax.tree.map(lambda a: jnp.sum(a, axis=0), term)
        terms.append(term)
    return terms


def drtrl_finalize(graph: ETraceGraph, summed: Sequence[Any],
                   operands: Sequence[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
    """Maps summed contributions to ``{key: dθ}`` per relation."""
    grads = []
    for r, total, theta in zip(graph.relations, summed, operands):
        prim = r.primitive
        if not r.has_input:
            grads.append(prim.rule("xy_to_dw")(None, total, theta, **r.params))
        elif prim.has_rule("trace_to_dw"):
            grads.append(prim.rule("trace_to_dw")(total, theta, **r.params))
        else:
            grads.append(dict(total))
    return grads


class D_RTRL(AbstractAlgorithm):  # noqa: N801
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

    def init(self, graph, operands):
        return drtrl_init(graph, operands)

    def update(self, graph, state, jac, rel_x, operands):
        return drtrl_update(graph, state, jac, rel_x, operands)

    def contribution(self, graph, state, delta, operands):
        return drtrl_contribution(graph, state, delta)

    def finalize(self, graph, summed, operands):
        return drtrl_finalize(graph, summed, operands)
