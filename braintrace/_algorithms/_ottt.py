"""OTTT: online training through time (Xiao et al., NeurIPS 2022).

For a LIF layer ``u^t = λ(u^{t-1} - V_th s^{t-1}) + W s_in^t`` whose reset
passes no derivative, OTTT tracks the presynaptic activity and takes the
instantaneous gradient of each step (the paper's derivation of OTTT from BPTT):

.. math::

    \\hat a^t = \\lambda \\hat a^{t-1} + x^t, \\qquad
    \\nabla_W L = \\sum_t \\Big(\\frac{\\partial L_t}{\\partial u^t}\\Big)^{\\!\\top} \\hat a^t,

with ``∂L_t/∂u^t`` the spatial derivative of step ``t`` only (through the
layers above at step ``t``, nothing across steps). In braintrace's terms, per
relation ``y = f(x, θ)``, ``∂L_t/∂u^t`` times ``∂u^t/∂y^t`` is the operation's
own output cotangent ``∂L_t/∂y^t`` with ``h^{t-1}`` held fixed, which the loops
compute exactly (``OutputSignal``), so

.. math::

    \\nabla_\\theta L = \\sum_t \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1},
        \\text{traced ops cut}} + \\mathrm{xy\\_to\\_dw}\\Big(\\hat a^t,\\,
        \\frac{\\partial L_t}{\\partial y^t}\\Big):

ES-D-RTRL's input-side trace with its decay fixed to ``λ`` and no output-side
trace at all: no hidden Jacobian is computed. Every ETP primitive whose input
side sums (dense, conv, sparse, LoRA, einsum, grouped; not the embedding, whose
integer indices do not: it is refused, as by ES-D-RTRL) runs it, per step and
time-blocked. A bias counts as a weight row fed by a constant 1, whose trace is
``ε_1 = Σ_k λ^k``; so does an elementwise operation ``y = fn(w)`` (a learnable
time constant, gain or threshold): ``xy_to_dw(ε_1^t ∂L_t/∂y^t)``. (The authors' code
gives biases their same-step gradient alone; the trace is what the derivation gives a
constant input, and what makes OTTT equal BPTT in its exact case.) OTTT_O
(gradients summed over the sequence) is ``etrace_grad``; OTTT_A (an update every
step) is ``OnlineTrainer`` or ``online_update`` with ``update_every=1``.

``λ`` is a hyperparameter (``decay``), meant to be the neurons' leak
``exp(-dt/τ)``. The trace then equals D-RTRL's exactly where the group's
Jacobian ``D^t = ∂h^t/∂h^{t-1}`` is ``λ·I`` at every step and ``Df`` never
changes (``LIF(detach_reset=True)``, ``ExpSynapse``, a leaky integrator), and
OTTT equals BPTT where, besides, nothing else carries credit across steps (no
new state computed from another one, no readout of the previous state or of
``y`` past ``h``: the compiler's ``fast_signal_obstacles``): one such layer under
a memoryless readout. A ``λ`` other than the leak weighs an
input ``k`` steps back by ``λ^k`` instead of ``∏ D``: the credit of old inputs
is over-counted (``λ`` larger) or forgotten early (``λ`` smaller), and
``report()`` says so. Memory ``O(B·I)`` per operation (the trace ``â``), constant
in ``T``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm, BlockSteps, RelationRule
from braintrace._algorithms._constant_jacobians import follow_leak
from braintrace._algorithms._es_d_rtrl import IOTerm, input_side_block, input_side_finalize
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._signals import OUTPUT_SIGNAL
from braintrace._algorithms._trace_algebra import param_dtypes
from braintrace._compiler import (
    Approximation,
    ElementwiseRelation,
    ETraceGraph,
    InputRelation,
    Relation,
    fast_signal_obstacles,
)

__all__ = ["OTTT", "PresynapticTrace", "check_decay", "leak_approximation",
           "presynaptic_rules"]


def check_decay(owner: str, decay: float) -> float:
    """``decay`` as a float, after checking it is a number in ``[0, 1)``.

    Example:
        >>> from braintrace._algorithms._ottt import check_decay
        >>> check_decay("OTTT", 0.5)
        0.5
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise TypeError(f"{owner}: decay must be a float in [0, 1) (the neurons' leak "
                        f"exp(-dt/tau)), got {decay!r}.")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"{owner}: decay must lie in [0, 1) (the neurons' leak exp(-dt/tau)), "
                         f"got {decay}.")
    return float(decay)


class PresynapticTrace(NamedTuple):
    """OTTT's trace of one relation, in the Params' dtype.

    Attributes:
        x: ``â = λ â + x`` ``(*x.shape)`` (``None`` for an elementwise operation).
        ones: ``ε_1 = λ ε_1 + 1``, the trace of a bias's (or an elementwise operation's)
            constant input.
    """

    x: jax.Array | None
    ones: jax.Array


def _zero_if_none(r: Relation, dy: jax.Array | None, dtype) -> jax.Array:
    """``dy``, or zeros for a relation whose equation an earlier relation counts."""
    return jnp.zeros(r.y_shape, dtype) if dy is None else dy


def _geometric(decay: float, steps: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(λ^{k+1}, Σ_{i≤k} λ^i)`` for ``k < steps``, constants of the block length."""
    powers = float(decay) ** np.arange(steps + 1)
    return jnp.asarray(powers[1:], dtype), jnp.asarray(np.cumsum(powers[:-1]), dtype)


def presynaptic_rules(decay: float) -> dict[type, RelationRule]:
    """OTTT's rule per relation kind: the presynaptic trace decayed by ``decay``, contracted
    with the relation's output cotangent ``∂L_t/∂y^t`` after the update (module docstring).
    Neither reads ``D`` or ``Df``. An operation with an input needs the IO-dimension family's
    rules (``init_pp``, as ES-D-RTRL): a primitive whose input is not summable, the
    embedding's integer indices, has none and is refused."""

    def init(graph: ETraceGraph, r: Relation, theta) -> PresynapticTrace:
        dtype = jnp.result_type(*param_dtypes(graph, r).values())
        x = jnp.zeros(r.x_shape, dtype) if isinstance(r, InputRelation) else None
        return PresynapticTrace(x=x, ones=jnp.zeros((), dtype))

    def update(r: Relation, s: PresynapticTrace, d_g, df, x, theta) -> PresynapticTrace:
        """``â = λ â + x``, ``ε_1 = λ ε_1 + 1``."""
        del d_g, df, theta
        ones = (decay * s.ones + 1.0).astype(s.ones.dtype)
        if s.x is None:
            return s._replace(ones=ones)
        return PresynapticTrace(x=(decay * s.x + x.astype(s.x.dtype)).astype(s.x.dtype),
                                ones=ones)

    def input_contribution(r: InputRelation, s: PresynapticTrace, dy, theta) -> IOTerm:
        dy = _zero_if_none(r, dy, s.x.dtype)
        return IOTerm(grad=r.primitive.rule("xy_to_dw")(s.x, dy, theta, **r.params),
                      bias_signal=(s.ones - 1.0) * dy)

    def input_block(r: InputRelation, s: PresynapticTrace, steps: BlockSteps, theta):
        """``K`` steps at once: ``xy_to_dw(â^k, dy_k) = xy_to_dw(â^{k-1}, λ dy_k) +
        xy_to_dw(x_k, dy_k)`` (``input_side_block``)."""
        dy = jnp.zeros((steps.x.shape[0], *r.y_shape), s.x.dtype) if steps.dy is None \
            else steps.dy
        x, ones, term = input_side_block(r, s.x, s.ones, steps.x, decay * dy, dy, decay, theta)
        return PresynapticTrace(x=x, ones=ones), term

    def elementwise_contribution(r: ElementwiseRelation, s: PresynapticTrace, dy, theta):
        del theta
        return s.ones * _zero_if_none(r, dy, s.ones.dtype)

    def elementwise_finalize(r: ElementwiseRelation, total: jax.Array, theta) -> dict:
        return r.primitive.rule("xy_to_dw")(None, total, theta, **r.params)

    def elementwise_block(r: ElementwiseRelation, s: PresynapticTrace, steps: BlockSteps,
                          theta):
        """``Σ_k ε_1^k dy_k`` with ``ε_1^k = λ^{k+1} ε_1^{-1} + Σ_{i≤k} λ^i``."""
        del theta
        length = steps.signal.shape[0]
        powers, sums = _geometric(decay, length, s.ones.dtype)
        weights = powers * s.ones + sums
        term = (jnp.zeros(r.y_shape, s.ones.dtype) if steps.dy is None
                else jnp.tensordot(weights.astype(steps.dy.dtype), steps.dy, axes=1))
        return s._replace(ones=weights[-1].astype(s.ones.dtype)), term

    common = {"init": init, "update": update, "jacobians": False}
    return {
        InputRelation: RelationRule(contribution=input_contribution,
                                    finalize=input_side_finalize,
                                    rules=lambda r: ("init_pp", "xy_to_dw"),
                                    block_finish=input_block,
                                    **common),
        ElementwiseRelation: RelationRule(contribution=elementwise_contribution,
                                          finalize=elementwise_finalize,
                                          rules=lambda r: ("xy_to_dw",),
                                          block_finish=elementwise_block, **common),
    }


def leak_approximation(graph: ETraceGraph, leaky: Sequence[Relation], decay: float, *,
                       label: str, what: str, detail: str,
                       remedy: str) -> tuple[Approximation, ...]:
    """The record of a rule that decays the traces of ``leaky`` by a fixed ``decay`` (the
    other relations keeping D-RTRL's) and reads the signal of the new state.

    It names every relation that carries credit where the fast signal is not exact on the
    graph (``fast_signal_obstacles``, which also covers traces that are not the exact
    influence); elsewhere those of ``leaky`` whose group's ``D`` is not ``decay·I`` at every
    step or whose ``Df`` varies (``follow_leak``).
    """
    obstacles = fast_signal_obstacles(graph)
    if obstacles:
        inexact = list(graph.relations)
        detail = f"{detail}; here {'; '.join(o.detail for o in obstacles)}"
    else:
        exact = follow_leak(graph, leaky, decay)
        inexact = [r for r in leaky if r not in exact]
    return algorithm_approximation(graph, inexact, kind="temporal-path", label=label,
                                   what=what, detail=detail, remedy=remedy)


class OTTT(AbstractAlgorithm):
    """Online training through time: a presynaptic trace times each step's spatial gradient.

    .. math::

        \\hat a^t = \\lambda \\hat a^{t-1} + x^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\mathrm{xy\\_to\\_dw}\\big(\\hat a^t,\\,
            Df^t \\cdot \\partial L_t/\\partial h^t\\big)

    (module docstring). Exact (equal to BPTT) where the neurons' leak is
    ``decay`` at every step and nothing else carries credit across steps
    (``compile(..., strict=True)`` checks it); elsewhere ``report()`` names
    the Params whose temporal credit it drops and ``strict=True`` refuses
    them. Single-step: no ``chunk_size``.

    Args:
        decay: ``λ``, the decay of the presynaptic trace in ``[0, 1)``: the
            neurons' leak ``exp(-dt/τ)`` (``0.9``: ``τ ≈ 9.5`` steps).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> lif = layers.LIF(4, tau=10.0, detach_reset=True)
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), lif,
        ...                        layers.ETPLinear(4, 2, rngs=nnx.Rngs(1)))
        >>> learner = braintrace.compile(model, braintrace.OTTT(decay=float(jnp.exp(-0.1))),
        ...                              jnp.ones(3), strict=True)  # exact on this model
        >>> grads = learner.etrace_grad(jnp.ones((5, 3)), jnp.zeros((5, 2)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    name = "ottt"
    supports_windowed = False

    def __init__(self, decay: float = 0.9):
        self.decay = check_decay("OTTT", decay)
        self._rules = presynaptic_rules(self.decay)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(self._rules[type(r)] for r in graph.relations)

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """The bound rules, reading each operation's output cotangent ``∂L_t/∂y^t``."""
        return dataclasses.replace(super().rules(graph), learning_signal=OUTPUT_SIGNAL)

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The operations whose trace is not D-RTRL's (a leak other than ``decay``, or one
        that varies), or every one where the fast signal is not exact.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> graph = braintrace.compile_graph(model, jnp.ones(3))
            >>> [(a.kind, a.param_paths) for a in braintrace.OTTT().approximations(graph)]
            [('temporal-path', ('layers.0.bias', 'layers.0.kernel'))]
        """
        return leak_approximation(
            graph, graph.relations, self.decay,
            label=f"OTTT(decay={self.decay:g})",
            what=(f"keeps of the temporal path only the presynaptic trace â = {self.decay:g}·â "
                  "+ x (and each step's spatial signal ∂L_t/∂h^t) for"),
            detail=("the traces Df^t ⊗ â^t replace D-RTRL's Σ_k (Π D) Df^k ⊗ x^k; exact where "
                    "D^t = λ·I at every step, Df is fixed and the fast signal is exact"),
            remedy=("it is exact on one layer of neurons whose leak is decay and whose reset "
                    "passes no derivative (LIF(detach_reset=True)) under a memoryless readout; "
                    "DRTRL() keeps the exact per-weight traces"))
