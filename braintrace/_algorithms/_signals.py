"""Where the per-step learning signal comes from: the loss, or a sequence given by the caller.

Every algorithm but ThreeFactor learns from the loss: per step, the learning
signal is ``δ̄^t = ∂(w_t L_t)/∂h^{t-1}``, contracted with the traces *before*
the step's update, and every Param keeps its exact same-step gradient
(:class:`LossSignal`). A rule whose signal comes from elsewhere (a reward, a
neuromodulator) subclasses :class:`AbstractLearningSignal`: it names the per-step input
it reads (``etrace_grad(..., <input_name>=...)``), checks it, says whether it
is contracted with the traces after the step's update, and which Params keep
their same-step gradient of the loss.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax

from braintrace._compiler import ETraceGraph

__all__ = ["LOSS_SIGNAL", "AbstractLearningSignal", "LossSignal"]


class AbstractLearningSignal(abc.ABC):
    """The learning signal of the per-step loop (module docstring).

    Attributes:
        input_name: The keyword under which the caller passes the per-step
            sequence this signal reads (``None``: it reads none).
        after_update: Contract the signal with the traces after the step's
            update (``ε^t``) instead of before it (``ε^{t-1}``).
    """

    input_name: str | None = None
    after_update: bool = False

    def check_inputs(self, graph: ETraceGraph, hidden: Sequence[jax.Array], inputs: Any,
                     length: int) -> Any:
        """The checked per-step inputs (time axis leading), or ``None`` for no input.

        Raises:
            ValueError: ``inputs`` is given to a signal that reads none.
        """
        del graph, hidden, length
        if inputs is not None:
            raise ValueError(f"This algorithm's learning signal reads no '{self.input_name}'.")
        return None

    @abc.abstractmethod
    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> Sequence[jax.Array]:
        """Step ``t``'s signal per hidden leaf, given the loss's ``∂(w_t L_t)/∂h^{t-1}``."""

    def keeps_same_step(self, graph: ETraceGraph) -> tuple[bool, ...]:
        """Per Param leaf: whether it keeps its exact same-step gradient of the loss."""
        return (True,) * graph.num_params


class LossSignal(AbstractLearningSignal):
    """The loss's learning signal ``∂(w_t L_t)/∂h^{t-1}``; every Param keeps its same-step
    gradient."""

    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> Sequence[jax.Array]:
        del inputs_t, weight_t
        return loss_signal


LOSS_SIGNAL = LossSignal()
"""The default learning signal."""
