"""SLTT: spatial learning through time (Meng et al., ICCV 2023).

SLTT drops the temporal path of BPTT's gradient: each step's loss reaches a
weight only through the same step (the paper keeps the spatial components of
the surrogate gradient and drops the temporal ones),

.. math::

    \\nabla_W L = \\sum_t \\Big(\\frac{\\partial L_t}{\\partial u^t}\\Big|_{\\text{spatial}}
        \\Big)^{\\!\\top} x^t = \\sum_t \\frac{\\partial L_t}{\\partial W}\\Big|_{h^{t-1}},

which is the exact same-step gradient every braintrace loop already computes,
and nothing else: no traces, no hidden Jacobians, memory of the step alone. On
every ETP primitive, for every Param. It is OTTT with ``λ = 0`` without the
trace. Exact where no gradient flows through the temporal path: where every
hidden Jacobian ``D^t = ∂h^t/∂h^{t-1}`` that a Param's credit could cross is
zero at every step (neurons without memory, or whose membrane is reset
completely and the reset passes no derivative) and the loss reads no previous
state. SLTT-K (the backward pass at ``K`` random steps only) is not offered:
the fused scan computes each step's same-step gradient in any case, so it would
save no time here; a ``(T, B)`` ``mask`` selecting those steps gives its
gradient.
"""

from __future__ import annotations

from braintrace._algorithms._base import AbstractAlgorithm, RelationRule
from braintrace._algorithms._ottt import leak_approximation
from braintrace._compiler import Approximation, ETraceGraph

__all__ = ["SLTT"]


class SLTT(AbstractAlgorithm):
    """Spatial learning through time: each step's exact same-step gradient, summed.

    .. math::

        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta\\,\\big|_{h^{t-1}}

    (module docstring). It keeps no traces, so it runs per step whatever
    ``block_size`` is, and it has no windowed mode (a window would be
    truncated BPTT). Exact where no hidden Jacobian carries credit across
    steps (``compile(..., strict=True)`` checks it); elsewhere ``report()``
    names the Params whose temporal credit it drops.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'sltt', jnp.ones(3))
        >>> learner.traces
        []
        >>> grads = learner.etrace_grad(jnp.ones((5, 3)), jnp.zeros((5, 4)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    name = "sltt"
    supports_windowed = False

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        """None: SLTT keeps no traces (the loops then add the same-step gradient only)."""
        del graph
        return ()

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The operations whose credit crosses steps: every one that carries credit, but
        those the compiler proves memoryless (their group's ``D`` zero at every step).

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> graph = braintrace.compile_graph(model, jnp.ones(3))
            >>> [(a.kind, a.param_paths) for a in braintrace.SLTT().approximations(graph)]
            [('temporal-path', ('layers.0.bias', 'layers.0.kernel'))]
        """
        return leak_approximation(
            graph, graph.relations, 0.0, label="SLTT()",
            what="drops the temporal path (keeps each step's spatial gradient only) of",
            detail="no trace: the gradient is Σ_t ∂L_t/∂θ|h^(t-1); exact where D^t = 0 at "
                   "every step and the loss reads no previous state",
            remedy="OTTT(decay=λ) keeps a presynaptic trace at O(I) memory, DRTRL() the exact "
                   "per-weight traces")
