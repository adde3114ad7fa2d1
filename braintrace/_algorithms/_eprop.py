"""e-prop: D-RTRL traces passed through a low-pass filter, optionally with random feedback.

.. math::

    \\bar e^t = \\kappa\\, \\bar e^{t-1} + \\epsilon^t, \\qquad
    \\nabla_\\theta L = \\sum_t \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^{t-1}}
        + L^t \\cdot \\bar e^{t-1}

where ``ε^t`` is the D-RTRL eligibility trace and ``L^t = ∂L_t/∂h^{t-1}`` the
learning signal. ``κ = 0`` is D-RTRL. The filter matches e-prop's treatment of
a leaky readout (Bellec et al. 2020).

With ``feedback='symmetric'`` (default) the same-step gradient and ``L^t`` are
exact. With ``feedback='random'`` they come from the same reverse pass of the
step, except that every ETP operation whose input ``x`` depends on the new
hidden state ``h^t`` (a readout, the input
weights of a next layer) sends the error back to ``x`` through **fixed random
operands** ``B`` of the shapes and dtypes of its trainable operands instead of
its weights (feedback alignment, Lillicrap et al. 2016):
``x̄ = (∂f/∂x)(x, B)ᵀ ȳ``. For a dense readout ``y = h W`` this is
``x̄ = ȳ Bᵀ``: e-prop's ``L = B e`` with ``e = ∂L_t/∂y`` the output error
(Bellec et al. 2020, random e-prop). Everything else on the way keeps its
exact derivative: non-ETP operations (fixed matrices, nonlinearities, the
spike surrogate ``∂z/∂v``) and hidden states that are themselves outputs (a
leaky readout's ``y`` receives ``e`` unchanged). Params learning by same-step
gradients (untraced readouts) still receive their exact gradient.

``B`` is drawn once from ``seed``: for the ETP equation at index ``i`` of the
compiled step and its ``k``-th trainable operand (in the primitive's layout
order), ``B = scale · N(0, 1) / sqrt(fan_in)`` with key
``fold_in(fold_in(key(seed), i), k)`` and ``fan_in`` the product of all but the
last axis (LeCun normal, the scale of a freshly initialised kernel; ``1`` for
vectors and scalars). The same model, seed and scale always give the same
``B``. Random feedback is a single-step rule: windowed mode (which uses the
exact reverse pass inside windows) rejects it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax

from braintrace._algorithms._approximations import algorithm_approximation, params_reaching_inputs
from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._d_rtrl import DRTRL_ELEMENTWISE, DRTRL_INPUT
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._compiler import (
    Approximation,
    ElementwiseRelation,
    ETraceGraph,
    InputRelation,
    eqn_names,
    is_var,
    operations,
    params_phrase,
)

__all__ = ["EProp", "FilteredTrace", "feedback_equations", "filtered",
           "random_feedback_approximation", "random_feedback_operands"]

FEEDBACKS = ("symmetric", "random")


def feedback_equations(graph: ETraceGraph) -> list[int]:
    """ETP equations with an input ``x`` that depends on the new hidden state ``h^t``."""
    jaxpr = graph.jaxpr
    depends = {v for v in graph.new_state_vars() if is_var(v)}
    found = []
    for index, eqn in enumerate(jaxpr.eqns):
        reads = [is_var(v) and v in depends for v in eqn.invars]
        if not any(reads):
            continue
        depends.update(v for v in eqn.outvars if is_var(v))
        prim = eqn.primitive
        if index in graph.etp_eqns and prim.x_invar_index is not None and reads[prim.x_invar_index]:
            found.append(index)
    return found


def random_feedback_approximation(graph: ETraceGraph) -> tuple[Approximation, ...]:
    """Random feedback: the Params whose gradient passes back through a feedback operation's
    input get feedback alignment's direction, not BPTT's (at every ``T``)."""
    jaxpr = graph.jaxpr
    eqns = feedback_equations(graph)
    params = params_reaching_inputs(graph, eqns)
    if not params:
        return ()
    return (Approximation(
        "random-feedback", params,
        f"{eqn_names(jaxpr, eqns)} send the error to their input through fixed random operands",
        f"EProp(feedback='random') sends the error back through fixed random weights at "
        f"{operations(jaxpr, graph.modules, eqns)} instead of their own (feedback alignment), "
        f"so the gradients of {params_phrase(params)} are not BPTT's, even at T = 1; "
        "feedback='symmetric' gives the exact learning signal."),)


def random_feedback_operands(graph: ETraceGraph, seed: int = 0,
                             scale: float = 1.0) -> dict[int, dict[int, jax.Array]]:
    """The fixed random operands ``{eqn index: {operand position: B}}`` (module docstring)."""
    feedback = {}
    base = jax.random.key(seed)
    for index in feedback_equations(graph):
        eqn = graph.jaxpr.eqns[index]
        layout = eqn.primitive.trainable_invars(eqn.params)
        key = jax.random.fold_in(base, index)
        operands = {}
        for k, position in enumerate(layout.values()):
            aval = eqn.invars[position].aval
            shape = tuple(aval.shape)
            fan_in = math.prod(shape[:-1]) if len(shape) >= 2 else 1
            b = jax.random.normal(jax.random.fold_in(key, k), shape, aval.dtype)
            operands[position] = (b * (scale / math.sqrt(fan_in))).astype(aval.dtype)
        feedback[index] = operands
    return feedback


class FilteredTrace(NamedTuple):
    """The D-RTRL trace ``ε`` and its filtered version ``ē``."""

    trace: Any
    filtered: Any


def filtered(rule: RelationRule, kappa: float) -> RelationRule:
    """``rule`` with its trace passed through ``ē^t = κ ē^{t-1} + ε^t``; contracts ``ē``."""

    def init(graph, r, theta):
        trace = rule.init(graph, r, theta)
        return FilteredTrace(trace, trace)

    def update(r, s, d_g, df, x, theta):
        eps = rule.update(r, s.trace, d_g, df, x, theta)
        return FilteredTrace(eps, jax.tree.map(lambda f, e: (kappa * f + e).astype(f.dtype),
                                               s.filtered, eps))

    def contribution(r, s, signal, theta):
        return rule.contribution(r, s.filtered, signal, theta)

    return RelationRule(init=init, update=update, contribution=contribution,
                        finalize=rule.finalize, rules=rule.rules)


class EProp(AbstractAlgorithm):
    """e-prop: filtered D-RTRL eligibility traces, symmetric or random feedback.

    .. math::

        \\bar e^t = \\kappa \\bar e^{t-1} + \\epsilon^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta|_{h^{t-1}}
            + L^t \\cdot \\bar e^{t-1}

    Args:
        kappa: The filter decay in ``[0, 1)``; ``0`` gives D-RTRL.
        feedback: ``'symmetric'``: ``L^t`` is the exact ``∂L_t/∂h^{t-1}``.
            ``'random'``: ETP operations reading the new hidden state send
            the error back through fixed random operands (see the module
            docstring); single-step mode only.
        seed: Seed of the random feedback operands.
        feedback_scale: Multiplies the random operands (LeCun-normal scaled).

    Example:
        >>> import braintrace
        >>> braintrace.EProp(kappa=0.5).kappa
        0.5
        >>> braintrace.EProp(feedback='random', seed=3).feedback
        'random'
    """

    name = "eprop"
    supports_trace_dtype = True

    def __init__(self, kappa: float = 0.0, *, feedback: str = "symmetric", seed: int = 0,
                 feedback_scale: float = 1.0):
        if not 0.0 <= kappa < 1.0:
            raise ValueError(f"EProp: kappa must lie in [0, 1), got {kappa}.")
        if feedback not in FEEDBACKS:
            raise ValueError(f"EProp: feedback must be one of {FEEDBACKS}, got {feedback!r}.")
        self.kappa = float(kappa)
        self.feedback = feedback
        self.seed = int(seed)
        self.feedback_scale = float(feedback_scale)
        self.supports_windowed = feedback == "symmetric"
        self._rules = {kind: filtered(rule, self.kappa)
                       for kind, rule in ((InputRelation, DRTRL_INPUT),
                                          (ElementwiseRelation, DRTRL_ELEMENTWISE))}

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(self._rules[type(r)] for r in graph.relations)

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The filtered traces (``kappa > 0``) and the random feedback (``'random'``)."""
        found: tuple[Approximation, ...] = ()
        if self.kappa > 0:
            found += algorithm_approximation(
                graph, graph.relations, kind="filtered-traces",
                label=f"EProp(kappa={self.kappa:g})",
                what=f"low-pass filters (ē = {self.kappa:g}·ē + ε) D-RTRL's traces of",
                detail="ē^t = κ ē^{t-1} + ε^t is contracted instead of ε^t",
                remedy="EProp(kappa=0) is D-RTRL")
        if self.feedback == "random":
            found += random_feedback_approximation(graph)
        return found

    def feedback_operands(self, graph: ETraceGraph) -> dict[int, dict[int, jax.Array]] | None:
        if self.feedback == "symmetric":
            return None
        return random_feedback_operands(graph, self.seed, self.feedback_scale)
