"""``compile_graph``: a stateful NNX module's step to an :class:`ETraceGraph`."""

from __future__ import annotations

from typing import Any

from flax import nnx

from braintrace._compiler._graph import ETraceGraph, build_graph
from braintrace._compiler._step import trace_model_step

__all__ = ["compile_graph"]


def compile_graph(model: nnx.Module, example_x: Any, *, scope: str = "diagonal") -> ETraceGraph:
    """Compiles one time step of ``model`` into an eligibility-trace graph.

    ``model(x)`` must be one time step that reads and writes the model's
    :class:`braintrace.HiddenState` variables. Hidden states must already have
    their batch shape (see :func:`braintrace.init_states`).

    Args:
        model: A stateful NNX module.
        example_x: An input of one step (any pytree of arrays).
        scope: ``'diagonal'`` (default): the hidden Jacobian ignores operations
            that mix positions; ``'coupled'``: keep their per-position blocks
            (used by OSTL).

    Returns:
        The graph; ``print(graph.report())`` describes it.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> class Leaky(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.w = nnx.Param(jnp.ones((3, 2)))
        ...         self.h = braintrace.HiddenState(jnp.zeros((4, 2)))
        ...     def __call__(self, x):
        ...         self.h[...] = 0.9 * self.h[...] + braintrace.matmul(x, self.w[...])
        ...         return self.h[...]
        >>> graph = braintrace.compile_graph(Leaky(nnx.Rngs(0)), jnp.ones((4, 3)))
        >>> [g.paths for g in graph.groups]
        [('h',)]
        >>> graph.traced_param_paths
        ('w',)
    """
    step = trace_model_step(model, example_x)
    graph = build_graph(
        step.closed_jaxpr, param_paths=step.param_paths, hidden_paths=step.hidden_paths,
        other_paths=step.other_paths, num_outputs=step.num_outputs,
        out_treedef=step.out_treedef, scope=scope, notes=step.notes, warnings=step.warnings)
    return graph
