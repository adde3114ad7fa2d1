"""Building the :class:`ETraceGraph` of a flat step jaxpr: the passes, in order.

1. hidden groups and the equations cut from ``D`` (``_groups.hidden_groups``);
2. colours of groups whose step moves values between positions
   (``_groups.colour_groups``);
3. relations and exclusions (``_relations.find_relations``; in the full scope
   ``_full_relations.find_full_relations``, through every path of the step), and
   ETP primitives hidden in opaque bodies (``_relations.opaque_exclusions``);
4. approximations of the temporal credit (``_approximations.find_approximations``;
   in the full scope ``find_full_approximations``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.extend.core as jex_core

from braintrace._compiler._approximations import (
    coupling_equations,
    find_approximations,
    find_full_approximations,
)
from braintrace._compiler._full_relations import find_full_relations
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._groups import colour_groups, hidden_groups
from braintrace._compiler._layout import StepLayout
from braintrace._compiler._modules import ModuleMap
from braintrace._compiler._relations import find_relations, opaque_exclusions
from braintrace._primitives import ETPPrimitive

__all__ = ["build_graph"]

SCOPES = ("diagonal", "coupled", "full")


def build_graph(closed: jex_core.ClosedJaxpr, layout: StepLayout, *, scope: str,
                modules: ModuleMap, notes: Sequence[str] = (),
                warnings: Sequence[str] = ()) -> ETraceGraph:
    """Builds the graph of a flat step jaxpr (see the module docstring).

    ``modules`` names the modules the equations run in, for the report.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be 'diagonal', 'coupled' or 'full', got {scope!r}.")
    jaxpr = closed.jaxpr
    etp_eqns = frozenset(i for i, e in enumerate(jaxpr.eqns)
                         if isinstance(e.primitive, ETPPrimitive))

    def stops_at_etp(index: int, eqn: jex_core.JaxprEqn) -> bool:
        return index in etp_eqns and not eqn.primitive.gradient_enabled

    groups, cut_eqns = hidden_groups(jaxpr, layout, stops_at_etp)
    groups = colour_groups(jaxpr, layout, groups, cut_eqns, stops_at_etp)
    if scope == "full":
        relations, exclusions = find_full_relations(jaxpr, layout, groups, etp_eqns)
        exclusions.extend(opaque_exclusions(jaxpr, layout, etp_eqns))
        approximations = find_full_approximations(jaxpr, layout, modules, relations=relations,
                                                  exclusions=exclusions)
    else:
        relations, exclusions, output_mixing = find_relations(
            jaxpr, layout, groups, cut_eqns, etp_eqns, stops_at_etp)
        exclusions.extend(opaque_exclusions(jaxpr, layout, etp_eqns))
        stops = cut_eqns | {i for i in etp_eqns if stops_at_etp(i, jaxpr.eqns[i])}
        approximations = find_approximations(
            jaxpr, layout, modules, groups=groups, relations=relations, exclusions=exclusions,
            coupling_eqns=coupling_equations(jaxpr, layout, stops), output_mixing=output_mixing)
        cut_eqns = cut_eqns.union(*output_mixing.values())
    return ETraceGraph(
        jaxpr=jaxpr, consts=tuple(closed.consts), layout=layout, groups=tuple(groups),
        relations=tuple(relations), exclusions=tuple(exclusions), cut_eqns=frozenset(cut_eqns),
        etp_eqns=etp_eqns, approximations=approximations, scope=scope, modules=modules,
        notes=tuple(notes), warnings=tuple(dict.fromkeys(warnings)))
