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
  depends on Params or hidden state and is read again: no trace follows it.

``braintrace.compile(..., strict=True)`` refuses a graph with any of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import jax.extend.core as jex_core

__all__ = ["Approximation", "find_approximations"]


@dataclasses.dataclass(frozen=True)
class Approximation:
    """A place where the traces are not the exact influence of a Param on the hidden state.

    Attributes:
        kind: ``'hidden-coupling'``, ``'moved-positions'``, ``'output-mixing'``,
            ``'untraced-path'`` or ``'carried-state'`` (module docstring).
        param_paths: The Params whose temporal credit it affects.
        detail: Which operations and states, for a person.
    """

    kind: str
    param_paths: tuple[str, ...]
    detail: str

    def describe(self) -> str:
        """One line: the Params, the kind and the detail."""
        return f"{', '.join(self.param_paths)}: {self.kind}: {self.detail}"


def _is_var(v: Any) -> bool:
    return not isinstance(v, (jex_core.Literal, jex_core.DropVar))


def feeding(jaxpr: jex_core.Jaxpr, targets: Iterable[Any]) -> set[Any]:
    """Variables from which some variable of ``targets`` is computed (``targets`` included)."""
    found = {v for v in targets if _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in found for v in eqn.outvars if _is_var(v)):
            found.update(v for v in eqn.invars if _is_var(v))
    return found


def reached(jaxpr: jex_core.Jaxpr, sources: Iterable[Any],
            blocked: Collection[tuple[int, int]] = ()) -> tuple[set[Any], list[int]]:
    """Variables and equations computed from ``sources``.

    An equation does not pass on a value that enters it only through a
    ``(equation index, operand position)`` listed in ``blocked``.
    """
    found = {v for v in sources if _is_var(v)}
    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if any(_is_var(v) and v in found and (i, k) not in blocked
               for k, v in enumerate(eqn.invars)):
            eqns.append(i)
            found.update(v for v in eqn.outvars if _is_var(v))
    return found, eqns


def _names(jaxpr: jex_core.Jaxpr, eqns: Iterable[int], limit: int = 4) -> str:
    listed = list(dict.fromkeys(f"'{jaxpr.eqns[i].primitive.name}' (eqn {i})" for i in eqns))
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more


def find_approximations(
    jaxpr: jex_core.Jaxpr,
    *,
    num_outputs: int,
    param_paths: Sequence[str],
    hidden_paths: Sequence[str],
    other_paths: Sequence[str],
    groups: Sequence[Any],
    relations: Sequence[Any],
    exclusions: Sequence[Any],
    coupling_eqns: Collection[int],
    output_mixing: dict[int, list[int]],
) -> tuple[Approximation, ...]:
    """Every approximation of a graph's traces (module docstring).

    Args:
        jaxpr: The flat step: ``[*params, *hidden, *other, *x]`` to
            ``[*y, *params, *hidden, *other]``.
        num_outputs: Number of output leaves.
        param_paths / hidden_paths / other_paths: Leaf paths.
        groups: The hidden groups.
        relations: The traced relations.
        exclusions: ETP operations (or targets) not traced.
        coupling_eqns: Equations that read hidden-derived values and are cut
            from ``D`` (mixing operations and non-elementwise ETP operations).
        output_mixing: ``{ETP eqn: mixing equations on the way from its output}``.
    """
    n_p, n_h = len(param_paths), len(hidden_paths)
    hidden_out = jaxpr.outvars[num_outputs + n_p:num_outputs + n_p + n_h]
    feeds_hidden = feeding(jaxpr, hidden_out)
    group_params: dict[int, set[str]] = {}
    for r in relations:
        group_params.setdefault(r.group, set()).update(
            p for ps in r.param_paths.values() for p in ps)
    found = [*_coupling(jaxpr, n_p, groups, group_params, coupling_eqns, feeds_hidden)]
    for g in groups:
        if g.colours is not None and group_params.get(g.index):
            found.append(Approximation(
                "moved-positions", tuple(sorted(group_params[g.index])),
                f"the step moves values of hidden group {list(g.paths)} between positions; D "
                "keeps only the same-position part"))
    for r in relations:
        mixing = [i for i in output_mixing.get(r.eqn_index, ())
                  if any(_is_var(v) and v in feeds_hidden for v in jaxpr.eqns[i].outvars)]
        if mixing:
            found.append(Approximation(
                "output-mixing", tuple(sorted({p for ps in r.param_paths.values() for p in ps})),
                f"the output of '{r.primitive.name}' (eqn {r.eqn_index}) reaches hidden group "
                f"{list(groups[r.group].paths)} also through {_names(jaxpr, mixing)}, which mix "
                "units; Df keeps only the elementwise part of ∂h/∂y"))
    found.extend(_untraced_paths(jaxpr, param_paths, relations, exclusions, hidden_out,
                                 feeds_hidden))
    found.extend(_carried_state(jaxpr, num_outputs, param_paths, hidden_paths, other_paths,
                                relations))
    return tuple(dict.fromkeys(found))


def _coupling(jaxpr, n_p, groups, group_params, coupling_eqns, feeds_hidden):
    """``'hidden-coupling'``: cut equations between hidden state and hidden state."""
    group_of = {}
    for g in groups:
        for leaf in g.leaves:
            group_of[jaxpr.invars[n_p + leaf]] = {g.index}
    for eqn in jaxpr.eqns:
        sources = set().union(*(group_of.get(v, set()) for v in eqn.invars if _is_var(v)))
        if sources:
            for v in eqn.outvars:
                if _is_var(v):
                    group_of[v] = sources
    by_groups: dict[frozenset[int], list[int]] = {}
    for i in sorted(coupling_eqns):
        eqn = jaxpr.eqns[i]
        if not any(_is_var(v) and v in feeds_hidden for v in eqn.outvars):
            continue
        sources = frozenset().union(*(group_of.get(v, set()) for v in eqn.invars if _is_var(v)))
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


def _untraced_paths(jaxpr, param_paths, relations, exclusions, hidden_out, feeds_hidden):
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
    targets = {v for v in hidden_out if _is_var(v)}
    for k, path in enumerate(param_paths):
        values, eqns = reached(jaxpr, [jaxpr.invars[k]], blocked)
        if not values & targets:
            continue
        on_path = [i for i in eqns if any(_is_var(v) and v in feeds_hidden
                                          for v in jaxpr.eqns[i].outvars)]
        why = "; ".join(reasons.get(path, [])) or "no traced ETP operation covers this path"
        yield Approximation(
            "untraced-path", (path,),
            f"reaches hidden state through {_names(jaxpr, on_path)}, which no trace follows "
            f"({why}); it gets its exact same-step gradient but no credit over time")


def _carried_state(jaxpr, num_outputs, param_paths, hidden_paths, other_paths, relations):
    """``'carried-state'``: non-hidden Variables that carry gradient-bearing values."""
    n_p, n_h = len(param_paths), len(hidden_paths)
    start = num_outputs + n_p + n_h
    read_again = feeding(jaxpr, jaxpr.outvars[:num_outputs]
                         + jaxpr.outvars[num_outputs + n_p:start])
    traced = sorted({p for r in relations for ps in r.param_paths.values() for p in ps})
    for j, path in enumerate(other_paths):
        other_in, other_out = jaxpr.invars[n_p + n_h + j], jaxpr.outvars[start + j]
        if other_out is other_in or other_in not in read_again:
            continue
        params = {p for k, p in enumerate(param_paths)
                  if other_out in reached(jaxpr, [jaxpr.invars[k]])[0]}
        if other_out in reached(jaxpr, jaxpr.invars[n_p:n_p + n_h])[0]:
            params.update(traced)
        if params:
            yield Approximation(
                "carried-state", tuple(sorted(params)),
                f"'{path}' is carried from step to step, depends on these Params (or on hidden "
                "state) and is read again, but it is not a HiddenState, so no trace follows it "
                "(declare it braintrace.HiddenState)")
