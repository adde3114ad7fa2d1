"""D-RTRL: parameter-dimension eligibility traces (diagonal RTRL).

For a relation ``y = f(x, θ)`` feeding hidden group ``g`` with ``S`` states
per unit, the trace of every trainable input follows

.. math::

    \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t

where ``D^t = ∂h^t/∂h^{t-1}`` (``S×S`` per unit) and ``Df^t = ∂h^t/∂y^t``,
applied through the primitive's ``dt_to_t`` (``D ε``) and ``xy_to_dw`` (the
outer product) rules, per sample. The temporal gradient term of step ``t`` is

.. math::

    \\sum_{b} \\sum_{s} \\bar\\delta^t_{b,\\cdot,s} \\cdot \\epsilon^{t-1}_{b,\\dots,s},
    \\qquad \\bar\\delta^t = \\partial L_t / \\partial h^{t-1},

added to the exact same-step gradient. It equals BPTT when the real hidden
Jacobian is position-diagonal and ``y -> h`` is elementwise (the graph then
has no approximations). Memory is ``O(B·|θ|·S)``.

The elementwise primitive (no ``x``) keeps its trace with respect to its
output, shaped like the hidden group: ``ε^t = D^t ε^{t-1} + Df^t``, and maps the
contracted trace to ``w`` through ``xy_to_dw`` once at the end (exact, since
``y = fn(w)`` does not change within a sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._base import AbstractAlgorithm, BlockSteps, RelationRule
from braintrace._algorithms._block_algebra import block_coefficients
from braintrace._algorithms._fast_signal import (
    after_update_block,
    check_signal,
    fast_signal_approximation,
    uses_fast_signal,
)
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._signals import NEW_STATE_SIGNAL
from braintrace._algorithms._trace_algebra import (
    batch_split,
    merge_steps,
    mix_states,
    param_dtypes,
    per_sample,
    sum_over_samples,
    tree_sum,
)
from braintrace._algorithms._trace_storage import widened_from, widened_traces
from braintrace._compiler import (
    Approximation,
    ElementwiseRelation,
    ETraceGraph,
    InputRelation,
    Relation,
)
from braintrace._platform import by_platform, interpreting, tpu_formulations

__all__ = ["DRTRL", "DRTRL_ELEMENTWISE", "DRTRL_INPUT", "D_RTRL", "contract_y", "drtrl_rule"]


def _cast_to_params(graph: ETraceGraph, r: Relation, trace: Any) -> Any:
    dtypes = param_dtypes(graph, r)
    if isinstance(trace, dict):
        return {key: jnp.asarray(value, dtypes.get(key, value.dtype))
                for key, value in trace.items()}
    return jax.tree.map(lambda e: e.astype(jnp.result_type(*dtypes.values())), trace)


# -- operations with an input ----------------------------------------------------


def _input_rules(r: InputRelation) -> tuple[str, ...]:
    """The rules the update reads (``xy_to_trace``, by default ``xy_to_dw``)."""
    return ("init_drtrl", "dt_to_t", r.primitive.rules.source("xy_to_trace") or "xy_to_dw")


def _input_init(graph: ETraceGraph, r: InputRelation, theta: dict[str, jax.Array]) -> tuple:
    """A zero trace: a tuple over the group's ``S`` states, each ``{key: (B?, *θ_key)}``.

    The rule's per-sample ``(*θ_key, S)`` is split along its state axis. One
    array per state keeps the update, the contraction and the loop carry on
    the same buffer, which XLA then updates in place; a stacked state axis
    makes XLA:CPU copy and recompute the whole trace every step.
    """
    g = graph.groups[r.group]
    x_shape = r.x_shape[1:] if r.batched else r.x_shape
    y_shape = r.y_shape[1:] if r.batched else r.y_shape
    trace = r.primitive.rule("init_drtrl")(jnp.zeros(x_shape, g.dtype),
                                          jnp.zeros(y_shape, g.dtype), theta, g.num_states)
    lead = (r.y_shape[0],) if r.batched else ()
    return tuple(
        _cast_to_params(graph, r, jax.tree.map(
            lambda e, s=s: jnp.broadcast_to(e[..., s], (*lead, *e.shape[:-1])), trace))
        for s in range(g.num_states))


def _input_update(r: InputRelation, eps: tuple, d_g: jax.Array, df: jax.Array, x: jax.Array,
                  theta: dict[str, jax.Array]) -> tuple:
    """``ε_s ← Σ_{s'} dt_to_t(D_{s s'}, ε_{s'}) + xy_to_trace(x, Df_s)``, per sample."""
    prim = r.primitive
    dt_to_t = prim.rule("dt_to_t")
    xy_to_trace = prim.rules.resolved("xy_to_trace")
    scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
    outer = per_sample(lambda x, d: xy_to_trace(x, d, theta, **r.params), r)
    d_y = r.gather_hidden(d_g, feeds_large=True)
    new = []
    for s, old in enumerate(eps):
        mixed = tree_sum([scale(d_y[..., s, s2], source) for s2, source in enumerate(eps)])
        new.append(jax.tree.map(lambda m, i, e: (m + i).astype(e.dtype),
                                mixed, outer(x, df[..., s]), old))
    return tuple(new)


def _input_contribution(r: InputRelation, eps: tuple, signal: jax.Array,
                        theta: dict[str, jax.Array]) -> Any:
    """``Σ_b Σ_s contract(δ̄_s, ε_s)`` (the closed-form ``contract`` rule, or ``dt_to_t``,
    which it equals on one sample), summed over the batch by :func:`sum_over_samples`."""
    del theta
    return contract_y(r, eps, r.gather_hidden(signal, feeds_large=True))


def contract_y(r: InputRelation, eps: tuple, signal: jax.Array) -> Any:
    """``Σ_b Σ_s contract(signal_s, ε_s)`` for a signal already at ``y``'s units ``(*y, S)``."""
    prim = r.primitive
    contract = prim.rules.resolved("contract")  # one sample: dt_to_t by default

    def one(states, signal):  # one sample: states[s] is ε_s (*θ), signal (*y, S)
        return tree_sum([contract(signal[..., s], e, **r.params) for s, e in enumerate(states)])

    return sum_over_samples(one, eps, signal) if r.batched else one(eps, signal)


def _contract_entering(r: InputRelation, eps: tuple, signal: jax.Array) -> Any:
    """:func:`contract_y` once per block.

    On XLA:CPU, per sample summed by unrolled adds (:func:`sum_over_samples`):
    the ``contract`` rule's sum over the batch axis there is a ``dot_general``
    batched over the output units, for which XLA:CPU transposes the whole
    trace first (measured: 1.2 ms against 0.2 ms for a ``(16, 256, 768)``
    trace). Elsewhere one ``contract`` over the batch axis too, with no
    per-sample slices, which a batch-sharded trace would move between devices.
    """
    prim = r.primitive
    if not prim.has_rule("contract") or jax.default_backend() == "cpu":
        return contract_y(r, eps, signal)
    contract = prim.rule("contract")
    return tree_sum([contract(signal[..., s], e, **r.params) for s, e in enumerate(eps)])


def _instantaneous(r: InputRelation, theta: dict[str, jax.Array]):
    """The instantaneous trace term ``x ⊗ f`` (``xy_to_trace``, else ``xy_to_dw``), leading
    axes summed."""
    prim = r.primitive
    rule = prim.rules.resolved("xy_to_trace")
    return lambda x, f: rule(x, f, theta, **r.params)


def _input_block(r: InputRelation, eps: tuple, steps: BlockSteps,
                 theta: dict[str, jax.Array]) -> tuple[tuple, Any]:
    """``K`` steps of :func:`_input_contribution` then :func:`_input_update` (``_block_algebra``):

    ``term = Σ_s contract(β_{-1,s}, ε_s) + Σ_{k,b} x_k ⊗ (β_k·f_k + dy_k)`` (``dy``:
    the same-step share, in the same product) and
    ``ε_s ← Σ_{s'} dt_to_t(Λ_{-1,ss'}, ε_{s'}) + Σ_k x_k ⊗ (Λ_k f_k)_s`` per sample.
    """
    signal, d_g, df, x, dy = steps.signal, steps.d, steps.df, steps.x, steps.dy
    # Per hidden unit, then to y's units: the same recursion for every relation of the
    # group (XLA computes it once) and over fewer units than y has with fused gates.
    beta, lam, beta0, lam0 = block_coefficients(signal, d_g)
    beta, lam = jax.vmap(r.gather_hidden)(beta), jax.vmap(r.gather_hidden)(lam)
    beta0 = r.gather_hidden(beta0, feeds_large=True)  # both scale the whole trace
    lam0 = r.gather_hidden(lam0, feeds_large=True)
    df = df.astype(beta.dtype)
    outer = _instantaneous(r, theta)
    a = jnp.sum(beta * df, axis=-1)
    a = a if dy is None else a + dy.astype(a.dtype)
    current = outer(merge_steps(r, x), merge_steps(r, a))  # the block's steps, one product
    entering = _contract_entering(r, eps, beta0)
    gain = jnp.einsum("k...st,k...t->k...s", lam, df)
    over_steps = jax.vmap(outer, in_axes=(1, 1)) if r.batched else outer
    dt_to_t = r.primitive.rule("dt_to_t")
    scale = per_sample(lambda d, e: dt_to_t(d, e, **r.params), r)
    new = []
    for s, old in enumerate(eps):
        mixed = tree_sum([scale(lam0[..., s, s2], source) for s2, source in enumerate(eps)])
        new.append(jax.tree.map(lambda m, i, e: (m + i).astype(e.dtype),
                                mixed, over_steps(x, gain[..., s]), old))
    if _fused_dense(r, eps):  # the kernel's trace in one pass (XLA drops the two above)
        trace, narrow = eps[0]["kernel"], widened_from()
        # a widened copy of a narrower stored trace: the kernel reads and writes the stored
        # one (narrowing the copy back and widening the result are converts XLA removes)
        trace = trace if narrow is None else trace.astype(narrow)
        kernel, c = _dense_block(trace, lam0[..., 0, 0], beta0[..., 0], x, gain[..., 0])
        new[0] = {**new[0], "kernel": kernel.astype(new[0]["kernel"].dtype)}
        entering = {**entering, "kernel": c.astype(entering["kernel"].dtype)}
    return tuple(new), jax.tree.map(jnp.add, entering, current)


FUSED_DENSE_BLOCKS: bool = True
"""Whether a TPU runs the time-blocked update of a dense trace as one pass over it
(``_dense_block_kernel.py``: the trace read once and written once per block, where XLA
reads it twice; compiled for a TPU v5e, GRU hidden 1,024, batch 64: 1,581 MiB of the block's
memory traffic on the trace against 2,333, its floor 1,536). On one TPU v5e (GRU / LIF
hidden 1,024, batch 64, T = 100; ``benchmarks/results/throughput_tpu_h1024.json`` against
``throughput_tpu_h1024_xla.json``, one session): 169.1 / 177.7 us of device time per step
against 203.8 / 219.8 with XLA's passes, and gradients equal to those of XLA's passes to
1.6e-7 of the largest (float32, highest matmul precision). Tested in Pallas' interpreters
(float64: XLA's gradients to 1e-12, BPTT's where D-RTRL is exact). ``False``: XLA's
passes everywhere."""

FUSED_NARROW_TRACES: bool = False
"""Whether the one-pass block update (:data:`FUSED_DENSE_BLOCKS`) also takes traces stored
narrower than the rules read them (``trace_dtype=jnp.bfloat16``): the kernel reads and writes
the stored trace, updating in float32, where XLA's passes read it twice (compiled for a TPU
v5e, GRU hidden 1,024, batch 64, T = 100: per block 814 MiB on the 384 MiB trace against
XLA's 1,182, its floor 768; the block's body 2,926 MiB against 3,425). Tested in Pallas'
interpreters (XLA's gradients to 1e-7 of the largest). On one TPU v5e (same sizes, GRU / LIF;
``benchmarks/results/throughput_tpu_h1024_bf16_fused.json`` against
``throughput_tpu_h1024_bf16_xla.json``, one session) the gradients equal XLA's passes' to
1.1e-7 / 2.3e-7 of the largest, but the device time per step barely moves: 108.3 / 132.3 us
against 113.0 / 129.6, so off."""


def _fused_dense(r: InputRelation, eps: tuple) -> bool:
    """Whether the block's update and entering contraction of ``eps["kernel"]`` run as one
    pass (:data:`FUSED_DENSE_BLOCKS`): a batched dense relation (its own ``dt_to_t``,
    ``contract`` and outer product, no kernel transform) on a group of one state, a trace
    that tiles, stored in the dtype it is read in (a bfloat16 trace reaches the rules
    widened) unless :data:`FUSED_NARROW_TRACES`, the batch on one device, where
    :func:`by_platform` takes a TPU's formulations."""
    from braintrace._primitives import DENSE_RULES, output_axis_contract, scale_output_axis

    prim = r.primitive
    if not (FUSED_DENSE_BLOCKS and tpu_formulations()
            and (FUSED_NARROW_TRACES or not widened_traces())
            and r.batched and len(eps) == 1 and "kernel" in eps[0] and not batch_split()
            and r.params.get("kernel_transform") is None):
        return False
    if not (prim.rule("dt_to_t") is scale_output_axis
            and prim.rules.resolved("contract") is output_axis_contract
            and prim.rules.resolved("xy_to_trace") is DENSE_RULES.xy_to_dw):
        return False
    from braintrace._algorithms._dense_block_kernel import tile_sizes

    trace = eps[0]["kernel"]
    return trace.ndim == 3 and tile_sizes(*trace.shape[1:]) is not None


def _dense_block(eps: jax.Array, lam0: jax.Array, beta0: jax.Array, x: jax.Array,
                 gain: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ε_new, c)`` of a dense trace by the TPU kernel (interpreted off a TPU), XLA's
    formulation in programs lowered for another backend."""
    from braintrace._algorithms import _dense_block_kernel as kernel

    def on_tpu(*args):
        return kernel.block_update(*args, interpret=interpreting())

    return by_platform(cpu=kernel.reference, accelerator=kernel.reference, tpu=on_tpu)(
        eps, lam0, beta0, x, gain)


def _input_finalize(r: InputRelation, total: Any, theta: dict[str, jax.Array]) -> dict:
    return r.primitive.rules.resolved("trace_to_dw")(total, theta, **r.params)


DRTRL_INPUT = RelationRule(init=_input_init, update=_input_update,
                           contribution=_input_contribution, finalize=_input_finalize,
                           rules=_input_rules, block_finish=_input_block)
"""D-RTRL for an operation with an input: ``ε = D ε + Df ⊗ x``."""


# -- the elementwise primitive ------------------------------------------------------


def _elementwise_init(graph: ETraceGraph, r: ElementwiseRelation,
                      theta: dict[str, jax.Array]) -> dict:
    g = graph.groups[r.group]
    trace = r.primitive.rule("init_drtrl")(None, jnp.zeros(g.shape, g.dtype), theta,
                                           g.num_states)
    return _cast_to_params(graph, r, trace)


def _elementwise_update(r: ElementwiseRelation, eps: dict, d_g: jax.Array, df: jax.Array,
                        x: None, theta: dict[str, jax.Array]) -> dict:
    """``ε ← D ε + Df``: the trace of the output, shaped like the group ``(*V, S)``."""
    del x, theta
    mixed = mix_states(r.primitive.rule("dt_to_t"), d_g, eps, **r.params)
    return jax.tree.map(lambda m, i: m + i.astype(m.dtype), mixed, {"weight": df})


def _elementwise_contribution(r: ElementwiseRelation, eps: dict, signal: jax.Array,
                              theta: dict[str, jax.Array]) -> jax.Array:
    del theta
    return r.scatter_to_y(jnp.sum(signal * eps["weight"], axis=-1))


def _elementwise_with_share(r: ElementwiseRelation, eps: dict, signal: jax.Array, x: None,
                            dy: jax.Array | None, theta: dict[str, jax.Array]) -> jax.Array:
    """:func:`_elementwise_contribution` plus the same-step share ``dy`` (the term lives at
    ``y``, as the block's)."""
    term = _elementwise_contribution(r, eps, signal, theta)
    return term if dy is None else term + dy.astype(term.dtype)


def _elementwise_finalize(r: ElementwiseRelation, total: jax.Array,
                          theta: dict[str, jax.Array]) -> dict:
    return r.primitive.rule("xy_to_dw")(None, total, theta, **r.params)


def _elementwise_block(r: ElementwiseRelation, eps: dict, steps: BlockSteps,
                       theta: dict[str, jax.Array]) -> tuple[dict, Any]:
    """``K`` steps of the elementwise rule at once (``_block_algebra`` with ``x = 1``), plus the
    same-step share ``Σ_k dy_k`` (the term lives at ``y``)."""
    del theta
    signal, d_g, df, dy = steps.signal, steps.d, steps.df, steps.dy
    beta, lam, beta0, lam0 = block_coefficients(signal, d_g)
    df = df.astype(beta.dtype)
    trace = eps["weight"]
    term = r.scatter_to_y(jnp.sum(beta0 * trace, axis=-1) + jnp.sum(beta * df, axis=(0, -1)))
    if dy is not None:
        term = term + jnp.sum(dy, axis=0).astype(term.dtype)
    mixed = mix_states(r.primitive.rule("dt_to_t"), lam0, eps, **r.params)
    gain = jnp.einsum("k...st,k...t->...s", lam, df)
    return jax.tree.map(lambda m: (m + gain).astype(m.dtype), mixed), term


DRTRL_ELEMENTWISE = RelationRule(
    init=_elementwise_init, update=_elementwise_update, contribution=_elementwise_contribution,
    finalize=_elementwise_finalize, rules=lambda r: ("init_drtrl", "dt_to_t", "xy_to_dw"),
    block_finish=_elementwise_block, contribution_with_share=_elementwise_with_share)
"""D-RTRL for the elementwise primitive: the trace of its output, ``ε = D ε + Df``."""


def drtrl_rule(relation: Relation, *, after_update: bool = False) -> RelationRule:
    """The D-RTRL rule of a relation's kind (``after_update``: its time-blocked form reads the
    fast signal ``δ^t``, contracted with the updated traces)."""
    rule = DRTRL_INPUT if isinstance(relation, InputRelation) else DRTRL_ELEMENTWISE
    if after_update:
        return rule._replace(block_finish=after_update_block(rule.block_finish))
    return rule


class DRTRL(AbstractAlgorithm):
    """Diagonal RTRL: exact parameter-dimension eligibility traces.

    .. math::

        \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta|_{h^{t-1}}
            + \\bar\\delta^t \\cdot \\epsilon^{t-1}

    Exact (equal to BPTT) when the compiled graph has no approximations
    (``compile(..., strict=True)`` checks it). Trace memory ``O(B·|θ|·S)``.

    With ``signal='fast'`` the learning signal is ``δ^t = ∂L_t/∂h^t`` (``h^t``
    an input of the readout and of later states: no backward product through
    the recurrent kernels), contracted with the updated traces:

    .. math::

        \\nabla_\\theta L = \\sum_t \\partial L_t/\\partial\\theta|_{h^t}
            + \\delta^t \\cdot \\epsilon^t,

    ``∂L_t/∂θ|_{h^t}`` being the same-step gradient by every path but the
    traced operations' (the readout's Params). Where the compiler proves the
    two forms equal (exact traces on the signal's support, no read of
    ``h^{t-1}`` or of a traced output past ``h^t``, no new state computed from
    another new state) the fast form runs whatever ``signal`` says; elsewhere
    ``signal='fast'`` is an approximation that ``report()`` names and
    ``strict=True`` refuses. Single-step: no ``chunk_size`` with ``'fast'``.

    Args:
        coupled: Use the per-position blocks of the full hidden Jacobian
            (OSTL's recurrent rule, see :func:`braintrace.OSTLRecurrent`)
            instead of its elementwise part.
        signal: ``'exact'`` (the default) or ``'fast'``.

    Example:
        >>> import braintrace
        >>> braintrace.DRTRL().name, braintrace.DRTRL(coupled=True).scope
        ('d_rtrl', 'coupled')
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> cell = layers.Stateful(layers.GRUCell(3, 4, rngs=nnx.Rngs(0)))
        >>> learner = braintrace.compile(cell, braintrace.DRTRL(signal='fast'), jnp.ones((3,)))
        >>> [a.kind for a in learner.algorithm.approximations(learner.graph)]
        ['fast-signal']
        >>> grads = learner.etrace_grad(jnp.ones((5, 3)), jnp.zeros((5, 4)),
        ...                             lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['cell']['dense_h']['kernel'].shape
        (4, 12)
    """

    supports_trace_dtype = True

    def __init__(self, *, coupled: bool = False, signal: str = "exact"):
        self.scope = "coupled" if coupled else "diagonal"
        self.name = "ostl_recurrent" if coupled else "d_rtrl"
        self.signal = check_signal(signal)
        self.supports_windowed = self.signal == "exact"

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        fast = uses_fast_signal(self.signal, graph, additive=True)
        return tuple(drtrl_rule(r, after_update=fast) for r in graph.relations)

    def rules(self, graph: ETraceGraph) -> GraphRules:
        rules = super().rules(graph)
        if uses_fast_signal(self.signal, graph, additive=True):
            return dataclasses.replace(rules, learning_signal=NEW_STATE_SIGNAL)
        return rules

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """With ``signal='fast'``, the fast signal where it is not the exact one."""
        return fast_signal_approximation(self.signal, graph, additive=True,
                                         label=f"{type(self).__name__} ('{self.name}')")


D_RTRL = DRTRL
"""The earlier spelling of :class:`DRTRL`."""
