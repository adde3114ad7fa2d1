"""The contract every online learning algorithm follows, the optax way.

An algorithm is, per relation ``r`` (an ETP operation feeding hidden group
``g``), a :class:`RelationRule`: pure functions over a trace state, like an
optax transformation's ``init``/``update``:

* ``init(graph, r, θ)`` -> the trace state of ``r`` (a NamedTuple or pytree);
* ``update(r, state, D_g, Df_r, x, θ)`` -> the next state (``ε^{t-1} → ε^t``);
* ``contribution(r, state, δ̄_g, θ)`` -> this step's temporal gradient term: the
  learning signal ``δ̄_g = ∂L_t/∂h_g^{t-1}`` ``(*V, S)`` contracted with the
  traces *before* this step's update (``ε^{t-1}``); terms are summed over time
  and the loop adds the exact same-step gradient (``braintrace/_loops``);
* ``finalize(r, summed, θ)`` -> ``{key: dθ}`` (linear, applied once after
  summing);
* ``rules(r)``: the ETP rules it calls, checked once when the algorithm is bound
  to a graph (:meth:`AbstractAlgorithm.rules`), so a missing rule fails at
  ``braintrace.compile`` with a :class:`~braintrace.MissingRuleError`;

and, for the time-blocked loop (``K`` steps at once, see
``braintrace/_loops/_blocked.py``), one block protocol in two parts:

* optionally ``block_step(r, state, δ̄_k, D_k, Df_k) -> (state, out_k)``: the
  part of a block that is a short recursion, run inside the model's own loop
  over the block's steps (nothing stacked but ``out_k``); a rule without it
  reads the block's stacked signals and Jacobians instead;
* ``block_finish(r, state, steps, θ) -> (state, term)``: the rest, from the
  state entering the block and the block's :class:`BlockSteps`: equal to ``K``
  rounds of ``contribution`` then ``update`` with their terms summed, plus the
  relation's own share of the same-step gradient ``Σ_k xy_to_dw(x_k, dy_k)``.

A rule whose state has a part that depends on ``D`` and ``Df`` only (ES-D-RTRL's
``ε_f``) can let relations that share ``Df`` (``summed_outputs``) keep that part
once, with ``own(state)`` (the state without it) and ``tie(own, leader)`` (the
state again, that part the leader's); :class:`GraphRules` then stores ``own``
and hands every function the tied state.

:meth:`AbstractAlgorithm.rules` binds an algorithm to one compiled graph once,
at compile time, and returns :class:`~braintrace._algorithms._graph_rules.GraphRules`:
every relation's rule, the learning-signal and window hooks and the feedback
operands. The loops only ever talk to that record.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._relation_rule import BlockSteps, RelationRule
from braintrace._algorithms._signals import LOSS_SIGNAL, AbstractLearningSignal
from braintrace._algorithms._trace_algebra import group_signal
from braintrace._compiler import Approximation, ETraceGraph, Relation

# BlockSteps and RelationRule are named here for the rules that import them with the base
__all__ = ["AbstractAlgorithm", "BlockSteps", "RelationRule"]


class AbstractAlgorithm(abc.ABC):
    """Base of the online learning algorithms (see the module docstring).

    An algorithm is a configuration (its hyperparameters) and one abstract
    method, :meth:`relation_rules`. Everything else is a hook with a default:

    * :meth:`bind`: what binds to the model (DNI's synthesiser); returns the
      algorithm to use with it.
    * :meth:`learning_signal`: where the learning signal comes from (default: the
      loss, ``∂L_t/∂h^{t-1}``; ThreeFactor's modulators).
    * :meth:`window`: what a window of windowed mode adds (DNI's synthetic
      gradients); ``None``: nothing.
    * :meth:`feedback_operands`: fixed random feedback (e-prop); ``None``: exact.
    * :meth:`approximations`: where the algorithm approximates BPTT by
      construction on a graph (reported; refused by ``strict=True``);
      :meth:`graph_approximations`: which of the graph's own approximations hold
      for it (all of them by default).

    :meth:`rules` combines them into the :class:`GraphRules` the loops run.

    Attributes:
        name: The name :func:`braintrace.compile` accepts.
        scope: ``'diagonal'``, ``'coupled'`` or ``'full'``: which hidden Jacobian it uses.
        supports_windowed: Whether ``chunk_size=`` (windowed mode) may be used.
        needs_window: Whether it runs only in windowed mode (BPTT, DNI).
        keeps_traces: Whether its gradient reads eligibility traces, and so has the
            graph's approximations (``graph.approximations``) besides its own. BPTT's
            does not: reverse mode through the sequence is exact on every model.
        supports_trace_dtype: Whether its traces may be stored in another dtype
            (``braintrace.compile(..., trace_dtype=...)``, ``GraphRules.trace_dtype``).
    """

    name: str = ""
    scope: str = "diagonal"
    supports_windowed: bool = True
    needs_window: bool = False
    keeps_traces: bool = True
    supports_trace_dtype: bool = False

    @abc.abstractmethod
    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        """The rule this algorithm applies to each relation of ``graph``, in order."""

    def relation_signal(self, graph: ETraceGraph, delta: Sequence[jax.Array],
                        relation: Relation) -> jax.Array:
        """The learning signal a relation's contribution reads: its group's ``(*V, S)``."""
        return group_signal(graph, delta, relation.group)

    def bind(self, model: nnx.Module) -> AbstractAlgorithm:
        """The algorithm to use with ``model`` (this one, unless something binds to it)."""
        del model
        return self

    def learning_signal(self) -> AbstractLearningSignal:
        """Where the learning signal comes from (the loss by default)."""
        return LOSS_SIGNAL

    def window(self, graph: ETraceGraph) -> Any:
        """What each window of windowed mode adds (``None``: nothing)."""
        del graph
        return None

    def feedback_operands(self, graph: ETraceGraph) -> dict[int, dict[int, jax.Array]] | None:
        """``{eqn index: {operand position: B}}`` for feedback alignment, or ``None`` (exact).

        Listed ETP equations send the derivative to their input through ``B``
        instead of their trainable operands, in the same-step gradient and in
        the learning signal alike. Computed once, when :meth:`rules` binds the graph.
        """
        del graph
        return None

    def graph_approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The approximations of ``graph``'s traces that hold for this algorithm: all of
        ``graph.approximations`` (D-RTRL's view), unless the algorithm follows some of those
        paths itself (OTPE, the feed-forward coupling into a reading layer).
        ``report()`` and ``strict=True`` read these with :meth:`approximations`."""
        return graph.approximations

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """What this algorithm approximates by construction on ``graph``.

        Beyond ``graph.approximations`` (where the graph's own traces are not
        the exact influence), which count when it :attr:`keeps_traces`: empty
        when the algorithm's gradient equals BPTT wherever the graph's traces
        are exact. ``report()`` lists both and ``compile(..., strict=True)``
        refuses either.
        """
        del graph
        return ()

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """Binds this algorithm to ``graph``: its rules per relation and its hooks, checked.

        Raises:
            MissingRuleError: A relation's primitive lacks a rule the algorithm
                needs (the message names the algorithm, the primitive, the rules
                and the Params).
        """
        with jax.ensure_compile_time_eval():
            feedback = self.feedback_operands(graph)
        rules = GraphRules(
            graph=graph, name=self.name or type(self).__name__, scope=self.scope,
            relation_rules=tuple(self.relation_rules(graph)),
            signal_view=self.relation_signal, feedback=feedback,
            learning_signal=self.learning_signal(), window=self.window(graph),
            supports_windowed=self.supports_windowed, needs_window=self.needs_window)
        rules.check()
        return rules
