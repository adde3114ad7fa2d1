"""A person-readable report of an eligibility-trace graph, in the model's module terms.

Two forms. The short one (the default) is a few lines: the hidden groups by
module, which Params learn by eligibility traces and which by their same-step
gradient only (and why), one plain sentence per approximation (what is
approximate, and what to do that is particular to it), the exact alternatives
once (what RTRL costs, said once), and the warnings. The verbose one
(``verbose=True``) gives a summary (one sentence per approximation, each with
all its advice), then the details: hidden groups, traced operations, every
Param and why, the approximations with their equations, warnings and what the
normalisation pass changed.

The short report is a list of sections (:data:`SHORT_SECTIONS`), each a
function of the graph, the algorithm and its approximations that returns its
lines: a new kind of line is one more section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from braintrace._compiler._alternatives import (
    approximations_of,
    exact_algorithms,
    exact_alternatives,
)
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._phrases import EXACT_ALTERNATIVES, WINDOWED, listing
from braintrace._compiler._records import Approximation

__all__ = ["SHORT_SECTIONS", "graph_report", "same_step_reasons"]

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


def _head(graph: ETraceGraph, algorithm: Any) -> list[str]:
    lines = ([] if algorithm is None
             else [f"algorithm: {algorithm.name} ({type(algorithm).__name__})"])
    lines.append(f"ETraceGraph ({graph.scope} scope)")
    return lines


def _keeps_no_traces(algorithm: Any) -> list[str]:
    if algorithm is None or algorithm.keeps_traces:
        return []
    return [(f"  '{algorithm.name}' keeps no eligibility traces: every Param's gradient is "
            "reverse mode through the sequence (the details are the traces an online "
            "algorithm would keep)")]


def graph_report(graph: ETraceGraph, algorithm: Any = None, verbose: bool = False) -> str:
    """Describes an ETraceGraph (module docstring); with ``algorithm`` (any object with
    ``name``, ``keeps_traces`` and ``approximations(graph)``), the approximations of a
    gradient by that algorithm (``_alternatives.approximations_of``). ``verbose``: the
    summary and every detail; otherwise the short report."""
    found = approximations_of(graph, algorithm)
    lines = _head(graph, algorithm)
    if not verbose:
        for section in SHORT_SECTIONS:
            lines.extend(section(graph, algorithm, found))
        return "\n".join(lines)
    lines.extend(_summary(graph, algorithm, found))
    lines.extend(_keeps_no_traces(algorithm))
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
    lines.extend(_warnings(graph))
    if graph.notes:
        lines.append("  normalisation:")
        lines.extend(f"    - {n}" for n in graph.notes)
    return "\n".join(lines)


# -- the short report -------------------------------------------------------------------


def _relative(path: str, module: str | None) -> str:
    """``path`` inside ``module`` (``'cell.hi.kernel'`` in ``'rnn'``)."""
    return path[len(module) + 1:] if module else path


def _by_module(graph: ETraceGraph, paths: dict[str, str | None],
               suffix: dict[str | None, str]) -> str:
    """``'`rnn` (Stateful): cell.kernel, cell.bias; `out` (ETPLinear): kernel'``: ``paths``
    (path -> module) by module, each module's ``suffix`` after its Params."""
    by: dict[str | None, list[str]] = {}
    for path, module in paths.items():
        by.setdefault(module, []).append(path)
    parts = []
    for module, members in by.items():
        names = listing((_relative(p, module) for p in members), limit=3)
        label = "" if module is None else f"{graph.modules.label(module)}: "
        parts.append(f"{label}{names}{suffix.get(module, '')}")
    return "; ".join(parts)


def _short_groups(graph: ETraceGraph, algorithm: Any, found: tuple[Approximation, ...]
                  ) -> list[str]:
    """One line: the hidden groups, each by the modules holding its states (a neuron and
    the readout over time that joins its group: ``'`n` (CuBaLIF): i and v, with `count`
    (SumOverTime): c (4,)'``)."""
    del algorithm, found
    parts = []
    for g in graph.groups:
        by: dict[str | None, list[str]] = {}
        for path in g.paths:
            by.setdefault(graph.modules.module_of(path), []).append(path)
        held = []
        for owner, paths in by.items():
            states = listing((_relative(p, owner) for p in paths), limit=3)
            held.append(states if owner is None else f"{graph.modules.label(owner)}: {states}")
        parts.append(f"{', with '.join(held)} {g.shape}")
    more = f"; and {len(parts) - 4} more" if len(parts) > 4 else ""
    return [f"hidden groups ({len(graph.groups)}): {'; '.join(parts[:4])}{more}"]


SHORT_WHY = {
    "readout": "reaches no hidden state (a readout)",
    "through-etp-only": "reaches hidden state only through another trainable ETP operation",
    "through-mixing-only": "reaches hidden state only through operations that mix units",
    "feeds-several-units": "each output unit feeds several hidden units",
    "reads-several-outputs": "a hidden unit reads several of its output units",
    "operand-not-from-params": "its operand is not computed from Params only",
    "opaque-body": "it runs inside a custom_jvp/custom_vjp function",
    "batch-mismatch": "its input and output have different batch axes",
}
"""Why a Param learns from its same-step gradient only, per exclusion kind (short report)."""


def _short_params(graph: ETraceGraph, algorithm: Any, found: tuple[Approximation, ...]
                  ) -> list[str]:
    """Which Params learn by traces (by the hidden state they are traced into) and which by
    their same-step gradient only (by their module, with why)."""
    del found
    if algorithm is not None and not algorithm.keeps_traces:
        return []
    modules = graph.modules
    into: dict[str | None, list[str]] = {}
    traced: set[str] = set()
    for r in graph.relations:
        owner = modules.module_of(graph.groups[r.group].paths[0])
        for path in r.all_param_paths:
            if path not in traced:
                traced.add(path)
                into.setdefault(owner, []).append(path)
    parts = [("" if owner is None else f"into {modules.label(owner)}: ")
             + listing(paths, limit=4) for owner, paths in into.items()]
    lines = [f"Params learning by eligibility traces ({len(traced)}): {'; '.join(parts) or '-'}"]
    why: dict[str, list[str]] = {}
    for x in graph.exclusions:
        for path in x.param_paths:
            why.setdefault(path, []).append(SHORT_WHY.get(x.kind, x.reason))
    same_step = {p: modules.module_of(p) for p in graph.param_paths if p not in traced}
    suffix: dict[str | None, set[str]] = {}
    for path, module in same_step.items():
        suffix.setdefault(module, set()).update(why.get(path, ["no ETP primitive reads it"]))
    if same_step:
        reasons = {m: f" ({'; '.join(sorted(r))})" for m, r in suffix.items()}
        lines.append(f"Params with same-step gradients only ({len(same_step)}): "
                     f"{_by_module(graph, same_step, reasons)}")
    return lines


def _short_approximations(graph: ETraceGraph, algorithm: Any,
                          found: tuple[Approximation, ...]) -> list[str]:
    """The summary of :func:`_summary`, each approximation in its short sentence and the
    exact alternatives once (RTRL's cost said once)."""
    if not found:
        return _summary(graph, algorithm, found)
    lines = [f"approximations ({len(found)}; strict=True refuses them):"]
    lines.extend(f"  - {s}" for s in dict.fromkeys(a.short or a.summary for a in found))
    shared = any(a.short for a in found)
    names = exact_algorithms(graph)
    if names:
        lines.append(f"  Exact on this model (strict=True accepts them): {', '.join(names)}."
                     + (f" Or {WINDOWED}." if shared else ""))
    elif shared:
        lines.append(f"  What is exact instead: {EXACT_ALTERNATIVES}.")
    return lines


def _short_no_traces(graph: ETraceGraph, algorithm: Any, found: tuple[Approximation, ...]
                     ) -> list[str]:
    del graph, found
    return _keeps_no_traces(algorithm)


def _warnings(graph: ETraceGraph, algorithm: Any = None,
              found: tuple[Approximation, ...] = ()) -> list[str]:
    """What tracing the step warned about (both reports)."""
    del algorithm, found
    if not graph.warnings:
        return []
    return ["  warnings:", *(f"    - {w}" for w in graph.warnings)]


def _more(graph: ETraceGraph, algorithm: Any, found: tuple[Approximation, ...]) -> list[str]:
    del graph, algorithm, found
    return ["report(verbose=True) adds every Param, the traced operations and the equations"]


SHORT_SECTIONS: list[Callable[[ETraceGraph, Any, tuple[Approximation, ...]], list[str]]] = [
    _short_approximations, _short_no_traces, _short_groups, _short_params, _warnings, _more]
"""The sections of the short report, in order: each ``section(graph, algorithm,
approximations) -> lines``."""
