"""BPTT: backpropagation through time, behind the same interface as the online algorithms.

.. math::

    \\nabla_\\theta L = \\nabla_\\theta \\sum_t w_t L_t(\\theta)

by reverse mode through the whole sequence (``jax.vjp`` of a ``lax.scan`` of the
model step). With ``chunk_size=K`` it is truncated BPTT: exact reverse mode
inside windows of ``K`` steps, the hidden state carried across windows but no
credit (the windowed loop with no traces). It keeps no eligibility traces;
its memory grows with ``T`` (or ``K``): it is the reference every comparison
uses, now one word away (``braintrace.compile(model, 'bptt', x)``).

Per step, its reverse pass keeps the state the step starts from and the outputs
of the step's matrix products, and recomputes the elementwise rest (spikes,
surrogate derivatives, gates; ``braintrace/_loops/_windowed.py``): on a LIF
network, two neuron-sized arrays a step where ``jax.grad`` through a plain
``lax.scan`` keeps three. A scan of one's own keeps the same with its step under
``jax.checkpoint(step, policy=jax.checkpoint_policies.dots_saveable)``.
"""

from __future__ import annotations

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._compiler import ETraceGraph

__all__ = ["BPTT"]


class BPTT(AbstractAlgorithm):
    """Backpropagation through time (truncated with ``chunk_size``): no traces, exact.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, braintrace.BPTT(), jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> grads = learner.etrace_grad(jnp.ones((5, 2, 3)), jnp.zeros((5, 2, 4)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    name = "bptt"
    needs_window = True
    keeps_traces = False  # exact on every model: the traces' approximations are not its

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        del graph
        return ()
