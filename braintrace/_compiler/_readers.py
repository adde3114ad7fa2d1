"""Which traced operations read a hidden group's new state, unit by unit: a group's *readers*.

A relation ``r'`` (an ETP operation with an input) *reads* hidden group ``g``
when its input ``x'`` is computed, in the same step, from ``g``'s new state
``h_g^t``, shaped like the group and position by position: ``x'[v]`` depends
on ``h_g^t[v, ·]`` only (a layer's spikes ``z = H(v - A)`` fed to the next
layer or a readout). Then ``∂x'^t/∂h_g^t`` is diagonal, ``ψ[v, s]``, and the
pullback of a reader's input cotangent ``∂L_t/∂x'`` lands on ``g``'s units.
OTPE estimates the effect of ``g``'s weights on the reader's later outputs
through that path (``braintrace/_algorithms/_otpe.py``). A reader is one reading
*operation*: an equation whose output feeds several groups (several relations)
is listed once, by its first relation, and its input cotangent ``∂L_t/∂x'`` is
taken at that equation's operand alone (``programs.forward``'s ``input_probes``),
not at every read of ``x'``.

Found structurally, by position maps (``_positions.py``): elementwise and
data-movement operations are followed, a value reached through an operation
that mixes positions is not position by position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from braintrace._compiler._positions import propagate, source_map
from braintrace._compiler._records import HiddenGroup, InputRelation
from braintrace._compiler._walk import is_var, reached

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = ["reader_list", "readers"]


def _position_by_position(m: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether map ``m`` sends element ``v`` to source position ``v`` alone (or to none)."""
    own = source_map(shape)[..., 0]
    found = m[..., 0]
    rest = m[..., 1:]
    return bool(np.all((found == own) | (found == -1)) and np.all(rest == -1))


def readers(graph: ETraceGraph) -> tuple[tuple[int, ...], ...]:
    """Per hidden group, the indices (in ``graph.relations``) of the relations that read it.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._compiler._readers import readers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4),
        ...                        layers.LeakyReadout(4, 2, rngs=nnx.Rngs(1)))
        >>> graph = braintrace.compile_graph(model, jnp.ones(3))
        >>> [g.paths for g in graph.groups], readers(graph)  # the readout reads the spikes
        ([('layers.1.v',), ('layers.2.y',)], ((1,), ()))
    """
    outvars = graph.new_state_vars()
    return tuple(_read_by(graph, [outvars[k] for k in g.leaves if is_var(outvars[k])], g)
                 for g in graph.groups)


def _read_by(graph: ETraceGraph, starts: list, group: HiddenGroup) -> tuple[int, ...]:
    """The relations reading ``group``, whose new state's variables are ``starts``."""
    jaxpr = graph.jaxpr
    mixing: list[int] = []
    env = propagate(jaxpr, {v: source_map(v.aval.shape) for v in starts},
                    on_mixing=lambda i, _: mixing.append(i))
    mixed, _ = reached(jaxpr, [v for i in mixing for v in jaxpr.eqns[i].outvars if is_var(v)])
    reach, _ = reached(jaxpr, starts)
    shape = tuple(group.shape)
    found: dict[int, int] = {}  # one reader per reading operation: {eqn index: relation}
    for r in graph.relations:
        if (isinstance(r, InputRelation) and r.group != group.index
                and (x := graph.relation_input_var(r)) in reach and x not in mixed and x in env
                and tuple(x.aval.shape) == shape and _position_by_position(env[x], shape)):
            found.setdefault(r.eqn_index, r.index)
    return tuple(found.values())


def reader_list(found: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """``(group, relation)`` for every reader of :func:`readers`, in group order: the order of
    the readers' input probes.

    Example:
        >>> reader_list(((1, 2), (), (0,)))
        [(0, 1), (0, 2), (2, 0)]
    """
    return [(g, r) for g, rs in enumerate(found) for r in rs]
