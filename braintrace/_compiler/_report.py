"""A person-readable summary of an eligibility-trace graph."""

from __future__ import annotations

from typing import Any

__all__ = ["graph_report", "same_step_reasons"]

NOT_READ = "no ETP primitive reads it as a trainable input (plain JAX operations only)"


def same_step_reasons(graph: Any) -> dict[str, list[str]]:
    """``{Param path: reasons}`` for every Param that gets (part of) its gradient in the same step.

    A Param traced at one site can still be excluded at another (tied weights),
    so it may appear here and in ``graph.traced_param_paths``.
    """
    reasons: dict[str, list[str]] = {}
    for x in graph.exclusions:
        for path in x.param_paths:
            reasons.setdefault(path, []).append(f"{x.primitive} (eqn {x.eqn_index}): {x.reason}")
    traced = set(graph.traced_param_paths)
    for path in graph.param_paths:
        if path not in traced and path not in reasons:
            reasons[path] = [NOT_READ]
    return {p: reasons[p] for p in graph.param_paths if p in reasons}


def graph_report(graph: Any) -> str:
    """Describes an ETraceGraph: groups, traced Params, same-step Params, approximations."""
    lines = [f"ETraceGraph ({graph.scope} scope)"]
    lines.append(f"  hidden groups ({len(graph.groups)}):")
    for g in graph.groups:
        lines.append(f"    [{g.index}] {', '.join(g.paths)}  shape={g.shape}  S={g.num_states}")
    lines.append(f"  traced relations ({len(graph.relations)}):")
    for r in graph.relations:
        params = ", ".join(f"{k}<-{'+'.join(v)}" for k, v in r.param_paths.items())
        extra = "" if r.num_colours == 1 else f"  ({r.num_colours} fused units per hidden unit)"
        paths = ", ".join(graph.groups[r.group].paths)
        lines.append(f"    {r.primitive.name} (eqn {r.eqn_index}): {params} -> group {r.group} "
                     f"[{paths}]{extra}")
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
    if graph.approximations:
        lines.append(f"  approximations of the temporal credit ({len(graph.approximations)}; the "
                     "same-step gradient stays exact; strict=True refuses them):")
        lines.extend(f"    - {a.describe()}" for a in graph.approximations)
    else:
        lines.append("  approximations: none (D-RTRL equals BPTT on this model)")
    if graph.warnings:
        lines.append("  warnings:")
        lines.extend(f"    - {w}" for w in graph.warnings)
    if graph.notes:
        lines.append("  normalisation:")
        lines.extend(f"    - {n}" for n in graph.notes)
    return "\n".join(lines)
