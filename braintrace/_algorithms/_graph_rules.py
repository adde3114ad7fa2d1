"""An algorithm bound to one compiled graph: the record the time loops run.

:meth:`AbstractAlgorithm.rules(graph) <braintrace.AbstractAlgorithm.rules>`
returns a :class:`GraphRules` once, at compile time. It holds every relation's
:class:`~braintrace._algorithms._relation_rule.RelationRule` and the algorithm's hooks
(learning signal, window, feedback operands), and maps the rules over the
graph's relations. It holds no mutable state and nothing keyed on the graph's
identity: a new graph (another batch size, another mode) gets its own record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from braintrace._algorithms._relation_rule import BlockSteps, Jacobians, RelationRule
from braintrace._algorithms._signals import AbstractLearningSignal
from braintrace._algorithms._trace_algebra import operand_structs
from braintrace._algorithms._trace_storage import reading_widened, stored, working
from braintrace._compiler import ETraceGraph, Relation
from braintrace._primitives import MissingRuleError

__all__ = ["GraphRules"]


@dataclasses.dataclass(frozen=True, eq=False)
class GraphRules:
    """An algorithm's rules for every relation of one graph, and its hooks.

    Attributes:
        graph: The compiled graph.
        name: The algorithm's name (for messages).
        scope: ``'diagonal'``, ``'coupled'`` or ``'full'``: the hidden Jacobian it reads.
        relation_rules: One rule per relation of ``graph`` (empty: nothing traced, BPTT).
        signal_view: ``(graph, delta, relation) -> signal``: what a relation's rule reads
            of the per-leaf learning signal ``delta``.
        feedback: Fixed feedback operands ``{eqn: {operand: B}}``, or ``None`` (exact).
        learning_signal: Where the per-step learning signal comes from.
        window: What each window of windowed mode adds (DNI), or ``None``.
        supports_windowed: Whether windowed mode may be used.
        needs_window: Whether only windowed mode may be used (BPTT, DNI).
        leaders: Per relation, the relation whose output its own is added to before
            anything reads them (``summed_outputs``: the same ``Df`` and the same output
            cotangent ``dy``), whose ``Df``-only part of the state it shares (its rule's
            ``own``/``tie``), or ``None``; empty: none shares. A sharing relation's stored
            state is ``own(state)``; every rule function sees ``tie(own, leader's
            state)``, and in a block its ``block_step`` outputs and ``dy`` are the
            leader's (not stacked twice).
        trace_dtype: The dtype the trace arrays are stored in, or ``None``: the rules'
            own (the Params'). Every function then reads the stored states widened (to
            float32, or the trace dtype if wider) and rounds the states it returns once
            (``_trace_storage.py``).
        readers: Per hidden group, the relations that read its new state unit by unit
            (``braintrace._compiler.readers``), for rules that follow a weight's effect
            into them (OTPE); empty: none. Then the loops also compute, per step, each
            reader's ``∂x'/∂h^t`` (``Jacobians.reads``), handed to ``update`` (and stacked
            to ``block_finish``, ``BlockSteps.d``) with ``D`` as the pair
            ``(D_g, reads_g)``, and its input cotangent ``∂L_t/∂x'``, appended to
            the learning signal after the hidden leaves' (in ``reader_list`` order), then
            every relation's output cotangent ``∂L_t/∂y^t`` (as ``output_probes``). One
            entry per group (groups nobody reads: empty) makes every ``update`` get pairs.
    """

    graph: ETraceGraph
    name: str
    scope: str
    relation_rules: tuple[RelationRule, ...]
    signal_view: Callable[[ETraceGraph, Sequence[jax.Array], Relation], jax.Array]
    feedback: dict[int, dict[int, jax.Array]] | None
    learning_signal: AbstractLearningSignal
    window: Any = None
    supports_windowed: bool = True
    needs_window: bool = False
    leaders: tuple[int | None, ...] = ()
    trace_dtype: Any = None
    readers: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        """Checks ``leaders``: one entry per relation, each an earlier relation that shares
        nothing itself, with rules that can share (``own`` and ``tie``)."""
        if not self.leaders:
            return
        if len(self.leaders) != len(self.relation_rules):
            raise ValueError(f"GraphRules.leaders has {len(self.leaders)} entries for "
                             f"{len(self.relation_rules)} relations.")
        for i, lead in enumerate(self.leaders):
            if lead is None:
                continue
            rule = self.relation_rules[i]
            if not (0 <= lead < i and self.leaders[lead] is None
                    and rule.own is not None and rule.tie is not None):
                raise ValueError(
                    f"Relation {i} (trains {list(self.graph.relations[i].all_param_paths)}) "
                    f"cannot share relation {lead}'s state: a leader comes earlier and "
                    "shares nothing itself, and the rule must define own and tie.")

    # -- what the rules offer ------------------------------------------------------

    @property
    def relations(self) -> tuple[Relation, ...]:
        """The relations that keep traces (none when nothing is traced)."""
        return self.graph.relations if self.relation_rules else ()

    @property
    def traced(self) -> bool:
        """Whether any relation keeps eligibility traces."""
        return bool(self.relation_rules)

    @property
    def supports_blocks(self) -> bool:
        """Whether every relation's rule has a time-blocked form (``block_finish``)."""
        return self.traced and all(rule.block_finish is not None
                                   for rule in self.relation_rules)

    @functools.cached_property
    def trace_bytes(self) -> int:
        """The bytes of every relation's trace state as stored (in ``trace_dtype`` where one
        is set), from the graph's shapes: abstractly evaluated, nothing allocated.

        Example:
            >>> import braintrace, jax.numpy as jnp
            >>> from flax import nnx
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> braintrace.compile(model, 'd_rtrl', jnp.ones((3,))).rules.trace_bytes
            64
        """
        states = jax.eval_shape(lambda operands: stored(self.init(operands), self.trace_dtype),
                                operand_structs(self.graph))
        return sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(states))

    @property
    def reads_jacobians(self) -> bool:
        """Whether some relation's rule reads the hidden Jacobians ``D`` and ``Df``."""
        return any(rule.jacobians for rule in self.relation_rules)

    @property
    def has_block_steps(self) -> bool:
        """Whether some relation's block runs a part inside the model's loop (``block_step``)."""
        return any(rule.block_step is not None for rule in self.relation_rules)

    @property
    def reads_stacked_steps(self) -> bool:
        """Whether some relation's block reads the block's stacked signals and Jacobians."""
        return any(rule.block_step is None for rule in self.relation_rules)

    @property
    def adds_share(self) -> bool:
        """Whether the per-step loop hands each relation its own share of the same-step
        gradient, its output cotangent ``dy^t``, to add in its term
        (:meth:`contribution_with_share`) instead of adding it to the Params' same-step
        gradient: when every relation's rule can (``RelationRule.contribution_with_share``)
        and the signal is the loss's ``∂L_t/∂h^{t-1}``, contracted before the update, with
        every Param keeping its same-step gradient and no readers."""
        signal = self.learning_signal
        return (self.traced and not self.readers
                and all(rule.contribution_with_share is not None
                        for rule in self.relation_rules)
                and not (signal.after_update or signal.reads_new_state or signal.reads_outputs)
                and all(signal.keeps_same_step(self.graph)))

    def check(self) -> None:
        """Raises :class:`~braintrace.MissingRuleError` if a relation's primitive lacks a rule.

        The message names the algorithm, the primitive, every missing rule and
        the Params that the relation trains.
        """
        for r, rule in zip(self.relations, self.relation_rules):
            prim = r.primitive
            missing = [name for name in rule.rules(r) if not prim.has_rule(name)]
            if missing:
                rules = ", ".join(f"'{m}'" for m in missing)
                raise MissingRuleError(
                    f"Algorithm '{self.name}' needs the ETP rule(s) {rules} of primitive "
                    f"'{prim.name}' (which trains {list(r.all_param_paths)}), but "
                    f"'{prim.name}' never registered them. Register them with "
                    f"`{prim.name}.register_etp_rules({missing[0]}=...)` (or the single-rule "
                    "`register_*` methods), or choose an algorithm that does not need them.")

    # -- shared state parts ---------------------------------------------------------------

    def leader(self, index: int) -> int | None:
        """The relation whose ``Df``-only state part relation ``index`` shares, or ``None``."""
        return self.leaders[index] if self.leaders else None

    @property
    def unread_df(self) -> frozenset[int]:
        """The relations whose ``Df`` no rule reads: those sharing their leader's output side,
        which read the leader's (:meth:`df`); the step's Jacobians skip their tangents."""
        return frozenset(i for i in range(len(self.relation_rules)) if self.leader(i) is not None)

    def df(self, df: Sequence[Any], index: int) -> Any:
        """Relation ``index``'s ``Df`` in ``df`` (per relation): a sharing relation's is its
        leader's, the same Jacobian (the step's Jacobians skip its own: ``None`` there)."""
        lead = self.leader(index)
        return df[index if lead is None else lead]

    def _tied(self, state: Sequence[Any]) -> list[Any]:
        """Every relation's whole state (a sharing relation's tied to its leader's), as the
        rules read it (widened from the trace dtype)."""
        state = working(list(state), self.trace_dtype)
        tied = [s if self.leader(i) is None
                else self.relation_rules[i].tie(s, state[self.leader(i)])
                for i, s in enumerate(state)]
        # the parts every relation of one rule holds alike, read from its first relation's
        # state: one scalar update per step, not one per relation
        first: dict[int, Any] = {}
        for i, (rule, s) in enumerate(zip(self.relation_rules, tied)):
            if rule.uniform is not None:
                source = first.setdefault(id(rule), s)
                tied[i] = s if source is s else rule.uniform(s, source)
        return tied

    def unshared(self, per_relation: Sequence[Any]) -> list[Any]:
        """``per_relation`` with a sharing relation's entry ``None`` (its leader's stands for
        it: a ``block_step`` output or ``dy`` to stack once)."""
        return [None if self.leader(i) is not None else v for i, v in enumerate(per_relation)]

    def _owned(self, state: Sequence[Any]) -> list[Any]:
        """The states as stored (a sharing relation's without the shared part, rounded to
        the trace dtype)."""
        return stored([s if self.leader(i) is None else self.relation_rules[i].own(s)
                       for i, s in enumerate(state)], self.trace_dtype)

    # -- the rules mapped over the relations ----------------------------------------------

    def signal(self, delta: Sequence[jax.Array], relation: Relation) -> jax.Array:
        """The learning signal ``relation``'s rule reads, from the per-leaf ``delta``."""
        return self.signal_view(self.graph, delta, relation)

    def init(self, operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """Each relation's zero trace state."""
        return self._owned([rule.init(self.graph, r, theta)
                            for r, rule, theta in zip(self.relations, self.relation_rules,
                                                      operands)])

    def update(self, state: Sequence[Any], jac: Jacobians, rel_x: Sequence[jax.Array | None],
               operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """``ε^{t-1} → ε^t`` for every relation."""
        d = ([(d_g, reads) for d_g, reads in zip(jac.d, jac.reads)] if self.readers
             else jac.d)
        return self._owned([rule.update(r, s, d[r.group], self.df(jac.df, r.index), x, theta)
                            for r, rule, s, x, theta in zip(self.relations, self.relation_rules,
                                                            self._tied(state), rel_x, operands)])

    def contribution(self, state: Sequence[Any], delta: Sequence[jax.Array],
                     operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """Every relation's temporal gradient term, from the per-leaf signal ``delta``."""
        return [rule.contribution(r, s, self.signal(delta, r), theta)
                for r, rule, s, theta in zip(self.relations, self.relation_rules,
                                             self._tied(state), operands)]

    def contribution_with_share(self, state: Sequence[Any], delta: Sequence[jax.Array],
                                rel_x: Sequence[jax.Array | None], dy: Sequence[jax.Array | None],
                                operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """:meth:`contribution` with each relation's own share of the same-step gradient, from
        its input ``x^t`` and output cotangent ``dy^t`` (``None`` for a relation whose
        equation an earlier relation counts), in the same term (:attr:`adds_share`)."""
        return [rule.contribution_with_share(r, s, self.signal(delta, r), x, d, theta)
                for r, rule, s, x, d, theta in zip(self.relations, self.relation_rules,
                                                   self._tied(state), rel_x, dy, operands)]

    def contribution_from_outputs(self, state: Sequence[Any], dy: Sequence[jax.Array | None],
                                  operands: Sequence[dict[str, jax.Array]]) -> list[Any]:
        """Every relation's gradient term from its own output cotangent ``dy`` (``None`` for a
        relation whose equation an earlier relation counts): the output form of the signal
        (``OutputSignal``)."""
        return [rule.contribution(r, s, d, theta)
                for r, rule, s, d, theta in zip(self.relations, self.relation_rules,
                                                self._tied(state), dy, operands)]

    def finalize(self, summed: Sequence[Any],
                 operands: Sequence[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
        """Maps every relation's summed terms to ``{key: dθ}``."""
        return [rule.finalize(r, total, theta)
                for r, rule, total, theta in zip(self.relations, self.relation_rules, summed,
                                                 operands)]

    def block_step(self, state: Sequence[Any], delta: Sequence[jax.Array],
                   jac: Jacobians) -> tuple[list[Any], list[Any]]:
        """One step of every ``block_step`` (the others' states, ``None`` here, pass through,
        outputs ``None``; a sharing relation's output is its leader's, ``None`` here too)."""
        out = []
        for r, rule, s in zip(self.relations, self.relation_rules, self._tied(state)):
            out.append((s, None) if rule.block_step is None else rule.block_step(
                r, s, self.signal(delta, r), jac.d[r.group], self.df(jac.df, r.index)))
        return self._owned([new for new, _ in out]), self.unshared([o for _, o in out])

    def block_finish(self, state: Sequence[Any], steps: Sequence[BlockSteps],
                     operands: Sequence[dict[str, jax.Array]]) -> tuple[list[Any], list[Any]]:
        """``K`` steps of every relation at once: the traces after them and their summed terms.

        ``steps`` holds one :class:`BlockSteps` per relation (a sharing relation's with its
        own part of the stepped state and no outputs or ``dy``: they are completed from its
        leader's).
        """
        steps = [view._replace(stepped=working(view.stepped, self.trace_dtype))
                 for view in steps]
        for i, view in enumerate(steps):
            lead = self.leader(i)
            if lead is not None and view.stepped is not None:
                steps[i] = view._replace(
                    stepped=self.relation_rules[i].tie(view.stepped, steps[lead].stepped),
                    outs=steps[lead].outs, dy=steps[lead].dy)
        with reading_widened(self.trace_dtype):
            out = [rule.block_finish(r, s, view, theta)
                   for r, rule, s, view, theta in zip(self.relations, self.relation_rules,
                                                      self._tied(state), steps, operands)]
        return self._owned([new for new, _ in out]), [term for _, term in out]
