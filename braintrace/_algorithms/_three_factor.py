"""Three-factor learning: D-RTRL eligibility traces gated by a modulator sequence.

A third factor ``M^t`` (a reward, a neuromodulator, a broadcast error), given
per step and shaped like the hidden states, takes the place of the learning
signal:

.. math::

    \\nabla_\\theta = \\sum_t w_t\\, M^t \\cdot \\epsilon^t, \\qquad
    \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t

with ``ε^t`` the D-RTRL eligibility trace of the influence of ``θ`` on
``h^t`` (after step ``t``) and ``w_t`` the step weight of ``etrace_grad``
(``1/T`` for ``reduction='mean'``, times the mask). The contraction is
D-RTRL's (``contribution``), so with ``M^t = ∂L_t/∂h^t`` it is D-RTRL's
gradient of the traced Params whenever the loss reads ``h^t`` (then
``∂L_t/∂θ|_{h^{t-1}} + ∂L_t/∂h^{t-1}·ε^{t-1} = ∂L_t/∂h^t·ε^t``).

**Modulators** are a dict ``{hidden path: (T, *state_shape)}`` with one entry
for every hidden state of the compiled graph (``learner.graph.hidden_paths``;
``state_shape`` includes the batch axis, e.g. ``(T, B, H)``); see
:func:`check_modulators`.

**Params without traces** (readouts, Params no ETP primitive reads) receive
their exact same-step gradient of the loss, ``Σ_t ∂(w_t L_t)/∂θ|_{h^{t-1}}``
(as under every algorithm): a readout learns by its supervised error while the
traced Params learn by the three-factor rule. Traced Params receive only
``Σ_t w_t M^t·ε^t`` (no term of the loss). For a loss-free rule, pass a
``loss_fn`` returning ``0.0``: every untraced Param then gets zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._d_rtrl import DRTRL_ELEMENTWISE, DRTRL_INPUT
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._algorithms._signals import AbstractLearningSignal
from braintrace._compiler import ElementwiseRelation, ETraceGraph, InputRelation

__all__ = ["ModulatorSignal", "ThreeFactor", "check_modulators"]


class ThreeFactor(AbstractAlgorithm):
    """Three-factor rule: ``∇θ = Σ_t w_t M^t · ε^t`` with D-RTRL traces ``ε^t``.

    .. math::

        \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t, \\qquad
        \\nabla_\\theta = \\sum_t w_t\\, M^t \\cdot \\epsilon^t

    Give the modulators to ``etrace_grad(..., modulators=M)`` or
    ``OnlineTrainer.step(..., modulators=M)``: a dict ``{hidden path: array of
    shape (T, *state_shape)}`` (see the module docstring, also for what
    untraced Params receive). Single-step mode only (no ``chunk_size``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, braintrace.ThreeFactor(), jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> xs, ys = jnp.ones((5, 2, 3)), jnp.zeros((5, 2, 4))
        >>> reward = {'layers.1.v': jnp.ones((5, 2, 4))}
        >>> grads = learner.etrace_grad(xs, ys, lambda y, t: 0.0, modulators=reward)
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    name = "three_factor"
    supports_windowed = False
    supports_trace_dtype = True

    def __init__(self):
        self._rules = {InputRelation: DRTRL_INPUT._replace(block_finish=None),
                       ElementwiseRelation: DRTRL_ELEMENTWISE._replace(block_finish=None)}

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(self._rules[type(r)] for r in graph.relations)

    def learning_signal(self) -> ModulatorSignal:
        return MODULATOR_SIGNAL


class ModulatorSignal(AbstractLearningSignal):
    """The third factor ``w_t M^t``, contracted with ``ε^t``; only untraced Params keep their
    same-step gradient of the loss (module docstring)."""

    input_name = "modulators"
    after_update = True

    def check_inputs(self, graph: ETraceGraph, hidden: Sequence[jax.Array], inputs: Any,
                     length: int) -> list[jax.Array]:
        """The modulators as a list in ``graph.hidden_paths`` order (:func:`check_modulators`).

        Raises:
            ValueError: No modulators were given, or they are invalid.
        """
        if inputs is None:
            raise ValueError(
                "ThreeFactor needs modulators=: a dict {hidden path: array of shape (T, "
                f"*state_shape)}} with the keys {list(graph.hidden_paths)}.")
        return check_modulators(graph, hidden, inputs, length)

    def signal(self, loss_signal: Sequence[jax.Array], inputs_t: Any,
               weight_t: jax.Array) -> list[jax.Array]:
        del loss_signal
        return [(weight_t * m).astype(m.dtype) for m in inputs_t]

    def keeps_same_step(self, graph: ETraceGraph) -> tuple[bool, ...]:
        traced = set(graph.traced_param_paths)
        return tuple(path not in traced for path in graph.param_paths)


MODULATOR_SIGNAL = ModulatorSignal()


def check_modulators(graph: ETraceGraph, hidden: Sequence[jax.Array], modulators: Any,
                     length: int) -> list[jax.Array]:
    """The modulators as a list in ``graph.hidden_paths`` order, after checking them.

    Args:
        graph: The compiled graph.
        hidden: The current hidden states (their shapes and dtypes).
        modulators: ``{hidden path: (T, *state_shape)}``, one entry per hidden state.
        length: The sequence length ``T``.

    Raises:
        TypeError: ``modulators`` is not a dict.
        ValueError: ``modulators`` lacks a hidden path, has one
            the graph does not know, or has an entry of the wrong shape or
            with a value that is not finite.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'three_factor', jnp.ones((3,)))
        >>> mods = check_modulators(learner.graph, learner.leaves().hidden,
        ...                         {'layers.1.v': jnp.ones((6, 4))}, 6)
        >>> [m.shape for m in mods]
        [(6, 4)]
    """
    paths = graph.hidden_paths
    if not isinstance(modulators, dict):
        raise TypeError(
            f"modulators must be a dict {{hidden path: array of shape (T, *state_shape)}} with "
            f"the keys {list(paths)}, got {type(modulators).__name__}.")
    missing = [p for p in paths if p not in modulators]
    unknown = [k for k in modulators if k not in paths]
    if missing or unknown:
        raise ValueError(
            f"modulators must have exactly one entry per hidden state {list(paths)}; missing "
            f"{missing}, unknown {unknown}.")
    out = []
    for path, h in zip(paths, hidden):
        m = modulators[path]
        want = (length, *np.shape(h))
        if tuple(np.shape(m)) != want:
            raise ValueError(
                f"modulators['{path}'] has shape {tuple(np.shape(m))}; it must be (T, "
                f"*state_shape) = {want}: one value per time step for every element of the "
                f"hidden state '{path}'.")
        try:
            finite = bool(np.all(np.isfinite(np.asarray(m))))
        except jax.errors.TracerArrayConversionError:
            finite = True  # a traced value: checked by the caller's finiteness checks
        if not finite:
            raise ValueError(f"modulators['{path}'] has a value that is not finite.")
        out.append(jnp.asarray(m, jnp.result_type(h)))
    return out
