"""The hidden Jacobians of a graph's step: ``D = ∂h^t/∂h^{t-1}`` and ``Df = ∂h^t/∂y``.

Each is a function of an :class:`~braintrace.ETraceGraph` and one
:class:`StepLeaves` record, differentiating the *cut* step (ETP operations and
mixing operations stopped) as evaluated by ``_interpret.evaluate``:

* :func:`jacobians`: each group's ``D`` ``(*V, S, S)`` and each relation's
  ``Df``. Where every input reaches one hidden unit only (no group moves
  positions, no elementwise output shared between units) and a relation has
  several colours (fused gates), from one pullback per state
  (:func:`pulls_jacobians`); elsewhere one JVP per state and colour of a group
  and per colour of a relation (each group's responses to its own, a relation
  whose ``Df`` no rule reads skipped) — exact because units of one colour never
  meet in one output (in two parts, :func:`jacobian_responses` and
  :func:`assemble_jacobians`, so that a loop over a block of steps can arrange
  the colours once for the block);
* :func:`coupled_jacobians`: per-position blocks of the full hidden Jacobian
  (only ETP operations cut), ``N·S`` JVPs per group;
* :func:`full_jacobians`: the full per-sample Jacobians, for exact RTRL.

Re-exported by ``_programs`` (``braintrace._compiler.programs``), where the
loops read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compiler._interpret import evaluate
from braintrace._compiler._layout import StepLeaves
from braintrace._compiler._records import ElementwiseRelation, HiddenGroup, InputRelation
from braintrace._platform import tpu_formulations

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = [
    "arranges_colours",
    "assemble_jacobians",
    "can_pull_jacobians",
    "coupled_jacobians",
    "full_jacobians",
    "jacobian_responses",
    "jacobians",
    "pulls_jacobians",
]


def _etp_stops(graph: ETraceGraph) -> frozenset[int]:
    return frozenset(e for e in graph.etp_eqns
                     if not graph.jaxpr.eqns[e].primitive.gradient_enabled)


def jacobians(graph: ETraceGraph, leaves: StepLeaves, unread: frozenset[int] = frozenset()
              ) -> tuple[list[jax.Array], list[jax.Array | None]]:
    """Each group's ``D`` ``(*V, S, S)`` and each relation's ``Df`` (``None`` for the
    relations in ``unread``, whose ``Df`` no rule reads: its tangents are not taken).

    ``Df`` is ``(*y, S)`` for an operation with an input (entry ``[k, s]`` is
    ``∂h[π(k), s]/∂y[k]``) and ``(*V, S)`` for the elementwise primitive
    (entry ``[v, s]`` is ``∂h[v, s]/∂y[σ(v)]``). Read from ``S`` pullbacks
    where :func:`pulls_jacobians` holds, else from one JVP per slot.
    """
    if pulls_jacobians(graph):
        d, df = _pulled_jacobians(graph, leaves)
        return d, [None if r.index in unread else f for r, f in zip(graph.relations, df)]
    return assemble_jacobians(graph, jacobian_responses(graph, leaves, unread), unread)


def _injected(graph: ETraceGraph) -> list[int]:
    """The traced ETP equations, in the order of the cut step's output injections."""
    return sorted(graph.traced_eqns)


def _hidden_step(graph: ETraceGraph, leaves: StepLeaves, stop: frozenset[int],
                 forward_mode: bool = True):
    """``step(hidden_in, injections=()) -> new hidden states``: the graph's step from the
    hidden states, the equations ``stop`` stopped, each traced output plus its injection
    (in :func:`_injected` order; none given: none added)."""
    injected = _injected(graph)

    def step(hidden_in, injections=()):
        inj = {e: (graph.jaxpr.eqns[e].primitive.y_outvar_index, value)
               for e, value in zip(injected, injections)}
        outs, _ = evaluate(graph.jaxpr, graph.consts, leaves.with_hidden(hidden_in).args(),
                           stop_eqns=stop, injections=inj, forward_mode=forward_mode)
        return graph.layout.split_outputs(outs).hidden

    return step


def _zero_outputs(graph: ETraceGraph) -> list[jax.Array]:
    """Zero injections, one per traced output (in :func:`_injected` order)."""
    return [jnp.zeros(a.shape, a.dtype)
            for a in (graph.relation_output_var(e).aval for e in _injected(graph))]


def _cut(graph: ETraceGraph) -> frozenset[int]:
    """What ``D`` and ``Df`` stop: ETP operations and mixing operations."""
    return graph.cut_eqns | _etp_stops(graph)


def pulls_jacobians(graph: ETraceGraph) -> bool:
    """Whether ``D`` and ``Df`` are read from ``S`` pullbacks of the cut step, one per state:
    where :func:`can_pull_jacobians` and a relation has several colours (fused gates).

    With several colours each JVP's tangent is a mask over one colour's units, which XLA
    cannot tell from a dense tangent: it evaluates every path of every tangent, and fuses
    that into each consumer (a GRU's fast ES-D-RTRL step: 308 → 262 µs with pullbacks).
    With one colour per relation the JVPs are as cheap, and the pullbacks' stored forward
    values cost memory traffic at scale (two-state ALIF at 131,072 neurons: 3-6% slower),
    so those graphs keep the JVPs.
    """
    return can_pull_jacobians(graph) and any(r.num_colours > 1 for r in graph.relations)


def can_pull_jacobians(graph: ETraceGraph) -> bool:
    """Whether ``S`` pullbacks of the cut step give ``D`` and ``Df`` exactly.

    The pullback of a cotangent that is 1 on state ``s`` of every hidden unit gives, at
    input ``u``, ``Σ_v ∂h[v, s]/∂u``. That is the one entry ``D`` or ``Df`` keeps when
    ``u`` reaches one hidden unit only within the cut step: a hidden state its own
    position (no group moves values between positions, ``colours is None``; groups are
    closed under elementwise updates), an output unit ``y[k]`` its ``π(k)`` (checked when
    the relation is made) and no other group (one relation per operation), and an
    elementwise output its own unit (``σ`` the identity).
    """
    relations = graph.relations
    if len({r.eqn_index for r in relations}) != len(relations):
        return False
    if any(g.colours is not None for g in graph.groups):
        return False
    for r in relations:
        if isinstance(r, ElementwiseRelation):
            g = graph.groups[r.group]
            if tuple(r.y_shape) != tuple(g.shape) or not np.array_equal(
                    r.hidden_to_y, np.arange(g.size)):
                return False
    return True


def _unit_cotangent(h: jax.Array, on: bool) -> jax.Array:
    """Ones (``on``) or zeros shaped like ``h``; ``float0`` zeros for a non-float state."""
    if not jnp.issubdtype(h.dtype, jnp.inexact):
        return np.zeros(h.shape, jax.dtypes.float0)
    return jnp.full(h.shape, 1 if on else 0, h.dtype)


def _pulled_jacobians(graph: ETraceGraph, leaves: StepLeaves
                      ) -> tuple[list[jax.Array], list[jax.Array]]:
    """``D`` and ``Df`` from one pullback per state (:func:`can_pull_jacobians`)."""
    if not graph.groups:
        return [], []
    cut_step = _hidden_step(graph, leaves, _cut(graph), forward_mode=False)
    hidden_out, pullback = jax.vjp(cut_step, list(leaves.hidden), _zero_outputs(graph))
    state_of = {leaf: s for g in graph.groups for s, leaf in enumerate(g.leaves)}
    num_states = max(g.num_states for g in graph.groups)
    pulled = []  # per output state s: (∂/∂h_in, ∂/∂y) of Σ_v h[v, s]
    for s in range(num_states):
        pulled.append(pullback([_unit_cotangent(h, state_of.get(k) == s)
                                for k, h in enumerate(hidden_out)]))
    d = [jnp.stack([jnp.stack([pulled[s][0][leaf] for leaf in g.leaves], axis=-1)
                    for s in range(g.num_states)], axis=-2)  # D[..., s, s']
         for g in graph.groups]
    position = {e: i for i, e in enumerate(_injected(graph))}
    df = [jnp.stack([pulled[s][1][position[r.eqn_index]]
                     for s in range(graph.groups[r.group].num_states)], axis=-1)
          for r in graph.relations]
    return d, df


def jacobian_responses(graph: ETraceGraph, leaves: StepLeaves,
                       unread: frozenset[int] = frozenset()) -> list[jax.Array]:
    """The cut step's responses to its tangents, per hidden leaf ``(R_g, *V)``: what
    :func:`assemble_jacobians` arranges into ``D`` and ``Df``.

    A leaf of group ``g`` holds its responses to ``g``'s own ``R_g`` slots only
    (:func:`_group_slots`: its states' colours, then the colours of its relations but those
    in ``unread``, whose ``Df`` no rule reads), the only ones the assembly reads: one
    ``vmap`` of the JVP per group (in a TPU's programs one JVP per slot, below), each
    returning its own leaves, so that XLA computes
    ``Σ_g R_g·|g|`` responses, not ``R·Σ_g |g|`` (an ALIF layer fed by an input and a
    recurrent relation, with a readout: 4 of 6 slots per neuron, 3 when the recurrent
    relation reads the input's ``Df``; each layer of a deeper network only its own slots).
    A leaf of no group holds none, ``(0, *V)``.

    Kept apart so that a loop over time can stack the responses (contiguous
    rows) and arrange a whole block of steps at once: arranged inside the
    loop, XLA:CPU fuses the arrangement into every step's elementwise
    Jacobian and runs it element by element.
    """
    cut_step, hidden_in, zero_y = (_hidden_step(graph, leaves, _cut(graph)),
                                   list(leaves.hidden), _zero_outputs(graph))
    slots = _slots(graph)
    if not slots:
        return []
    tangents = _slot_tangents(graph, hidden_in, zero_y, _injected(graph))
    _, jvp = jax.linearize(cut_step, hidden_in, zero_y)
    index = {slot: i for i, slot in enumerate(slots)}
    outs = [jnp.zeros((0, *h.shape), h.dtype) for h in hidden_in]
    for g in graph.groups:
        numbers = [index[slot] for slot in _group_slots(graph, g, unread)]
        rows = jnp.asarray(numbers, jnp.int32)
        # The one-hot tangents are made inside the vmapped call from the slot's index: a
        # materialised (R, *V) stack of them is loop-invariant, and XLA hoists it out of
        # the time loop as R live copies of every hidden state (384 MiB at 131,072 ALIF
        # neurons). A TPU's programs take one JVP per slot instead, each tangent made from
        # a constant index: XLA:TPU fused the vmapped JVPs into one pass that wrote every
        # response of a block's steps (ES-D-RTRL at 131,072 ALIF neurons, batch 128: 768
        # MiB, 0.7 ms per step on a TPU v5e), where each slot's own JVP fuses into the
        # responses' readers (the block's estimated cycles 8% fewer, compiled for a v5e).
        if tpu_formulations():
            each = [jvp(*tangents(i)) for i in numbers]
            own = [jnp.stack([e[k] for e in each]) for k in g.leaves]
        else:
            own = jax.vmap(lambda slot, g=g: [jvp(*tangents(slot))[k] for k in g.leaves])(rows)
        for k, response in zip(g.leaves, own):
            outs[k] = response
    return outs


def assemble_jacobians(graph: ETraceGraph, outs: Sequence[jax.Array],
                       unread: frozenset[int] = frozenset()
                       ) -> tuple[list[jax.Array], list[jax.Array | None]]:
    """``D`` per group and ``Df`` per relation (``None`` in ``unread``) from
    :func:`jacobian_responses` of the same ``unread``."""
    if not outs:
        return [], []
    row = {g.index: {slot: i for i, slot in enumerate(_group_slots(graph, g, unread))}
           for g in graph.groups}
    return ([_assemble_d(g, outs, row[g.index]) for g in graph.groups],
            [None if r.index in unread else
             _assemble_df(r, graph.groups[r.group], outs, row[r.group])
             for r in graph.relations])


def arranges_colours(graph: ETraceGraph) -> bool:
    """Whether :func:`assemble_jacobians` picks among several colours' responses (a GRU's
    gates), rather than only stacking states. Measured on XLA:CPU: arranging several
    colours per block instead of per step saves ~50 µs/step on a GRU (hidden 256, batch
    16); with one colour, deferring the stacking costs 3-7% (LIF, ALIF)."""
    if pulls_jacobians(graph):  # nothing to arrange
        return False
    return any(g.num_colours > 1 for g in graph.groups) or any(
        r.num_colours > 1 for r in graph.relations)


def _slots(graph: ETraceGraph) -> list[tuple[str, int, int, int]]:
    """The tangent rows in order: per (group, state, colour), then per (relation, colour)."""
    slots = [("group", g.index, s, c) for g in graph.groups for s in range(g.num_states)
             for c in range(g.num_colours)]
    return slots + [("relation", r.index, 0, c) for r in graph.relations
                    for c in range(r.num_colours)]


def _group_slots(graph: ETraceGraph, g: HiddenGroup, unread: frozenset[int] = frozenset()
                 ) -> list[tuple[str, int, int, int]]:
    """The slots of :func:`_slots` whose responses group ``g``'s ``D`` and ``Df`` read, in
    order: ``g``'s states' colours, then the colours of the relations into ``g`` but those
    in ``unread``."""
    return [slot for slot in _slots(graph)
            if (slot[0] == "group" and slot[1] == g.index)
            or (slot[0] == "relation" and graph.relations[slot[1]].group == g.index
                and slot[1] not in unread)]


def _slot_tangents(graph, hidden_in, zero_y, injected):
    """``tangents(slot) -> (hidden tangents, output tangents)``: the one-hot tangent of slot
    ``slot`` of :func:`_slots` (a colour of one state of a group, or a colour of one relation's
    output), made from the slot's index by comparisons with small constant tables."""
    by_target: dict[tuple[str, int], dict[int, Any]] = {}  # target -> {id(source): source}

    def mark(target, colours, colour, i):
        if colours is not None and not np.any(colours):  # one colour: every position
            colours = None
        sources = by_target.setdefault(target, {})
        key = id(colours)
        if key not in sources:
            sources[key] = (colours, np.full(len(slots), -1, np.int32))
        sources[key][1][i] = colour

    slots = _slots(graph)
    position = {e: i for i, e in enumerate(injected)}
    for i, (kind, index, s, c) in enumerate(slots):
        if kind == "group":
            g = graph.groups[index]
            mark(("h", g.leaves[s]), g.colours, c, i)
        else:
            r = graph.relations[index]
            colours = None if isinstance(r, ElementwiseRelation) else r.colours
            mark(("y", position[r.eqn_index]), colours, c, i)

    def one_hot(target, shape, dtype, slot):
        hit = jnp.zeros(shape, bool)
        for colours, table in by_target.get(target, {}).values():
            colour = jnp.asarray(table)[slot]  # -1: the slot is not this target's
            if colours is None:
                hit = hit | jnp.broadcast_to(colour >= 0, shape)
            else:
                hit = hit | (jnp.asarray(np.asarray(colours).reshape(shape)) == colour)
        return hit.astype(dtype)

    def tangents(slot):
        return ([one_hot(("h", k), h.shape, h.dtype, slot) for k, h in enumerate(hidden_in)],
                [one_hot(("y", j), a.shape, a.dtype, slot) for j, a in enumerate(zero_y)])

    return tangents


def _response(g: HiddenGroup, outs: list[jax.Array], i: int) -> jax.Array:
    """``(*V, S)``: the response of every state of ``g`` to tangent row ``i``."""
    return jnp.stack([outs[leaf][i] for leaf in g.leaves], axis=-1)


def _assemble_d(g: HiddenGroup, outs, row) -> jax.Array:
    cols = []
    for s in range(g.num_states):
        responses = [_response(g, outs, row[("group", g.index, s, c)])
                     for c in range(g.num_colours)]
        if g.colours is None:
            cols.append(responses[0])
            continue
        # Position v reads the response to the tangent of its own colour.
        flat = jnp.stack(responses).reshape(g.num_colours * g.size, g.num_states)
        cols.append(g.own_colour_map.take(flat).reshape(*g.shape, g.num_states))
    return jnp.stack(cols, axis=-1)  # (*V, S, S'): D[..., s, s']


def _assemble_df(r, g: HiddenGroup, outs, row) -> jax.Array:
    responses = jnp.stack([_response(g, outs, row[("relation", r.index, 0, c)])
                           for c in range(r.num_colours)])
    if isinstance(r, ElementwiseRelation):
        return responses[0]
    assert isinstance(r, InputRelation)
    flat = responses.reshape(r.num_colours * g.size, g.num_states)
    return r.response_map.take(flat).reshape(*r.y_shape, g.num_states)


def coupled_jacobians(graph: ETraceGraph, leaves: StepLeaves) -> list[jax.Array]:
    """Per-position blocks ``D[v, s, s'] = ∂h[v,s]/∂h[v,s']`` of the full Jacobian.

    Unlike :func:`jacobians`, only ETP operations are cut: coupling through
    other operations (a fixed recurrent matrix) is kept in the Jacobian and
    its diagonal blocks are returned. Costs ``N·S`` JVPs per group.
    """
    step_hidden = _hidden_step(graph, leaves, _etp_stops(graph))
    hidden_in = list(leaves.hidden)
    _, jvp = jax.linearize(lambda h: step_hidden(h), hidden_in)
    d_list = []
    for g in graph.groups:
        n = g.size
        blocks = []
        for leaf_in in g.leaves:
            def unit(j, leaf_in=leaf_in, n=n, g=g):  # one-hot in unit j, made from its index
                tangents = [jnp.zeros(h.shape, h.dtype) for h in hidden_in]
                hot = jnp.arange(n) == j
                tangents[leaf_in] = hot.reshape(g.shape).astype(hidden_in[leaf_in].dtype)
                return jvp(tangents)

            out = jax.vmap(unit)(jnp.arange(n))
            # out[leaf][j, ...] = ∂h_leaf / ∂h_in[j]; keep the diagonal j = v.
            cols = [jnp.diagonal(out[leaf].reshape(n, n)) for leaf in g.leaves]
            blocks.append(jnp.stack(cols, axis=-1))  # (N, S) over s for this s'
        d_list.append(jnp.stack(blocks, axis=-1).reshape(*g.shape, g.num_states,
                                                         g.num_states))
    return d_list


def full_jacobians(graph: ETraceGraph, leaves: StepLeaves,
                   batched: bool) -> tuple[jax.Array, list[jax.Array]]:
    """The full per-sample step Jacobians, for exact RTRL.

    Nothing is cut: ``J[b, n, m] = ∂h^t_n/∂h^{t-1}_m`` over all hidden units of
    one sample (the leaves flattened in order), and for each relation
    ``Df[b, n, j] = ∂h^t_n/∂y_j`` over the units ``j`` of one sample's output
    (for an unbatched output, such as a time constant shared by the batch,
    over all of its units). One JVP per unit of one sample: ``N + Σ|y|``.

    Args:
        graph: The graph.
        leaves: The step's input leaves.
        batched: Whether every hidden leaf (and batched output) has a leading
            batch axis; without one the ``b`` axis is absent.

    Returns:
        ``(J (*B, N, N), [Df (*B, N, *y_sample)] per relation)``.
    """
    injected, zero_y = _injected(graph), _zero_outputs(graph)
    step = _hidden_step(graph, leaves, frozenset())  # nothing cut
    hidden_in = list(leaves.hidden)
    _, jvp = jax.linearize(step, hidden_in, zero_y)
    lead = 1 if batched else 0
    per_unit = ([(h.shape, h.dtype, lead) for h in hidden_in]
                + [(a.shape, a.dtype, lead if _is_batched_y(graph, e) else 0)
                   for e, a in zip(injected, zero_y)])
    sizes = [int(np.prod(shape[l:], dtype=np.int64)) for shape, _, l in per_unit]
    starts = np.cumsum([0, *sizes])
    n_hidden = len(hidden_in)
    tangents = _unit_tangents(per_unit)
    outs = jax.vmap(lambda row: jvp(*_split(tangents(row), n_hidden)))(jnp.arange(starts[-1]))
    # outs[k]: (R, *B, *V_k) -> (*B, N, R): response of unit n to tangent row r.
    flat = jnp.concatenate([o.reshape(o.shape[0], *o.shape[1:1 + lead], -1) for o in outs],
                           axis=-1)
    response = jnp.moveaxis(flat, 0, -1)
    jac = response[..., starts[0]:starts[n_hidden]]
    by_eqn = {}
    for i, (e, (shape, _, l)) in enumerate(zip(injected, per_unit[n_hidden:])):
        block = response[..., starts[n_hidden + i]:starts[n_hidden + i + 1]]
        by_eqn[e] = block.reshape(*block.shape[:-1], *shape[l:])
    return jac, [by_eqn[r.eqn_index] for r in graph.relations]


def _is_batched_y(graph: ETraceGraph, eqn_index: int) -> bool:
    return graph.jaxpr.eqns[eqn_index].primitive.batched


def _split(values: list, at: int) -> tuple[list, list]:
    return values[:at], values[at:]


def _unit_tangents(specs: list[tuple[tuple[int, ...], Any, int]]):
    """``tangents(row)``: one per leaf, a one-hot in unit ``row`` of one sample (counted over
    every leaf's units in order), for every sample; zero in the leaves that do not hold it.

    ``specs`` lists ``(shape, dtype, number of leading batch axes)`` per leaf. The one-hot is
    made from the row's index inside the caller's ``vmap``: a materialised ``(R, *shape)``
    stack would be loop-invariant and hoisted out of a time loop.
    """
    sizes = [int(np.prod(shape[lead:], dtype=np.int64)) for shape, _, lead in specs]
    starts = np.cumsum([0, *sizes])

    def tangents(row):
        out = []
        for (shape, dtype, lead), start, size in zip(specs, starts, sizes):
            sample = (jnp.arange(size) == row - int(start)).reshape(shape[lead:])
            out.append(jnp.broadcast_to(sample, shape).astype(dtype))
        return out

    return tangents
