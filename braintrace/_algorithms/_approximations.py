"""What an algorithm approximates by construction, as records the report and ``strict`` read.

An algorithm that is not exact by design (ES-D-RTRL's factorised traces,
e-prop's filter or random feedback, UORO's random estimate, SnAp below
saturation) overrides ``AbstractAlgorithm.approximations(graph)`` and builds
its records here. It matters only where credit flows through the traces: the
traces of a relation contribute ``δ̄^t · ε^{t-1}`` with ``δ̄^t = ∂L_t/∂h^{t-1}``,
which is zero unless the step reads the hidden state the relation feeds (in
the full scope, any hidden state). So a record names the Params of those
relations only, and an algorithm reports nothing on a model where no
relation's traces are ever read.
"""

from __future__ import annotations

from collections.abc import Sequence

from braintrace._compiler import (
    Approximation,
    ETraceGraph,
    Relation,
    feeding,
    params_phrase,
    reached,
)

__all__ = ["algorithm_approximation", "credit_relations", "params_reaching_inputs"]


def credit_relations(graph: ETraceGraph, relations: Sequence[Relation]) -> list[Relation]:
    """Those of ``relations`` whose traces carry credit: the step's outputs depend on the
    hidden state they feed (on any hidden state in the full scope)."""
    jaxpr = graph.jaxpr
    feeds = feeding(jaxpr, jaxpr.outvars)
    read = {k for k, v in enumerate(graph.layout.hidden_invars(jaxpr)) if v in feeds}
    if graph.scope == "full":
        return list(relations) if read else []
    return [r for r in relations if read & set(graph.groups[r.group].leaves)]


def params_reaching_inputs(graph: ETraceGraph, eqns: Sequence[int]) -> tuple[str, ...]:
    """The paths of the Params whose value reaches the ``x`` input of any ETP equation of
    ``eqns`` (their gradient passes back through that input)."""
    jaxpr = graph.jaxpr
    inputs = {jaxpr.eqns[i].invars[jaxpr.eqns[i].primitive.x_invar_index] for i in eqns}
    return tuple(p for v, p in zip(graph.layout.param_invars(jaxpr), graph.param_paths)
                 if inputs & reached(jaxpr, [v])[0])


def algorithm_approximation(graph: ETraceGraph, relations: Sequence[Relation], *, kind: str,
                            label: str, what: str, detail: str,
                            remedy: str) -> tuple[Approximation, ...]:
    """One record for ``relations`` that carry credit (nothing if none does).

    The summary reads ``"{label} {what} {Params}, so their credit over time is not BPTT's;
    {remedy}."``.
    """
    carrying = credit_relations(graph, relations)
    params = tuple(sorted({p for r in carrying for p in r.all_param_paths}))
    if not params:
        return ()
    eqns = ", ".join(f"'{r.primitive.name}' (eqn {r.eqn_index})" for r in carrying)
    return (Approximation(
        kind, params, f"{detail} ({eqns})",
        f"{label} {what} {params_phrase(params)}, so their credit over time is not BPTT's; "
        f"{remedy}."),)
