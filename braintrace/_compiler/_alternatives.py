"""The strict-exact alternatives on a compiled model: what reports and errors advise.

A graph knows its own scope's approximations; whether another algorithm is
exact on the same model is a question for the graph of *its* scope, built
here from the same step (no retracing) when a report or an error asks.
"""

from __future__ import annotations

import math
from typing import Any

import jax.extend.core as jex_core

from braintrace._compiler._build import build_graph
from braintrace._compiler._flax_cells import DROP_INS, cell_sentence, flax_cells
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._phrases import RTRL_TIME
from braintrace._compiler._records import Approximation

__all__ = ["approximations_of", "exact_algorithms", "exact_alternatives", "flax_cell_advice",
           "rescope"]


def approximations_of(graph: ETraceGraph, algorithm: Any = None) -> tuple[Approximation, ...]:
    """Where a gradient on ``graph`` is not BPTT's: the graph's traces' approximations that
    hold for ``algorithm`` (its ``graph_approximations``, when it keeps traces; without an
    algorithm, the traces are asked about), then what ``algorithm`` approximates by
    construction. BPTT keeps none, and approximates nothing.
    """
    if algorithm is None:
        return graph.approximations
    return (*(algorithm.graph_approximations(graph) if algorithm.keeps_traces else ()),
            *algorithm.approximations(graph))


def rescope(graph: ETraceGraph, scope: str) -> ETraceGraph:
    """The same step compiled in another scope (``graph`` itself for its own scope)."""
    if graph.scope == scope:
        return graph
    return build_graph(jex_core.ClosedJaxpr(graph.jaxpr, list(graph.consts)), graph.layout,
                       scope=scope, modules=graph.modules, notes=graph.notes,
                       warnings=graph.warnings)


def _influence_bytes(graph: ETraceGraph) -> int:
    """Roughly RTRL's influence memory: batch × hidden units × traced operand sizes."""
    hidden = graph.layout.hidden_invars(graph.jaxpr)
    batched = any(r.batched for r in graph.relations)
    batch = hidden[0].aval.shape[0] if batched and hidden and hidden[0].aval.shape else 1
    units = _hidden_units(graph)
    jaxpr = graph.jaxpr
    size = sum(math.prod(jaxpr.eqns[r.eqn_index].invars[k].aval.shape)
               * jaxpr.eqns[r.eqn_index].invars[k].aval.dtype.itemsize
               for r in graph.relations for k in r.operands.values())
    return batch * units * size


def _hidden_units(graph: ETraceGraph) -> int:
    """``N``: the hidden units of one sample."""
    hidden = graph.layout.hidden_invars(graph.jaxpr)
    batched = any(r.batched for r in graph.relations)
    return sum(math.prod(v.aval.shape[1 if batched else 0:]) for v in hidden)


def exact_algorithms(graph: ETraceGraph) -> list[str]:
    """The algorithms whose gradient equals BPTT on this model (``strict=True`` accepts
    them): ``DRTRL()`` without approximations in the diagonal scope, ``RTRL()`` without
    any in the full scope (with its memory and time per step)."""
    found = []
    if not rescope(graph, "diagonal").approximations:
        found.append("DRTRL()")
    full = rescope(graph, "full")
    if not full.approximations:
        mib = _influence_bytes(full) / 2 ** 20
        n = _hidden_units(full)
        found.append(f"RTRL() (for small models: an influence of about {mib:.3g} MiB at this "
                     f"batch size, multiplied by the {n} × {n} step Jacobian every step: "
                     f"{RTRL_TIME})")
    return found


def exact_alternatives(graph: ETraceGraph) -> str:
    """One line naming :func:`exact_algorithms` (empty when there is none)."""
    names = exact_algorithms(graph)
    if not names:
        return ""
    return f"Exact on this model (strict=True accepts them): {', '.join(names)}.\n"


def flax_cell_advice(graph: ETraceGraph, algorithm: Any = None) -> list[str]:
    """One sentence per Flax recurrent cell (``nnx.LSTMCell``, ...) whose Params get no credit
    over time under ``algorithm`` (an ``'untraced-path'`` among :func:`approximations_of`),
    naming its drop-in in ``braintrace.layers``; empty when there is none (BPTT: never)."""
    if not set(graph.modules.classes.values()) & set(DROP_INS):
        return []  # no Flax cell: the algorithm's approximations are not even asked for
    untraced = [p for a in approximations_of(graph, algorithm) if a.kind == "untraced-path"
                for p in a.param_paths]
    return [cell_sentence(graph.modules, cell, params)
            for cell, params in flax_cells(graph.modules, dict.fromkeys(untraced)).items()]
