"""Where OTPE equals BPTT, and why not elsewhere, as plain phrases ``report()`` shows.

OTPE (``_otpe.py``) contracts each reader's input cotangent ``g_j^t`` (taken at
that reading operation's own input, ``programs.forward``'s ``input_probes``) with
``R̂_j^t = Σ_k λ^{t-k} ψ_j^k E^k``, and every other path from the layer's new
state to the loss with the exact trace ``E^t`` at the same step. BPTT's credit
of the layer's weights through reader ``j`` at step ``t`` is
``Σ_k (∂L_t/∂x'_j{}^k)·ψ_j^k E^k``, so the two are equal when, for every group
``g`` whose new state another new state is computed from:

* ``E`` is the exact influence ``∂h_g^t/∂θ`` (the graph's only approximation is
  the coupling of ``g`` into the reading groups, no operation the traces do not
  follow reads the previous state: no recurrence across units);
* every such state is reached from ``g`` only through the inputs of ``g``'s
  reading operations (``_compiler.readers``), and each group those operations
  feed leaks by ``λ`` at every step (``D = λ·I``) with a fixed ``Df`` and is read
  by no further state: then ``∂L_t/∂x'_j{}^k = λ^{t-k} g_j^t`` (a reading operation
  is linear in its input: every built-in ETP primitive is);
* the step's output reads neither a previous state nor a traced output other
  than through the new state (the reading group's ``h^t`` holds all of step ``t``'s
  credit, ``'reads-before-update'``);
* no new state is computed from another new state of its own group (a
  ``CuBaLIF``'s membrane from its synaptic current, an ``ExpSynapse`` or a
  ``SumOverTime`` of a layer's spikes): the signal on the new states and the
  group's traces would both hold that path.

Any number of reading operations qualifies, on the spikes or on any position-wise
function of them (``2·s``), and any path from the spikes that is not a reading
operation's (a memoryless readout, a direct term of the output) is exact at its
own step. :func:`otpe_obstacles` names what breaks each condition.
"""

from __future__ import annotations

from braintrace._algorithms._constant_jacobians import constant_jacobians
from braintrace._compiler import (
    ETraceGraph,
    fast_signal_obstacles,
    is_var,
    reached,
    readers,
    states_phrase,
)

__all__ = ["otpe_exact", "otpe_obstacles"]


def _states(graph: ETraceGraph, groups) -> str:
    """``hidden state `b.y` of `b` (LeakyReadout)``: the states of ``groups`` (indices)."""
    return states_phrase(graph.modules, [p for h in sorted(groups) for p in graph.groups[h].paths])


def _couples_previous_state(graph: ETraceGraph) -> bool:
    """Whether an operation that ``D`` does not follow (a traced one, or a cut mixing one)
    reads the previous hidden state other than through the new one: a recurrence across
    units (recurrent weights), which no estimate here follows."""
    jaxpr = graph.jaxpr
    new = {v for v in graph.new_state_vars() if is_var(v)}
    through_new = {(i, k) for i, eqn in enumerate(jaxpr.eqns)
                   for k, v in enumerate(eqn.invars) if is_var(v) and v in new}
    old, _ = reached(jaxpr, graph.layout.hidden_invars(jaxpr), through_new)
    unfollowed = graph.cut_eqns | {r.eqn_index for r in graph.relations}
    return any(is_var(v) and v in old for i in unfollowed for v in jaxpr.eqns[i].invars)


def _new_from_new_within_a_group(graph: ETraceGraph) -> list[str]:
    """The new states computed from another new state of their own group in the same step (a
    synaptic current feeding its membrane, a count of the spikes): OTPE's signal on the new
    state then holds that path as well as the group's traces do."""
    jaxpr = graph.jaxpr
    outs = graph.new_state_vars()
    out = []
    for g in graph.groups:
        for k in g.leaves:
            if not is_var(outs[k]):
                continue
            values, _ = reached(jaxpr, [outs[k]])
            later = [graph.hidden_paths[j] for j in g.leaves
                     if j != k and is_var(outs[j]) and outs[j] is not outs[k] and outs[j] in values]
            if later:
                out.append(f"the new value of {states_phrase(graph.modules, later)} is computed "
                           f"from that of {states_phrase(graph.modules, [graph.hidden_paths[k]])} "
                           "in the same step, in one hidden group (the signal on the new state "
                           "and the group's traces both hold that path)")
    return out


def _reading_obstacles(graph: ETraceGraph, decay: float) -> list[str]:
    """Per group whose new state another new state is computed from: what keeps those
    states from being reading neurons whose dynamics the estimate is (module docstring)."""
    jaxpr, found = graph.jaxpr, readers(graph)
    outs = graph.new_state_vars()
    constant = constant_jacobians(graph)

    def later(g: int, blocked=()) -> set[int]:
        values, _ = reached(jaxpr, [outs[k] for k in graph.groups[g].leaves], blocked)
        return {h.index for h in graph.groups if h.index != g
                and any(outs[k] in values for k in h.leaves)}

    out = []
    for g in graph.groups:
        reading = later(g.index)
        if not reading:
            continue
        ports = {(graph.relations[r].eqn_index, graph.relations[r].primitive.x_invar_index)
                 for r in found[g.index]}
        if bypass := later(g.index, ports):
            out.append(f"the new value of {_states(graph, bypass)} is computed from that of "
                       f"{_states(graph, [g.index])} other than through the input of an "
                       "operation that reads it unit by unit")
        fed: dict[int, list[int]] = {}  # every relation of a reading operation, by group
        for r in graph.relations:
            if (r.eqn_index, r.primitive.x_invar_index) in ports:
                fed.setdefault(r.group, []).append(r.index)
        for h in sorted(reading - bypass):
            out.extend(_reader_state_obstacles(graph, g.index, h, fed.get(h, []), decay,
                                               constant, later(h)))
    return out


def _reader_state_obstacles(graph, g, h, fed, decay, constant, further) -> list[str]:
    """What keeps group ``h``, which reads group ``g`` through relations ``fed``, from the
    estimate's dynamics: a leak ``decay`` at every step, fixed ``Df``, no state reading it."""
    name, layer, out = _states(graph, [h]), _states(graph, [g]), []
    decay_h = constant.decays[h]
    if decay_h is None:
        out.append(f"{name} reads {layer} but does not leak by a constant factor (its "
                   "D = ∂h^t/∂h^{t-1} is not λ·I at every step)")
    elif abs(decay_h - decay) > 1e-6 * max(decay, 1e-12):
        out.append(f"{name} reads {layer} and leaks by {decay_h:g}, not by decay={decay:g}")
    if not fed:
        out.append(f"{name} reads {layer} other than as the output of an operation reading "
                   "it unit by unit")
    if any(not constant.fixed_df[r] for r in fed):
        out.append(f"{name} reads {layer} through a Df = ∂h^t/∂y that changes from step to "
                   "step")
    if further:
        out.append(f"{name} reads {layer} and is itself read by {_states(graph, further)}")
    return out


def otpe_obstacles(graph: ETraceGraph, decay: float) -> tuple[str, ...]:
    """What keeps OTPE with postsynaptic leak ``decay`` from BPTT on ``graph``, one phrase
    each (module docstring); empty where it is exact.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4),
        ...                        layers.LeakyReadout(4, 2, tau=10.0, rngs=nnx.Rngs(1)))
        >>> graph = braintrace.compile_graph(model, jnp.ones(3))
        >>> print(*otpe_obstacles(graph, 0.5))
        hidden state `layers.2.y` of `layers.2` (LeakyReadout) reads hidden state `layers.1.v` \
of `layers.1` (LIF) and leaks by 0.904837, not by decay=0.5
    """
    out = [f"the per-layer traces are approximate ({a.kind}: {a.detail})"
           for a in graph.approximations if a.kind != "hidden-coupling"]
    if _couples_previous_state(graph):
        out.append("an operation the traces do not follow reads the previous hidden state "
                   "(a recurrence across units)")
    out += [o.detail for o in fast_signal_obstacles(graph) if o.kind == "reads-before-update"]
    out += _new_from_new_within_a_group(graph)
    return tuple(dict.fromkeys(out + _reading_obstacles(graph, decay)))


def otpe_exact(graph: ETraceGraph, decay: float) -> bool:
    """Whether OTPE with postsynaptic leak ``decay`` equals BPTT on ``graph``
    (:func:`otpe_obstacles` finds nothing).

    Example:
        >>> import math
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4),
        ...                        layers.LeakyReadout(4, 2, tau=10.0, rngs=nnx.Rngs(1)))
        >>> graph = braintrace.compile_graph(model, jnp.ones(3))
        >>> otpe_exact(graph, math.exp(-0.1)), otpe_exact(graph, 0.5)
        (True, False)
    """
    return not otpe_obstacles(graph, decay)
