"""Approximations pass: where the traces of a graph are not the exact influence ``∂h^t/∂θ``.

The same-step gradient is always exact (see ``_algorithms/_scan.py``); what
the compiler can get wrong is the *temporal* credit carried by the traces. A
trace is the exact influence of a traced Param on the hidden state (and
D-RTRL then equals BPTT) unless one of these holds, each reported as an
:class:`Approximation` naming the Params whose temporal credit it affects:

* ``'hidden-coupling'``: an operation reads hidden state and feeds hidden
  state but is not elementwise (a recurrent weight, a fixed matrix, a
  reduction, or an ETP operation reading the state): ``D`` keeps only the
  elementwise part of ``∂h^t/∂h^{t-1}``, so the influence that flows through
  it is dropped (the Params traced into the state it reads are affected);
* ``'moved-positions'``: the step moves hidden values between positions (a
  roll, a flip): ``D`` keeps only the same-position part;
* ``'output-mixing'``: a traced operation's output reaches hidden state also
  through operations that mix units (a LayerNorm): ``Df`` keeps only the
  elementwise part of ``∂h^t/∂y``;
* ``'untraced-path'``: a Param reaches hidden state by a path that is not a
  traced ETP operand (a plain ``nnx.Linear``, a traced weight also used by
  plain operations, an ETP operation that is excluded): that path has no
  trace at all;
* ``'carried-state'``: a non-hidden Variable is carried from step to step,
  depends on Params or hidden state and is read again: no trace follows it;
* ``'sample-mixing'`` (reported in the full scope, where the others above but
  the last two are exact): the step combines the samples of a batch (batch
  statistics), which per-sample traces cannot follow.

``braintrace.compile(..., strict=True)`` refuses a graph with any of these.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import jax.extend.core as jex_core

from braintrace._compiler._layout import StepLayout
from braintrace._compiler._records import Approximation, Exclusion, HiddenGroup, Relation
from braintrace._compiler._walk import feeding, is_var, reached

__all__ = ["Approximation", "coupling_equations", "find_approximations", "sample_mixing"]


def mixes_samples(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` combines values along the leading (batch) axis.

    Reductions over axis 0 (BatchNorm's batch statistics, a mean over the
    batch), cumulative ops along it, and contractions of the left operand's
    axis 0.
    """
    name, params = eqn.primitive.name, eqn.params
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        return 0 in tuple(params.get("axes", ()))
    if name.startswith("cum"):
        return params.get("axis") == 0
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        return 0 in tuple(lhs_contract) and len(eqn.invars[0].aval.shape) >= 2
    return False


def sample_mixing(jaxpr: jex_core.Jaxpr, eqns: Iterable[int],
                  relations: Sequence[Relation]) -> tuple[Approximation, ...]:
    """``'sample-mixing'``: operations among ``eqns`` that combine samples of a batch.

    Every trace, exact RTRL's included, is kept per sample; a step that mixes
    samples (batch statistics) couples them, which no per-sample trace follows.
    """
    mixing = sorted(i for i in set(eqns) if mixes_samples(jaxpr.eqns[i]))
    params = tuple(sorted({p for r in relations for p in r.all_param_paths}))
    if not mixing or not params:
        return ()
    return (Approximation(
        "sample-mixing", params,
        f"{_names(jaxpr, mixing)} combine the samples of the batch (e.g. batch statistics); "
        "traces are kept per sample, so the coupling between samples over time is dropped"),)


def coupling_equations(jaxpr: jex_core.Jaxpr, layout: StepLayout,
                       stops: Collection[int]) -> set[int]:
    """The equations among ``stops`` (cut from ``D``) that read hidden-derived values."""
    blocked = {(i, k) for i in stops for k in range(len(jaxpr.eqns[i].invars))}
    from_hidden, _ = reached(jaxpr, layout.hidden_invars(jaxpr), blocked)
    return {i for i in stops if any(is_var(v) and v in from_hidden for v in jaxpr.eqns[i].invars)}


def _names(jaxpr: jex_core.Jaxpr, eqns: Iterable[int], limit: int = 4) -> str:
    listed = list(dict.fromkeys(f"'{jaxpr.eqns[i].primitive.name}' (eqn {i})" for i in eqns))
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more


def find_approximations(
    jaxpr: jex_core.Jaxpr,
    layout: StepLayout,
    *,
    groups: Sequence[HiddenGroup],
    relations: Sequence[Relation],
    exclusions: Sequence[Exclusion],
    coupling_eqns: Collection[int],
    output_mixing: dict[int, list[int]],
) -> tuple[Approximation, ...]:
    """Every approximation of a graph's traces (module docstring).

    Args:
        jaxpr: The flat step.
        layout: Its leaf layout.
        groups: The hidden groups.
        relations: The traced relations.
        exclusions: ETP operations (or targets) not traced.
        coupling_eqns: Equations that read hidden-derived values and are cut
            from ``D`` (see :func:`coupling_equations`).
        output_mixing: ``{ETP eqn: mixing equations on the way from its output}``.
    """
    hidden_out = layout.hidden_outvars(jaxpr)
    feeds_hidden = feeding(jaxpr, hidden_out)
    group_params: dict[int, set[str]] = {}
    for r in relations:
        group_params.setdefault(r.group, set()).update(r.all_param_paths)
    found = [*_coupling(jaxpr, layout, groups, group_params, coupling_eqns, feeds_hidden)]
    for g in groups:
        if g.colours is not None and group_params.get(g.index):
            found.append(Approximation(
                "moved-positions", tuple(sorted(group_params[g.index])),
                f"the step moves values of hidden group {list(g.paths)} between positions; D "
                "keeps only the same-position part"))
    for r in relations:
        mixing = [i for i in output_mixing.get(r.eqn_index, ())
                  if any(is_var(v) and v in feeds_hidden for v in jaxpr.eqns[i].outvars)]
        if mixing:
            found.append(Approximation(
                "output-mixing", r.all_param_paths,
                f"the output of '{r.primitive.name}' (eqn {r.eqn_index}) reaches hidden group "
                f"{list(groups[r.group].paths)} also through {_names(jaxpr, mixing)}, which mix "
                "units; Df keeps only the elementwise part of ∂h/∂y"))
    found.extend(_untraced_paths(jaxpr, layout, relations, exclusions, feeds_hidden))
    found.extend(_carried_state(jaxpr, layout, relations))
    return tuple(dict.fromkeys(found))


def _coupling(jaxpr, layout, groups, group_params, coupling_eqns, feeds_hidden):
    """``'hidden-coupling'``: cut equations between hidden state and hidden state."""
    hidden_in = layout.hidden_invars(jaxpr)
    group_of = {hidden_in[leaf]: {g.index} for g in groups for leaf in g.leaves}
    for eqn in jaxpr.eqns:
        sources = set().union(*(group_of.get(v, set()) for v in eqn.invars if is_var(v)))
        if sources:
            for v in eqn.outvars:
                if is_var(v):
                    group_of[v] = sources
    by_groups: dict[frozenset[int], list[int]] = {}
    for i in sorted(coupling_eqns):
        eqn = jaxpr.eqns[i]
        if not any(is_var(v) and v in feeds_hidden for v in eqn.outvars):
            continue
        sources = frozenset().union(*(group_of.get(v, set()) for v in eqn.invars if is_var(v)))
        by_groups.setdefault(sources, []).append(i)
    for sources, eqns in by_groups.items():
        params = sorted(set().union(*(group_params.get(g, set()) for g in sources)))
        if not params:
            continue
        paths = [p for g in sorted(sources) for p in groups[g].paths]
        yield Approximation(
            "hidden-coupling", tuple(params),
            f"{_names(jaxpr, eqns)} read hidden state {paths} and feed hidden state without "
            "being elementwise; D keeps only the elementwise part of ∂h^t/∂h^{t-1}")


def _untraced_paths(jaxpr, layout, relations, exclusions, feeds_hidden):
    """``'untraced-path'``: Params that reach hidden state other than as traced operands."""
    blocked = {(r.eqn_index, k) for r in relations for k in r.operands.values()}
    traced_eqns = {r.eqn_index for r in relations}
    reasons: dict[str, list[str]] = {}
    for x in exclusions:
        for p in x.param_paths:
            reasons.setdefault(p, []).append(f"'{x.primitive}' (eqn {x.eqn_index}): {x.reason}")
        if x.eqn_index in traced_eqns and x.param_paths:
            yield Approximation(
                "untraced-path", tuple(x.param_paths),
                f"'{x.primitive}' (eqn {x.eqn_index}) is traced into one hidden group but not "
                f"another: {x.reason}")
    targets = {v for v in layout.hidden_outvars(jaxpr) if is_var(v)}
    for var, path in zip(layout.param_invars(jaxpr), layout.param_paths):
        values, eqns = reached(jaxpr, [var], blocked)
        if not values & targets:
            continue
        on_path = [i for i in eqns if any(is_var(v) and v in feeds_hidden
                                          for v in jaxpr.eqns[i].outvars)]
        why = "; ".join(reasons.get(path, [])) or "no traced ETP operation covers this path"
        yield Approximation(
            "untraced-path", (path,),
            f"reaches hidden state through {_names(jaxpr, on_path)}, which no trace follows "
            f"({why}); it gets its exact same-step gradient but no credit over time")


def _carried_state(jaxpr, layout, relations):
    """``'carried-state'``: non-hidden Variables that carry gradient-bearing values."""
    outs = layout.split_outputs(jaxpr.outvars)
    read_again = feeding(jaxpr, outs.y + outs.hidden)
    traced = sorted({p for r in relations for p in r.all_param_paths})
    from_hidden, _ = reached(jaxpr, layout.hidden_invars(jaxpr))
    for path, other_in, other_out in zip(layout.other_paths, layout.other_invars(jaxpr),
                                         outs.other):
        if other_out is other_in or other_in not in read_again:
            continue
        params = {p for v, p in zip(layout.param_invars(jaxpr), layout.param_paths)
                  if other_out in reached(jaxpr, [v])[0]}
        if other_out in from_hidden:
            params.update(traced)
        if params:
            yield Approximation(
                "carried-state", tuple(sorted(params)),
                f"'{path}' is carried from step to step, depends on these Params (or on hidden "
                "state) and is read again, but it is not a HiddenState, so no trace follows it "
                "(declare it braintrace.HiddenState)")
