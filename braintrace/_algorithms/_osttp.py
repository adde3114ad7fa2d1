"""OSTTP: OSTL's eligibility traces with direct random target projection (Ortner et al. 2023).

OSTL (Bohnstingl et al. 2022) splits the gradient of layer ``l`` into a temporal part, an
eligibility trace carried forward within the layer, and a spatial part, the learning
signal at the layer's output ``y^{t,l}``:

.. math::

    \\epsilon^{t,l} = \\frac{\\partial s^{t,l}}{\\partial s^{t-1,l}}\\,\\epsilon^{t-1,l}
        + \\frac{\\partial s^{t,l}}{\\partial W^l}, \\qquad
    \\frac{\\partial L_t}{\\partial W^l} = L^{t,l} \\Big(
        \\frac{\\partial y^{t,l}}{\\partial s^{t,l}}\\,\\epsilon^{t,l}
        + \\frac{\\partial y^{t,l}}{\\partial W^l}\\Big),
    \\qquad L^{t,l} = \\frac{\\partial L_t}{\\partial y^{t,l}} .

OSTTP keeps the trace and replaces the spatial signal of every hidden layer by direct random
target projection (DRTP, Frenkel et al. 2021): a fixed random projection of the step's
target ``y*^t``, so no error travels back through the layers above,

.. math::

    L^{t,l} = y^{*t} B_l \\quad (\\text{hidden layers}), \\qquad
    L^{t,L} = \\frac{\\partial L_t}{\\partial y^{t,L}} \\quad (\\text{the output layer}).

Here the trace is D-RTRL's (``ε^t = D^t ε^{t-1} + Df^t ⊗ x^t``) contracted after each step's
update with ``δ^t = ∂/∂h^t`` (D-RTRL's ``signal='fast'``), and a *hidden layer's output* is the
input ``x`` of an ETP operation that reads the new hidden state (the next layer's input
weights, a readout): that input sends back ``w_t·y*^t B`` instead of the error that reaches
it, and the derivative from there to the hidden state (the spike function's surrogate,
``∂y/∂s``) is exact. The output layer is the state the loss reads directly (a
:class:`~braintrace.layers.LeakyReadout`), or an untraced readout, whose Params keep their
exact same-step gradient of the loss: both learn from the true error. A non-ETP operation
(a plain ``nnx.Linear``) passes the error through exactly.

The target is what ``loss_fn(y, target)`` receives at each step. ``y*`` is shaped like the
model's output: a float array of that shape is ``y*`` itself; integer class labels shaped
like the output without its last axis are one-hot encoded over it; ``target=`` maps any other
target to one of those. Per sample, ``y*`` (flattened) is projected onto an input ``x`` of
``X`` values per sample by ``B`` of shape ``(C, X)``, drawn once, ``B = scale · N(0, 1)/√X``
with key ``fold_in(key(seed), i)`` for the ETP equation at index ``i`` of the compiled step
(DRTP's reference code draws a He-uniform ``B``). The projection stands where the error of a
loss averaged over the batch would: ``w_t/B`` per sample for a per-step weight ``w_t``, ``w_b``
with a per-sample mask.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._approximations import params_reaching_inputs
from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._d_rtrl import drtrl_rule
from braintrace._algorithms._eprop import feedback_equations
from braintrace._algorithms._fast_signal import new_state_signal_record
from braintrace._algorithms._graph_rules import GraphRules
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._algorithms._signals import NewStateSignal
from braintrace._compiler import (
    Approximation,
    ETraceGraph,
    eqn_names,
    fast_signal_obstacles,
    operations,
    params_phrase,
)

__all__ = ["OSTTP", "TargetProjection", "new_state_signal_approximation", "projected_equations",
           "projection_approximation", "projection_matrices"]


def projected_equations(graph: ETraceGraph) -> list[int]:
    """The ETP equations whose floating input ``x`` depends on the new hidden state: the
    hidden layers' outputs the target is projected onto."""
    eqns = graph.jaxpr.eqns
    return [i for i in feedback_equations(graph)
            if jnp.issubdtype(eqns[i].invars[eqns[i].primitive.x_invar_index].aval.dtype,
                              jnp.inexact)]


def _output_shape(graph: ETraceGraph) -> tuple[int, ...]:
    """The shape of the step's one output array (``y*`` is shaped like it)."""
    outs = graph.layout.split_outputs(graph.jaxpr.outvars).y
    if len(outs) != 1:
        raise ValueError(
            f"OSTTP projects each step's target y* onto the hidden layers and needs y* shaped "
            f"like the model's output, but the model's step returns {len(outs)} arrays: return "
            "the output layer's array alone.")
    return tuple(outs[0].aval.shape)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TargetProjection(NewStateSignal):
    """OSTTP's learning signal on one graph: ``∂(w_t L_t)/∂h^t`` with the error through the
    inputs of ``cut_inputs`` replaced by ``w_t y*^t B`` (module docstring); contracted with
    the updated traces like :class:`~braintrace.NewStateSignal`'s.

    Attributes:
        cut_inputs: The ETP equations whose input ``x`` receives the projected target.
        matrices: ``B`` ``(C, X)`` of each, in that order.
        batched: Whether each input carries a leading batch axis.
        output_shape: The shape of the model's output (``y*``'s).
        target: Maps a step's target to ``y*`` (``None``: the target itself).
    """

    cut_inputs: tuple[int, ...]
    matrices: tuple[jax.Array, ...]
    batched: tuple[bool, ...]
    output_shape: tuple[int, ...]
    target: Callable[[Any], Any] | None = None

    def target_vector(self, target_t: Any) -> jax.Array:
        """``y*`` of one step, one flat row per sample ``(B, C)`` (``(1, C)`` unbatched).

        Raises:
            ValueError: The target is neither shaped like the output (floating) nor integer
                labels shaped like it without its last axis.
        """
        value = target_t if self.target is None else self.target(target_t)
        leaves = jax.tree.leaves(value)
        shape = self.output_shape
        y = jnp.asarray(leaves[0]) if len(leaves) == 1 else None
        if y is not None and jnp.issubdtype(y.dtype, jnp.integer) and y.shape == shape[:-1]:
            y = jax.nn.one_hot(y, shape[-1], dtype=self.matrices[0].dtype)
        if y is None or not jnp.issubdtype(y.dtype, jnp.floating) or y.shape != shape:
            got = (f"{y.dtype} {tuple(y.shape)}" if y is not None
                   else f"a {type(value).__name__} of {len(leaves)} arrays")
            raise ValueError(
                f"OSTTP projects each step's target y* onto the hidden layers: y* must be a "
                f"float array shaped like the model's output {shape} (one-hot for classes) or "
                f"integer class labels of shape {shape[:-1]}, but the step's target"
                f"{' mapped by target=' if self.target is not None else ''} is {got}. Pass "
                "OSTTP(target=fn), fn mapping the target loss_fn receives to y*.")
        rows = shape[0] if any(self.batched) else 1
        return y.reshape(rows, -1)

    def input_objective(self, inputs: Sequence[jax.Array], target_t: Any,
                        weight_t: jax.Array) -> jax.Array:
        """``Σ_i ⟨x_i - sg(x_i), w ⊙ y*^t B_i⟩``: zero, its derivative the projected target."""
        y_star = self.target_vector(target_t)
        total = []
        for x, b, batched in zip(inputs, self.matrices, self.batched, strict=True):
            sent = (y_star.astype(b.dtype) @ b).reshape(x.shape)
            if batched:  # w_t/B per sample (a batch-mean loss), or the mask's w_b
                w = weight_t if jnp.ndim(weight_t) == 1 else weight_t / x.shape[0]
                w = jnp.reshape(w, (-1,) + (1,) * (x.ndim - 1))
            else:
                w = weight_t
            sent = jnp.where(w != 0, w * sent, 0).astype(x.dtype)
            total.append(jnp.sum((x - jax.lax.stop_gradient(x)) * sent))
        return sum(total)


def projection_matrices(graph: ETraceGraph, eqns: Sequence[int], output: tuple[int, ...],
                        seed: int, scale: float) -> tuple[jax.Array, ...]:
    """``B`` ``(C, X)`` per equation, ``scale · N(0, 1)/√X`` (module docstring), for a model
    whose output is shaped ``output``."""
    jaxpr_eqns = graph.jaxpr.eqns
    base = jax.random.key(seed)
    out = []
    for i in eqns:
        prim = jaxpr_eqns[i].primitive
        aval = jaxpr_eqns[i].invars[prim.x_invar_index].aval
        per_sample = aval.shape[1:] if prim.batched else aval.shape
        width = math.prod(per_sample)
        classes = math.prod(output[1:] if prim.batched else output)
        b = jax.random.normal(jax.random.fold_in(base, i), (classes, width), aval.dtype)
        out.append((b * (scale / math.sqrt(width))).astype(aval.dtype))
    return tuple(out)


def projection_approximation(graph: ETraceGraph, eqns: Sequence[int],
                             label: str) -> tuple[Approximation, ...]:
    """The Params whose gradient passes back through a projected input: DRTP's direction, not
    BPTT's (at every ``T``)."""
    jaxpr = graph.jaxpr
    params = params_reaching_inputs(graph, eqns)
    if not params:
        return ()
    return (Approximation(
        "target-projection", params,
        f"{eqn_names(jaxpr, eqns)} send a fixed random projection of the target to their input",
        f"{label} sends a fixed random projection of the target back from "
        f"{operations(jaxpr, graph.modules, list(eqns))} instead of the error through them "
        f"(direct random target projection), so the gradients of {params_phrase(params)} are "
        "not BPTT's, even at T = 1; DRTRL() sends the exact error."),)


def new_state_signal_approximation(graph: ETraceGraph,
                                   label: str) -> tuple[Approximation, ...]:
    """OSTL's contraction of ``∂/∂h^t`` with the updated traces, where the compiler cannot
    prove it the exact learning signal (``fast_signal_obstacles``)."""
    return new_state_signal_record(
        graph, fast_signal_obstacles(graph),
        what=(f"{label} contracts the learning signal at h^t with the traces after each step's "
              "update (OSTL's form)"),
        differs="may differ from the exact signal's", remedy="DRTRL() contracts the exact signal")


class OSTTP(AbstractAlgorithm):
    """OSTTP: OSTL's traces, each hidden layer's learning signal a random projection of the target.

    .. math::

        \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t, \\qquad
        \\nabla_\\theta L = \\sum_t \\delta^t \\cdot \\epsilon^t,

    ``δ^t = ∂/∂h^t`` of ``w_t L_t`` in which every ETP operation reading a hidden layer's
    output ``x`` sends ``w_t y*^t B`` back to ``x`` instead of the error (see the module
    docstring for the target ``y*``, the matrices ``B`` and the scaling). Hidden layers learn
    without any error transported to them, the output layer from its true error. Where no
    ETP operation reads the new hidden state it is OSTL (D-RTRL with the fast signal), equal
    to BPTT wherever ``compile(..., strict=True)`` accepts it; elsewhere ``report()`` names
    the Params that learn from the projection and ``strict=True`` refuses them. Traces ``O(B·|θ|·S)``, constant in
    ``T``. Single-step: no ``chunk_size``.

    Give the target at every step, as the paper does: the projection is weighted like the loss,
    so a step the loss does not score sends none, and a spiking layer scored at its last step
    alone can stay at chance. On spiking layers the one-hot target's class-independent part
    drives units to fire always or never; a centred target helps (the docs' OSTTP section).

    Args:
        target: Maps the step's target (what ``loss_fn`` receives) to ``y*``; ``None``: the
            target is ``y*`` (a float array shaped like the output, or integer labels,
            one-hot encoded). ``lambda labels: jax.nn.one_hot(labels, C) - 1 / C`` centres it.
        seed: Seed of the projection matrices.
        projection_scale: Multiplies the projection matrices.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 8, rngs=nnx.Rngs(0)), layers.LIF(8),
        ...                        layers.LeakyReadout(8, 4, rngs=nnx.Rngs(1)))
        >>> learner = braintrace.compile(model, 'osttp', jnp.ones((2, 3)), batch_size=2)
        >>> def loss_fn(logits, labels):  # labels (2,): y* is their one-hot (2, 4)
        ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        >>> grads = learner.etrace_grad(jnp.ones((5, 2, 3)), jnp.zeros((5, 2), jnp.int32),
        ...                             loss_fn)
        >>> grads['layers'][0]['kernel'].shape
        (3, 8)
        >>> [a.kind for a in learner.algorithm.approximations(learner.graph)]
        ['target-projection', 'fast-signal']
    """

    name = "osttp"
    supports_windowed = False

    def __init__(self, target: Callable[[Any], Any] | None = None, *, seed: int = 0,
                 projection_scale: float = 1.0):
        if target is not None and not callable(target):
            raise TypeError(f"OSTTP: target must be a function from a step's target to y* (or "
                            f"None), got {type(target).__name__}.")
        self.target = target
        self.seed = int(seed)
        self.projection_scale = float(projection_scale)

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return tuple(drtrl_rule(r, after_update=True) for r in graph.relations)

    def rules(self, graph: ETraceGraph) -> GraphRules:
        """The bound rules, their learning signal the target projection of ``graph``.

        Raises:
            ValueError: An ETP operation reads the new hidden state and the model's step
                returns more than one array (``y*`` is shaped like the output).
        """
        eqns = tuple(projected_equations(graph))
        output = _output_shape(graph) if eqns else ()
        with jax.ensure_compile_time_eval():
            matrices = projection_matrices(graph, eqns, output, self.seed,
                                           self.projection_scale)
        signal = TargetProjection(
            cut_inputs=eqns, matrices=matrices,
            batched=tuple(bool(graph.jaxpr.eqns[i].primitive.batched) for i in eqns),
            output_shape=output, target=self.target)
        return dataclasses.replace(super().rules(graph), learning_signal=signal)

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The Params that learn from the projected target, and OSTL's learning signal where
        it is not the exact one."""
        label = f"OSTTP ('{self.name}')"
        return (projection_approximation(graph, projected_equations(graph), label)
                + new_state_signal_approximation(graph, label))

