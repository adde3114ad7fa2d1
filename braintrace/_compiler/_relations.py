"""Relations pass: which ETP operations are traced into which hidden group, and which are not.

For every ETP equation ``y = prim(x, θ)``:

* each trainable operand is traced back to the Param leaves it is computed
  from (masks and transforms included); an operand computed from anything
  else (hidden state, input, a non-Param Variable) excludes the operation;
* position maps from ``y`` to each group's ``h^t``, not crossing another
  trainable ETP operation nor an equation cut from ``D``, give the structural
  map ``y → h``: for an operation with an input each output unit must feed at
  most one hidden unit (fused gates such as GRU's ``(in, 3h)`` kernel
  qualify); for one without, each hidden unit must read at most one output
  unit. Anything else is excluded, with its reason as data. Paths from ``y``
  through operations that mix positions are cut from ``Df`` and returned, so
  the approximations pass can report those that reach hidden state;
* ETP primitives hidden in opaque bodies (``custom_jvp``) are excluded.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.extend.core as jex_core
import numpy as np

from braintrace._compiler._layout import StepLayout
from braintrace._compiler._positions import propagate, source_map, union
from braintrace._compiler._records import (
    ElementwiseRelation,
    Exclusion,
    HiddenGroup,
    InputRelation,
    Relation,
)
from braintrace._compiler._walk import producers, sources_of
from braintrace._primitives import ETPPrimitive

__all__ = ["find_relations", "opaque_exclusions", "trace_operands"]


def find_relations(
    jaxpr: jex_core.Jaxpr, layout: StepLayout, groups: list[HiddenGroup], cut_eqns: set[int],
    etp_eqns: frozenset[int], stops_at_etp: Callable[[int, jex_core.JaxprEqn], bool],
) -> tuple[list[Relation], list[Exclusion], dict[int, list[int]]]:
    """Pass 3: ``(relations, exclusions, {ETP eqn: mixing eqns cut from its Df})``."""
    invar_kinds = layout.invar_kinds(jaxpr)
    producer = producers(jaxpr)
    relations: list[Relation] = []
    exclusions: list[Exclusion] = []
    output_mixing: dict[int, list[int]] = {}
    for e in sorted(etp_eqns):
        eqn = jaxpr.eqns[e]
        prim: ETPPrimitive = eqn.primitive
        origin, problem = trace_operands(jaxpr, e, producer, invar_kinds)
        all_paths = tuple(sorted({p for ps in origin.values() for p in ps}))
        if problem is not None:
            exclusions.append(Exclusion(e, prim.name, all_paths, "operand-not-from-params",
                                        problem))
            continue
        if not all_paths:
            continue  # no trainable Param feeds it: nothing to learn here
        env, crossings, mixing = _walk_from_output(jaxpr, e, cut_eqns, stops_at_etp)
        output_mixing[e] = mixing
        found = _relations_of(jaxpr, layout, groups, env, e, origin, len(relations))
        for group, relation_or_kind in found:
            if isinstance(relation_or_kind, tuple):
                kind, why = relation_or_kind
                exclusions.append(Exclusion(e, prim.name, all_paths, kind,
                                            f"for hidden group {list(group.paths)}: {why}"))
            else:
                relations.append(relation_or_kind)
        if not found:
            exclusions.append(_unreached(jaxpr, e, all_paths, crossings, mixing))
    return relations, exclusions, output_mixing


def _walk_from_output(jaxpr, e, cut_eqns, stops_at_etp):
    """Position maps from ETP equation ``e``'s output ``y``, with the ETP operations it
    crosses (where the walk stops) and the mixing operations it meets (cut from ``Df``)."""
    y_var = jaxpr.eqns[e].outvars[jaxpr.eqns[e].primitive.y_outvar_index]
    crossings: list[int] = []
    mixing: list[int] = []

    def cut(i: int, other: jex_core.JaxprEqn) -> bool:
        if i != e and stops_at_etp(i, other):
            crossings.append(i)
            return True
        return i in cut_eqns

    env = propagate(jaxpr, {y_var: source_map(y_var.aval.shape)}, cut=cut,
                              on_mixing=lambda i, _: mixing.append(i))
    return env, crossings, mixing


def _relations_of(jaxpr, layout, groups, env, e, origin, first_index):
    """``[(group, relation or (exclusion kind, reason))]`` for each group ``y`` reaches."""
    hidden_out = layout.hidden_outvars(jaxpr)
    found = []
    for g in groups:
        maps = [env.get(hidden_out[k]) for k in g.leaves
                if not isinstance(hidden_out[k], jex_core.Literal)]
        maps = [m for m in maps if m is not None]
        if maps:
            sources = union([m.reshape(g.size, -1) for m in maps], (g.size,))
            index = first_index + sum(not isinstance(r, tuple) for _, r in found)
            found.append((g, make_relation(index, jaxpr.eqns[e], e, g, origin, sources)))
    return found


def _unreached(jaxpr, e, all_paths, crossings, mixing) -> Exclusion:
    name = jaxpr.eqns[e].primitive.name
    listing = lambda eqns: ", ".join(sorted({f"'{jaxpr.eqns[i].primitive.name}' (eqn {i})"
                                             for i in eqns}))
    if crossings:
        return Exclusion(e, name, all_paths, "through-etp-only",
                         "reaches hidden state only through another trainable ETP operation "
                         f"({listing(crossings)})", tuple(sorted(set(crossings))))
    if mixing:
        return Exclusion(e, name, all_paths, "through-mixing-only",
                         "reaches hidden state only through operations that mix positions "
                         f"({listing(mixing)})", tuple(sorted(set(mixing))))
    return Exclusion(e, name, all_paths, "readout", "reaches no hidden state (a readout)")


def make_relation(index: int, eqn: jex_core.JaxprEqn, e: int, g: HiddenGroup,
                  origin: dict[str, tuple[str, ...]], sources: np.ndarray):
    """A relation of equation ``e`` with group ``g``, or ``(exclusion kind, reason)``.

    ``sources[v]`` lists (padded with ``-1``) the flat ``y`` positions hidden
    unit ``v`` depends on.
    """
    prim: ETPPrimitive = eqn.primitive
    y_shape = tuple(eqn.outvars[prim.y_outvar_index].aval.shape)
    common = {"index": index, "eqn_index": e, "primitive": prim, "params": dict(eqn.params),
              "group": g.index, "operands": dict(prim.trainable_invars(eqn.params)),
              "param_paths": origin, "y_shape": y_shape, "group_shape": g.shape}
    if prim.x_invar_index is None:
        if sources.shape[-1] > 1:
            return ("reads-several-outputs",
                    "a hidden unit reads several units of the elementwise output")
        return ElementwiseRelation(**common, hidden_to_y=sources[:, 0].copy())
    x_shape = tuple(eqn.invars[prim.x_invar_index].aval.shape)
    y_size = int(np.prod(y_shape, dtype=np.int64))
    valid = sources >= 0
    if np.any(np.bincount(sources[valid], minlength=y_size) > 1):
        return ("feeds-several-units",
                ("an output unit feeds several hidden units (e.g. a broadcast), so its trace "
                 "cannot follow one hidden unit"))
    if prim.batched and x_shape and y_shape and x_shape[0] != y_shape[0]:
        return "batch-mismatch", "the batched primitive's x and y disagree on the batch size"
    y_to_hidden = np.full(y_size, -1, np.int64)
    colours = np.zeros(y_size, np.int64)
    rows, slots = np.nonzero(valid)
    y_to_hidden[sources[rows, slots]] = rows
    colours[sources[rows, slots]] = slots
    return InputRelation(**common, x_shape=x_shape, y_to_hidden=y_to_hidden, colours=colours)


def trace_operands(jaxpr, e, producer, invar_kinds):
    """``({key: Param paths}, problem)`` for each trainable operand of equation ``e``.

    ``problem`` says why an operand cannot be traced: it depends on a value
    that changes during the step or between steps (hidden state, input or a
    non-Param Variable).
    """
    eqn = jaxpr.eqns[e]
    origin: dict[str, tuple[str, ...]] = {}
    problem = None
    for key, position in eqn.primitive.trainable_invars(eqn.params).items():
        leaves = []
        for v in sources_of(jaxpr, [eqn.invars[position]], producer):
            kind, path = invar_kinds.get(v, ("constant", ""))
            if kind == "Param":
                leaves.append(path)
            elif kind != "constant" and problem is None:
                problem = (f"its trainable input '{key}' is computed from the {kind} "
                           f"'{path}', not only from Params, so it cannot be traced")
        origin[key] = tuple(sorted(set(leaves)))
    return origin, problem


def _inner_etp_names(jaxpr: jex_core.Jaxpr) -> list[str]:
    """Names of the ETP primitives anywhere inside ``jaxpr`` (nested bodies included)."""
    names: list[str] = []
    for eqn in jaxpr.eqns:
        if isinstance(eqn.primitive, ETPPrimitive) and eqn.primitive.name not in names:
            names.append(eqn.primitive.name)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            names.extend(n for n in _inner_etp_names(sub) if n not in names)
    return names


def opaque_exclusions(jaxpr: jex_core.Jaxpr, layout: StepLayout,
                      etp_eqns: frozenset[int]) -> list[Exclusion]:
    """An exclusion for every equation that hides ETP primitives in its body.

    A ``custom_jvp``/``custom_vjp`` body (or control flow the normalisation
    pass kept) is opaque to the compiler; the Params it reads (directly or
    through non-ETP operations) get their same-step gradient only.
    """
    producer = producers(jaxpr)
    invar_kinds = layout.invar_kinds(jaxpr)
    out = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in etp_eqns:
            continue
        inner = [n for sub in jex_core.jaxprs_in_params(eqn.params)
                 for n in _inner_etp_names(sub)]
        if not inner:
            continue
        paths = {invar_kinds[v][1] for v in sources_of(jaxpr, eqn.invars, producer, etp_eqns)
                 if invar_kinds.get(v, ("",))[0] == "Param"}
        if not paths:
            continue  # no Param reaches it: nothing is lost
        names = ", ".join(dict.fromkeys(inner))
        out.append(Exclusion(
            i, eqn.primitive.name, tuple(sorted(paths)), "opaque-body",
            f"ETP primitive(s) {names} inside this opaque '{eqn.primitive.name}' body are "
            "invisible to the compiler; call them outside custom_jvp/custom_vjp functions"))
    return out
