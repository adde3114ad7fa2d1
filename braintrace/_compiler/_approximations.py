"""Approximations pass: where the traces of a graph are not the exact influence ``∂h^t/∂θ``.

The same-step gradient is always exact (see ``_loops/_per_step.py``); what
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

Each carries a one-sentence summary in module terms (the modules the
operations run in, the states and Params by path) with what to do, and the
equations for the details. ``braintrace.compile(..., strict=True)`` refuses a
graph with any of these.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import jax.extend.core as jex_core

from braintrace._compiler._flax_cells import cell_sentence, flax_cells
from braintrace._compiler._layout import StepLayout
from braintrace._compiler._modules import ModuleMap
from braintrace._compiler._phrases import (
    EXACT_ALTERNATIVES,
    eqn_names,
    operations,
    params_phrase,
    states_phrase,
)
from braintrace._compiler._positions import OPAQUE_CALLS
from braintrace._compiler._records import Approximation, Exclusion, HiddenGroup, Relation
from braintrace._compiler._walk import feeding, is_var, reached

__all__ = ["Approximation", "coupling_equations", "find_approximations",
           "find_full_approximations", "sample_mixing"]


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


def sample_mixing(jaxpr: jex_core.Jaxpr, modules: ModuleMap, eqns: Iterable[int],
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
        f"{eqn_names(jaxpr, mixing)} combine the samples of the batch (e.g. batch statistics); "
        "traces are kept per sample, so the coupling between samples over time is dropped",
        f"{operations(jaxpr, modules, mixing, ('combines', 'combine'))} the samples of a batch "
        "(batch statistics), but traces are kept per sample, so the credit over time of "
        f"{params_phrase(params)} through that coupling is dropped; normalise per sample "
        "(nnx.LayerNorm) or use BatchNorm's running averages (use_running_average=True)."),)


def coupling_equations(jaxpr: jex_core.Jaxpr, layout: StepLayout,
                       stops: Collection[int]) -> set[int]:
    """The equations among ``stops`` (cut from ``D``) that read hidden-derived values."""
    blocked = {(i, k) for i in stops for k in range(len(jaxpr.eqns[i].invars))}
    from_hidden, _ = reached(jaxpr, layout.hidden_invars(jaxpr), blocked)
    return {i for i in stops if any(is_var(v) and v in from_hidden for v in jaxpr.eqns[i].invars)}


def find_approximations(
    jaxpr: jex_core.Jaxpr,
    layout: StepLayout,
    modules: ModuleMap,
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
        modules: The modules its equations run in (for the summaries).
        groups: The hidden groups.
        relations: The traced relations.
        exclusions: ETP operations (or targets) not traced.
        coupling_eqns: Equations that read hidden-derived values and are cut
            from ``D`` (see :func:`coupling_equations`).
        output_mixing: ``{ETP eqn: mixing equations on the way from its output}``.
    """
    feeds_hidden = feeding(jaxpr, layout.hidden_outvars(jaxpr))
    group_params: dict[int, set[str]] = {}
    for r in relations:
        group_params.setdefault(r.group, set()).update(r.all_param_paths)
    found = [*_coupling(jaxpr, layout, modules, groups, group_params, coupling_eqns,
                        feeds_hidden)]
    found.extend(_moved_positions(jaxpr, layout, modules, groups, group_params))
    for r in relations:
        mixing = [i for i in output_mixing.get(r.eqn_index, ())
                  if any(is_var(v) and v in feeds_hidden for v in jaxpr.eqns[i].outvars)]
        if mixing:
            found.append(_output_mixing(jaxpr, modules, groups[r.group], r, mixing))
    found.extend(_untraced_paths(jaxpr, layout, modules, relations, exclusions, feeds_hidden))
    found.extend(_carried_state(jaxpr, layout, modules, relations))
    return tuple(dict.fromkeys(found))


def find_full_approximations(jaxpr: jex_core.Jaxpr, layout: StepLayout, modules: ModuleMap, *,
                             relations: Sequence[Relation],
                             exclusions: Sequence[Exclusion]) -> tuple[Approximation, ...]:
    """The approximations of the full scope (exact RTRL's influence ``∂h^t/∂θ``).

    Its traces follow every path of the step, so only ``'untraced-path'``,
    ``'carried-state'`` and, for a batched step, ``'sample-mixing'`` remain:
    the operations from ``h^{t-1}`` or a traced output to ``h^t`` that combine
    the samples of the batch.
    """
    feeds_hidden = feeding(jaxpr, layout.hidden_outvars(jaxpr))
    found = [*_untraced_paths(jaxpr, layout, modules, relations, exclusions, feeds_hidden),
             *_carried_state(jaxpr, layout, modules, relations)]
    if any(r.batched for r in relations):
        starts = [*layout.hidden_invars(jaxpr),
                  *(jaxpr.eqns[r.eqn_index].outvars[r.primitive.y_outvar_index]
                    for r in relations)]
        _, on_paths = reached(jaxpr, starts)
        found.extend(sample_mixing(
            jaxpr, modules, [i for i in on_paths if any(is_var(v) and v in feeds_hidden
                                                        for v in jaxpr.eqns[i].outvars)],
            relations))
    return tuple(dict.fromkeys(found))


def _coupling(jaxpr, layout, modules, groups, group_params, coupling_eqns, feeds_hidden):
    """``'hidden-coupling'``: cut equations between hidden state and hidden state."""
    hidden_in = layout.hidden_invars(jaxpr)
    group_of = {hidden_in[leaf]: {g.index} for g in groups for leaf in g.leaves}
    for eqn in jaxpr.eqns:
        sources = set().union(*(group_of.get(v, set()) for v in eqn.invars if is_var(v)))
        if sources:
            for v in eqn.outvars:
                if is_var(v):
                    group_of[v] = sources
    hidden_out = layout.hidden_outvars(jaxpr)
    blocked = {(j, k) for j in coupling_eqns for k in range(len(jaxpr.eqns[j].invars))}
    by_groups: dict[tuple[frozenset[int], tuple[str, ...]], list[int]] = {}
    for i in sorted(coupling_eqns):
        eqn = jaxpr.eqns[i]
        if not any(is_var(v) and v in feeds_hidden for v in eqn.outvars):
            continue
        sources = frozenset().union(*(group_of.get(v, set()) for v in eqn.invars if is_var(v)))
        fed = reached(jaxpr, [v for v in eqn.outvars if is_var(v)], blocked)[0]
        fed_paths = tuple(p for g in groups for k, p in zip(g.leaves, g.paths)
                          if hidden_out[k] in fed)
        by_groups.setdefault((sources, fed_paths), []).append(i)
    for (sources, fed_paths), eqns in by_groups.items():
        params = sorted(set().union(*(group_params.get(g, set()) for g in sources)))
        if not params:
            continue
        paths = [p for g in sorted(sources) for p in groups[g].paths]
        ops = operations(jaxpr, modules, eqns, ("couples", "couple")
                         if set(fed_paths) <= set(paths) else ("carries", "carry"))
        if set(fed_paths) <= set(paths):
            what = (f"{ops} different units of {states_phrase(modules, paths)} from one step to "
                    "the next (recurrent weights, a matrix or a reduction), but the diagonal "
                    "traces keep only each unit's own recurrence")
            spikes = _through_spikes(jaxpr, [hidden_in[leaf] for g in sources
                                             for leaf in groups[g].leaves], eqns)
            remedy, own = ((SPIKING_REMEDY, SPIKING_OWN) if spikes
                           else (RECURRENT_REMEDY, RECURRENT_OWN))
        else:
            fed = states_phrase(modules, [p for p in fed_paths if p not in paths])
            what = (f"{ops} {states_phrase(modules, paths)} into {fed} (a feed-forward "
                    "connection between two stateful layers, or a matrix or a reduction), but "
                    "the diagonal traces keep each hidden group's own recurrence only")
            remedy, own = f"{EXACT_ALTERNATIVES}.", ""
        what = f"{what}, so the credit over time of {params_phrase(params)} through that coupling"
        yield Approximation(
            "hidden-coupling", tuple(params),
            f"{eqn_names(jaxpr, eqns)} read hidden state {paths} and feed hidden state without "
            "being elementwise; D keeps only the elementwise part of ∂h^t/∂h^{t-1}",
            f"{what} is dropped; {remedy}", f"{what} is dropped{own}.")


RECURRENT_REMEDY = (f"{EXACT_ALTERNATIVES}, or use a layer with an elementwise recurrence "
                    "(MinGRUCell, MinLSTMCell, LRU).")
"""What to do about recurrent weights of a non-spiking layer."""

RECURRENT_OWN = "; layers with an elementwise recurrence (MinGRUCell, MinLSTMCell, LRU) have none"
""":data:`RECURRENT_REMEDY` without the shared exact alternatives (a short report's)."""

SPIKING_REMEDY = ("drop the recurrent weights if the task allows (a spiking layer fed only "
                  "forward, ETPLinear into LIF or ALIF, has exact DRTRL() traces), or keep them: "
                  f"{EXACT_ALTERNATIVES}.")
"""What to do about recurrent weights between spiking neurons."""

SPIKING_OWN = ("; drop the recurrent weights if the task allows (a spiking layer fed only "
               "forward, ETPLinear into LIF or ALIF, has exact DRTRL() traces)")
""":data:`SPIKING_REMEDY` without the shared exact alternatives (a short report's)."""

_COMPARISONS = frozenset({"gt", "ge", "lt", "le"})


def _is_spike(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` is a spike function: a custom-derivative call whose body compares
    (a step forward, a surrogate derivative backward, as ``layers.spike``)."""
    if eqn.primitive.name not in OPAQUE_CALLS:
        return False
    return any(inner.primitive.name in _COMPARISONS
               for body in jex_core.jaxprs_in_params(eqn.params) for inner in body.eqns)


def _through_spikes(jaxpr: jex_core.Jaxpr, states: Sequence[object],
                    eqns: Sequence[int]) -> bool:
    """Whether the coupling equations ``eqns`` read ``states`` through a spike function."""
    feeds = feeding(jaxpr, [v for i in eqns for v in jaxpr.eqns[i].invars if is_var(v)])
    _, from_states = reached(jaxpr, states)
    return any(_is_spike(jaxpr.eqns[i]) for i in from_states
               if any(is_var(v) and v in feeds for v in jaxpr.eqns[i].outvars))


def _moved_positions(jaxpr, layout, modules, groups, group_params):
    """``'moved-positions'``: groups whose step moves values between positions."""
    del jaxpr, layout
    for g in groups:
        params = tuple(sorted(group_params.get(g.index, ())))
        if g.colours is None or not params:
            continue
        what = (f"The step moves values of {states_phrase(modules, g.paths)} between positions "
                "(a roll or a flip), but the diagonal traces keep only each position's own "
                f"recurrence, so the credit over time of {params_phrase(params)} that moves is "
                "dropped")
        yield Approximation(
            "moved-positions", params,
            f"the step moves values of hidden group {list(g.paths)} between positions; D "
            "keeps only the same-position part", f"{what}; {EXACT_ALTERNATIVES}.", f"{what}.")


def _output_mixing(jaxpr, modules, group, r, mixing):
    """``'output-mixing'``: a traced output reaches hidden state through mixing operations."""
    op = modules.eqn_label(r.eqn_index, f"'{r.primitive.name}'")
    what = (f"Between {op} and {states_phrase(modules, group.paths)}, "
            f"{operations(jaxpr, modules, mixing, ('mixes', 'mix'))} units (e.g. a "
            f"normalisation), but the diagonal traces of {params_phrase(r.all_param_paths)} "
            "keep only the unit-to-unit part of that map")
    return Approximation(
        "output-mixing", r.all_param_paths,
        f"the output of '{r.primitive.name}' (eqn {r.eqn_index}) reaches hidden group "
        f"{list(group.paths)} also through {eqn_names(jaxpr, mixing)}, which mix "
        "units; Df keeps only the elementwise part of ∂h/∂y",
        f"{what}; {EXACT_ALTERNATIVES}, or normalise before the ETP layer instead.",
        f"{what}; normalising before the ETP layer avoids it.")


def _untraced_paths(jaxpr, layout, modules, relations, exclusions, feeds_hidden):
    """``'untraced-path'``: Params that reach hidden state other than as traced operands."""
    blocked = {(r.eqn_index, k) for r in relations for k in r.operands.values()}
    traced_eqns = {r.eqn_index for r in relations}
    reasons: dict[str, list[str]] = {}
    excluded: dict[str, list[Exclusion]] = {}
    for x in exclusions:
        for p in x.param_paths:
            reasons.setdefault(p, []).append(f"'{x.primitive}' (eqn {x.eqn_index}): {x.reason}")
            excluded.setdefault(p, []).append(x)
        if x.eqn_index in traced_eqns and x.param_paths:
            op = modules.eqn_label(x.eqn_index, f"'{x.primitive}'")
            what = (f"{op} is traced into one hidden group but not into another ({x.reason}), "
                    f"so the credit over time of {params_phrase(x.param_paths)} along that path "
                    "is dropped")
            yield Approximation(
                "untraced-path", tuple(x.param_paths),
                f"'{x.primitive}' (eqn {x.eqn_index}) is traced into one hidden group but not "
                f"another: {x.reason}", f"{what}; {EXACT_ALTERNATIVES}.", f"{what}.")
    targets = {v for v in layout.hidden_outvars(jaxpr) if is_var(v)}
    untraced = {}
    for var, path in zip(layout.param_invars(jaxpr), layout.param_paths):
        values, eqns = reached(jaxpr, [var], blocked)
        if values & targets:
            untraced[path] = [i for i in eqns if any(is_var(v) and v in feeds_hidden
                                                     for v in jaxpr.eqns[i].outvars)]
    cells = flax_cells(modules, (p for p in untraced if p not in excluded))
    cell_of = {p: cell for cell, paths in cells.items() for p in paths}
    alike: dict[tuple, list[str]] = {}  # excluded alike, in one module: one sentence
    for path in untraced:
        x = _excluded_because(excluded.get(path, []))
        if x is not None:
            alike.setdefault(_alike(modules, path, x), []).extend(x.param_paths)
    for path, on_path in untraced.items():
        why = "; ".join(reasons.get(path, [])) or "no traced ETP operation covers this path"
        x = _excluded_because(excluded.get(path, []))
        if path in cell_of:
            summary, short = cell_sentence(modules, cell_of[path], cells[cell_of[path]]), ""
        elif x is not None:
            summary, short = _excluded_summary(
                jaxpr, modules, path, x, sorted(set(alike[_alike(modules, path, x)])))
        else:
            summary, short = _untraced_summary(jaxpr, modules, path, on_path,
                                               any(path in r.all_param_paths for r in relations))
        yield Approximation(
            "untraced-path", (path,),
            f"reaches hidden state through {eqn_names(jaxpr, on_path)}, which no trace follows "
            f"({why}); it gets its exact same-step gradient but no credit over time", summary,
            short)


EXCLUDED_BECAUSE = {
    "through-etp-only": (("the operation's output reaches hidden state only through another "
                          "trainable ETP operation ({via}), which the traces of this scope do "
                          "not cross"), EXACT_ALTERNATIVES),
    "through-mixing-only": (("the operation's output reaches hidden state only through "
                             "operations that mix units ({via})"), EXACT_ALTERNATIVES),
    "feeds-several-units": (("each unit of the operation's output feeds several hidden units "
                             "(a broadcast)"), EXACT_ALTERNATIVES),
    "reads-several-outputs": ("a hidden unit reads several units of the operation's output",
                              EXACT_ALTERNATIVES),
    "operand-not-from-params": ("the operation {reason}", "compute its weights from Params only"),
    "opaque-body": (("the operation runs inside a custom_jvp/custom_vjp function the compiler "
                     "cannot see into"), "call the ETP layer outside that function"),
    "batch-mismatch": ("{reason}", "give x and y the same leading batch axis"),
}
"""Per exclusion kind: why an ETP operation is not traced, and what to do (summaries)."""


def _excluded_because(excluded: Sequence[Exclusion]) -> Exclusion | None:
    """The first of a Param's exclusions that :data:`EXCLUDED_BECAUSE` explains."""
    return next((x for x in excluded if x.kind in EXCLUDED_BECAUSE), None)


def _alike(modules, path, x):
    """What makes exclusions one sentence: the Param's module, the kind, the operations
    between, and the specifics where the sentence quotes them."""
    quoted = x.reason if "{reason}" in EXCLUDED_BECAUSE[x.kind][0] else None
    return modules.module_of(path), x.kind, x.via, quoted, x.primitive


def _untraced_summary(jaxpr, modules, path, on_path, traced):
    """The summary (no short one: its advice is its own) of a Param that reaches hidden state
    through plain operations no trace follows (``traced``: the Param is traced elsewhere)."""
    fix = ("use a traced weight only through its ETP operation" if traced else
           "route the operation through an ETP layer (e.g. layers.ETPLinear for "
           "nnx.Linear, layers.ETPElemwise for a gain)")
    summary = (f"{modules.leaf_label(path)} reaches hidden state through "
               f"{operations(jaxpr, modules, on_path)}, where no eligibility trace follows "
               f"it, so that path gives only its same-step gradient (no credit over time); "
               f"{fix}.")
    return summary, ""


def _excluded_summary(jaxpr, modules, path, x, params):
    """The summary and short summary (``Approximation.short``) of the excluded ETP operations
    of ``params`` (one module's, excluded alike, ``path`` among them): why, what to do."""
    because, fix = EXCLUDED_BECAUSE[x.kind]
    owner = modules.module_of(path)
    of = f" of {modules.label(owner)}" if owner is not None else f" ('{x.primitive}')"
    via = operations(jaxpr, modules, x.via) if x.via else ""
    one = len(params) == 1
    what = (f"{params_phrase(params)}{of} {'is' if one else 'are'} not traced: "
            f"{because.format(via=via, reason=x.reason)}, so {'it learns' if one else 'they learn'}"
            " from the same-step gradient only (no credit over time)")
    return f"{what}; {fix}.", (f"{what}." if fix == EXACT_ALTERNATIVES else "")


def _carried_state(jaxpr, layout, modules, relations):
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
            module = modules.module_of(path)
            where = "" if module is None else f" of {modules.label(module)}"
            yield Approximation(
                "carried-state", tuple(sorted(params)),
                f"'{path}' is carried from step to step, depends on these Params (or on hidden "
                "state) and is read again, but it is not a HiddenState, so no trace follows it "
                "(declare it braintrace.HiddenState)",
                f"`{path}`{where} is carried from step to step and depends on "
                f"{params_phrase(sorted(params))} (or on hidden state), but it is not a "
                "HiddenState, so no trace follows it; declare it braintrace.HiddenState.")
