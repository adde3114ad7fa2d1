"""What a mask ignores is never read: the non-finite values it hides are replaced step by step.

A mask weighs step ``t`` (of sample ``b``) with ``w_t`` (``w_tb``); weight 0
means the position is ignored: it adds nothing to the loss, the gradient or the
metrics. Multiplying by 0 is not enough, since ``0 · nan = nan`` (and ``0 · inf``):
a NaN target at an ignored step makes that step's loss NaN, and its product with
0 is NaN again, in the loss and, through the VJP, in the gradient. So inside the
time loop, on each step's inputs and targets as the loop reads them
(:func:`ignore_masked`, when a mask is given; the drivers compute the small flags
:func:`reaches_scored` once, ``(T,)`` or ``(T, B)``, and every loop passes them on
with its steps, so no cleaned copy of the whole ``(T, B, ...)`` ``xs`` or ``ys``
exists; without a mask, where no weight is 0, nothing is done):

* a **target** entry that is not finite at an ignored position is replaced by
  0, so ``loss_fn`` never sees it;
* an **input** entry that is not finite after the last scored step of its
  sample (trailing padding) is replaced by 0. Only there: an input at an
  ignored step before a scored one still reaches that scored step through the
  hidden state (a ``(T,)`` mask scoring an answer period reads the stimulus at
  unscored steps), so it is data, and a non-finite one is an error the drivers
  name. After the last scored step nothing reaches a scored loss (causality),
  so the replacement changes no loss, gradient or metric that counts.

Finite values are kept as they are, bit for bit, so with finite data the
result is the one without this step. (The hidden state after the sequence is
then that of zeros at the replaced inputs: finite, so a stream that carries it
into its next call goes on.) A ``loss_fn`` may still be singular at an ignored position (a relative error
at a zero-padded target): its loss there is inf and so is its derivative. Two
selections, the "double ``where``", keep it out of the sum and the gradient:
each step's weighted loss is selected with :func:`weigh`, ``where(w ≠ 0, w·L,
0)``, not multiplied, so the sum stays finite; and the outputs reach
``loss_fn`` through :func:`stop_unscored`, ``where(w ≠ 0, y, stop_gradient(y))``,
so the zero cotangent of an ignored loss is never multiplied by its infinite
derivative (``0 · inf = nan``): the pullback of a select drops it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ignore_masked", "ignore_masked_inputs", "ignore_masked_targets", "reaches_scored",
           "stop_unscored", "weigh"]


def weigh(loss: jax.Array, weight: jax.Array) -> jax.Array:
    """``w·L`` where ``w ≠ 0``, else exactly 0 (also for a non-finite ``L``).

    Example:
        >>> import jax.numpy as jnp
        >>> weigh(jnp.array([2.0, jnp.nan]), jnp.array([0.5, 0.0])).tolist()
        [1.0, 0.0]
    """
    return jnp.where(weight != 0, loss * weight, 0)


def stop_unscored(y: Any, weight: jax.Array) -> Any:
    """``y`` (the step's outputs), its gradient stopped at the positions ``weight`` ignores.

    ``weight`` is a scalar (one step) or ``(B,)`` (its samples, each leaf of
    ``y`` leading with the batch axis). The values are ``y``'s, bit for bit; the
    pullback is a select, so a non-finite cotangent from an ignored loss stops here.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda y: jnp.sum(weigh(1 / stop_unscored(y, jnp.array([1.0, 0.0])),
        ...                             jnp.array([1.0, 0.0])))
        >>> jax.grad(f)(jnp.array([2.0, 0.0])).tolist()
        [-0.25, 0.0]
    """
    keep = weight != 0

    def select(a: jax.Array) -> jax.Array:
        return jnp.where(keep.reshape(keep.shape + (1,) * (jnp.ndim(a) - keep.ndim)), a,
                         jax.lax.stop_gradient(a))

    return jax.tree.map(select, y)


def reaches_scored(weights: jax.Array) -> jax.Array:
    """Whether each position is at or before a scored step of its sample: ``(T,)`` or ``(T, B)``.

    ``weights`` are ``(T,)`` (per step) or ``(T, B)`` (per step and sample); a
    position after the last nonzero weight of its sample (trailing padding)
    reaches no scored step.

    Example:
        >>> import jax.numpy as jnp
        >>> reaches_scored(jnp.array([0.0, 1.0, 0.0, 1.0, 0.0])).tolist()
        [True, True, True, True, False]
    """
    return jax.lax.cummax((weights != 0).astype(jnp.int32), axis=0, reverse=True) > 0


def _keep(a: jax.Array, keep: jax.Array) -> jax.Array:
    """``a`` with its non-finite entries replaced by 0 where ``keep`` (leading axes) is False."""
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return a
    keep = keep.reshape(keep.shape + (1,) * (a.ndim - keep.ndim))
    return jnp.where(keep | jnp.isfinite(a), a, jnp.zeros((), a.dtype))


def ignore_masked(xs: Any, ys: Any, weights: jax.Array,
                  reaches: jax.Array | None) -> tuple[Any, Any]:
    """``(xs, ys)`` with the non-finite entries the weights ignore replaced by 0.

    Targets at positions of weight 0, and inputs after their sample's last
    scored step (module docstring). ``xs``, ``ys``, ``weights`` and ``reaches``
    are a piece of the sequence, the same positions of each: one step (each
    leaf leading with the batch axis when the weights are ``(B,)``), a block of
    steps, or the whole of it. ``reaches`` is :func:`reaches_scored` of the
    *whole* sequence's weights at those positions (a piece cannot tell whether a
    later one scores), or ``None``: no mask, ``(xs, ys)`` unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> xs = jnp.array([1.0, jnp.nan, 3.0, jnp.nan])
        >>> ys = jnp.array([jnp.nan, 2.0, jnp.inf, jnp.nan])
        >>> w = jnp.array([0.0, 1.0, 1.0, 0.0])
        >>> xs, ys = ignore_masked(xs, ys, w, reaches_scored(w))
        >>> xs.tolist(), ys.tolist()  # xs[1] reaches the scored steps: it stays
        ([1.0, nan, 3.0, 0.0], [0.0, 2.0, inf, 0.0])
        >>> x, y = ignore_masked(jnp.nan, jnp.nan, jnp.array(0.0), jnp.array(False))  # one step
        >>> x.tolist(), y.tolist()
        (0.0, 0.0)
    """
    if reaches is None:
        return xs, ys
    return ignore_masked_inputs(xs, reaches), ignore_masked_targets(ys, weights)


def ignore_masked_inputs(xs: Any, reaches: jax.Array | None) -> Any:
    """``xs`` with its non-finite entries replaced by 0 where ``reaches`` is False
    (:func:`ignore_masked`'s inputs; unchanged when ``reaches`` is ``None``).

    Example:
        >>> import jax.numpy as jnp
        >>> ignore_masked_inputs(jnp.array([jnp.nan, jnp.nan]), jnp.array([True, False])).tolist()
        [nan, 0.0]
    """
    if reaches is None:
        return xs
    return jax.tree.map(lambda a: _keep(a, reaches), xs)


def ignore_masked_targets(ys: Any, weights: jax.Array) -> Any:
    """``ys`` with its non-finite entries replaced by 0 where ``weights`` are 0
    (:func:`ignore_masked`'s targets).

    Example:
        >>> import jax.numpy as jnp
        >>> ignore_masked_targets(jnp.array([jnp.inf, jnp.inf]), jnp.array([1.0, 0.0])).tolist()
        [inf, 0.0]
    """
    return jax.tree.map(lambda a: _keep(a, weights != 0), ys)
