"""RTRL: exact real-time recurrent learning for any compiled model.

The influence ``M = dh/dθ`` of every traced operand on every hidden unit of a
sample (all groups, all states: ``N`` units, leaves flattened in order) follows

.. math::

    M^t = J^t M^{t-1} + I^t, \\qquad
    \\nabla_\\theta L = \\sum_t \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1}}
        + \\bar\\delta^t \\cdot M^{t-1}

with ``J^t = ∂h^t/∂h^{t-1}`` the *full* per-sample step Jacobian (nothing cut:
recurrent kernels, fixed matrices, normalisations, other layers) and
``I^t_n = xy_to_dw(x^t, ∂h^t_n/∂y^t)`` the immediate influence through the
operation's output ``y`` (for the elementwise primitive, whose ``y = fn(w)`` is
constant in time, ``M`` is kept with respect to ``y``). ``∂h^t/∂y`` is taken
through the whole step, other ETP operations included, and every ETP operation
whose output reaches hidden state by any path is traced (the full scope's
relations, ``_compiler/_full_relations.py``): an encoder in front of a
recurrent layer, a layer feeding the next layer's state. This is BPTT's
gradient, computed forward in time, for every model whose trainable operations
are all ETP operations (the report lists any Param it cannot follow). Memory
``O(B·|θ|·N)`` and ``N + Σ|y|`` JVPs per step: a reference for small models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._algorithms._trace_algebra import is_batched, param_dtypes
from braintrace._arguments import check_integer
from braintrace._compiler import ElementwiseRelation, ETraceGraph, InputRelation, Relation

__all__ = ["RTRL", "RTRL_ELEMENTWISE", "RTRL_INPUT", "flat_signal", "hidden_size"]

DEFAULT_MAX_TRACE_BYTES = 1 << 30


def hidden_size(graph: ETraceGraph, batched: bool) -> int:
    """``N``: the hidden units of one sample, over every hidden leaf."""
    return sum(math.prod(v.aval.shape[1 if batched else 0:])
               for v in graph.layout.hidden_invars(graph.jaxpr))


def flat_signal(graph: ETraceGraph, delta: Sequence[jax.Array]) -> jax.Array:
    """The per-leaf learning signal of one sample flattened over every hidden unit: ``(*B, N)``."""
    batched = is_batched(graph)
    return jnp.concatenate([d.reshape(*d.shape[:1 if batched else 0], -1) for d in delta],
                           axis=-1)


def _immediate(r: InputRelation):
    return r.primitive.rules.resolved("xy_to_trace")


def _input_init(graph: ETraceGraph, r: InputRelation, theta: dict[str, jax.Array]) -> dict:
    """``M``: ``(*B, N, *trace_key)`` per key, the trace shaped as ``xy_to_trace`` returns."""
    batched = r.batched
    x_one = r.x_shape[1:] if batched else r.x_shape
    y_one = r.y_shape[1:] if batched else r.y_shape
    g = graph.groups[r.group]
    shapes = jax.eval_shape(lambda x, d: _immediate(r)(x, d, theta, **r.params),
                            jax.ShapeDtypeStruct(x_one, g.dtype),
                            jax.ShapeDtypeStruct(y_one, g.dtype))
    lead = (r.y_shape[0],) if batched else ()
    n = hidden_size(graph, batched)
    dtypes = param_dtypes(graph, r)
    return {key: jnp.zeros((*lead, n, *s.shape), dtypes.get(key, s.dtype))
            for key, s in shapes.items()}


def _mix(jac: jax.Array, m: jax.Array, batched: bool) -> jax.Array:
    """``J M`` over the unit axis: ``Σ_m J[.., n, m] M[.., m, ...]``."""
    flat = m.reshape(*m.shape[:1 + batched], -1)
    out = jnp.einsum("...nm,...mk->...nk", jac.astype(m.dtype), flat)
    return out.reshape(m.shape)


def _input_update(r: InputRelation, m: dict, jac: jax.Array, df: jax.Array, x: jax.Array,
                  theta: dict[str, jax.Array]) -> dict:
    """``M = J M + I``, ``I_n = xy_to_trace(x, Df_n)`` per sample and unit."""
    per_unit = jax.vmap(lambda d, x: _immediate(r)(x, d, theta, **r.params), in_axes=(0, None))
    immediate = jax.vmap(per_unit)(df, x) if r.batched else per_unit(df, x)
    return {key: (_mix(jac, m[key], r.batched) + immediate[key].astype(m[key].dtype))
            for key in m}


def _contract(signal: jax.Array, m: jax.Array, batched: bool) -> jax.Array:
    """``Σ_b Σ_n δ̄[b, n] M[b, n, ...]``."""
    axes = 2 if batched else 1
    return jnp.tensordot(signal.astype(m.dtype), m, axes=axes)


def _input_contribution(r: InputRelation, m: dict, signal: jax.Array, theta) -> dict:
    del theta
    return {key: _contract(signal, value, r.batched) for key, value in m.items()}


def _input_finalize(r: InputRelation, total: dict, theta: dict[str, jax.Array]) -> dict:
    return r.primitive.rules.resolved("trace_to_dw")(total, theta, **r.params)


def _input_rules(r: InputRelation) -> tuple[str, ...]:
    return (r.primitive.rules.source("xy_to_trace") or "xy_to_dw",)


RTRL_INPUT = RelationRule(init=_input_init, update=_input_update,
                          contribution=_input_contribution, finalize=_input_finalize,
                          rules=_input_rules)
"""RTRL for an operation with an input: the influence of its trace on every hidden unit."""


def _elementwise_init(graph: ETraceGraph, r: ElementwiseRelation, theta) -> jax.Array:
    """``M``: ``(*B, N, *y)``, the influence of the output ``y`` (constant in time)."""
    del theta
    batched = is_batched(graph)
    g = graph.groups[r.group]
    lead = (g.shape[0],) if batched else ()
    dtype = jnp.result_type(*param_dtypes(graph, r).values())
    return jnp.zeros((*lead, hidden_size(graph, batched), *r.y_shape), dtype)


def _elementwise_update(r: ElementwiseRelation, m: jax.Array, jac: jax.Array, df: jax.Array,
                        x: None, theta) -> jax.Array:
    del r, x, theta
    return _mix(jac, m, jac.ndim == 3) + df.astype(m.dtype)


def _elementwise_contribution(r: ElementwiseRelation, m: jax.Array, signal: jax.Array,
                              theta) -> jax.Array:
    del r, theta
    return _contract(signal, m, signal.ndim == 2)


RTRL_ELEMENTWISE = RelationRule(
    init=_elementwise_init, update=_elementwise_update,
    contribution=_elementwise_contribution,
    finalize=lambda r, total, theta: r.primitive.rule("xy_to_dw")(None, total, theta, **r.params),
    rules=lambda r: ("xy_to_dw",))
"""RTRL for the elementwise primitive: the influence of its output on every hidden unit."""


class RTRL(AbstractAlgorithm):
    """Exact real-time recurrent learning: the full influence of every traced Param.

    .. math::

        M^t = J^t M^{t-1} + I^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta|_{h^{t-1}}
            + \\bar\\delta^t \\cdot M^{t-1}

    Equals BPTT on every model whose trainable operations are ETP operations,
    whatever lies between an operation and the hidden state (recurrent
    kernels, other ETP layers, several coupled layers, LSTMs, normalisations
    included). Memory ``O(B·|θ|·N)`` for ``N`` hidden units per sample.

    Args:
        max_trace_bytes: Refuse (at compile) influence matrices larger than
            this; raise it to accept them. A positive integer.

    Raises:
        TypeError: ``max_trace_bytes`` is not an integer.
        ValueError: It is below 1.

    Example:
        >>> import braintrace
        >>> braintrace.RTRL().name, braintrace.RTRL().scope
        ('rtrl', 'full')
    """

    name = "rtrl"
    scope = "full"

    def __init__(self, *, max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES):
        self.max_trace_bytes = check_integer("RTRL: max_trace_bytes", max_trace_bytes,
                                             minimum=1)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(RTRL_INPUT if isinstance(r, InputRelation) else RTRL_ELEMENTWISE
                     for r in graph.relations)

    def relation_signal(self, graph: ETraceGraph, delta: Sequence[jax.Array],
                        relation: Relation) -> jax.Array:
        """Every hidden unit's signal of one sample, flattened: ``(*B, N)``."""
        return flat_signal(graph, delta)

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """The rules, after checking the influence matrices fit ``max_trace_bytes``.

        Raises:
            ValueError: They do not (the message gives their size and what to do).
        """
        rules = super().rules(graph)
        size = rules.trace_bytes  # the influence matrices' bytes
        if size > self.max_trace_bytes:
            units = hidden_size(graph, is_batched(graph))
            raise ValueError(
                f"RTRL: the influence matrices of this model need {size:,} bytes "
                f"({size / 2**20:.1f} MiB: batch × traced weights × {units} hidden units), "
                f"more than max_trace_bytes={self.max_trace_bytes:,}. Use a smaller model or "
                "batch, raise the budget with braintrace.RTRL(max_trace_bytes=...), or use "
                "D_RTRL / ES_D_RTRL.")
        return rules
