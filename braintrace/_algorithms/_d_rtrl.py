"""D-RTRL: parameter-dimension eligibility traces (diagonal RTRL).

For a relation ``y = f(x, θ)`` feeding hidden group ``g`` with ``S`` states
per unit, the trace of every trainable input follows

.. math::

    \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t

where ``D^t = ∂h^t/∂h^{t-1}`` (``S×S`` per unit) and ``Df^t = ∂h^t/∂y^t``,
applied through the primitive's ``dt_to_t`` (``D ε``) and ``xy_to_dw`` (the
outer product) rules, per sample. The temporal gradient term of step ``t`` is

.. math::

    \\sum_{b} \\sum_{s} \\bar\\delta^t_{b,\\cdot,s} \\cdot \\epsilon^{t-1}_{b,\\dots,s},
    \\qquad \\bar\\delta^t = \\partial L_t / \\partial h^{t-1},

added to the exact same-step gradient. It equals BPTT when the real hidden
Jacobian is position-diagonal and ``y -> h`` is elementwise (the graph then
has no approximations). Memory is ``O(B·|θ|·S)``.

The elementwise primitive (no ``x``) keeps its trace with respect to its
output, shaped like the hidden group: ``ε^t = D^t ε^{t-1} + Df^t``, and maps the
contracted trace to ``w`` through ``xy_to_dw`` once at the end (exact, since
``y = fn(w)`` does not change within a sequence).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm, RelationRule
from braintrace._algorithms._trace_algebra import (
    mix_states,
    param_dtypes,
    per_sample,
    sum_over_samples,
    tree_sum,
)
from braintrace._compiler import ElementwiseRelation, ETraceGraph, InputRelation, Relation

__all__ = ["D_RTRL", "DRTRL_ELEMENTWISE", "DRTRL_INPUT", "drtrl_rule"]


def _cast_to_params(graph: ETraceGraph, r: Relation, trace: Any) -> Any:
    dtypes = param_dtypes(graph, r)
    if isinstance(trace, dict):
        return {key: jnp.asarray(value, dtypes.get(key, value.dtype))
                for key, value in trace.items()}
    return jax.tree.map(lambda e: e.astype(jnp.result_type(*dtypes.values())), trace)


# -- operations with an input ----------------------------------------------------


def _input_rules(r: InputRelation) -> tuple[str, ...]:
    """``xy_to_trace`` may stand in for ``xy_to_dw`` in the update."""
    if r.primitive.has_rule("xy_to_trace"):
        return ("init_drtrl", "dt_to_t")
    return ("init_drtrl", "dt_to_t", "xy_to_dw")


def _input_init(graph: ETraceGraph, r: InputRelation, theta: dict[str, jax.Array]) -> tuple:
    """A zero trace: a tuple over the group's ``S`` states, each ``{key: (B?, *θ_key)}``.

    The rule's per-sample ``(*θ_key, S)`` is split along its state axis. One
    array per state keeps the update, the contraction and the loop carry on
    the same buffer, which XLA then updates in place; a stacked state axis
    makes XLA:CPU copy and recompute the whole trace every step.
    """
    g = graph.groups[r.group]
    x_shape = r.x_shape[1:] if r.batched else r.x_shape
    y_shape = r.y_shape[1:] if r.batched else r.y_shape
    trace = r.primitive.rule("init_drtrl")(jnp.zeros(x_shape, g.dtype),
                                          jnp.zeros(y_shape, g.dtype), theta, g.num_states)
    lead = (r.y_shape[0],) if r.batched else ()
    return tuple(
        _cast_to_params(graph, r, jax.tree.map(
            lambda e, s=s: jnp.broadcast_to(e[..., s], (*lead, *e.shape[:-1])), trace))
        for s in range(g.num_states))


def _input_update(r: InputRelation, eps: tuple, d_g: jax.Array, df: jax.Array, x: jax.Array,
                  theta: dict[str, jax.Array]) -> tuple:
    """``ε_s ← Σ_{s'} dt_to_t(D_{s s'}, ε_{s'}) + xy_to_trace(x, Df_s)``, per sample."""
    prim = r.primitive
    dt_to_t = prim.rule("dt_to_t")
    xy_to_trace = prim.rule("xy_to_trace") if prim.has_rule("xy_to_trace") else prim.rule(
        "xy_to_dw")
    scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
    outer = per_sample(lambda x, d: xy_to_trace(x, d, theta, **r.params), r)
    d_y = r.gather_hidden(d_g)
    new = []
    for s, old in enumerate(eps):
        mixed = tree_sum([scale(d_y[..., s, s2], source) for s2, source in enumerate(eps)])
        new.append(jax.tree.map(lambda m, i, e: (m + i).astype(e.dtype),
                                mixed, outer(x, df[..., s]), old))
    return tuple(new)


def _input_contribution(r: InputRelation, eps: tuple, signal: jax.Array,
                        theta: dict[str, jax.Array]) -> Any:
    """``Σ_b Σ_s contract(δ̄_s, ε_s)`` (the closed-form ``contract`` rule, or ``dt_to_t``,
    which it equals on one sample), summed over the batch by :func:`sum_over_samples`."""
    del theta
    signal = r.gather_hidden(signal)
    prim = r.primitive
    contract = prim.rule("contract") if prim.has_rule("contract") else prim.rule("dt_to_t")

    def one(states, signal):  # one sample: states[s] is ε_s (*θ), signal (*y, S)
        return tree_sum([contract(signal[..., s], e, **r.params) for s, e in enumerate(states)])

    return sum_over_samples(one, eps, signal) if r.batched else one(eps, signal)


def _input_finalize(r: InputRelation, total: Any, theta: dict[str, jax.Array]) -> dict:
    if r.primitive.has_rule("trace_to_dw"):
        return r.primitive.rule("trace_to_dw")(total, theta, **r.params)
    return dict(total)


DRTRL_INPUT = RelationRule(init=_input_init, update=_input_update,
                           contribution=_input_contribution, finalize=_input_finalize,
                           rules=_input_rules)
"""D-RTRL for an operation with an input: ``ε = D ε + Df ⊗ x``."""


# -- the elementwise primitive ------------------------------------------------------


def _elementwise_init(graph: ETraceGraph, r: ElementwiseRelation,
                      theta: dict[str, jax.Array]) -> dict:
    g = graph.groups[r.group]
    trace = r.primitive.rule("init_drtrl")(None, jnp.zeros(g.shape, g.dtype), theta,
                                           g.num_states)
    return _cast_to_params(graph, r, trace)


def _elementwise_update(r: ElementwiseRelation, eps: dict, d_g: jax.Array, df: jax.Array,
                        x: None, theta: dict[str, jax.Array]) -> dict:
    """``ε ← D ε + Df``: the trace of the output, shaped like the group ``(*V, S)``."""
    del x, theta
    mixed = mix_states(r.primitive.rule("dt_to_t"), d_g, eps, **r.params)
    return jax.tree.map(lambda m, i: m + i.astype(m.dtype), mixed, {"weight": df})


def _elementwise_contribution(r: ElementwiseRelation, eps: dict, signal: jax.Array,
                              theta: dict[str, jax.Array]) -> jax.Array:
    del theta
    return r.scatter_to_y(jnp.sum(signal * eps["weight"], axis=-1))


def _elementwise_finalize(r: ElementwiseRelation, total: jax.Array,
                          theta: dict[str, jax.Array]) -> dict:
    return r.primitive.rule("xy_to_dw")(None, total, theta, **r.params)


DRTRL_ELEMENTWISE = RelationRule(
    init=_elementwise_init, update=_elementwise_update, contribution=_elementwise_contribution,
    finalize=_elementwise_finalize, rules=lambda r: ("init_drtrl", "dt_to_t", "xy_to_dw"))
"""D-RTRL for the elementwise primitive: the trace of its output, ``ε = D ε + Df``."""


def drtrl_rule(relation: Relation) -> RelationRule:
    """The D-RTRL rule of a relation's kind."""
    return DRTRL_INPUT if isinstance(relation, InputRelation) else DRTRL_ELEMENTWISE


class D_RTRL(AbstractAlgorithm):
    """Diagonal RTRL: exact parameter-dimension eligibility traces.

    .. math::

        \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta|_{h^{t-1}}
            + \\bar\\delta^t \\cdot \\epsilon^{t-1}

    Exact (equal to BPTT) when the compiled graph has no approximations
    (``compile(..., strict=True)`` checks it). Trace memory ``O(B·|θ|·S)``.

    Args:
        coupled: Use the per-position blocks of the full hidden Jacobian
            (OSTL's recurrent rule, see :func:`braintrace.OSTLRecurrent`)
            instead of its elementwise part.

    Example:
        >>> import braintrace
        >>> braintrace.D_RTRL().name, braintrace.D_RTRL(coupled=True).scope
        ('d_rtrl', 'coupled')
    """

    def __init__(self, *, coupled: bool = False):
        self.scope = "coupled" if coupled else "diagonal"
        self.name = "ostl_recurrent" if coupled else "d_rtrl"

    def relation_rule(self, relation: Relation) -> RelationRule:
        return drtrl_rule(relation)
