"""The records of the per-relation rule contract: what a rule is and what it reads.

:class:`RelationRule` is one algorithm's pure functions for one kind of relation
(see :mod:`braintrace._algorithms._base` for the contract they follow);
:class:`Jacobians` is what a step's trace update reads and :class:`BlockSteps`
what a block of the time-blocked loop hands each relation. They sit below both
:class:`~braintrace._algorithms._base.AbstractAlgorithm`, which makes rules, and
:class:`~braintrace._algorithms._graph_rules.GraphRules`, which maps them over a
graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from braintrace._compiler import ETraceGraph, Relation

__all__ = ["BlockSteps", "Jacobians", "RelationRule"]


@dataclasses.dataclass(frozen=True)
class Jacobians:
    """One step's hidden Jacobians ``d[g]`` ``(*V, S, S)`` and ``df[r]``, and ``reads[g]``:
    for each relation reading group ``g`` (``GraphRules.readers``), ``∂x'/∂h_g^t`` on ``g``'s
    units ``(*V, S)`` (empty unless the rules read them)."""

    d: Sequence[jax.Array]
    df: Sequence[jax.Array]
    reads: Sequence[tuple[jax.Array, ...]] = ()


class BlockSteps(NamedTuple):
    """What one relation's ``block_finish`` reads of a block of ``K`` steps.

    Every array is stacked on a leading ``K`` axis.

    Attributes:
        signal: The relation's learning signals ``δ̄_k`` (a rule without ``block_step``).
        d: Its group's ``D_k`` (a rule without ``block_step``); where the rules read the
            groups' readers (``GraphRules.readers``), the pair ``(D_k, reads_k)`` as
            ``update`` gets it, ``reads_k`` the group's ``Jacobians.reads``.
        df: Its ``Df_k`` (a rule without ``block_step``).
        x: Its inputs ``x_k`` (``None`` for an elementwise relation).
        dy: Its output cotangents ``∂L_k/∂y_k``, or ``None`` when another relation
            of the same equation counts the same-step share.
        stepped: The state after ``block_step`` ran over the block (with ``block_step``).
        outs: ``block_step``'s stacked outputs (with ``block_step``).
    """

    signal: jax.Array | None
    d: jax.Array | None
    df: jax.Array | None
    x: jax.Array | None
    dy: jax.Array | None
    stepped: Any = None
    outs: Any = None


class RelationRule(NamedTuple):
    """The pure functions of one algorithm for one kind of relation (the contract:
    :mod:`braintrace._algorithms._base`); ``jacobians=False``: ``update`` reads no ``D``
    and ``Df`` (when no rule of a graph does, the loops do not compute them and pass
    ``None``).

    ``contribution_with_share(r, state, δ̄, x, dy, θ) -> term``, optional: ``contribution``
    plus the relation's own share of the same-step gradient, ``xy_to_dw(x^t, dy^t)`` with
    ``dy^t = ∂L_t/∂y^t`` its output cotangent (``None``: another relation of the same
    equation counts it), in the form of the rule's term. When every relation's rule has it,
    the per-step loop hands it that share instead of adding it to the Params' same-step
    gradient (``GraphRules.adds_share``): ES-D-RTRL's two products ``xy_to_dw(ε_x, d)`` and
    ``xy_to_dw(x, dy)`` of the same shape then become one.
    """

    init: Callable[[ETraceGraph, Relation, dict[str, jax.Array]], Any]
    update: Callable[..., Any]
    contribution: Callable[[Relation, Any, jax.Array, dict[str, jax.Array]], Any]
    finalize: Callable[[Relation, Any, dict[str, jax.Array]], dict[str, jax.Array]]
    rules: Callable[[Relation], tuple[str, ...]]
    block_step: Callable[..., tuple[Any, Any]] | None = None
    block_finish: Callable[..., tuple[Any, Any]] | None = None
    own: Callable[[Any], Any] | None = None
    tie: Callable[[Any, Any], Any] | None = None
    uniform: Callable[[Any, Any], Any] | None = None
    jacobians: bool = True
    contribution_with_share: Callable[..., Any] | None = None
