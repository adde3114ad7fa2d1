"""When the fast learning signal equals the exact one: a structural check of the step.

The exact per-step gradient (``_loops/_per_step.py``) is

.. math::

    \\nabla_\\theta L_t = \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1}}
        + \\frac{\\partial L_t}{\\partial h^{t-1}} \\cdot \\epsilon^{t-1}.

The fast one contracts ``δ^t = ∂L_t/∂h^t`` (``h^t`` an input of the rest of
the step) with the updated traces ``ε^t = D^t ε^{t-1} + Df^t ⊗ x^t``, plus the
same-step gradient by every path but the traced operations'. By the chain
rule the two are equal when

* the traces are the exact influence ``∂h^t/∂θ`` wherever a signal reaches
  them (the graph has no approximations: ``D`` is the one-step Jacobian
  ``∂h^t/∂h^{t-1}`` on the traces' support, ``Df ⊗ x`` the whole immediate
  influence, no Param reaches ``h^t`` by an untraced path);
* the step's outputs read the previous state and the traced operations'
  outputs only through the new state ``h^t`` (``'reads-before-update'``);
* no new state is computed from another new state of the same step
  (``'new-from-new'``: its trace already holds that path, which ``δ^t`` of
  the other state would count again);

and the algorithm's trace update is additive (``ε^t = D ε^{t-1} + Df ⊗ x``,
which the algorithm knows). :func:`fast_signal_obstacles` lists what stands in
the way, as records; an empty tuple means the compiler proves the two equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from braintrace._compiler._phrases import operations
from braintrace._compiler._walk import is_var, reached

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = ["SignalObstacle", "fast_signal_obstacles"]


class SignalObstacle(NamedTuple):
    """Why the fast learning signal is not the exact one on a graph.

    Attributes:
        kind: ``'approximate-traces'``, ``'reads-before-update'`` or ``'new-from-new'``
            (module docstring).
        detail: One plain phrase naming the states or operations.
    """

    kind: str
    detail: str


def fast_signal_obstacles(graph: ETraceGraph) -> tuple[SignalObstacle, ...]:
    """What keeps the fast learning signal from equalling the exact one on ``graph``.

    Returns:
        One record per obstacle (module docstring); empty when the two are equal
        for an algorithm whose trace update is additive.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._compiler._fast_signal import fast_signal_obstacles
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> fast_signal_obstacles(braintrace.compile_graph(model, jnp.ones((3,))))
        ()
        >>> cell = layers.Stateful(layers.GRUCell(3, 4, rngs=nnx.Rngs(0)))
        >>> [o.kind for o in fast_signal_obstacles(braintrace.compile_graph(cell, jnp.ones((3,))))]
        ['approximate-traces']
    """
    found = []
    if graph.approximations:
        kinds = ", ".join(dict.fromkeys(a.kind for a in graph.approximations))
        found.append(SignalObstacle(
            "approximate-traces",
            f"the traces are not the exact influence of the Params on the hidden state ({kinds}; "
            "see the approximations)"))
    found.extend(_reads_before_update(graph))
    found.extend(_new_from_new(graph))
    return tuple(found)


def _new_outvars(graph: ETraceGraph) -> dict[object, str]:
    """``{variable of a new state: its path}`` (literals and repeated variables left out;
    ``graph.new_state_vars()``: a value cast into the state's dtype is the new state)."""
    out: dict[object, str] = {}
    for var, path in zip(graph.new_state_vars(), graph.hidden_paths):
        if is_var(var) and var not in out:
            out[var] = path
    return out


def _reads_before_update(graph: ETraceGraph) -> list[SignalObstacle]:
    """The step's outputs computed from ``h^{t-1}`` or a traced output other than through
    ``h^t``."""
    jaxpr, new = graph.jaxpr, _new_outvars(graph)
    through_new = {(i, k) for i, eqn in enumerate(jaxpr.eqns)
                   for k, v in enumerate(eqn.invars) if is_var(v) and v in new}
    previous = [(v, path) for v, path in zip(graph.layout.hidden_invars(jaxpr),
                                             graph.hidden_paths) if v not in new]
    traced = [(graph.relation_output_var(e), operations(jaxpr, graph.modules, [e]))
              for e in dict.fromkeys(r.eqn_index for r in graph.relations)]
    outputs = [v for v in graph.layout.split_outputs(jaxpr.outvars).y
               if is_var(v) and v not in new]
    found = []
    for var, name in [*previous, *traced]:
        if var in new:
            continue
        values, _ = reached(jaxpr, [var], through_new)
        if any(v in values for v in outputs):
            what = f"the state '{name}' before the update" if (var, name) in previous else (
                f"the output of {name}")
            found.append(SignalObstacle(
                "reads-before-update",
                f"the step's output reads {what} other than through the new hidden state"))
    return found


def _new_from_new(graph: ETraceGraph) -> list[SignalObstacle]:
    """New states computed from another new state of the same step."""
    jaxpr, new = graph.jaxpr, _new_outvars(graph)
    found = []
    for var, path in new.items():
        values, _ = reached(jaxpr, [var])
        later = [p for v, p in new.items() if v is not var and v in values]
        if later:
            found.append(SignalObstacle(
                "new-from-new",
                f"the new value of {', '.join(repr(p) for p in later)} is computed from the "
                f"new value of '{path}' in the same step"))
    return found
