"""The fast learning signal of D-RTRL and ES-D-RTRL (``signal='fast'``), as rules and records.

The exact signal contracts ``δ̄^t = ∂L_t/∂h^{t-1}`` with the traces before the
step's update and adds every Param's exact same-step gradient; it costs a
backward product through the recurrent kernels every step. The fast one
(``NewStateSignal``) contracts ``δ^t = ∂L_t/∂h^t`` with the updated traces:

.. math::

    \\nabla_\\theta L_t \\approx \\frac{\\partial L_t}{\\partial \\theta}\\Big|_{h^t}
        + \\delta^t \\cdot \\epsilon^t, \\qquad
    \\epsilon^t = D^t \\epsilon^{t-1} + Df^t \\otimes x^t .

For an additive trace (D-RTRL's) ``δ^t·ε^t = (δ^t D^t)·ε^{t-1} + δ^t·(Df^t ⊗ x^t)``:
the exact form with ``δ^t D^t`` in place of ``δ̄^t`` and ``δ^t·Df^t`` in place of the
relation's output cotangent. :func:`after_update_block` builds the time-blocked
rule from that identity. The two forms are equal when the compiler finds no
obstacle (``fast_signal_obstacles``) and the traces are additive; then the fast
form is used whatever ``signal`` says (:func:`uses_fast_signal`). Elsewhere it
is used only with ``signal='fast'``, and :func:`fast_signal_approximation`
names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._algorithms._relation_rule import BlockSteps
from braintrace._compiler import (
    Approximation,
    ElementwiseRelation,
    ETraceGraph,
    Relation,
    SignalObstacle,
    fast_signal_obstacles,
    params_phrase,
)

__all__ = ["SIGNALS", "after_update_block", "check_signal", "fast_signal_approximation",
           "new_state_signal_record", "uses_fast_signal"]

SIGNALS = ("exact", "fast")
"""The values of D-RTRL's and ES-D-RTRL's ``signal=``."""


def check_signal(signal: Any) -> str:
    """``signal`` after checking it is one of :data:`SIGNALS`.

    Example:
        >>> from braintrace._algorithms._fast_signal import check_signal
        >>> check_signal('fast')
        'fast'
    """
    if not isinstance(signal, str) or signal not in SIGNALS:
        raise ValueError(
            f"signal must be 'exact' (∂L_t/∂h^(t-1) with the traces before each step's update, "
            f"the default) or 'fast' (∂L_t/∂h^t with the updated traces), got {signal!r}.")
    return signal


def _obstacles(graph: ETraceGraph, additive: bool) -> tuple[SignalObstacle, ...]:
    found = fast_signal_obstacles(graph)
    if not additive:
        found = (*found, SignalObstacle(
            "factorised-traces", "the factorised traces ε_x ⊗ ε_f are not additive in each "
            "step's immediate influence"))
    return found


def uses_fast_signal(signal: str, graph: ETraceGraph, *, additive: bool) -> bool:
    """Whether the fast form runs: asked for (``signal='fast'``), or proven equal to the exact
    form (no obstacle and an ``additive`` trace update)."""
    return signal == "fast" or not _obstacles(graph, additive)


def new_state_signal_record(graph: ETraceGraph, found: Sequence[SignalObstacle], *, what: str,
                            differs: str, remedy: str) -> tuple[Approximation, ...]:
    """The record of a learning signal contracted at ``h^t`` with the updated traces where
    ``found`` obstacles keep it from the exact one (nothing without an obstacle).

    It names every traced Param (their credit over time goes through the signal); the
    summary reads ``"{what}, which on this model is not the exact learning signal
    ({reasons}), so the gradient of {Params} {differs}; {remedy}."``.
    """
    params = tuple(sorted({p for r in graph.relations for p in r.all_param_paths}))
    if not found or not params:
        return ()
    reasons = "; ".join(o.detail for o in found)
    return (Approximation(
        "fast-signal", params,
        f"∂L_t/∂h^t contracted with the updated traces ε^t is not ∂L_t/∂θ|same step + "
        f"∂L_t/∂h^(t-1)·ε^(t-1) here ({', '.join(dict.fromkeys(o.kind for o in found))})",
        f"{what}, which on this model is not the exact learning signal ({reasons}), so the "
        f"gradient of {params_phrase(params)} {differs}; {remedy}."),)


def fast_signal_approximation(signal: str, graph: ETraceGraph, *, additive: bool,
                              label: str) -> tuple[Approximation, ...]:
    """The record of ``signal='fast'`` where it is not the exact signal (nothing otherwise):
    :func:`new_state_signal_record`."""
    if signal != "fast":
        return ()
    return new_state_signal_record(
        graph, _obstacles(graph, additive),
        what=(f"{label} with signal='fast' contracts ∂L_t/∂h^t with the traces after each "
              "step's update"),
        differs="differs from signal='exact'",
        remedy="use signal='exact' (the default) for the exact signal")


def _output_share(r: Relation, signal: jax.Array, df: jax.Array) -> jax.Array:
    """``δ_k·Df_k`` at the relation's output units, per step ``(K, *y)``."""
    if isinstance(r, ElementwiseRelation):
        return jax.vmap(r.scatter_to_y)(jnp.sum(signal * df, axis=-1))
    return jnp.sum(jax.vmap(r.gather_hidden)(signal) * df.astype(signal.dtype), axis=-1)


def after_update_block(block_finish: Callable[..., tuple[Any, Any]]
                       ) -> Callable[..., tuple[Any, Any]]:
    """The time-blocked rule of the fast signal from an additive rule's ``block_finish``.

    ``block_finish`` reads ``δ̄_k`` against the trace entering step ``k`` and the
    relation's output cotangents ``dy_k``; with ``δ̄_k = δ_k D_k`` (per unit,
    ``Σ_s δ_s D[s, s']``) and ``dy_k = δ_k·Df_k`` it sums ``δ_k·ε^k`` (module docstring).
    """

    def finish(r: Relation, state: Any, steps: BlockSteps, theta: dict[str, jax.Array]
               ) -> tuple[Any, Any]:
        entering = jnp.einsum("k...s,k...st->k...t", steps.signal, steps.d.astype(
            steps.signal.dtype))
        share = _output_share(r, steps.signal, steps.df)
        dy = share if steps.dy is None else steps.dy + share.astype(steps.dy.dtype)
        return block_finish(r, state, steps._replace(signal=entering, dy=dy), theta)

    return finish
