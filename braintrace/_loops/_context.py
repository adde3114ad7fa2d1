"""What every time loop reads: the graph, the algorithm's rules, the loss and the Params."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from braintrace._algorithms import GraphRules
from braintrace._compiler import ETraceGraph, programs

__all__ = ["LoopContext"]


class LoopContext(NamedTuple):
    """The context of one run of a loop, built once (:meth:`build`) and passed down.

    Attributes:
        rules: The algorithm bound to the graph.
        loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
        params: The Params, in the order of ``graph.param_paths`` (fixed during the run).
        operands: Each relation's trainable operands ``θ``, computed from ``params``.
        x_pullbacks: The recurrent dense kernels transposed once, for the exact
            learning signal's pullback (``programs.x_pullbacks``).
    """

    rules: GraphRules
    loss_fn: Callable[[Any, Any], jax.Array]
    params: list[jax.Array]
    operands: list[dict[str, jax.Array]]
    x_pullbacks: dict[int, tuple[Any, jax.Array]]

    @property
    def graph(self) -> ETraceGraph:
        """The compiled graph."""
        return self.rules.graph

    @classmethod
    def build(cls, rules: GraphRules, loss_fn: Callable[[Any, Any], jax.Array],
              params: Sequence[jax.Array]) -> LoopContext:
        """The context of a run with ``params``: their relations' operands, and the recurrent
        dense kernels transposed for the learning signal, computed once."""
        operands = programs.operands(rules.graph, params)
        pulls = programs.x_pullbacks(rules.graph, operands, rules.feedback)
        return cls(rules, loss_fn, list(params), operands, pulls)
