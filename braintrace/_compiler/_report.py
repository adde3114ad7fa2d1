"""A person-readable summary of an eligibility-trace graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = ["graph_report"]


def graph_report(graph: ETraceGraph) -> str:
    """Describes hidden groups, traced Params, same-step Params and warnings."""
    lines = [f"ETraceGraph ({graph.scope} scope)"]
    lines.append(f"  hidden groups ({len(graph.groups)}):")
    for g in graph.groups:
        lines.append(f"    [{g.index}] {', '.join(g.paths)}  shape={g.shape}  S={g.num_states}")
    lines.append(f"  traced relations ({len(graph.relations)}):")
    for r in graph.relations:
        params = ", ".join(f"{k}<-{'+'.join(v)}" for k, v in r.param_paths.items())
        extra = "" if r.num_colours == 1 else f"  ({r.num_colours} fused units per hidden unit)"
        lines.append(f"    {r.primitive.name} (eqn {r.eqn_index}): {params} -> group {r.group}"
                     f"{extra}")
    traced = set(graph.traced_param_paths)
    same_step = [p for p in graph.param_paths if p not in traced]
    lines.append(f"  Params learning by eligibility traces: {', '.join(sorted(traced)) or '-'}")
    lines.append(f"  Params with same-step gradients: {', '.join(same_step) or '-'}")
    for x in graph.exclusions:
        lines.append(f"    {x.primitive} (eqn {x.eqn_index}) [{', '.join(x.param_paths)}]: "
                     f"{x.reason}")
    if graph.warnings:
        lines.append("  warnings:")
        lines.extend(f"    - {w}" for w in graph.warnings)
    if graph.notes:
        lines.append("  normalisation:")
        lines.extend(f"    - {n}" for n in graph.notes)
    return "\n".join(lines)
