"""The contract every online learning algorithm follows, and shared trace algebra.

An algorithm owns, per relation ``r`` (an ETP operation feeding hidden group
``g``), a trace state, a per-step update and a per-step gradient
contribution:

* ``init(graph, operands)`` -> trace state (a pytree, one entry per relation);
* ``update(graph, state, jac, rel_x, operands)`` -> next trace state, given
  this step's Jacobians (``jac.d[g]``, ``jac.df[r]``) and each relation's
  input ``x``;
* ``contribution(graph, state, delta, operands)`` -> this step's gradient
  term per relation, given the learning signal ``δ_g = ∂L_t/∂h_g^t``
  ``(*V, S)``; terms are summed over time;
* ``finalize(graph, summed, operands)`` -> ``{key: dθ}`` per relation
  (linear, so it is applied once, after summing).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._compiler._graph import ETraceGraph, Relation

__all__ = ["AbstractAlgorithm", "Jacobians", "mix_states", "per_sample"]


@dataclasses.dataclass(frozen=True)
class Jacobians:
    """One step's hidden Jacobians ``d[g]`` ``(*V, S, S)`` and ``df[r]``."""

    d: Sequence[jax.Array]
    df: Sequence[jax.Array]


class AbstractAlgorithm(abc.ABC):
    """Base of the online learning algorithms (see the module docstring).

    Attributes:
        scope: ``'diagonal'`` or ``'coupled'``: which hidden Jacobian it uses.
        name: The name :func:`braintrace.compile` accepts.
    """

    scope: str = "diagonal"
    name: str = ""

    @abc.abstractmethod
    def init(self, graph: ETraceGraph, operands: Sequence[dict[str, jax.Array]]) -> Any:
        """See the module docstring."""

    @abc.abstractmethod
    def update(self, graph: ETraceGraph, state: Any, jac: Jacobians,
               rel_x: Sequence[jax.Array | None],
               operands: Sequence[dict[str, jax.Array]]) -> Any:
        """See the module docstring."""

    @abc.abstractmethod
    def contribution(self, graph: ETraceGraph, state: Any, delta: Sequence[jax.Array],
                     operands: Sequence[dict[str, jax.Array]]) -> Any:
        """See the module docstring."""

    @abc.abstractmethod
    def finalize(self, graph: ETraceGraph, summed: Any,
                 operands: Sequence[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
        """See the module docstring."""


def per_sample(fn: Callable[..., Any], relation: Relation) -> Callable[..., Any]:
    """``jax.vmap(fn)`` over the leading batch axis when the relation is batched."""
    return jax.vmap(fn) if relation.batched else fn


def mix_states(dt_to_t: Callable[..., Any], d: jax.Array, trace: Any, **params: Any) -> Any:
    """``out[..., s] = Σ_{s'} dt_to_t(d[..., s, s'], trace[..., s'])``.

    Applies an ``(S, S)`` per-unit matrix to a trace whose last axis holds the
    ``S`` states, through the primitive's ``dt_to_t`` rule.
    """
    num_states = d.shape[-1]
    take = lambda s: jax.tree.map(lambda e: e[..., s], trace)  # noqa: E731
    rows = []
    for s in range(num_states):
        total = None
        for s2 in range(num_states):
            term = dt_to_t(d[..., s, s2], take(s2), **params)
            total = term if total is None else jax.tree.map(jnp.add, total, term)
        rows.append(total)
    return jax.tree.map(lambda *r: jnp.stack(r, axis=-1), *rows)


def contract_states(dt_to_t: Callable[..., Any], delta: jax.Array, trace: Any,
                    **params: Any) -> Any:
    """``Σ_s dt_to_t(δ[..., s], trace[..., s])``: a trace contracted with a signal."""
    total = None
    for s in range(delta.shape[-1]):
        term = dt_to_t(delta[..., s], jax.tree.map(lambda e, s=s: e[..., s], trace), **params)
        total = term if total is None else jax.tree.map(jnp.add, total, term)
    return total


def group_signal(graph: ETraceGraph, delta: Sequence[jax.Array], group: int) -> jax.Array:
    """Stacks the per-leaf learning signals of a group: ``(*V, S)``."""
    g = graph.groups[group]
    return jnp.stack([delta[k] for k in g.leaves], axis=-1)
