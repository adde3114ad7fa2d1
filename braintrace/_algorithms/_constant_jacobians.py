"""Where a graph's hidden Jacobians are constants: a fixed leak ``D = λ·I`` and a fixed ``Df``.

OTTT, SLTT and OTPE replace a weight's influence over time by a trace decayed
with a fixed ``λ`` (``0`` for SLTT). Where the model's own ``D^t = ∂h^t/∂h^{t-1}``
is ``λ·I`` at every step and ``Df^t = ∂h^t/∂y^t`` never changes, D-RTRL's trace
``Σ_k (Π D) Df^k ⊗ x^k`` is ``Df ⊗ Σ_k λ^{t-k} x^k``: the rule's trace, exactly
(a leaky integrator, an exponential synapse, a LIF neuron whose reset passes no
derivative, ``LIF(detach_reset=True)``).

:func:`constant_jacobians` reads that from the compiled graph without running
the model: the program of ``D`` and ``Df`` (``programs.jacobians``) is traced
once on abstract leaves. A Jacobian that no hidden state, input or non-Param
Variable reaches is the same at every step; one that no Param reaches either is
evaluated once, at compile time, which gives its ``λ``. A Jacobian that depends
on the state only through a term that happens to vanish (``0·h``) counts as
varying: the answer errs towards "not constant", never the other way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from braintrace._compiler import ETraceGraph, Relation, StepLeaves, is_var, programs, reached

__all__ = ["ConstantJacobians", "constant_jacobians", "follow_leak"]


class ConstantJacobians(NamedTuple):
    """What of a graph's hidden Jacobians is the same at every step.

    Attributes:
        decays: Per hidden group, ``λ`` when its ``D`` is ``λ·I`` at every step
            whatever the Params (a fixed leak), else ``None``.
        fixed_df: Per relation, whether its ``Df`` is the same at every step
            (it may depend on the Params, which a sequence does not change).
    """

    decays: tuple[float | None, ...]
    fixed_df: tuple[bool, ...]


def _abstract_leaves(graph: ETraceGraph) -> StepLeaves:
    layout, jaxpr = graph.layout, graph.jaxpr
    struct = lambda vs: [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in vs]
    return StepLeaves(struct(layout.param_invars(jaxpr)), struct(layout.hidden_invars(jaxpr)),
                      struct(layout.other_invars(jaxpr)), struct(layout.input_invars(jaxpr)))


def _scalar_identity(d: np.ndarray) -> float | None:
    """``λ`` when ``d`` ``(*V, S, S)`` is ``λ·I`` on every unit, else ``None``."""
    states = d.shape[-1]
    eye = np.eye(states, dtype=bool)
    diagonal = d[..., eye]
    if d[..., ~eye].size and np.any(d[..., ~eye] != 0):
        return None
    if diagonal.size == 0 or np.any(diagonal != diagonal.flat[0]):
        return None
    return float(diagonal.flat[0])


def constant_jacobians(graph: ETraceGraph) -> ConstantJacobians:
    """Which hidden Jacobians of ``graph`` are constants, and the fixed leaks' values.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._algorithms._constant_jacobians import constant_jacobians
        >>> def net(**lif):
        ...     return nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)),
        ...                           layers.LIF(4, tau=4.0, **lif))
        >>> found = constant_jacobians(braintrace.compile_graph(net(detach_reset=True),
        ...                                                     jnp.ones(3)))
        >>> round(found.decays[0], 4), found.fixed_df  # exp(-1/4), and Df = 1
        (0.7788, (True,))
        >>> constant_jacobians(braintrace.compile_graph(net(), jnp.ones(3))).decays  # the reset
        (None,)
    """
    if not graph.groups:
        return ConstantJacobians((), ())
    leaves = _abstract_leaves(graph)
    closed = jax.make_jaxpr(lambda lv: programs.jacobians(graph, lv))(leaves)
    jaxpr = closed.jaxpr
    num_params = len(leaves.params)
    varying, _ = reached(jaxpr, jaxpr.invars[num_params:])
    anything, _ = reached(jaxpr, jaxpr.invars)
    outs = jaxpr.outvars
    d_outs, df_outs = outs[:len(graph.groups)], outs[len(graph.groups):]
    fixed_df = tuple(not (is_var(v) and v in varying) for v in df_outs)
    if all(is_var(v) and v in anything for v in d_outs):
        return ConstantJacobians((None,) * len(graph.groups), fixed_df)
    with jax.ensure_compile_time_eval():
        zeros = [jnp.zeros(a.shape, a.dtype) for a in jax.tree.leaves(leaves)]
        values = jex_core.jaxpr_as_fun(closed)(*zeros)
    decays = tuple(None if is_var(v) and v in anything else _scalar_identity(np.asarray(d))
                   for v, d in zip(d_outs, values[:len(graph.groups)]))
    return ConstantJacobians(decays, fixed_df)


def follow_leak(graph: ETraceGraph, relations: Sequence[Relation],
                decay: float) -> tuple[Relation, ...]:
    """Those of ``relations`` whose group's ``D`` is ``decay·I`` at every step and whose
    ``Df`` is fixed: there a trace decayed by ``decay`` is D-RTRL's exactly (module
    docstring). ``decay`` is compared with the model's leak to float32 rounding.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._algorithms._constant_jacobians import follow_leak
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)),
        ...                        layers.ExpSynapse(4, tau=2.0))
        >>> graph = braintrace.compile_graph(model, jnp.ones(3))
        >>> import math
        >>> leak = math.exp(-1 / 2.0)  # exp(-dt/τ)
        >>> len(follow_leak(graph, graph.relations, leak)), follow_leak(graph, graph.relations, 0.9)
        (1, ())
    """
    found = constant_jacobians(graph)
    return tuple(r for r in relations
                 if found.fixed_df[r.index] and found.decays[r.group] is not None
                 and math.isclose(found.decays[r.group], decay, rel_tol=1e-6, abs_tol=1e-12))
