"""Hidden-group passes: which hidden states update each other elementwise, and their colours.

1. :func:`hidden_groups`: walk forward from every hidden state ``h^{t-1}``,
   stopping at ETP primitives (that are not gradient-enabled) and at
   operations that mix positions (``dot_general``, reductions, ...). States
   whose new values then depend on each other form one group
   ``h_g^t = f_g(h_g^{t-1}; c)``, all of one shape ``V``, ``S`` states stacked
   on a trailing axis. The mixing operations found are *cut*: ``D`` ignores them.
2. :func:`colour_groups`: within each group, position maps give the positions
   of ``h^{t-1}`` each ``h^t[v]`` depends on. Usually that is ``v`` alone and one
   JVP per state gives ``D`` exactly. A step that moves values between
   positions (a roll, a flip) gets a colouring of the positions, one JVP per
   colour and state, so ``D`` is still exactly the per-position block of the
   cut step's Jacobian.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.extend.core as jex_core
import numpy as np

from braintrace._compiler._layout import StepLayout
from braintrace._compiler._positions import propagate, source_map, union
from braintrace._compiler._records import HiddenGroup

__all__ = ["colour_groups", "colour_positions", "hidden_groups"]

Cut = Callable[[int, jex_core.JaxprEqn], bool]


def _maps_of(env: dict, outvars: list, leaves: tuple[int, ...]) -> list[np.ndarray]:
    found = [env.get(outvars[k]) for k in leaves if not isinstance(outvars[k], jex_core.Literal)]
    return [m for m in found if m is not None]


def hidden_groups(jaxpr: jex_core.Jaxpr, layout: StepLayout,
                  stops_at_etp: Cut) -> tuple[list[HiddenGroup], set[int]]:
    """Pass 1: the hidden groups (without colours) and the equations cut from ``D``."""
    hidden_in, hidden_out = layout.hidden_invars(jaxpr), layout.hidden_outvars(jaxpr)
    cut_eqns: set[int] = set()
    sources = {v: np.full((*v.aval.shape, 1), k, np.int64) for k, v in enumerate(hidden_in)}
    env = propagate(jaxpr, sources, cut=stops_at_etp,
                              on_mixing=lambda i, e: cut_eqns.add(i))
    parent = list(range(layout.num_hidden))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for j in range(layout.num_hidden):
        for m in _maps_of(env, hidden_out, (j,)):
            for i in np.unique(m[m >= 0]):
                parent[find(int(i))] = find(j)
    members: dict[int, list[int]] = {}
    for k in range(layout.num_hidden):
        members.setdefault(find(k), []).append(k)
    groups = [_group(index, tuple(leaves), hidden_in, layout)
              for index, leaves in enumerate(sorted(members.values()))]
    return groups, cut_eqns


def _group(index: int, leaves: tuple[int, ...], hidden_in: list, layout: StepLayout):
    shapes = {tuple(hidden_in[k].aval.shape) for k in leaves}
    if len(shapes) > 1:
        listing = ", ".join(f"'{layout.hidden_paths[k]}' {tuple(hidden_in[k].aval.shape)}"
                            for k in leaves)
        raise ValueError(
            f"Hidden states {listing} update each other elementwise but have different "
            "shapes, so they cannot form one hidden group. Give coupled states one shape "
            "(broadcast the smaller one when creating it).")
    first = hidden_in[leaves[0]].aval
    return HiddenGroup(index=index, leaves=leaves,
                       paths=tuple(layout.hidden_paths[k] for k in leaves),
                       shape=tuple(first.shape), dtype=first.dtype)


def colour_groups(jaxpr: jex_core.Jaxpr, layout: StepLayout, groups: list[HiddenGroup],
                  cut_eqns: set[int], stops_at_etp: Cut) -> list[HiddenGroup]:
    """Pass 2: colours for groups whose step moves values between positions.

    Mixing operations found on the way are added to ``cut_eqns``.
    """
    hidden_in, hidden_out = layout.hidden_invars(jaxpr), layout.hidden_outvars(jaxpr)
    coloured = []
    for g in groups:
        sources = {hidden_in[k]: source_map(g.shape) for k in g.leaves}
        over: list[int] = []
        env = propagate(
            jaxpr, sources, cut=lambda i, e: i in cut_eqns or stops_at_etp(i, e),
            on_mixing=lambda i, e: over.append(i))
        cut_eqns.update(over)
        maps = _maps_of(env, hidden_out, g.leaves)
        colours = None
        if maps:
            deps = union([m.reshape(g.size, -1) for m in maps], (g.size,))
            own = np.arange(g.size)[:, None]
            if not np.all((deps == own) | (deps < 0)):
                colours = colour_positions(deps)
        coloured.append(dataclasses.replace(g, colours=colours))
    return coloured


def colour_positions(deps: np.ndarray) -> np.ndarray:
    """Greedy colouring: positions in one row of ``deps`` other than the row get distinct colours.

    ``deps[v]`` lists (padded with ``-1``) the positions ``h^t[v]`` depends on.
    Position ``u != v`` in ``deps[v]`` must not share ``v``'s colour, so the
    response of ``h^t[v]`` to a tangent on one colour class is ``∂h^t[v]/∂h[v]``.

    Example:
        >>> import numpy as np
        >>> from braintrace._compiler._groups import colour_positions
        >>> colour_positions(np.array([[0, 1], [1, 2], [2, 0]])).tolist()  # a roll
        [0, 1, 2]
    """
    n = deps.shape[0]
    neighbours: list[set[int]] = [set() for _ in range(n)]
    rows, slots = np.nonzero((deps >= 0) & (deps != np.arange(n)[:, None]))
    for v, u in zip(rows.tolist(), deps[rows, slots].tolist()):
        neighbours[v].add(u)
        neighbours[u].add(v)
    colours = np.full(n, -1, np.int64)
    for v in range(n):
        used = {int(colours[u]) for u in neighbours[v]}
        c = 0
        while c in used:
            c += 1
        colours[v] = c
    return colours
