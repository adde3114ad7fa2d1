"""The contract every online learning algorithm follows, the optax way.

An algorithm is, per relation ``r`` (an ETP operation feeding hidden group
``g``), a :class:`RelationRule`: four pure functions over a trace state, like
an optax transformation's ``init``/``update``:

* ``init(graph, r, θ)`` -> the trace state of ``r`` (a NamedTuple or pytree);
* ``update(r, state, D_g, Df_r, x, θ)`` -> the next state (``ε^{t-1} → ε^t``);
* ``contribution(r, state, δ̄_g, θ)`` -> this step's temporal gradient term: the
  learning signal ``δ̄_g = ∂L_t/∂h_g^{t-1}`` ``(*V, S)`` contracted with the
  traces *before* this step's update (``ε^{t-1}``); terms are summed over time
  and the driver adds the exact same-step gradient (see ``_scan.py``);
* ``finalize(r, summed, θ)`` -> ``{key: dθ}`` (linear, applied once after
  summing);
* optionally ``block(r, state, δ̄, D, Df, x, dy, θ)`` -> ``(state, term)``:
  ``K`` steps at once (every argument but the state and ``θ`` stacked on a
  leading ``K`` axis), equal to ``K`` rounds of ``contribution`` then
  ``update`` with their terms summed, plus the relation's own share of the
  same-step gradient, ``Σ_k xy_to_dw(x_k, dy_k)`` with ``dy = ∂L_t/∂y`` (``None``
  when another relation of the same equation counts it): written with
  matrix products (see ``_blocked.py``);
* or, for a block whose step-by-step part is a short recursion,
  ``block_step(r, state, δ̄_k, D_k, Df_k)`` -> ``(state, out_k)``, run inside the
  model's own loop over the block's steps (no loop of its own, nothing
  stacked but ``out_k``), and ``block_finish(r, entering, stepped, outs, x, dy,
  θ)`` -> ``(state, term)``, the rest of ``block`` from the state entering the
  block, the state after ``block_step`` and the stacked ``out_k``;

and ``rules(r)``, the ETP rules it calls (checked once, when the traces are
created, so a missing rule fails at ``braintrace.compile`` with a
:class:`~braintrace.MissingRuleError`).

:class:`AbstractAlgorithm` is the engine: it picks a rule per relation
(:meth:`~AbstractAlgorithm.relation_rule`, the one abstract method: usually
one rule for :class:`~braintrace._compiler.InputRelation` and one for
:class:`~braintrace._compiler.ElementwiseRelation`), checks the rules and maps
the rule's functions over the relations. Traces are kept in the dtype of the
Params they belong to.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from braintrace._algorithms._trace_algebra import group_signal
from braintrace._compiler import Approximation, ETraceGraph, Relation
from braintrace._primitives import MissingRuleError

__all__ = ["AbstractAlgorithm", "BlockSteps", "Jacobians", "RelationRule", "check_rules"]


@dataclasses.dataclass(frozen=True)
class Jacobians:
    """One step's hidden Jacobians ``d[g]`` ``(*V, S, S)`` and ``df[r]``."""

    d: Sequence[jax.Array]
    df: Sequence[jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockSteps:
    """``K`` steps' learning signals (per hidden leaf), ``D`` (per group), ``Df``, inputs and
    output cotangents ``∂L_t/∂y`` (per relation), each stacked on a leading ``K`` axis."""

    signal: Sequence[jax.Array]
    d: Sequence[jax.Array]
    df: Sequence[jax.Array]
    rel_x: Sequence[jax.Array | None]
    dy: Sequence[jax.Array | None]


class RelationRule(NamedTuple):
    """The pure functions of one algorithm for one kind of relation (module docstring)."""

    init: Callable[[ETraceGraph, Relation, dict[str, jax.Array]], Any]
    update: Callable[..., Any]
    contribution: Callable[[Relation, Any, jax.Array, dict[str, jax.Array]], Any]
    finalize: Callable[[Relation, Any, dict[str, jax.Array]], dict[str, jax.Array]]
    rules: Callable[[Relation], tuple[str, ...]]
    block: Callable[..., tuple[Any, Any]] | None = None
    block_step: Callable[..., tuple[Any, Any]] | None = None
    block_finish: Callable[..., tuple[Any, Any]] | None = None


class AbstractAlgorithm(abc.ABC):
    """Base of the online learning algorithms (see the module docstring).

    Attributes:
        name: The name :func:`braintrace.compile` accepts.
        scope: ``'diagonal'`` or ``'coupled'``: which hidden Jacobian it uses.
        supports_windowed: Whether ``etrace_grad(chunk_size=...)`` may use it.
    """

    name: str = ""
    scope: str = "diagonal"
    supports_windowed: bool = True

    @abc.abstractmethod
    def relation_rule(self, relation: Relation) -> RelationRule:
        """The rule this algorithm applies to ``relation``."""

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """What this algorithm approximates by construction on ``graph``.

        Beyond ``graph.approximations`` (where the graph's own traces are not
        the exact influence): empty when the algorithm's gradient equals BPTT
        wherever the graph's traces are exact. ``report()`` lists both and
        ``compile(..., strict=True)`` refuses either.
        """
        del graph
        return ()

    def feedback_operands(self, graph: ETraceGraph) -> dict[int, dict[int, jax.Array]] | None:
        """``{eqn index: {operand position: B}}`` for feedback alignment, or ``None`` (exact).

        Listed ETP equations send the derivative to their input through ``B``
        instead of their trainable operands, in the same-step gradient and in
        the learning signal alike. Called while tracing each step: return
        constants (computed once), not values built inside the trace.
        """
        del graph
        return None

    def relation_signal(self, graph: ETraceGraph, delta: Sequence[jax.Array],
                        relation: Relation) -> jax.Array:
        """The learning signal a relation's contribution reads: its group's ``(*V, S)``."""
        return group_signal(graph, delta, relation.group)

    def required_rules(self, relation: Relation) -> tuple[str, ...]:
        """The ETP rules this algorithm calls for ``relation``."""
        return self.relation_rule(relation).rules(relation)

    def init(self, graph: ETraceGraph, operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """Checks the rules, then each relation's zero trace state."""
        check_rules(self, graph)
        return [self.relation_rule(r).init(graph, r, theta)
                for r, theta in zip(graph.relations, operands)]

    def update(self, graph: ETraceGraph, state: Sequence[Any], jac: Jacobians,
               rel_x: Sequence[jax.Array | None],
               operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """``ε^{t-1} → ε^t`` for every relation."""
        return [self.relation_rule(r).update(r, s, jac.d[r.group], jac.df[r.index], x, theta)
                for r, s, x, theta in zip(graph.relations, state, rel_x, operands)]

    def contribution(self, graph: ETraceGraph, state: Sequence[Any],
                     delta: Sequence[jax.Array],
                     operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """Every relation's temporal gradient term, from the per-leaf signal ``delta``."""
        return [self.relation_rule(r).contribution(r, s, self.relation_signal(graph, delta, r),
                                                   theta)
                for r, s, theta in zip(graph.relations, state, operands)]

    def supports_blocks(self, graph: ETraceGraph) -> bool:
        """Whether every relation's rule has a time-blocked form (``etrace_grad(block_size=)``)."""
        return all(rule.block is not None
                   or (rule.block_step is not None and rule.block_finish is not None)
                   for rule in map(self.relation_rule, graph.relations))

    def has_block_steps(self, graph: ETraceGraph) -> bool:
        """Whether some relation's block runs a part inside the model's loop (``block_step``)."""
        return any(self.relation_rule(r).block_step is not None for r in graph.relations)

    def block_step(self, graph: ETraceGraph, state: Sequence[Any], delta: Sequence[jax.Array],
                   jac: Jacobians) -> tuple[list[Any], list[Any]]:
        """One step of every ``block_step`` (the others' states, ``None`` here, pass through,
        outputs ``None``)."""
        out = []
        for r, s in zip(graph.relations, state):
            step = self.relation_rule(r).block_step
            out.append((s, None) if step is None else step(
                r, s, self.relation_signal(graph, delta, r), jac.d[r.group], jac.df[r.index]))
        return [new for new, _ in out], [o for _, o in out]

    def block(self, graph: ETraceGraph, state: Sequence[Any], steps: BlockSteps,
              operands: Sequence[dict[str, jax.Array]],
              stepped: tuple[Sequence[Any], Sequence[Any]] | None = None
              ) -> tuple[list[Any], list[Any]]:
        """``K`` steps of every relation at once: the traces after them and their summed terms.

        ``stepped``: the states and stacked outputs of :meth:`block_step` run over the
        block's steps (needed when :meth:`has_block_steps`).
        """
        out = []
        for i, (r, s, x, dy, theta) in enumerate(zip(graph.relations, state, steps.rel_x,
                                                     steps.dy, operands)):
            rule = self.relation_rule(r)
            if rule.block_step is None:
                signal = jax.vmap(lambda delta, r=r: self.relation_signal(graph, delta, r))(
                    steps.signal)
                out.append(rule.block(r, s, signal, steps.d[r.group], steps.df[r.index], x, dy,
                                      theta))
                continue
            if stepped is None:
                raise ValueError(f"Relation {r.index}'s block runs per step (block_step): "
                                 "pass the stepped states and outputs.")
            out.append(rule.block_finish(r, s, stepped[0][i], stepped[1][i], x, dy, theta))
        return [new for new, _ in out], [term for _, term in out]

    def finalize(self, graph: ETraceGraph, summed: Sequence[Any],
                 operands: Sequence[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
        """Maps every relation's summed terms to ``{key: dθ}``."""
        return [self.relation_rule(r).finalize(r, total, theta)
                for r, total, theta in zip(graph.relations, summed, operands)]


def check_rules(algorithm: AbstractAlgorithm, graph: ETraceGraph) -> None:
    """Raises :class:`~braintrace.MissingRuleError` if a relation's primitive lacks a rule.

    The message names the algorithm, the primitive, every missing rule and
    the Params that the relation trains.
    """
    for r in graph.relations:
        prim = r.primitive
        missing = [name for name in algorithm.required_rules(r) if not prim.has_rule(name)]
        if missing:
            rules = ", ".join(f"'{m}'" for m in missing)
            raise MissingRuleError(
                f"Algorithm '{algorithm.name or type(algorithm).__name__}' needs the ETP "
                f"rule(s) {rules} of primitive '{prim.name}' (which trains "
                f"{list(r.all_param_paths)}), but '{prim.name}' never registered them. Register "
                f"them with `{prim.name}.register_etp_rules({missing[0]}=...)` (or the "
                "single-rule `register_*` methods), or choose an algorithm that does not need "
                "them.")
