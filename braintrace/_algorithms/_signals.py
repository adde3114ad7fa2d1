"""Where the per-step learning signal comes from: the loss, or a sequence given by the caller.

Every algorithm but ThreeFactor learns from the loss: per step, the learning
signal is ``δ̄^t = ∂(w_t L_t)/∂h^{t-1}``, contracted with the traces *before*
the step's update, and every Param keeps its exact same-step gradient
(:class:`LossSignal`). The fast form (:class:`NewStateSignal`, D-RTRL's and
ES-D-RTRL's ``signal='fast'``) takes ``δ^t = ∂(w_t L_t)/∂h^t`` with ``h^t`` an
input of the rest of the step, contracted with the traces *after* the update,
and the same-step gradient by every path but the traced operations' (no
backward product through the recurrent kernels). The output form
(:class:`OutputSignal`, OTTT's) takes each traced operation's own output
cotangent ``∂(w_t L_t)/∂y^t`` (``h^{t-1}`` held fixed: the exact spatial
derivative of the step), contracted with the traces after the update, and the
same-step gradient by every path but the traced operations' (their share is in
the contraction). A rule whose signal comes from elsewhere (a reward, a
neuromodulator) subclasses :class:`AbstractLearningSignal`: it names the per-step input
it reads (``etrace_grad(..., <input_name>=...)``), checks it, says whether it
is contracted with the traces after the step's update, and which Params keep
their same-step gradient of the loss. A signal may also cut the error the loss sends back
through the input of some ETP operations and send a value of its own there instead
(``cut_inputs`` and :meth:`~AbstractLearningSignal.input_objective`: OSTTP's projected target).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._compiler import ETraceGraph

__all__ = ["LOSS_SIGNAL", "NEW_STATE_SIGNAL", "OUTPUT_SIGNAL", "AbstractLearningSignal",
           "LossSignal", "NewStateSignal", "OutputSignal"]


class AbstractLearningSignal(abc.ABC):
    """The learning signal of the per-step loop (module docstring).

    Attributes:
        input_name: The keyword under which the caller passes the per-step
            sequence this signal reads (``None``: it reads none).
        after_update: Contract the signal with the traces after the step's
            update (``ε^t``) instead of before it (``ε^{t-1}``).
        reads_new_state: The loss's signal handed to :meth:`signal` is
            ``∂(w_t L_t)/∂h^t`` (``h^t`` an input of the rest of the step; the
            traced operations cut from the same-step gradient) instead of
            ``∂(w_t L_t)/∂h^{t-1}``.
        cut_inputs: ETP equations (indices in the step's jaxpr) through whose input ``x``
            the loss sends no derivative back; the step's reverse pass adds
            :meth:`input_objective` of their inputs to the weighted loss instead.
        reads_outputs: The relations' rules read each relation's output
            cotangent ``∂(w_t L_t)/∂y^t`` (``None`` for a relation whose
            equation an earlier one counts) instead of :meth:`signal`'s, and
            the traced operations are cut from the same-step gradient.
    """

    input_name: str | None = None
    after_update: bool = False
    reads_new_state: bool = False
    cut_inputs: tuple[int, ...] = ()
    reads_outputs: bool = False

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
        """Step ``t``'s signal per hidden leaf, given the loss's ``∂(w_t L_t)/∂h^{t-1}`` (or
        ``∂(w_t L_t)/∂h^t`` when :attr:`reads_new_state`)."""

    def keeps_same_step(self, graph: ETraceGraph) -> tuple[bool, ...]:
        """Per Param leaf: whether it keeps its exact same-step gradient of the loss."""
        return (True,) * graph.num_params

    def input_objective(self, inputs: Sequence[jax.Array], target_t: Any,
                        weight_t: jax.Array) -> jax.Array:
        """A zero-valued term of step ``t``'s weighted loss whose derivative with respect to
        the inputs of the :attr:`cut_inputs` equations (in that order) is what they send back
        instead of the loss's error; ``target_t`` is the step's target (as ``loss_fn`` gets
        it). By default none: the cut inputs send nothing back."""
        del inputs, target_t
        return jnp.zeros((), jnp.result_type(weight_t))


class LossSignal(AbstractLearningSignal):
    """The loss's learning signal ``∂(w_t L_t)/∂h^{t-1}``; every Param keeps its same-step
    gradient."""

    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> Sequence[jax.Array]:
        del inputs_t, weight_t
        return loss_signal


LOSS_SIGNAL = LossSignal()
"""The default learning signal."""


class NewStateSignal(AbstractLearningSignal):
    """The fast loss signal ``δ^t = ∂(w_t L_t)/∂h^t``, contracted with ``ε^t``.

    .. math::

        \\nabla_\\theta L_t \\approx \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^t,\\,
            \\text{traced ops cut}} + \\frac{\\partial L_t}{\\partial h^t} \\cdot \\epsilon^t

    Equal to :class:`LossSignal`'s gradient where the compiler proves it
    (``braintrace._compiler.fast_signal_obstacles``) and the traces are additive.
    """

    after_update = True
    reads_new_state = True

    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> Sequence[jax.Array]:
        del inputs_t, weight_t
        return loss_signal


NEW_STATE_SIGNAL = NewStateSignal()
"""The fast learning signal (``signal='fast'``)."""


class OutputSignal(AbstractLearningSignal):
    """Each traced operation's output cotangent ``∂(w_t L_t)/∂y^t``, contracted with ``ε^t``.

    .. math::

        \\nabla_\\theta L_t = \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1},\\,
            \\text{traced ops cut}} + \\mathrm{contract}\\Big(\\epsilon^t,\\,
            \\frac{\\partial L_t}{\\partial y^t}\\Big)

    with ``h^{t-1}`` held fixed: the exact spatial derivative of step ``t``
    at the operation's output, whatever lies between it and the loss. The
    loops hand the rules the cotangents themselves (:meth:`signal` is not
    called).
    """

    after_update = True
    reads_outputs = True

    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> Sequence[jax.Array]:
        del inputs_t, weight_t
        return loss_signal


OUTPUT_SIGNAL = OutputSignal()
"""The output form of the learning signal (OTTT's)."""
