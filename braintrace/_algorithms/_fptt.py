"""FPTT: forward propagation through time (Kag & Saligrama 2021; spiking: Yin et al. 2023).

FPTT updates the Params at every step ``t`` from the instantaneous loss ``ℓ_t`` alone, and
makes up for the credit it does not carry over time with a dynamic regulariser that pulls
the Params towards a running average ``W̄`` of their past values (Kag & Saligrama, ICML
2021). ``ℓ_t`` is the summand ``ℓ(y_t, ŷ_t)`` of the paper's empirical risk, its Eq. (2),
``L(W, v) = (1/NT) Σ_i Σ_t ℓ(y_t^i, ŷ_t^i)`` with ``ŷ_t = vᵀh_t`` and
``h_t = f(W, x_t, h_{t-1})``: their ``W`` and ``v`` are our Params, their ``h_t`` our
``h^t``, and ``ℓ_t`` the value of ``loss_fn`` at step ``t``. The update:

.. math::

    W_{t+1} = \\arg\\min_W\\; \\ell_t(W) + \\frac{\\alpha}{2}\\Big\\lVert W - \\bar W_t
        - \\frac{1}{2\\alpha}\\nabla\\ell_{t-1}(W_t)\\Big\\rVert^2, \\qquad
    \\bar W_{t+1} = \\frac{1}{2}\\big(\\bar W_t + W_{t+1}\\big)
        - \\frac{1}{2\\alpha}\\nabla\\ell_t(W_{t+1}).

Two pieces, as a Flax user composes them:

* :class:`FPTT`, the gradient ``∇ℓ_t(W_t)``: the gradient of step ``t``'s loss through that
  step only, the state ``h^{t-1}`` it starts from held fixed (computed forward with the
  Params of its time, never differentiated): the paper's, one step back and no further. It
  keeps no traces; summed over a window it is the sum of each step's own gradient.
* :func:`fptt_regularizer`, an optax transformation that adds the regulariser's gradient and
  keeps ``W̄`` and the previous gradient in its state, for the user's own
  ``optax.chain(braintrace.fptt_regularizer(alpha), optax.adam(lr))``. It follows the
  authors' code (Kag & Saligrama's and Yin et al.'s), in which the previous gradient is
  the multiplier ``λ`` of the step's first-order condition and the regulariser reads
  ``(α/2)‖W - W̄_t - λ_t/α‖²`` (the paper writes ``1/(2α)`` there):

.. math::

    g_t = \\nabla\\ell_t(W_t) + \\alpha\\,(W_t - \\bar W_t) - \\lambda_t, \\qquad
    \\lambda_{t+1} = \\lambda_t - \\alpha\\,(W_{t+1} - \\bar W_t), \\qquad
    \\bar W_{t+1} = (1 - \\beta)\\,\\bar W_t + \\beta\\, W_{t+1}
        - \\frac{\\beta}{\\alpha}\\lambda_{t+1},

with ``W̄_0 = W_0``, ``λ_0 = 0``. The authors' code can also weigh the quadratic term (a
factor, 2 by default in Kag & Saligrama's language-model loop); here it is 1, as in their
classification loop. When the update solves the step's problem
(``∇ℓ_t(W_{t+1}) + α(W_{t+1} - W̄_t) - λ_t = 0``), ``λ_{t+1} = ∇ℓ_t(W_{t+1})`` and, with
``β = 1/2``, ``W̄_{t+1}`` is the paper's running average.

Yin et al.'s spiking FPTT updates ``K`` times per sequence, each time from the gradient
through the last ``T/K`` steps: ``online_update(learner, loss_fn, tx, update_every=T/K)``
with :class:`~braintrace.BPTT` (truncated to each window) and the regulariser in ``tx``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from braintrace._algorithms._approximations import algorithm_approximation
from braintrace._algorithms._base import AbstractAlgorithm
from braintrace._algorithms._relation_rule import RelationRule
from braintrace._compiler import Approximation, ETraceGraph

__all__ = ["FPTT", "FPTTState", "fptt_regularizer"]


class FPTT(AbstractAlgorithm):
    """FPTT's gradient: each step's loss through that step only (no traces).

    .. math::

        \\nabla_\\theta L = \\sum_t w_t\\,
            \\frac{\\partial \\ell_t}{\\partial \\theta}\\Big|_{h^{t-1}}

    The exact same-step gradient every algorithm adds, alone: equal to BPTT at ``T = 1``,
    and over time wherever no step's output depends on a hidden state (elsewhere
    ``report()`` names the Params whose credit over time it drops and ``strict=True``
    refuses them). With an update every step (``OnlineTrainer(..., update_every=1)``,
    :func:`~braintrace.online_update`) and :func:`fptt_regularizer` in the optimiser it is
    Kag & Saligrama's algorithm. Memory: the model's state only, constant in ``T``. With no
    traces there is nothing to advance in blocks: ``block_size`` changes nothing. No
    ``chunk_size`` (windows of exact reverse mode are :class:`~braintrace.BPTT`'s).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 8, rngs=nnx.Rngs(0)), layers.LIF(8),
        ...                        layers.LeakyReadout(8, 2, rngs=nnx.Rngs(1)))
        >>> learner = braintrace.compile(model, 'fptt', jnp.ones((4, 3)), batch_size=4)
        >>> tx = optax.chain(braintrace.fptt_regularizer(alpha=0.5), optax.adam(1e-2))
        >>> trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=lambda y, t: jnp.mean(
        ...     (y - t) ** 2), update_every=1)
        >>> trainer.step(jnp.ones((6, 4, 3)), jnp.zeros((6, 4, 2))).shape
        (6,)
        >>> [a.kind for a in learner.algorithm.approximations(learner.graph)]
        ['no-temporal-credit']
    """

    name = "fptt"
    supports_windowed = False

    def relation_rules(self, graph: ETraceGraph) -> tuple[RelationRule, ...]:
        del graph
        return ()

    def approximations(self, graph: ETraceGraph) -> tuple[Approximation, ...]:
        """The Params of every operation whose hidden state a later step reads: their credit
        through that state is dropped."""
        return algorithm_approximation(
            graph, graph.relations, kind="no-temporal-credit", label="FPTT ('fptt')",
            what="keeps only each step's own gradient, the state it starts from held fixed, "
                 "for",
            detail="∂ℓ_t/∂θ with h^(t-1) held fixed; no eligibility traces",
            remedy="DRTRL() or BPTT() carry credit over time (FPTT's dynamic regulariser, "
                   "fptt_regularizer, stands in for it)")


def _number(name: str, value: Any) -> float:
    """``value`` as a float; a ``TypeError`` naming ``name`` where it is not a real number."""
    real = isinstance(value, (int, float)) or (hasattr(value, "__float__")
                                               and jnp.ndim(value) == 0)  # a NumPy scalar
    if isinstance(value, bool) or not real:
        raise TypeError(f"fptt_regularizer: {name} must be a real number, got "
                        f"{type(value).__name__} {value!r}.")
    return float(value)


class FPTTState(NamedTuple):
    """The state of :func:`fptt_regularizer`, shaped like the Params.

    Attributes:
        mean: The running average ``W̄_t``.
        grad: ``λ_t``, the previous step's loss gradient at the current Params as the
            first-order condition of that step's problem gives it.
        started: Whether an update was made (the first call has no previous step).
    """

    mean: Any
    grad: Any
    started: jax.Array


def fptt_regularizer(alpha: float, beta: float = 0.5) -> optax.GradientTransformation:
    """FPTT's dynamic regulariser as an optax transformation (module docstring for the
    equations).

    ``update(updates, state, params)`` returns ``updates + α(W - W̄_t) - λ_t`` for the
    gradient ``updates = ∇ℓ_t(W_t)`` at ``params = W_t``. The Params after an update are only
    known once the whole chain has run, so each call first completes the previous step's
    ``λ`` and ``W̄`` from the ``params`` it receives (those after the previous update). Put
    it first in the chain, before the optimiser: ``optax.chain(fptt_regularizer(alpha),
    optax.adam(lr))``. Every call must be given ``params``; a step with no update (a window
    the mask scores nothing of) leaves the state as it is.

    Args:
        alpha: ``α > 0``, finite, the weight of the regulariser (the paper's ``α``).
        beta: ``β`` in ``(0, 1]``, the weight of the new Params in the running average (the
            paper's ``1/2``).

    Raises:
        TypeError: ``alpha`` or ``beta`` is not a real number.
        ValueError: ``alpha`` or ``beta`` is out of range (``alpha`` infinite or NaN
            included); ``update`` is called without ``params``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> tx = braintrace.fptt_regularizer(alpha=1.0)
        >>> params = {'w': jnp.array([1.0])}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({'w': jnp.array([0.5])}, state, params)
        >>> updates['w'].tolist()  # W_0 = W̄_0, λ_0 = 0: the gradient itself
        [0.5]
        >>> params = {'w': jnp.array([0.5])}  # W_1 after an update of -0.5
        >>> updates, state = tx.update({'w': jnp.array([0.2])}, state, params)
        >>> state.grad['w'].tolist(), state.mean['w'].tolist()  # λ_1 = 0.5, W̄_1 = 0.5
        ([0.5], [0.5])
        >>> updates['w'].tolist()  # 0.2 + 1.0·(0.5 - 0.5) - 0.5
        [-0.3]
    """
    alpha, beta = _number("alpha", alpha), _number("beta", beta)
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"fptt_regularizer: alpha must be a finite number > 0, got {alpha} "
                         "(an infinite or NaN weight makes the first update NaN).")
    if not 0 < beta <= 1:
        raise ValueError(f"fptt_regularizer: beta must lie in (0, 1], got {beta}.")

    def init(params: Any) -> FPTTState:
        return FPTTState(mean=jax.tree.map(jnp.asarray, params),
                         grad=jax.tree.map(jnp.zeros_like, params),
                         started=jnp.zeros((), bool))

    def update(updates: Any, state: FPTTState, params: Any = None) -> tuple[Any, FPTTState]:
        if params is None:
            raise ValueError("fptt_regularizer needs the Params: call tx.update(grads, state, "
                             "params) (nnx.Optimizer, OnlineTrainer and online_update do).")

        started = state.started  # λ_t, then W̄_t, from W_t: the Params after the last update
        lam = jax.tree.map(
            lambda w, m, lm: jnp.where(started, lm - alpha * (w - m), lm).astype(lm.dtype),
            params, state.mean, state.grad)
        mean = jax.tree.map(
            lambda w, m, lm: jnp.where(started, (1 - beta) * m + beta * w - (beta / alpha) * lm,
                                       m).astype(m.dtype),
            params, state.mean, lam)
        out = jax.tree.map(lambda g, w, m, lm: (g + alpha * (w - m) - lm).astype(g.dtype),
                           updates, params, mean, lam)
        return out, FPTTState(mean=mean, grad=lam, started=jnp.ones((), bool))

    return optax.GradientTransformation(init, update)
