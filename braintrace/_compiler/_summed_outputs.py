"""Operations whose outputs are added before anything reads them: they share ``Df``.

A spiking layer's input current is usually ``I = W_in x + W_rec z``: two traced
operations whose outputs ``y_a``, ``y_b`` meet in one ``add`` and are read
nowhere else. Everything the step computes from them it computes from
``y_a + y_b``, so the hidden state's derivative with respect to each is the
same,

.. math::

    Df_b = \\frac{\\partial h^t}{\\partial y_b} = \\frac{\\partial h^t}{\\partial (y_a + y_b)}
         = \\frac{\\partial h^t}{\\partial y_a} = Df_a,

at every unit, when both feed the same hidden group through the same unit map.
An algorithm whose trace keeps an output-side factor that depends on ``D`` and
``Df`` only (ES-D-RTRL's ``ε_f``) can keep it once for both.
:func:`summed_outputs` finds such pairs.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import jax
import numpy as np

from braintrace._compiler._records import InputRelation
from braintrace._compiler._walk import is_var

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = ["summed_outputs"]


def summed_outputs(graph: ETraceGraph) -> tuple[int | None, ...]:
    """For each relation, the earlier relation whose output its own is added to, or ``None``.

    Relation ``b`` gets ``a < b`` when both have an input, feed the same hidden
    group with the same unit map (``y_to_hidden``, colours) and the same output
    shape and dtype, and the step's only reading of ``y_a`` and of ``y_b`` is one
    ``add(y_a, y_b)`` (neither is an output of the step). Then ``Df_b = Df_a``
    (module docstring). A chain ``y_a + y_b + y_c`` pairs its first two only.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._compiler._summed_outputs import summed_outputs
        >>> class Net(nnx.Module):
        ...     def __init__(self):
        ...         self.inp = layers.ETPLinear(3, 4, rngs=nnx.Rngs(0))
        ...         self.rec = layers.ETPLinear(4, 4, rngs=nnx.Rngs(1))
        ...         self.lif = layers.LIF(4)
        ...     def __call__(self, x):
        ...         return self.lif(self.inp(x) + self.rec(self.lif.spikes()))
        >>> model = Net()
        >>> braintrace.init_states(model, 2)
        >>> summed_outputs(braintrace.compile_graph(model, jnp.ones((2, 3))))
        (None, 0)
    """
    relations = graph.relations
    by_output = {}
    for r in relations:
        if isinstance(r, InputRelation):
            by_output.setdefault(graph.relation_output_var(r.eqn_index), r)
    uses = Counter(v for eqn in graph.jaxpr.eqns for v in eqn.invars if is_var(v))
    uses.update(v for v in graph.jaxpr.outvars if is_var(v))
    leaders: list[int | None] = [None] * len(relations)
    for eqn in graph.jaxpr.eqns:
        if eqn.primitive is not jax.lax.add_p or not all(is_var(v) for v in eqn.invars):
            continue
        pair = [by_output.get(v) for v in eqn.invars]
        if None in pair or any(uses[v] != 1 for v in eqn.invars):
            continue
        a, b = sorted(pair, key=lambda r: r.index)
        if a.index != b.index and _same_units(graph, a, b) and leaders[a.index] is None:
            leaders[b.index] = a.index
    return tuple(leaders)


def _same_units(graph: ETraceGraph, a: InputRelation, b: InputRelation) -> bool:
    """Whether ``a`` and ``b`` feed the same units of one hidden group with like outputs."""
    ya, yb = (graph.relation_output_var(r.eqn_index).aval for r in (a, b))
    return (a.group == b.group and a.y_shape == b.y_shape and ya.dtype == yb.dtype
            and a.batched == b.batched and np.array_equal(a.y_to_hidden, b.y_to_hidden)
            and np.array_equal(a.colours, b.colours))
