"""Relations pass of the full scope (exact RTRL, SnAp, UORO): every trainable ETP operation
whose output reaches hidden state, by any path.

The diagonal and coupled scopes follow an operation's output ``y`` to the
hidden state without crossing another trainable ETP operation, because
D-RTRL's per-unit traces need the structural map ``y → h`` of that walk
(``_relations.py``). The full scope keeps, per sample, the influence of every
traced operand on *every* hidden unit, with ``Df = ∂h^t/∂y`` taken through the
whole step (``_programs.full_jacobians``: other ETP operations,
nonlinearities, normalisations and other layers' readouts included). So here
every ETP operation whose output reaches a hidden state at all is one
relation, and its immediate influence ``I^t = xy_to_dw(x^t, ∂h^t/∂y^t)`` is
exact: ``θ`` enters the step only through ``y``, and ``∂h^t/∂y`` holds every
other operand, input and ``h^{t-1}`` fixed.

A full-scope relation has no unit map: its ``group`` is the first hidden group
its output reaches (it sets the trace dtype), ``y_to_hidden`` (or
``hidden_to_y``) is ``-1`` throughout and there is one colour. Operations
whose operands are not computed from Params alone, and batched operations
whose ``x`` and ``y`` disagree on the batch size, are excluded as in the
other scopes; an operation whose output reaches no hidden state is a readout.
"""

from __future__ import annotations

import jax.extend.core as jex_core
import numpy as np

from braintrace._compiler._layout import StepLayout
from braintrace._compiler._records import (
    ElementwiseRelation,
    Exclusion,
    HiddenGroup,
    InputRelation,
    Relation,
)
from braintrace._compiler._relations import trace_operands
from braintrace._compiler._walk import is_var, producers, reached

__all__ = ["find_full_relations"]


def find_full_relations(jaxpr: jex_core.Jaxpr, layout: StepLayout, groups: list[HiddenGroup],
                        etp_eqns: frozenset[int]) -> tuple[list[Relation], list[Exclusion]]:
    """``(relations, exclusions)`` of the full scope: one relation per ETP equation whose
    output reaches hidden state (module docstring)."""
    invar_kinds = layout.invar_kinds(jaxpr)
    producer = producers(jaxpr)
    hidden_out = layout.hidden_outvars(jaxpr)
    group_of = {hidden_out[k]: g.index for g in groups for k in g.leaves
                if is_var(hidden_out[k])}
    relations: list[Relation] = []
    exclusions: list[Exclusion] = []
    for e in sorted(etp_eqns):
        eqn = jaxpr.eqns[e]
        prim = eqn.primitive
        origin, problem = trace_operands(jaxpr, e, producer, invar_kinds)
        paths = tuple(sorted({p for ps in origin.values() for p in ps}))
        if problem is not None:
            exclusions.append(Exclusion(e, prim.name, paths, "operand-not-from-params", problem))
            continue
        if not paths:
            continue  # no trainable Param feeds it: nothing to learn here
        reach, _ = reached(jaxpr, [eqn.outvars[prim.y_outvar_index]])
        targets = sorted({group_of[v] for v in reach if v in group_of})
        if not targets:
            exclusions.append(Exclusion(e, prim.name, paths, "readout",
                                        "reaches no hidden state (a readout)"))
            continue
        relation = _full_relation(len(relations), eqn, e, groups[targets[0]], origin)
        if isinstance(relation, tuple):
            exclusions.append(Exclusion(e, prim.name, paths, *relation))
        else:
            relations.append(relation)
    return relations, exclusions


def _full_relation(index: int, eqn: jex_core.JaxprEqn, e: int, g: HiddenGroup,
                   origin: dict[str, tuple[str, ...]]) -> Relation | tuple[str, str]:
    """The full-scope relation of equation ``e`` (no unit map), or ``(kind, reason)``."""
    prim = eqn.primitive
    y_shape = tuple(eqn.outvars[prim.y_outvar_index].aval.shape)
    y_size = int(np.prod(y_shape, dtype=np.int64))
    common = {"index": index, "eqn_index": e, "primitive": prim, "params": dict(eqn.params),
              "group": g.index, "operands": dict(prim.trainable_invars(eqn.params)),
              "param_paths": origin, "y_shape": y_shape, "group_shape": g.shape}
    if prim.x_invar_index is None:
        return ElementwiseRelation(**common, hidden_to_y=np.full(g.size, -1, np.int64))
    x_shape = tuple(eqn.invars[prim.x_invar_index].aval.shape)
    if prim.batched and x_shape and y_shape and x_shape[0] != y_shape[0]:
        return "batch-mismatch", "the batched primitive's x and y disagree on the batch size"
    return InputRelation(**common, x_shape=x_shape, y_to_hidden=np.full(y_size, -1, np.int64),
                         colours=np.zeros(y_size, np.int64))
