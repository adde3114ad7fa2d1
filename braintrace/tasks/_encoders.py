r"""Spike encoders: analog values or signals to spike trains, time axis leading.

Plain JAX functions, usable under ``jit`` and ``vmap``; the random ones take an
explicit PRNG key. Each returns float spikes of shape ``(T, *x.shape)`` (the delta
encoder keeps the signal's own time axis), ready as ``xs`` of ``etrace_grad``:

* :func:`rate_encode` — Bernoulli spikes with probability ``gain · x`` per step;
* :func:`poisson_encode` — a Poisson process of rate ``r`` binned in steps of ``dt``
  (a spike where a bin holds at least one event);
* :func:`latency_encode` — one spike per input, earlier for a larger value
  (time to first spike), linear or as an RC circuit charges;
* :func:`delta_encode` — an event where a signal has moved by a threshold since
  the last event (send-on-delta), signed or as ON/OFF channels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["delta_encode", "latency_encode", "poisson_encode", "rate_encode"]


def _check_steps(name: str, num_steps: int) -> None:
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"{name}: num_steps must be a positive int, got {num_steps!r}.")


def rate_encode(key: jax.Array, x: ArrayLike, num_steps: int, *,
                gain: float = 1.0) -> jax.Array:
    r"""Rate coding: at every step, input ``i`` spikes with probability ``p_i = clip(gain · x_i, 0, 1)``.

    Steps and inputs are independent Bernoulli draws, so input ``i`` fires
    ``p_i · T`` times on average (snnTorch's ``spikegen.rate``).

    Args:
        key: A PRNG key.
        x: Intensities, any shape (e.g. ``(B, C)``), typically in ``[0, 1]``.
        num_steps: ``T``.
        gain: Scales the intensities into probabilities.

    Returns:
        Spikes ``(T, *x.shape)``, float32 0/1.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace import tasks
        >>> spikes = tasks.rate_encode(jax.random.key(0), jnp.array([0.0, 0.5, 1.0]), 1000)
        >>> spikes.shape, spikes.mean(axis=0).round(1).tolist()
        ((1000, 3), [0.0, 0.5, 1.0])
    """
    _check_steps("rate_encode", num_steps)
    p = jnp.clip(gain * jnp.asarray(x, jnp.float32), 0.0, 1.0)
    return jax.random.bernoulli(key, p, (num_steps, *p.shape)).astype(jnp.float32)


def poisson_encode(key: jax.Array, rates: ArrayLike, num_steps: int, *,
                   dt: float = 1.0) -> jax.Array:
    r"""A Poisson process of rate ``r_i`` per input, binned in steps of ``dt``.

    A step holds a spike where its bin holds at least one event of the process:
    with probability ``p_i = 1 - exp(-r_i · dt)`` (``≈ r_i · dt`` for a small rate),
    independently per step and input.

    Args:
        key: A PRNG key.
        rates: Event rates ``r ≥ 0`` (events per unit of ``dt``), any shape.
        num_steps: ``T``.
        dt: The bin length.

    Returns:
        Spikes ``(T, *rates.shape)``, float32 0/1.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace import tasks
        >>> rates = jnp.array([10.0, 100.0])  # 10 Hz and 100 Hz in 1 ms bins
        >>> spikes = tasks.poisson_encode(jax.random.key(0), rates, 4000, dt=1e-3)
        >>> spikes.shape
        (4000, 2)
        >>> bool(jnp.allclose(spikes.mean(axis=0), 1 - jnp.exp(-rates * 1e-3), atol=0.015))
        True
    """
    _check_steps("poisson_encode", num_steps)
    if not dt > 0:
        raise ValueError(f"poisson_encode: dt must be positive, got {dt}.")
    r = jnp.asarray(rates, jnp.float32)
    p = -jnp.expm1(-jnp.maximum(r, 0.0) * dt)
    return jax.random.bernoulli(key, p, (num_steps, *p.shape)).astype(jnp.float32)


def latency_encode(x: ArrayLike, num_steps: int, *, method: str = "linear",
                   tau: float = 1.0, threshold: float = 0.0) -> jax.Array:
    r"""Latency coding (time to first spike): each input fires once, a larger value earlier.

    An input ``x > threshold`` fires at step

    .. math::

        t = \operatorname{round}\big((1 - x)(T - 1)\big) \ (\text{linear}, x \in [0, 1]),
        \qquad
        t = \operatorname{round}\Big(\tau \ln \frac{x}{x - \theta}\Big) \ (\text{log}),

    the second being when an RC circuit charged by ``x`` with time constant ``τ``
    (in steps) reaches ``θ`` (snnTorch's ``spikegen.latency``); an input at or
    below ``threshold``, or whose step is ``T`` or later, never fires.

    Args:
        x: Intensities, any shape.
        num_steps: ``T``.
        method: ``'linear'`` or ``'log'``.
        tau: ``τ`` of ``'log'``, in steps.
        threshold: ``θ``: inputs at or below it stay silent (``'log'`` needs ``θ > 0``).

    Returns:
        Spikes ``(T, *x.shape)``, float32 0/1, at most one per input.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> tasks.latency_encode(jnp.array([1.0, 0.5, 0.0]), 3)
        Array([[1., 0., 0.],
               [0., 1., 0.],
               [0., 0., 0.]], dtype=float32)
    """
    _check_steps("latency_encode", num_steps)
    x = jnp.asarray(x, jnp.float32)
    if method == "linear":
        step = jnp.round((1.0 - jnp.clip(x, 0.0, 1.0)) * (num_steps - 1))
    elif method == "log":
        if not threshold > 0 or not tau > 0:
            raise ValueError(f"latency_encode: method='log' needs threshold > 0 and tau > 0, "
                             f"got threshold={threshold}, tau={tau}.")
        above = jnp.where(x > threshold, x, 2.0 * threshold)  # the silent ones: a finite log
        step = jnp.round(tau * jnp.log(above / (above - threshold)))
    else:
        raise ValueError(f"latency_encode: method must be 'linear' or 'log', got {method!r}.")
    fires = x > threshold
    t = jnp.arange(num_steps, dtype=jnp.float32).reshape((num_steps,) + (1,) * x.ndim)
    return ((t == step) & fires).astype(jnp.float32)


def delta_encode(x: ArrayLike, threshold: float, *, two_channels: bool = False) -> jax.Array:
    r"""Delta (send-on-delta) coding of a signal: an event where it moved by ``θ`` since the last one.

    With a reference ``r`` that starts at 0 and follows the events,

    .. math::

        s_t = \begin{cases} +1 & x_t - r_{t-1} \ge \theta \\ -1 & x_t - r_{t-1} \le -\theta
              \\ 0 & \text{otherwise} \end{cases}, \qquad r_t = r_{t-1} + \theta s_t,

    at most one event per step and channel. The events are a complete code:
    ``θ Σ_{k≤t} s_k = r_t`` stays within ``θ`` of ``x_t`` while the signal moves by
    less than ``θ`` per step (a faster one is followed at ``θ`` per step).

    Args:
        x: The signal, time axis leading: ``(T, *channels)``.
        threshold: ``θ > 0``.
        two_channels: Return ON and OFF events as 0/1 channels, concatenated on the
            last axis (``(T, ..., 2C)``: ON first), instead of signed events.

    Returns:
        Float32 events: ``(T, *channels)`` in ``{-1, 0, 1}``, or ``(T, ..., 2C)`` in ``{0, 1}``.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace import tasks
        >>> x = jnp.array([0.1, 0.6, 1.2, 1.1, 0.3, 0.2])
        >>> tasks.delta_encode(x, 0.5)
        Array([ 0.,  1.,  0.,  0., -1.,  0.], dtype=float32)
        >>> tasks.delta_encode(x[:, None], 0.5, two_channels=True)[:, 1]  # OFF events
        Array([0., 0., 0., 0., 1., 0.], dtype=float32)
    """
    if not threshold > 0 or not math.isfinite(threshold):
        raise ValueError(f"delta_encode: threshold must be positive and finite, got {threshold}.")
    x = jnp.asarray(x, jnp.float32)
    if x.ndim < 1:
        raise ValueError("delta_encode: x must have a leading time axis, got a scalar.")

    def step(reference: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
        change = x_t - reference
        s = (change >= threshold).astype(jnp.float32) - (change <= -threshold).astype(jnp.float32)
        return reference + threshold * s, s

    _, events = jax.lax.scan(step, jnp.zeros(x.shape[1:], jnp.float32), x)
    if two_channels:
        return jnp.concatenate([(events > 0), (events < 0)], axis=-1).astype(jnp.float32)
    return events
