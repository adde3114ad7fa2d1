"""ES-D-RTRL (pp_prop): input/output-dimension eligibility traces.

The D-RTRL trace ``Σ_k (Π D) Df^{t-k} ⊗ x^{t-k}`` is replaced by a product of
two exponentially smoothed factors, one per side of the weight:

.. math::

    \\epsilon_x^t = \\alpha_x \\epsilon_x^{t-1} + x^t, \\qquad
    \\epsilon_f^t = \\alpha_f D^t \\epsilon_f^{t-1} + (1 - \\alpha_f) Df^t

    \\text{term}^t = \\mathrm{xy\\_to\\_dw}\\Big(\\epsilon_x^{t-1},\\;
        \\sum_s \\frac{\\epsilon_f^{t-1}[\\dots, s]}{c_{t-1}}\\,
        \\bar\\delta^t[\\dots, s]\\Big), \\qquad c_t = 1 - \\alpha_f^{t},

the temporal term added to the exact same-step gradient, with
``δ̄^t = ∂L_t/∂h^{t-1}``.

A bias is a weight row fed by a constant 1, whose x-side trace is
``ε_1^t = Σ_k α_x^k``, not 1: the part of ``xy_to_dw`` that does not depend on
``x`` is scaled by ``ε_1^t``. Memory ``O(B·(I + O·S))``, linear in neurons.
Exact at ``T = 1``. The elementwise primitive keeps its exact D-RTRL trace,
which is already shaped like the hidden state.

``decay_or_rank``: a float ``α`` in ``[0, 1)``, or an integer rank ``r`` giving
``α = (r - 1)/(r + 1)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm, BlockSteps, RelationRule
from braintrace._algorithms._block_algebra import decayed_end, decayed_sums
from braintrace._algorithms._d_rtrl import drtrl_rule
from braintrace._algorithms._fast_signal import (
    check_signal,
    fast_signal_approximation,
    uses_fast_signal,
)
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._signals import NEW_STATE_SIGNAL
from braintrace._algorithms._trace_algebra import merge_steps, mix_states, param_dtypes
from braintrace._compiler import (
    Approximation,
    ETraceGraph,
    InputRelation,
    is_var,
    reached,
    summed_outputs,
)
from braintrace._platform import by_platform
from braintrace._primitives import etp_sparse_batched_p, etp_sparse_p

GATHER_BOUND = (etp_sparse_p, etp_sparse_batched_p)
"""Primitives whose sums on accelerators cost per gathered index: a block's two weight
pullbacks are merged into one (:func:`_block_products`), so each index is read once; their
networks' default blocks keep to the memory budget (``_loops.default_block_size``)."""

__all__ = ["ESDRTRL", "ES_D_RTRL", "GATHER_BOUND", "IOTerm", "IOTrace", "decay_from",
           "es_input_rule", "input_side_block", "input_side_finalize", "paired_products",
           "pp_prop", "shared_output_sides", "x_free_part"]


def decay_from(decay_or_rank: float) -> float:
    """``α`` from a decay in ``[0, 1)`` or an integer rank ``r >= 1``: ``(r-1)/(r+1)``.

    Example:
        >>> from braintrace._algorithms._es_d_rtrl import decay_from
        >>> decay_from(3), decay_from(0.9)
        (0.5, 0.9)
    """
    if isinstance(decay_or_rank, bool):
        raise TypeError("decay_or_rank must be a float decay or an integer rank, not a bool.")
    if isinstance(decay_or_rank, int):
        if decay_or_rank < 1:
            raise ValueError(f"An integer rank must be >= 1, got {decay_or_rank}.")
        return (decay_or_rank - 1) / (decay_or_rank + 1)
    alpha = float(decay_or_rank)
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"A decay must lie in [0, 1), got {alpha}.")
    return alpha


class IOTrace(NamedTuple):
    """IO-dimension trace of one relation, all in the Params' dtype.

    Attributes:
        x: ``ε_x`` ``(*x.shape)`` (batch axis included when batched).
        ones: ``ε_1 = Σ_k α_x^k``, the x-side trace of a bias's constant input.
        f: ``ε_f`` ``(*y.shape, S)``.
        f_power: ``α_f^t``, so that the bias correction is ``c_t = 1 - α_f^t``
            (kept as a power rather than a step count: no overflow, no
            low-precision counting).
    """

    x: jax.Array
    ones: jax.Array
    f: jax.Array
    f_power: jax.Array


class IOTerm(NamedTuple):
    """One step's gradient term of a relation: ``xy_to_dw(ε_x, d)`` and ``(ε_1 - 1)·d``."""

    grad: dict
    bias_signal: jax.Array


def output_factor(r: InputRelation, s: IOTrace, signal: jax.Array) -> jax.Array:
    """``Σ_s ε_f[..., s] δ̄[..., s] / c``: the output side of one step's term, ``c = 1 - α_f^t``.

    Before the first step (``α_f^0 = 1``) the trace is zero and ``c`` is irrelevant (1).
    """
    correction = jnp.where(s.f_power < 1.0, 1.0 - s.f_power, 1.0)
    signal = r.gather_hidden(signal)
    # one product per state, added: a reduction over the short state axis is a slow
    # minor-axis reduce on XLA:CPU (5 ms per step at B 32, N 16,384, S 2)
    total = sum(s.f[..., k] * signal[..., k] for k in range(s.f.shape[-1]))
    return total / correction


def input_side_block(r: InputRelation, x_trace: jax.Array, ones: jax.Array, x: jax.Array,
                     ds: jax.Array, dy: jax.Array | None, decay: float, theta
                     ) -> tuple[jax.Array, jax.Array, IOTerm]:
    """A block of ``K`` steps of an input-side trace ``ε_x^k = α ε_x^{k-1} + x_k`` (and a
    bias's ``ε_1``): ``Σ_k xy_to_dw(ε_x^{k-1}, d_k) + Σ_k xy_to_dw(x_k, dy_k)`` and the traces
    after the block (module docstring of ``_block_algebra.py`` for the idea).

    With ``ε_x`` entering at ``ε_x^{-1}``, ``Σ_k xy_to_dw(ε_x^{k-1}, d_k) = xy_to_dw(ε_x^{-1},
    c) + Σ_j xy_to_dw(x_j, e_j)`` with ``c = Σ_k α^k d_k`` and ``e_j = Σ_{k>j} α^{k-1-j} d_k``
    (``_block_algebra.decayed_sums``); the same-step shares ``dy_j`` join ``e_j`` (on
    accelerators a sparse weight's ``(ε_x^{-1}, c)`` join the product as one more step,
    :func:`_block_products`).
    That product counts a bias's input as ``α^k + Σ_{j<k} α^{k-1-j}``, which falls ``α^k (ε_1^{-1} - 1)``
    short of ``ε_1^{k-1}``: the bias term adds ``(ε_1^{-1} - 1)·c``. At the end ``ε_x =
    α^K ε_x^{-1} + Σ_j α^{K-1-j} x_j`` (``_block_algebra.decayed_end``).

    Returns:
        ``(ε_x, ε_1, term)`` after the block.
    """
    c, e = decayed_sums(ds, decay, None if dy is None else dy.astype(ds.dtype))
    on_accelerator = _block_products(r, theta, merged=r.primitive in GATHER_BOUND,
                                     sample_major=True)
    grad = by_platform(cpu=_block_products(r, theta, merged=False), accelerator=on_accelerator)(
        x, e, x_trace, c)
    length = ds.shape[0]
    through = decay ** length  # α^K: what of the entering ε_x survives the block
    end = decayed_end(x_trace, x.astype(x_trace.dtype), decay)
    return (end.astype(x_trace.dtype),
            (through * ones + sum(decay ** k for k in range(length))).astype(ones.dtype),
            IOTerm(grad=grad, bias_signal=(ones - 1.0) * c))


def input_side_finalize(r: InputRelation, total: IOTerm, theta) -> dict:
    """``{key: dθ}`` from the summed terms: ``xy_to_dw``'s sums plus the bias correction
    ``Σ_t (ε_1 - 1)·d`` mapped once through the x-free part of ``xy_to_dw``."""
    bias = x_free_part(r.primitive.rule("xy_to_dw"), r.x_shape, total.bias_signal, theta,
                       r.params)
    return {key: value + bias[key] if key in bias else value
            for key, value in total.grad.items()}


def es_block_rules(f_update, x_decay: float, after_update: bool = False):
    """``block_step`` and ``block_finish`` of :func:`es_input_rule`: ``K`` steps of
    ``update``/``contribution`` (``after_update``: of ``update`` then ``contribution``).

    After the update, step ``k``'s term ``xy_to_dw(ε_x^k, d_k)`` with ``ε_x^k = α_x ε_x^{k-1}
    + x_k`` is ``xy_to_dw(ε_x^{k-1}, α_x d_k) + xy_to_dw(x_k, d_k)``: the block product
    below with output factors ``α_x d_k`` and same-step shares ``d_k`` (a bias's
    ``ε_1^k = α_x ε_1^{k-1} + 1`` splits the same way). The steps stack ``d_k`` once; the
    block scales it.
    """

    def block_step(r: InputRelation, s: IOTrace, signal_k, d_k, df_k) -> tuple[IOTrace, Any]:
        """``ε_f`` one step on, and the step's output factor ``d_k`` (from the ``ε_f`` it entered
        with; ``after_update``: from the updated one)."""
        new = f_update(r, s, d_k, df_k)
        return new, output_factor(r, new if after_update else s, signal_k)

    def block_finish(r: InputRelation, s: IOTrace, steps: BlockSteps, theta
                     ) -> tuple[IOTrace, IOTerm]:
        """The block's products (:func:`input_side_block`). ``steps.stepped`` carries ``ε_f``
        after the block and ``steps.outs`` each step's output factor ``d_k``."""
        stepped, ds, dy = steps.stepped, steps.outs, steps.dy
        if after_update:  # the same-step share d_k, the temporal factor α_x d_k
            dy = ds if dy is None else dy + ds.astype(dy.dtype)
            ds = x_decay * ds
        x, ones, term = input_side_block(r, s.x, s.ones, steps.x, ds, dy, x_decay, theta)
        return stepped._replace(x=x, ones=ones), term

    return block_step, block_finish


def _block_products(r: InputRelation, theta: dict, merged: bool, sample_major: bool = False):
    """``(x, e, ε_x, c) -> xy_to_dw(x_j, e_j) summed over the block's steps j + xy_to_dw(ε_x,
    c)``; ``merged``: one product with ``(ε_x, c)`` as one more step, so that a gather-bound
    product (the sparse one on accelerators) reads its indices once per block, at the cost
    of copying the stacks (two products on the CPU, where the sums cost the same, and for
    every other primitive).

    ``sample_major`` (accelerators, two products): the steps' rows sample by sample
    (``merge_steps``). XLA:TPU computes the decayed sums ``e`` as a convolution whose output
    it lays out sample-major; rows in step order then copy ``e`` whole (a GRU at hidden
    1024, batch 64: two ``(32, 64, 3072)`` copies per block, 1.5 µs per step on a TPU v5e),
    while in sample order only the narrower inputs ``x`` are reordered."""
    xy_to_dw = r.primitive.rule("xy_to_dw")
    if merged:
        rows = lambda steps, entering: merge_steps(r, jnp.concatenate([steps, entering[None]]))
        return lambda x, e, x_trace, c: xy_to_dw(rows(x, x_trace), rows(e, c), theta, **r.params)
    rows = lambda steps: merge_steps(r, steps, sample_major=sample_major)
    return lambda x, e, x_trace, c: jax.tree.map(
        jnp.add, xy_to_dw(rows(x), rows(e), theta, **r.params),
        xy_to_dw(x_trace, c, theta, **r.params))


def paired_products(r: InputRelation, theta: dict):
    """``(a, d, b, e) -> xy_to_dw(a, d) + xy_to_dw(b, e)`` for two pairs of the same shapes: on
    accelerators one product over the rows of both (``[a; b]`` with ``[d; e]``: a product
    whose rows are fewer than the systolic array's depth costs about the same with twice as
    many, measured per step on a TPU v5e at hidden 256, batch 16: 0.3 µs each), on the CPU
    two products (the sums cost the same there, the stacking would be a copy more)."""
    xy_to_dw = r.primitive.rule("xy_to_dw")

    def stacked(a, d, b, e):
        rows = lambda first, second: merge_steps(r, jnp.stack([first, second]))
        return xy_to_dw(rows(a, b), rows(d, e), theta, **r.params)

    def apart(a, d, b, e):
        return jax.tree.map(jnp.add, xy_to_dw(a, d, theta, **r.params),
                            xy_to_dw(b, e, theta, **r.params))

    return by_platform(cpu=apart, accelerator=stacked)


def x_free_part(xy_to_dw: Any, x_shape: tuple[int, ...], signal: jax.Array,
                theta: dict[str, jax.Array], params: dict[str, Any]) -> dict[str, jax.Array]:
    """The entries of ``xy_to_dw(x, signal)`` that do not depend on ``x`` (a bias's).

    ``xy_to_dw`` is evaluated at ``x = 0`` and the entries computed from ``x`` (found in
    its jaxpr) are left out, whatever their value there. Where ``xy_to_dw`` is linear in
    ``x`` (a kernel's ``xᵀd``) they vanish at ``x = 0``; left in, they would still be
    computed (XLA does not fold a product with a zero operand: once per optimiser update
    in ``OnlineTrainer``, a ``(B, I)ᵀ(B, O)`` product per dense layer).

    Example:
        >>> import jax.numpy as jnp
        >>> def xy_to_dw(x, d, theta):  # a dense layer's: kernel xᵀd, bias Σ d
        ...     return {"kernel": x.T @ d, "bias": d.sum(0)}
        >>> part = x_free_part(xy_to_dw, (2, 3), jnp.ones((2, 4)), {}, {})
        >>> list(part), part["bias"].tolist()
        (['bias'], [2.0, 2.0, 2.0, 2.0])
    """
    zeros = jnp.zeros(x_shape, signal.dtype)
    at = lambda x: xy_to_dw(x, signal, theta, **params)
    closed, out_shape = jax.make_jaxpr(at, return_shape=True)(zeros)
    from_x = reached(closed.jaxpr, closed.jaxpr.invars)[0]
    keys = jax.tree.structure(out_shape).unflatten(
        [is_var(v) and v in from_x for v in closed.jaxpr.outvars])
    values = at(zeros)
    return {key: values[key] for key in values
            if not any(jax.tree.leaves(keys[key]))}


def es_input_rule(x_decay: float, f_decay: float, after_update: bool = False) -> RelationRule:
    """The ES-D-RTRL rule of an operation with an input, for ``α_x`` and ``α_f``
    (``after_update``: its time-blocked form reads the fast signal, see :func:`es_block_rules`)."""

    def init(graph: ETraceGraph, r: InputRelation, theta) -> IOTrace:
        g = graph.groups[r.group]
        y_one = r.y_shape[1:] if r.batched else r.y_shape
        x_one = r.x_shape[1:] if r.batched else r.x_shape
        f = r.primitive.rule("init_pp")(jnp.zeros(x_one, g.dtype), jnp.zeros(y_one, g.dtype),
                                        theta, g.num_states)
        dtype = jnp.result_type(*param_dtypes(graph, r).values())
        f = jnp.broadcast_to(f, (*r.y_shape, g.num_states)).astype(dtype)
        return IOTrace(x=jnp.zeros(r.x_shape, dtype), ones=jnp.zeros((), dtype), f=f,
                       f_power=jnp.ones((), dtype))

    def f_update(r: InputRelation, s: IOTrace, d_g, df) -> IOTrace:
        """``ε_f = α_f D ε_f + (1 - α_f) Df`` and ``α_f^t``; the ``x`` side is left as it is."""
        f = (f_decay * mix_states(lambda d, t: d * t, r.gather_hidden(d_g), s.f)
             + (1.0 - f_decay) * df.astype(s.f.dtype))
        return s._replace(f=f.astype(s.f.dtype),
                          f_power=(f_decay * s.f_power).astype(s.f_power.dtype))

    def update(r: InputRelation, s: IOTrace, d_g, df, x, theta) -> IOTrace:
        """``ε_x = α_x ε_x + x``, ``ε_f = α_f D ε_f + (1 - α_f) Df``."""
        del theta
        s = f_update(r, s, d_g, df)
        return s._replace(x=(x_decay * s.x + x.astype(s.x.dtype)).astype(s.x.dtype),
                          ones=(x_decay * s.ones + 1.0).astype(s.ones.dtype))

    def contribution(r: InputRelation, s: IOTrace, signal, theta) -> IOTerm:
        # The x-independent (bias) part of xy_to_dw is linear in d, so its correction by
        # ε_1 - 1 is summed in output space and mapped once, in finalize.
        d = output_factor(r, s, signal)
        return IOTerm(grad=r.primitive.rule("xy_to_dw")(s.x, d, theta, **r.params),
                      bias_signal=(s.ones - 1.0) * d)

    def contribution_with_share(r: InputRelation, s: IOTrace, signal, x, dy, theta) -> IOTerm:
        """``xy_to_dw(ε_x, d) + xy_to_dw(x, dy)``: the term and the same-step share
        (:func:`paired_products`; the bias's share ``Σ dy`` needs no correction)."""
        if dy is None:
            return contribution(r, s, signal, theta)
        d = output_factor(r, s, signal)
        grad = paired_products(r, theta)(s.x, d, x.astype(s.x.dtype), dy.astype(d.dtype))
        return IOTerm(grad=grad, bias_signal=(s.ones - 1.0) * d)

    def own(s: IOTrace) -> IOTrace:
        """The state without its output side (``ε_f``, ``α_f^t``: functions of ``D``, ``Df``)."""
        return s._replace(f=None, f_power=None)

    def tie(s: IOTrace, leader: IOTrace) -> IOTrace:
        """The state with the output side of a relation with the same ``Df``."""
        return s._replace(f=leader.f, f_power=leader.f_power)

    def uniform(s: IOTrace, first: IOTrace) -> IOTrace:
        """The state with ``ε_1`` and ``α_f^t`` of ``first``: functions of the step count
        alone, alike in every relation of this rule (the same start, the same decays)."""
        return s._replace(ones=first.ones,
                          f_power=None if s.f_power is None else first.f_power)

    block_step, block_finish = es_block_rules(f_update, x_decay, after_update)
    return RelationRule(init=init, update=update, contribution=contribution,
                        finalize=input_side_finalize,
                        rules=lambda r: ("init_pp", "xy_to_dw"), block_step=block_step,
                        block_finish=block_finish, own=own, tie=tie, uniform=uniform,
                        contribution_with_share=None if after_update else contribution_with_share)


def shared_output_sides(graph: ETraceGraph) -> tuple[int | None, ...]:
    """Per relation, the relation whose ``ε_f`` it shares: the same ``Df``
    (``summed_outputs``) and the same trace dtype; empty when none does.

    Both traces start at zero and follow ``ε_f ← α_f D ε_f + (1 - α_f) Df`` with the
    group's ``D``, so they are equal at every step.
    """
    relations = graph.relations
    dtype = lambda r: jnp.result_type(*param_dtypes(graph, r).values())
    leaders = tuple(None if a is None or dtype(relations[a]) != dtype(relations[b]) else a
                    for b, a in enumerate(summed_outputs(graph)))
    return leaders if any(a is not None for a in leaders) else ()


class ESDRTRL(AbstractAlgorithm):
    """Exponentially smoothed D-RTRL (pp_prop): traces linear in the number of neurons.

    .. math::

        \\epsilon_x^t = \\alpha_x \\epsilon_x^{t-1} + x^t, \\quad
        \\epsilon_f^t = \\alpha_f D^t \\epsilon_f^{t-1} + (1-\\alpha_f) Df^t

    and the temporal term ``xy_to_dw(ε_x^{t-1}, Σ_s ε_f^{t-1} δ̄^t / c_{t-1})``
    added to the exact same-step gradient.

    With ``signal='fast'`` (0.2.8's pp_prop) the learning signal is
    ``δ^t = ∂L_t/∂h^t`` (``h^t`` an input of the readout and of later states: no
    backward product through the recurrent kernels), contracted with the
    updated traces, plus the same-step gradient by every path but the traced
    operations' (the readout's Params):

    .. math::

        \\text{term}^t = \\mathrm{xy\\_to\\_dw}\\Big(\\epsilon_x^{t},\\;
            \\sum_s \\frac{\\epsilon_f^{t}[\\dots, s]}{c_{t}}\\,\\delta^t[\\dots, s]\\Big).

    Operations whose outputs are added before anything reads them (a spiking
    layer's ``W_in x + W_rec z``) have the same ``Df``, so their ``ε_f`` are equal
    at every step: the compiler finds them (``summed_outputs``) and the trace is
    kept once, the second operation's ``ε_f`` and output factor being the first's
    (``GraphRules.leaders``): the same gradients with less memory and work per step.

    Every Param keeps its trace (the GRU's reset-gate kernel included). The
    factorised traces are not additive, so with an operation with an input the
    fast signal is never the exact one: an approximation that ``report()``
    names and ``strict=True`` refuses (the elementwise relations keep D-RTRL's
    traces; with only those, the fast form runs whatever ``signal`` says where
    the compiler proves it equal). Single-step: no ``chunk_size`` with
    ``'fast'``.

    Args:
        decay_or_rank: ``α_f`` (and ``α_x`` unless given): a float in
            ``[0, 1)`` or an integer rank ``r`` (``α = (r-1)/(r+1)``).
        x_decay_or_rank: A separate ``α_x`` for the input side.
        name: The name reported (``'ostl_feedforward'`` for OSTL's variant).
        signal: ``'exact'`` (the default) or ``'fast'``.

    Example:
        >>> import braintrace
        >>> alg = braintrace.ESDRTRL(3)
        >>> alg.f_decay, alg.x_decay
        (0.5, 0.5)
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, braintrace.ESDRTRL(signal='fast'),
        ...                              jnp.ones((3,)))
        >>> grads = learner.etrace_grad(jnp.ones((5, 3)), jnp.zeros((5, 4)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['layers'][0]['kernel'].shape
        (3, 4)
    """

    supports_trace_dtype = True

    def __init__(self, decay_or_rank: float = 0.9, *,
                 x_decay_or_rank: float | None = None, name: str = "es_d_rtrl",
                 signal: str = "exact"):
        self.name = name
        self.f_decay = decay_from(decay_or_rank)
        self.x_decay = decay_from(decay_or_rank if x_decay_or_rank is None else x_decay_or_rank)
        self.signal = check_signal(signal)
        self.supports_windowed = self.signal == "exact"
        self._input_rules = {after: es_input_rule(self.x_decay, self.f_decay, after)
                             for after in (False, True)}

    def _uses_fast(self, graph: ETraceGraph) -> bool:
        # only D-RTRL's (elementwise) traces are additive
        return uses_fast_signal(self.signal, graph, additive=not graph.input_relations)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        # the elementwise trace is already shaped like the hidden state: D-RTRL's, exact
        fast = self._uses_fast(graph)
        return tuple(self._input_rules[fast] if isinstance(r, InputRelation)
                     else drtrl_rule(r, after_update=fast) for r in graph.relations)

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """The bound rules; operations whose outputs are added before anything reads them
        (``summed_outputs``: the same ``Df``) keep one ``ε_f`` for both."""
        rules = dataclasses.replace(super().rules(graph), leaders=shared_output_sides(graph))
        if self._uses_fast(graph):
            return dataclasses.replace(rules, learning_signal=NEW_STATE_SIGNAL)
        return rules

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The factorised traces of every operation with an input (exact only at ``T = 1``),
        and with ``signal='fast'`` the fast signal where it is not the exact one.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> braintrace.init_states(model, 2)
            >>> graph = braintrace.compile_graph(model, jnp.ones((2, 3)))
            >>> [(a.kind, a.param_paths) for a in braintrace.ESDRTRL().approximations(graph)]
            [('factorised-traces', ('layers.0.bias', 'layers.0.kernel'))]
        """
        smoothing = ("no smoothing: the previous step's input and Df only" if self.f_decay == 0
                     and self.x_decay == 0 else
                     f"α_f = {self.f_decay:g}, α_x = {self.x_decay:g}")
        label = f"{type(self).__name__} ('{self.name}')"
        fast = fast_signal_approximation(self.signal, graph, additive=not graph.input_relations,
                                         label=label)
        return fast + algorithm_approximation(
            graph, graph.input_relations, kind="factorised-traces",
            label=label,
            what=("replaces D-RTRL's traces by a product of an input trace and an output trace "
                  f"({smoothing}) for"),
            detail="the traces ε_x ⊗ ε_f replace D-RTRL's Σ_k (Π D) Df ⊗ x; exact at T = 1",
            remedy="DRTRL() keeps the exact per-weight traces (memory O(B·|θ|·S))")


def pp_prop(decay_or_rank: float = 0.9, *,
            x_decay_or_rank: float | None = None) -> ESDRTRL:
    """Alias of :class:`ESDRTRL` (the name used by BrainScale's pp-prop).

    Example:
        >>> import braintrace
        >>> braintrace.pp_prop(0.5).f_decay
        0.5
    """
    return ESDRTRL(decay_or_rank, x_decay_or_rank=x_decay_or_rank)


ES_D_RTRL = ESDRTRL
"""The earlier spelling of :class:`ESDRTRL`."""
