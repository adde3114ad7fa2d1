"""SnAp-n: sparse n-step approximation of RTRL (Menick et al. 2021).

RTRL's influence ``M_r[n, θ] = dh_n/dθ`` is kept only where the unit ``j`` of
the operation's output that ``θ`` feeds can reach hidden unit ``n`` within
``n_steps`` steps: immediately (``h^t_n`` depends on ``y_j``) and then through
at most ``n_steps − 1`` steps of the recurrent graph (``h^t`` depends on
``h^{t-1}``). The compiler derives both patterns structurally
(``_compiler/_patterns.py``). After every update

.. math::

    M_r \\leftarrow (J M_r + I_r) \\odot P_r, \\qquad
    P_r = \\big((1 + A)^{n-1} \\, \\mathrm{Imm}_r\\big) > 0,

applied to the trace through the primitive's ``dt_to_t`` rule (which scales a
θ-shaped trace along its output axes). ``SnAp(1)`` keeps a parameter's own
units; once ``n − 1`` reaches the diameter of the recurrent graph the pattern
is full and ``SnAp(n)`` equals :class:`~braintrace.RTRL` (on a dense
recurrence from ``n = 2``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithms._base import AbstractAlgorithm, RelationRule
from braintrace._algorithms._rtrl import RTRL_ELEMENTWISE, RTRL_INPUT, flat_signal
from braintrace._algorithms._trace_algebra import is_batched
from braintrace._compiler import ETraceGraph, InputRelation, Relation, reach, unit_patterns

__all__ = ["SnAp", "snap_rule"]


def _masked_input_update(pattern: np.ndarray):
    def update(r: InputRelation, m: dict, jac, df, x, theta) -> dict:
        new = RTRL_INPUT.update(r, m, jac, df, x, theta)
        y_sample = r.y_shape[1:] if r.batched else r.y_shape
        mask = jnp.asarray(pattern.reshape(-1, *y_sample))  # (N, *y)
        scale = jax.vmap(lambda d, t: r.primitive.rule("dt_to_t")(d, t, **r.params))
        per_sample = lambda t: scale(mask.astype(next(iter(t.values())).dtype), t)
        return jax.vmap(per_sample)(new) if r.batched else per_sample(new)
    return update


def _masked_elementwise_update(pattern: np.ndarray):
    def update(r, m: jax.Array, jac, df, x, theta) -> jax.Array:
        new = RTRL_ELEMENTWISE.update(r, m, jac, df, x, theta)
        return new * jnp.asarray(pattern.reshape(pattern.shape[0], *r.y_shape), new.dtype)
    return update


def snap_rule(relation: Relation, pattern: np.ndarray) -> RelationRule:
    """RTRL's rule for ``relation`` with its influence masked by ``pattern`` ``(N, |y|)``."""
    if isinstance(relation, InputRelation):
        return RTRL_INPUT._replace(
            update=_masked_input_update(pattern),
            rules=lambda r: (*RTRL_INPUT.rules(r), "dt_to_t"))
    return RTRL_ELEMENTWISE._replace(update=_masked_elementwise_update(pattern))


class SnAp(AbstractAlgorithm):
    """Sparse n-step approximation of RTRL: influences kept on the n-step reachable units.

    Args:
        n_steps: ``n >= 1``: how many steps of reach a parameter's influence keeps.

    Example:
        >>> import braintrace
        >>> alg = braintrace.SnAp(2)
        >>> alg.name, alg.n_steps, alg.scope
        ('snap', 2, 'full')
    """

    name = "snap"
    scope = "full"

    def __init__(self, n_steps: int = 1):
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"SnAp: n_steps must be an integer >= 1, got {n_steps!r}.")
        self.n_steps = n_steps

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        """RTRL's rules, each masked by its relation's ``n_steps``-step reachable pattern."""
        adjacency, immediate = unit_patterns(graph, is_batched(graph))
        return tuple(snap_rule(r, reach(adjacency, imm, self.n_steps - 1))
                     for r, imm in zip(graph.relations, immediate))

    def relation_signal(self, graph: ETraceGraph, delta, relation: Relation) -> jax.Array:
        """Every hidden unit's signal of one sample, flattened: ``(*B, N)``."""
        return flat_signal(graph, delta)
