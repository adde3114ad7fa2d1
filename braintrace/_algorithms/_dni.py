"""DNI: synthetic gradients at the window boundaries of windowed mode (Jaderberg et al. 2017).

Windowed mode (``etrace_grad(..., chunk_size=K)``) runs exact reverse mode
inside windows of ``K`` steps. For a window from ``h_0`` to ``h_K`` with loss
``L_w``, DNI adds a synthesiser ``ŝ_φ(h, t) ≈ ∂L_future/∂h`` (an NNX module
with Params ``φ``) and injects its prediction at the window's end as the
cotangent of ``h_K``, so reverse mode inside the window sees the future:

.. math::

    g_\\theta = \\nabla_\\theta \\big(L_w + \\mathrm{sg}[\\hat s(h_K)] \\cdot h_K\\big),
    \\qquad
    g_0 = \\frac{\\partial}{\\partial h_0} \\big(L_w + \\mathrm{sg}[\\hat s(h_K)] \\cdot h_K\\big)

``g_0`` is the bootstrapped target of the synthesiser at ``h_0`` (the true
in-window cotangent plus the end prediction pulled back through the window),
and ``φ`` learns from

.. math::

    \\ell_\\phi = \\tfrac12 \\sum_w \\lVert \\hat s_\\phi(h_0^w) - \\mathrm{sg}[g_0^w] \\rVert^2

(summed over every element, the batch included). The traces of the base
algorithm still carry credit to earlier windows, but only the part the
synthetic gradient missed: the contraction reads ``g_0 - sg[ŝ(h_0)]``
instead of windowed mode's ``∂L_w/∂h_0``:

.. math::

    \\nabla_\\theta L \\mathrel{+}= (g_0 - \\hat s(h_0)) \\cdot \\epsilon_0.

So a zero synthesiser gives exactly plain windowed mode, and a synthesiser
that predicts the true future cotangent ``∂L_{>w}/∂h_K`` makes every ``g_θ``
exact and every correction zero: the gradient is then BPTT's.

**Where the synthesiser lives**: it must be a submodule of the model (e.g.
``model.synthesizer = braintrace.LinearSynthesizer(model)``) before
``braintrace.compile``. Its Params are then Params of the model: ``etrace_grad``
returns ``∇_φ ℓ_φ`` at their paths (the model's step never reads them, so
that is all they get) and one ``nnx.Optimizer(model, optax...)`` updates model
and synthesiser together. Its other Variables are read once, at compile time.
It is called as ``synthesizer(hidden, t) -> cotangents``: ``hidden`` a dict
``{hidden path: array}`` (``learner.graph.hidden_paths``, batch axis
included), ``t`` the number of steps of this call before ``h`` (``0`` at the
first window's start, ``K`` at its end); it returns a dict of the same keys
and shapes. DNI is windowed mode only (a ``chunk_size`` is required);
``OnlineTrainer`` runs one DNI window per update (``chunk_size =
update_every``, ``t`` counted from the window's start).

Two boundary cases: the last window's end is injected too (the stream may go
on in the next call; a synthesiser that should see no future there returns
zero), and the first window's correction subtracts the current synthesiser's
``ŝ(h_0)`` (what the previous call injected, if ``φ`` has not changed since;
with fresh traces the correction reads zero traces anyway). The targets are in
the units of the weighted loss ``Σ_t w_t L_t`` (``reduction='mean'`` divides
by ``T``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._d_rtrl import DRTRL
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._compiler import ETraceGraph, leaf_paths, split_model
from braintrace._hidden import state_batch_size

__all__ = ["DNI", "LinearSynthesizer", "SyntheticGradients"]


class DNI(AbstractAlgorithm):
    """Synthetic gradients at window boundaries, on top of a windowed base algorithm.

    See the module docstring for the equations. DNI is an algorithm (it picks
    the base's traces, and ``compile`` binds the synthesiser to the model) whose
    windows are run by windowed mode, which calls its window hook
    (:class:`SyntheticGradients`: ``injected`` and ``correct``).

    Args:
        synthesizer: An NNX module inside the model, called as
            ``synthesizer(hidden, t)`` (module docstring).
        base: The algorithm whose traces carry the residual credit across
            windows: an instance or a name (default :class:`~braintrace.DRTRL`).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0))),
        ...                        layers.ETPLinear(3, 1, rngs=nnx.Rngs(1)))
        >>> model.synthesizer = braintrace.LinearSynthesizer(model)
        >>> learner = braintrace.compile(model, braintrace.DNI(model.synthesizer),
        ...                              jnp.ones((2,)))
        >>> xs, ys = jnp.ones((6, 2)), jnp.zeros((6, 1))
        >>> grads = learner.etrace_grad(xs, ys, lambda y, t: jnp.mean((y - t) ** 2),
        ...                             chunk_size=3)
        >>> grads['synthesizer']['kernel'].shape
        (3, 3)
    """

    name = "dni"
    needs_window = True

    def __init__(self, synthesizer: nnx.Module, base: AbstractAlgorithm | str | None = None):
        from braintrace._algorithms._registry import get_algorithm

        if not isinstance(synthesizer, nnx.Module):
            raise TypeError(
                f"DNI: synthesizer must be an nnx.Module inside the model, got "
                f"{type(synthesizer).__name__}.")
        self.synthesizer = synthesizer
        self.base = DRTRL() if base is None else get_algorithm(base)
        if not self.base.supports_windowed or self.base.needs_window:
            raise ValueError(f"DNI: the base algorithm {type(self.base).__name__} does not keep "
                             "traces across windows of windowed mode; choose one that does "
                             "(e.g. DRTRL).")
        self.scope = self.base.scope
        self._binding: SynthesizerBinding | None = None

    # -- the base algorithm's traces ---------------------------------------------

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        return self.base.relation_rules(graph)

    def relation_signal(self, graph, delta, relation):
        return self.base.relation_signal(graph, delta, relation)

    def feedback_operands(self, graph):
        return self.base.feedback_operands(graph)

    def approximations(self, graph):
        return self.base.approximations(graph)

    # -- the synthesiser ---------------------------------------------------------

    def bind(self, model: nnx.Module) -> DNI:
        """A copy of this DNI bound to ``model``'s synthesiser (found by identity).

        Raises:
            ValueError: The synthesiser is not a submodule of ``model``.
        """
        found = [path for path, node in nnx.iter_graph(model) if node is self.synthesizer]
        if not found:
            raise ValueError(
                "DNI: the synthesizer is not part of the model, so its Params would not be "
                "trained with it. Attach it before braintrace.compile, e.g. "
                "`model.synthesizer = synthesizer`.")
        prefix = ".".join(str(p) for p in found[0])
        graphdef, params, rest = nnx.split(self.synthesizer, nnx.Param, ...)
        paths = tuple(f"{prefix}.{p}" if p else prefix for p in leaf_paths(params))
        bound = DNI(self.synthesizer, self.base)
        bound._binding = SynthesizerBinding(paths, graphdef, jax.tree.structure(params), rest)
        return bound

    def window(self, graph: ETraceGraph) -> SyntheticGradients:
        """The synthetic gradients each window injects and corrects (module docstring).

        Raises:
            ValueError: This DNI was not bound to a model (:meth:`bind`, which
                :func:`braintrace.compile` calls).
        """
        if self._binding is None:
            raise ValueError("DNI: compile the model with braintrace.compile(model, dni, ...) "
                             "before computing gradients (it binds the synthesizer).")
        return SyntheticGradients(self._binding, graph)


class SynthesizerBinding(NamedTuple):
    """Where the synthesiser sits in the model: its Param paths and its structure."""

    paths: tuple[str, ...]
    graphdef: Any
    treedef: Any
    rest: Any


@dataclasses.dataclass(frozen=True, eq=False)
class SyntheticGradients:
    """DNI's window hooks on one graph: what a window injects at its end and corrects at its
    start (module docstring)."""

    binding: SynthesizerBinding
    graph: ETraceGraph

    def predict(self, params: Sequence[jax.Array], hidden: Sequence[jax.Array],
                t: jax.Array) -> list[jax.Array]:
        """``ŝ(h, t)`` per hidden leaf, with the synthesiser's Params read from ``params``."""
        graph, (paths, graphdef, treedef, rest) = self.graph, self.binding
        index = {p: i for i, p in enumerate(graph.param_paths)}
        state = jax.tree.unflatten(treedef, [params[index[p]] for p in paths])
        module = nnx.merge(graphdef, state, rest, copy=True)
        out = module(dict(zip(graph.hidden_paths, hidden)), t)
        if not isinstance(out, dict) or set(out) != set(graph.hidden_paths):
            raise ValueError(
                f"DNI: the synthesizer must return a dict with the keys {list(graph.hidden_paths)}"
                f", got {type(out).__name__} {sorted(out) if isinstance(out, dict) else ''}.")
        for p, h in zip(graph.hidden_paths, hidden):
            if jnp.shape(out[p]) != jnp.shape(h):
                raise ValueError(f"DNI: the synthesizer's output for '{p}' has shape "
                                 f"{jnp.shape(out[p])}; the hidden state has {jnp.shape(h)}.")
        return [jnp.asarray(out[p], h.dtype) for p, h in zip(graph.hidden_paths, hidden)]

    def injected(self, params: Sequence[jax.Array], h_end: Sequence[jax.Array],
                 t: jax.Array) -> jax.Array:
        """``sg[ŝ(h_K)]·h_K``: added to the window's loss, its cotangent at ``h_K`` is ``ŝ``."""
        pred = jax.lax.stop_gradient(self.predict(params, h_end, t))
        return sum(jnp.vdot(s, h) for s, h in zip(pred, h_end))

    def correct(self, params: Sequence[jax.Array], h_start: Sequence[jax.Array],
                g_start: Sequence[jax.Array], g_params: Sequence[jax.Array], t: jax.Array
                ) -> tuple[list[jax.Array], list[jax.Array]]:
        """The traces' signal ``g_0 - sg[ŝ(h_0)]`` and ``g_params + ∇_φ ℓ_φ`` (one window)."""
        target = jax.lax.stop_gradient(list(g_start))
        h_start = jax.lax.stop_gradient(list(h_start))

        def synth_loss(p):
            pred = self.predict(p, h_start, t)
            return 0.5 * sum(jnp.sum((s - g) ** 2) for s, g in zip(pred, target)), pred

        grads, pred = jax.grad(synth_loss, has_aux=True)(list(params))
        signal = [g - jax.lax.stop_gradient(s) for g, s in zip(g_start, pred)]
        return signal, [a + b.astype(a.dtype) for a, b in zip(g_params, grads)]


class LinearSynthesizer(nnx.Module):
    """The default synthesiser: one linear map of all hidden states, zero-initialised.

    Per sample, the hidden leaves are flattened and concatenated to ``z``
    (``n`` features) and ``ŝ = z W + b`` is split back (``W`` ``(n, n)``,
    ``b`` ``(n,)``, both zero, so DNI starts as plain windowed mode).

    Args:
        model: The model whose hidden states it predicts cotangents for (its
            states are read for their paths and per-sample shapes).
        param_dtype: The Params' dtype (default: the first hidden state's).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> synth = braintrace.LinearSynthesizer(model)
        >>> out = synth({p: jnp.ones((3,)) for p in synth.paths}, 0)
        >>> synth.kernel.shape, float(jnp.abs(out[synth.paths[0]]).sum())
        ((3, 3), 0.0)
    """

    def __init__(self, model: nnx.Module, *, param_dtype: Any = None):
        _, _, hidden, _ = split_model(model)
        values = jax.tree.leaves(hidden)
        lead = 0 if state_batch_size(model) is None else 1
        self.paths = leaf_paths(hidden)
        self.shapes = tuple(tuple(v.shape[lead:]) for v in values)
        n = sum(math.prod(s) for s in self.shapes)
        dtype = param_dtype or jnp.result_type(values[0])
        self.kernel = nnx.Param(jnp.zeros((n, n), dtype))
        self.bias = nnx.Param(jnp.zeros((n,), dtype))

    def __call__(self, hidden: dict[str, jax.Array], t: Any) -> dict[str, jax.Array]:
        del t
        first = hidden[self.paths[0]]
        batch = first.shape[:first.ndim - len(self.shapes[0])]
        z = jnp.concatenate([hidden[p].reshape(*batch, -1) for p in self.paths], axis=-1)
        out = z @ self.kernel[...] + self.bias[...]
        cuts = list(itertools.accumulate(math.prod(s) for s in self.shapes))[:-1]
        parts = jnp.split(out, cuts, axis=-1)
        return {p: part.reshape(*batch, *s) for p, part, s in zip(self.paths, parts, self.shapes)}
