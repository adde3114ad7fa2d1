"""One time step of online learning, before any trace is touched.

Per step ``t``, with Params ``θ`` and the hidden state ``h^{t-1}`` it starts from:

1. the forward pass of the step (the new state ``h^t``, the output ``y^t`` and
   each relation's input ``x^t``);
2. the VJP of the step's weighted loss ``w_t·L_t`` with respect to the Params
   and ``h^{t-1}``: the exact same-step gradient ``∂(w_t L_t)/∂θ|_{h^{t-1}}``
   of every Param (every path of the step: nothing is ever dropped from it)
   and the learning signal ``δ̄^t = ∂(w_t L_t)/∂h^{t-1}``, which covers both a
   loss that reads the new state and one that reads the previous state
   (``w_t L_t`` is 0 where ``w_t = 0``, selected, not multiplied, and nothing of an
   ignored loss reaches the gradient: :func:`step_loss`);
3. the hidden Jacobians ``D^t = ∂h^t/∂h^{t-1}`` and ``Df^t = ∂h^t/∂y^t`` at
   ``(h^{t-1}, x^t)`` in the scope the algorithm reads.

:func:`loss_terms` is 1 and 2. :func:`probed_loss_terms` is the same pass with
each relation's output cotangent ``∂(w_t L_t)/∂y^t`` returned instead of the
relations' own share of the same-step gradient (the time-blocked rules add that
share in their block product; :func:`output_loss_terms` hands those cotangents to
the per-step loop as the signal of ``OutputSignal``). :func:`step_jacobians` is 3.

With ``new_state=True`` (the fast learning signal, ``NewStateSignal``), 2 is
instead the VJP with respect to probes on the new state ``h^t``
(``programs.state_probes``) and the Params, the traced relations' operands cut:
the signal ``δ^t = ∂(w_t L_t)/∂h^t`` (every read of ``h^t`` in the step, the
readout and later states, but no path into ``h^t``: no backward product
through the recurrent kernels) and the same-step gradient by every path but
the traced relations' (the readout's Params, untraced paths). The relations'
own share is then in the updated traces ``ε^t``, so ``dy`` is ``None``. Rules
that read the groups' readers (OTPE, ``GraphRules.readers``) get, after the
hidden leaves' signals, each reader's input cotangent ``∂(w_t L_t)/∂x'`` and
each relation's output cotangent ``∂(w_t L_t)/∂y^t``.

A learning signal with ``cut_inputs`` (OSTTP's target projection) cuts the derivative the
loss sends back through the input ``x`` of those ETP equations and adds its
``input_objective`` of their inputs (zero-valued) to the weighted loss of 2: what those
inputs send back instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from braintrace._algorithms import GraphRules, Jacobians, is_batched
from braintrace._arguments import call_loss
from braintrace._compiler import ETraceGraph, StepLeaves, programs, reader_list
from braintrace._loops._context import LoopContext
from braintrace._loops._masks import stop_unscored, weigh

__all__ = ["LossTerms", "ProbedLossTerms", "add_same_step", "loss_terms", "output_loss_terms",
           "probed_loss_terms", "reader_probes", "step_jacobians", "step_leaves",
           "step_loss"]


class LossTerms(NamedTuple):
    """Steps 1 and 2 of one time step (module docstring).

    Attributes:
        hidden, other: The state after the step.
        same_step: ``∂(w_t L_t)/∂θ|_{h^{t-1}}`` per Param leaf.
        signal: ``δ̄^t = ∂(w_t L_t)/∂h^{t-1}`` per hidden leaf.
        rel_x: Each relation's input ``x^t`` (``None`` for elementwise relations).
        loss: ``L_t`` (unweighted).
    """

    hidden: list[jax.Array]
    other: list[jax.Array]
    same_step: list[jax.Array]
    signal: list[jax.Array]
    rel_x: list[jax.Array | None]
    loss: jax.Array


class ProbedLossTerms(NamedTuple):
    """Steps 1 and 2 with the relations' output cotangents (module docstring).

    Attributes:
        hidden, other: The state after the step.
        same_step_rest: The same-step gradient per Param leaf *without* each
            relation's own share ``xy_to_dw(x^t, dy^t)``.
        dy: Each relation's output cotangent ``∂(w_t L_t)/∂y^t`` (``None`` for a
            relation sharing an earlier one's equation, which counts it).
        signal: ``δ̄^t`` per hidden leaf.
        rel_x: Each relation's input ``x^t``.
        loss: ``L_t`` (unweighted).
    """

    hidden: list[jax.Array]
    other: list[jax.Array]
    same_step_rest: list[jax.Array]
    dy: list[jax.Array | None]
    signal: list[jax.Array]
    rel_x: list[jax.Array | None]
    loss: jax.Array


def step_leaves(ctx: LoopContext, hidden: Sequence[jax.Array], other: Sequence[jax.Array],
                x_t: Any) -> StepLeaves:
    """The leaves of one step: the context's Params, the state it starts from, its input."""
    return StepLeaves(list(ctx.params), list(hidden), list(other), jax.tree.leaves(x_t))


def _reverse_pass(ctx: LoopContext, leaves: StepLeaves, y_t: Any, weight_t: jax.Array,
                  probes: Any, new_state: bool = False) -> tuple[Any, ...]:
    """The VJP of ``w_t L_t`` with respect to the Params, the start (``h^{t-1}``, or the
    probes on ``h^t`` with ``new_state``) and the relations' output probes."""
    graph, loss_fn, signal = ctx.graph, ctx.loss_fn, ctx.rules.learning_signal
    cut = signal.cut_inputs

    def weighted_loss(params, start, probes):
        if new_state:
            hidden = graph.num_hidden
            readers = reader_list(ctx.rules.readers)
            outs, rel_x, cut_x = programs.forward_cutting_inputs(
                graph, leaves._replace(params=params), cut, ctx.rules.feedback, probes,
                state_probes=start[:hidden],
                input_probes={r: p for (_, r), p in zip(readers, start[hidden:])})
        else:
            outs, rel_x, cut_x = programs.forward_cutting_inputs(
                graph, leaves._replace(params=params, hidden=start), cut, ctx.rules.feedback,
                probes, x_pullbacks=ctx.x_pullbacks)
        y = jax.tree.unflatten(graph.out_treedef, outs.y)
        weighted, reported = step_loss(loss_fn, y, y_t, weight_t)
        if cut:  # the learning signal's own value at the cut inputs (zero-valued)
            weighted = weighted + signal.input_objective(cut_x, y_t, weight_t).astype(
                weighted.dtype)
        return weighted, (reported, outs, rel_x)

    start = programs.state_probes(graph) if new_state else leaves.hidden
    reads = new_state and bool(ctx.rules.readers)
    if reads:  # also ∂L_t/∂x' at the groups' readers and ∂L_t/∂y at the relations' outputs
        start = [*start, *reader_probes(graph, reader_list(ctx.rules.readers))]
        probes = programs.output_probes(graph)
    weighted, pullback, (loss, outs, rel_x) = jax.vjp(
        weighted_loss, leaves.params, start, probes, has_aux=True)
    same_step, signal, dy = pullback(jnp.ones_like(weighted))  # w_t may be wider than L_t
    if reads:
        signal = [*signal, *dy]
    return outs, list(rel_x), loss, same_step, signal, dy


def step_loss(loss_fn: Callable[[Any, Any], jax.Array], y: Any, y_t: Any,
              weight_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(w_t L_t, reported L_t)`` of one step: ``weight_t`` a scalar, or ``(B,)`` per sample.

    What the weights ignore adds nothing, even where ``loss_fn`` is singular: the
    outputs reach it through ``_masks.stop_unscored`` and the weighted loss is
    selected with ``_masks.weigh`` (the double ``where``); a step of weight 0
    reports 0. Per sample: see :func:`per_sample_loss`.

    Example:
        >>> import jax.numpy as jnp
        >>> relative = lambda y, t: jnp.mean(((y - t) / t) ** 2)
        >>> weighted, reported = step_loss(relative, jnp.ones((2, 1)), jnp.array([[2.0], [0.0]]),
        ...                                jnp.array([1.0, 0.0]))
        >>> float(weighted), float(reported)
        (0.25, 0.25)
    """
    y = stop_unscored(y, weight_t)
    if jnp.ndim(weight_t) == 1:  # per-sample weights: a (T, B) mask
        return per_sample_loss(loss_fn, y, y_t, weight_t)
    loss = call_loss(loss_fn, y, y_t)
    _check_scalar(loss)
    return weigh(loss, weight_t), jnp.where(weight_t != 0, loss, 0)


def reader_probes(graph: ETraceGraph, readers: Sequence[tuple[int, int]]) -> list[jax.Array]:
    """Zeros shaped like each reader's input ``x'`` (``reader_list`` order)."""
    return [jnp.zeros(v.aval.shape, v.aval.dtype)
            for v in (graph.relation_input_var(graph.relations[r]) for _, r in readers)]


def _check_scalar(loss: jax.Array) -> None:
    if jnp.ndim(loss) != 0:
        raise ValueError(
            f"loss_fn must return a scalar per time step, got shape {jnp.shape(loss)}. "
            "Reduce over the batch and feature axes inside loss_fn.")


def per_sample_loss(loss_fn: Callable[[Any, Any], jax.Array], y: Any, y_t: Any,
                    weight_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(Σ_b w_b ℓ_b, reported)`` for per-sample weights ``w`` of one step (a ``(T, B)`` mask).

    ``ℓ_b = loss_fn(y[b], y_t[b])`` is each sample's loss (``loss_fn`` on one
    sample, without the batch axis: a mean-reducing ``loss_fn`` then gives the
    batch's loss as the mean of the samples'). The reported loss is the mean
    over the step's scored samples, ``Σ_b w_b ℓ_b / Σ_b w_b`` (0 when none is
    scored: no loss the weights ignore is read).

    Example:
        >>> import jax.numpy as jnp
        >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
        >>> y, t = jnp.array([[1.0], [3.0]]), jnp.zeros((2, 1))
        >>> weighted, reported = per_sample_loss(mse, y, t, jnp.array([0.0, 0.5]))
        >>> float(weighted), float(reported)
        (4.5, 9.0)
    """
    losses = jax.vmap(functools.partial(call_loss, loss_fn))(y, y_t)
    if jnp.shape(losses) != jnp.shape(weight_t):
        raise ValueError(
            f"With a per-sample mask, loss_fn runs on one sample (no batch axis) and must "
            f"return a scalar; it returned shape {jnp.shape(losses)[1:]} per sample.")
    total = jnp.sum(weight_t)
    weighted = jnp.sum(weigh(losses, weight_t))
    reported = jnp.where(total > 0, weighted / jnp.where(total > 0, total, 1), 0)
    return weighted, jax.lax.stop_gradient(reported)


def loss_terms(ctx: LoopContext, leaves: StepLeaves, y_t: Any, weight_t: jax.Array, *,
               new_state: bool = False) -> LossTerms:
    """The forward pass and the reverse pass of ``w_t L_t`` (module docstring, 1 and 2).

    ``new_state``: the fast signal ``∂(w_t L_t)/∂h^t`` (module docstring).
    """
    outs, rel_x, loss, same_step, signal, _ = _reverse_pass(ctx, leaves, y_t, weight_t, None,
                                                            new_state)
    return LossTerms(outs.hidden, outs.other, same_step, signal, rel_x, loss)


def probed_loss_terms(ctx: LoopContext, leaves: StepLeaves, y_t: Any, weight_t: jax.Array, *,
                      new_state: bool = False) -> ProbedLossTerms:
    """:func:`loss_terms` with the relations' output cotangents instead of their share of the
    same-step gradient (with ``new_state``: no share and no cotangents, ``dy`` all ``None``)."""
    if new_state:
        terms = loss_terms(ctx, leaves, y_t, weight_t, new_state=True)
        return ProbedLossTerms(terms.hidden, terms.other, terms.same_step,
                               [None] * len(ctx.graph.relations), terms.signal, terms.rel_x,
                               terms.loss)
    probes = programs.output_probes(ctx.graph)
    outs, rel_x, loss, rest, signal, dy = _reverse_pass(ctx, leaves, y_t, weight_t, probes)
    return ProbedLossTerms(outs.hidden, outs.other, rest, dy, signal, rel_x, loss)


def output_loss_terms(ctx: LoopContext, leaves: StepLeaves, y_t: Any,
                      weight_t: jax.Array) -> LossTerms:
    """:func:`probed_loss_terms` as :class:`LossTerms` for the output form of the signal
    (``OutputSignal``): the same-step gradient without the traced relations' share, and as
    the signal each relation's output cotangent ``∂(w_t L_t)/∂y^t``."""
    probed = probed_loss_terms(ctx, leaves, y_t, weight_t)
    return LossTerms(probed.hidden, probed.other, probed.same_step_rest, probed.dy,
                     probed.rel_x, probed.loss)


def step_jacobians(rules: GraphRules, leaves: StepLeaves) -> Jacobians:
    """``D`` (diagonal, coupled or full, as the algorithm reads) and ``Df`` of one step.

    In the full scope every group reads the one per-sample Jacobian ``J``. Rules that read
    neither (``GraphRules.reads_jacobians``) get ``None`` for each, computed from nothing.
    """
    graph = rules.graph
    if not rules.reads_jacobians:
        return Jacobians(d=[None] * len(graph.groups), df=[None] * len(graph.relations))
    if rules.scope == "full":
        jac, df = programs.full_jacobians(graph, leaves, is_batched(graph))
        return Jacobians(d=[jac] * len(graph.groups), df=df)
    d, df = programs.jacobians(graph, leaves, rules.unread_df)
    if rules.scope == "coupled":
        d = programs.coupled_jacobians(graph, leaves)
    reads = (programs.reader_jacobians(graph, leaves, rules.readers) if rules.readers
             else ())  # each reader's ∂x'/∂h^t (GraphRules.readers)
    return Jacobians(d=d, df=df, reads=reads)


def add_same_step(total: Sequence[jax.Array], same_step: Sequence[jax.Array],
                  keep: Sequence[bool] | None = None) -> list[jax.Array]:
    """The running same-step gradient sums, each kept in its Param's dtype.

    ``keep``: per Param, whether to add (the learning signal's ``keeps_same_step``).
    """
    keep = [True] * len(total) if keep is None else keep
    return [a + b.astype(a.dtype) if k else a for a, b, k in zip(total, same_step, keep)]
