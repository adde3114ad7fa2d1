"""A person-readable report of an eligibility-trace graph, in the model's module terms.

A summary first (one plain sentence per approximation of the graph's traces
and of the algorithm: what is approximate and what to do, then the
algorithms that are exact on this model), the details after: hidden groups,
traced operations, which Params learn by traces and which by their same-step
gradient (and why), the approximations with their equations, warnings and
what the normalisation pass changed.
"""

from __future__ import annotations

from typing import Any

from braintrace._compiler._alternatives import exact_alternatives
from braintrace._compiler._graph import ETraceGraph

__all__ = ["graph_report", "same_step_reasons"]

NOT_READ = "no ETP primitive reads it as a trainable input (plain JAX operations only)"
EXACT_BY_SCOPE = {"diagonal": "D-RTRL", "coupled": "D-RTRL in the coupled scope (OSTLRecurrent)",
                  "full": "RTRL"}


def _op_label(graph: ETraceGraph, eqn_index: int, param_paths: tuple[str, ...]) -> str:
    """The module of an ETP operation: the one holding its Params, else the one it ran in."""
    modules = graph.modules
    owners = [modules.module_of(p) for p in param_paths]
    owners = [o for o in owners if o is not None]
    if owners:
        return modules.label(owners[0])
    return modules.eqn_label(eqn_index, "")


def _where(graph: ETraceGraph, eqn_index: int, param_paths: tuple[str, ...]) -> str:
    label = _op_label(graph, eqn_index, param_paths)
    return f" in {label}" if label else ""


def same_step_reasons(graph: Any) -> dict[str, list[str]]:
    """``{Param path: reasons}`` for every Param that gets (part of) its gradient in the same step.

    A Param traced at one site can still be excluded at another (tied weights),
    so it may appear here and in ``graph.traced_param_paths``.
    """
    reasons: dict[str, list[str]] = {}
    for x in graph.exclusions:
        where = _where(graph, x.eqn_index, x.param_paths)
        for path in x.param_paths:
            reasons.setdefault(path, []).append(
                f"{x.primitive} (eqn {x.eqn_index}){where}: {x.reason}")
    traced = set(graph.traced_param_paths)
    for path in graph.param_paths:
        if path not in traced and path not in reasons:
            reasons[path] = [NOT_READ]
    return {p: reasons[p] for p in graph.param_paths if p in reasons}


def _summary(graph: ETraceGraph, algorithm: Any, found: tuple[Any, ...]) -> list[str]:
    if not found:
        who = EXACT_BY_SCOPE[graph.scope] if algorithm is None else f"'{algorithm.name}'"
        return [f"approximations: none ({who} equals BPTT on this model)"]
    lines = [f"approximations ({len(found)}; strict=True refuses them):"]
    lines.extend(f"  - {summary}" for summary in dict.fromkeys(a.summary for a in found))
    alternatives = exact_alternatives(graph).strip()
    if alternatives:
        lines.append(f"  {alternatives}")
    return lines


def _groups_and_relations(graph: ETraceGraph) -> list[str]:
    modules = graph.modules
    lines = [f"  hidden groups ({len(graph.groups)}):"]
    for g in graph.groups:
        owner = modules.module_of(g.paths[0])
        of = "" if owner is None else f"  of {modules.label(owner)}"
        lines.append(f"    [{g.index}] {', '.join(g.paths)}  shape={g.shape}  S={g.num_states}"
                     f"{of}")
    lines.append(f"  traced operations ({len(graph.relations)}):")
    for r in graph.relations:
        params = ", ".join(f"{k}<-{'+'.join(v)}" for k, v in r.param_paths.items())
        label = _op_label(graph, r.eqn_index, r.all_param_paths) or "an operation"
        if graph.scope == "full":
            target = "every hidden unit"
        else:
            target = f"group {r.group} [{', '.join(graph.groups[r.group].paths)}]"
        extra = "" if r.num_colours == 1 else f", {r.num_colours} fused units per hidden unit"
        lines.append(f"    {label}: {params} -> {target}  ({r.primitive.name}, eqn "
                     f"{r.eqn_index}{extra})")
    return lines


def graph_report(graph: ETraceGraph, algorithm: Any = None) -> str:
    """Describes an ETraceGraph (module docstring); with ``algorithm`` (any object with
    ``name``, ``approximations(graph)`` and ``graph_approximations(graph)``), what that
    algorithm approximates: the graph's approximations that hold for it and its own."""
    found = ((*algorithm.graph_approximations(graph), *algorithm.approximations(graph))
             if algorithm is not None else graph.approximations)
    lines = ([] if algorithm is None
             else [f"algorithm: {algorithm.name} ({type(algorithm).__name__})"])
    lines.append(f"ETraceGraph ({graph.scope} scope)")
    lines.extend(_summary(graph, algorithm, found))
    lines.append("details:")
    lines.extend(_groups_and_relations(graph))
    traced = graph.traced_param_paths
    lines.append(f"  Params learning by eligibility traces ({len(traced)}): "
                 f"{', '.join(traced) or '-'}")
    reasons = same_step_reasons(graph)
    lines.append(f"  Params with same-step gradients ({len(reasons)}):"
                 + ("" if reasons else " -"))
    for path, why in reasons.items():
        lines.extend(f"    {path}: {w}" for w in why)
    for x in graph.exclusions:
        if not x.param_paths:
            lines.append(f"    (no Param) {x.primitive} (eqn {x.eqn_index}): {x.reason}")
    if found:
        lines.append(f"  approximations, with their operations ({len(found)}):")
        lines.extend(f"    - {a.describe()}" for a in found)
    if graph.warnings:
        lines.append("  warnings:")
        lines.extend(f"    - {w}" for w in graph.warnings)
    if graph.notes:
        lines.append("  normalisation:")
        lines.extend(f"    - {n}" for n in graph.notes)
    return "\n".join(lines)
