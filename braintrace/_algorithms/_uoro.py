"""UORO: unbiased online recurrent optimisation (Tallec & Ollivier 2018), per relation.

RTRL's influence ``M_r = dh/dθ_r`` (``N`` hidden units × the relation's trace)
is replaced by a rank-one estimate ``ũ_r θ̃_rᵀ`` per sample, updated with a
fresh vector of random signs ``ν`` (``N`` per sample) every step:

.. math::

    ũ^t = \\rho_0 J^t ũ^{t-1} + \\rho_1 \\nu, \\qquad
    θ̃^t = θ̃^{t-1} / \\rho_0 + (\\nu^\\top I^t) / \\rho_1,

    \\rho_0 = \\sqrt{\\lVert θ̃^{t-1} \\rVert / \\lVert J^t ũ^{t-1} \\rVert}, \\quad
    \\rho_1 = \\sqrt{\\lVert \\nu^\\top I^t \\rVert / \\lVert \\nu \\rVert}

with ``J`` the full step Jacobian and ``νᵀI = xy_to_dw(x, Σ_n ν_n Df_n)``. The
cross terms of ``ũ θ̃ᵀ`` cancel between ``ν`` and ``-ν`` (which give the same
``ρ``), so ``E_ν[ũ^t θ̃^{tᵀ}] = M^t``: the gradient
``Σ_t ∂L_t/∂θ|_{h^{t-1}} + (δ̄^t·ũ^{t-1}) θ̃^{t-1}`` is an unbiased estimate of
RTRL's. Each relation keeps its own ``ũ`` (block-diagonal UORO, still
unbiased). Memory ``O(B·(N + |θ|))``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._algorithms._rtrl import RTRL_ELEMENTWISE, RTRL_INPUT, flat_signal
from braintrace._algorithms._trace_algebra import param_dtypes
from braintrace._arguments import check_integer
from braintrace._compiler import Approximation, ETraceGraph, InputRelation, Relation

__all__ = ["UORO", "UOROTrace", "uoro_update"]

EPSILON = 1e-7


class UOROTrace(NamedTuple):
    """The rank-one factors of one relation, per sample, and the step's random key.

    Attributes:
        u: ``ũ`` ``(*B, N)``: the hidden-side factor.
        theta: ``θ̃`` ``{key: (*B, *trace_key)}``: the parameter-side factor.
        key: The key the next step's signs are drawn from.
    """

    u: jax.Array
    theta: dict
    key: jax.Array


def _norm(tree: Any) -> jax.Array:
    """Per-sample Euclidean norm over every leaf (leading batch axis kept when ``batched``)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(a), axis=tuple(range(1, a.ndim)))
                        for a in jax.tree.leaves(tree)))


def uoro_update(r: InputRelation, s: UOROTrace, jac: jax.Array, df: jax.Array, x: jax.Array,
                theta: dict[str, jax.Array], nu: jax.Array) -> UOROTrace:
    """One UORO step with the signs ``nu`` ``(*B, N)`` (module docstring)."""
    prim = r.primitive
    immediate = prim.rules.resolved("xy_to_trace")
    batched = r.batched
    d = _sign_sum(nu, df, batched)
    nu_i = (jax.vmap(lambda x, d: immediate(x, d, theta, **r.params))(x, d) if batched
            else immediate(x, d, theta, **r.params))
    if not batched:  # a batch axis of one, so that the norms are per sample
        s = s._replace(u=s.u[None], theta=jax.tree.map(lambda a: a[None], s.theta))
        nu, jac = nu[None], jac[None]
        nu_i = jax.tree.map(lambda a: a[None], nu_i)
    ju = jnp.einsum("bnm,bm->bn", jac.astype(s.u.dtype), s.u)
    rho0 = jnp.sqrt((_norm(s.theta) + EPSILON) / (_norm(ju) + EPSILON))
    rho1 = jnp.sqrt((_norm(nu_i) + EPSILON) / (_norm(nu) + EPSILON))
    scale = lambda v, a: v.reshape(-1, *([1] * (a.ndim - 1)))
    u = rho0[:, None] * ju + rho1[:, None] * nu.astype(s.u.dtype)
    new_theta = {k: (s.theta[k] / scale(rho0, s.theta[k])
                     + nu_i[k].astype(s.theta[k].dtype) / scale(rho1, s.theta[k]))
                 .astype(s.theta[k].dtype) for k in s.theta}
    if not batched:
        u, new_theta = u[0], jax.tree.map(lambda a: a[0], new_theta)
    return UOROTrace(u.astype(s.u.dtype), new_theta, s.key)


def _sign_sum(nu: jax.Array, df: jax.Array, batched: bool) -> jax.Array:
    """``Σ_n ν_n Df_n``: ``(*B, *y)``."""
    flat = df.reshape(*df.shape[:1 + batched], -1)
    out = jnp.einsum("...n,...nk->...k", nu.astype(df.dtype), flat)
    return out.reshape(*df.shape[:batched], *df.shape[1 + batched:])


def uoro_rule(seed: int) -> RelationRule:
    """The UORO rule of an operation with an input."""

    def init(graph: ETraceGraph, r: InputRelation, theta) -> UOROTrace:
        m = jax.eval_shape(lambda th: RTRL_INPUT.init(graph, r, th), theta)  # (*B, N, *trace)
        lead = 1 + r.batched
        dtype = jnp.result_type(*param_dtypes(graph, r).values())
        u_shape = next(iter(m.values())).shape[:lead]
        return UOROTrace(
            u=jnp.zeros(u_shape, dtype),
            theta={k: jnp.zeros(v.shape[:lead - 1] + v.shape[lead:], v.dtype)
                   for k, v in m.items()},
            key=jax.random.fold_in(jax.random.key(seed), r.index))

    def update(r, s: UOROTrace, jac, df, x, theta) -> UOROTrace:
        key, sub = jax.random.split(s.key)
        nu = jax.random.rademacher(sub, s.u.shape, s.u.dtype)
        return uoro_update(r, s, jac, df, x, theta, nu)._replace(key=key)

    def contribution(r, s: UOROTrace, signal, theta) -> dict:
        del theta
        coefficient = jnp.sum(signal.astype(s.u.dtype) * s.u, axis=-1)  # (*B,)
        if not r.batched:
            return dict(jax.tree.map(lambda a: coefficient * a, s.theta))
        return {k: jnp.tensordot(coefficient, v, axes=1) for k, v in s.theta.items()}

    return RelationRule(init=init, update=update, contribution=contribution,
                        finalize=RTRL_INPUT.finalize, rules=RTRL_INPUT.rules)


class UORO(AbstractAlgorithm):
    """Unbiased online recurrent optimisation: a rank-one, unbiased estimate of RTRL.

    Args:
        seed: Seed of the random signs (one stream per relation): an integer.

    Raises:
        TypeError: ``seed`` is not an integer (``1.5`` is not rounded).

    Example:
        >>> import braintrace
        >>> braintrace.UORO(seed=3).name
        'uoro'
    """

    name = "uoro"
    scope = "full"

    def __init__(self, seed: int = 0):
        self.seed = check_integer("UORO: seed", seed)
        self._rule = uoro_rule(self.seed)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        # a time constant's influence is shaped like its output: exact RTRL is as cheap
        return tuple(self._rule if isinstance(r, InputRelation) else RTRL_ELEMENTWISE
                     for r in graph.relations)

    def relation_signal(self, graph: ETraceGraph, delta, relation: Relation) -> jax.Array:
        """Every hidden unit's signal of one sample, flattened: ``(*B, N)``."""
        return flat_signal(graph, delta)

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The random rank-one estimate of every operation with an input (time constants keep
        RTRL's exact influence)."""
        return algorithm_approximation(
            graph, graph.input_relations, kind="random-estimate",
            label=f"UORO (seed {self.seed})",
            what=("keeps a random rank-one estimate of RTRL's influence (unbiased over the "
                  "random signs, with high variance) for"),
            detail="ũ θ̃ᵀ estimates the influence M = ∂h/∂θ",
            remedy="RTRL() computes the influence exactly (small models)")
