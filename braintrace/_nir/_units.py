"""Units between a braintrace step and NIR's continuous time, in plain numpy.

A layer decays by ``α = exp(-dt_layer/τ)`` per step and adds its input with
gain 1. A NIR leaky node ``τ dv/dt = (v_leak - v) + R I`` stepped by forward
Euler over one step of length ``dt`` decays by ``1 - dt/τ_NIR`` and adds its
input with gain ``R dt/τ_NIR``. The two agree when ``τ_NIR = dt/(1 - α)`` and
``R = 1/(1 - α)``; see :mod:`braintrace.nir` for the full mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from braintrace.layers import ETPElemwise, ExpDecay


def positive_dt(dt: Any, user: str) -> float:
    """``dt`` as a float, or a ValueError: the length of one step in NIR's time unit."""
    try:
        value = float(dt)
    except (TypeError, ValueError):
        value = float("nan")
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{user}: dt (the length of one step in the graph's time unit) must "
                         f"be a positive number, got {dt!r}.")
    return value


def one_minus_decay(tau: float | ETPElemwise, layer_dt: float, where: str) -> np.ndarray:
    """``1 - α`` of a layer's time constant (a float, or a learnable ``ETPElemwise``)."""
    if isinstance(tau, ETPElemwise):
        if not isinstance(tau.fn, ExpDecay):
            raise TypeError(
                f"to_nir: the time constant at '{where}' is read through {tau.fn!r}, not "
                f"ExpDecay; only exp(-dt/τ) decays have a NIR time constant.")
        values, layer_dt = np.asarray(tau.weight[...], np.float64), tau.fn.dt
    else:
        values = np.asarray(tau, np.float64)
    return -np.expm1(-layer_dt / values)


def nir_time_constant(one_minus: np.ndarray, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """``(τ_NIR, R) = (dt/(1 - α), 1/(1 - α))``: Euler decay ``α`` and input gain 1."""
    return dt / one_minus, 1.0 / one_minus


def layer_time_constant(tau_nir: np.ndarray, dt: float, where: str) -> float | np.ndarray:
    """The layer's ``τ`` (with ``dt_layer = dt``) whose ``exp(-dt/τ)`` is Euler's ``1 - dt/τ_NIR``.

    A float when every unit shares it, else one per unit.
    """
    one_minus = dt / np.asarray(tau_nir, np.float64)
    if not np.all((one_minus > 0) & (one_minus < 1)):
        raise ValueError(
            f"from_nir: node '{where}' has a time constant {np.min(tau_nir)} <= dt={dt}; the "
            f"per-step decay 1 - dt/τ must lie in (0, 1). Pass the dt the graph was made for.")
    tau = -dt / np.log1p(-one_minus)
    return float(tau.flat[0]) if np.all(tau == tau.flat[0]) else tau


def finite(values: Any, where: str, field: str, why: str) -> None:
    """Nothing, or a ValueError naming the node and field when an entry is not finite.

    Example:
        >>> finite([0.02, float('inf')], 'lif', 'r', 'it must be finite')
        Traceback (most recent call last):
        ...
        ValueError: from_nir: node 'lif' has r = inf (1 of 2 entries not finite); it must ...
    """
    values = np.asarray(values, np.float64)
    bad = ~np.isfinite(values)
    if np.any(bad):
        raise ValueError(
            f"from_nir: node '{where}' has {field} = {values[bad].flat[0]} "
            f"({np.count_nonzero(bad)} of {values.size} entries not finite); {why}. Give the "
            f"node finite values of {field}.")


def uniform(values: Any, where: str, what: str) -> float:
    """The one value shared by every entry of ``values``, or a ValueError naming the node."""
    values = np.asarray(values)
    if values.size == 0 or not np.all(values == values.flat[0]):
        raise ValueError(
            f"from_nir: node '{where}' has different {what} per neuron; braintrace neurons "
            f"share one {what} per layer.")
    return float(values.flat[0])


def per_channel(values: Any, where: str, what: str) -> np.ndarray:
    """``(C,)`` from a vector, or from ``(C, *spatial)`` that is constant over the positions."""
    values = np.asarray(values, np.float64)
    if values.ndim <= 1:
        return values.reshape(-1)
    flat = values.reshape(values.shape[0], -1)
    if not np.all(flat == flat[:, :1]):
        raise ValueError(
            f"from_nir: node '{where}' has {what} that varies over positions; a braintrace "
            f"convolutional neuron shares it across positions (one value per channel).")
    return flat[:, 0]


def explicit_pads(padding: Any, spatial: Sequence[int], kernel_size: Sequence[int],
                  strides: Sequence[int], dilation: Sequence[int], where: str
                  ) -> list[tuple[int, int]]:
    """``(low, high)`` per spatial axis of an ETPConv's padding for frames of size ``spatial``."""
    n = len(spatial)
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(
                f"to_nir: the ETPConv at '{where}' pads with {padding!r}; NIR convolutions "
                f"pad with zeros only ('SAME', 'VALID' or explicit sizes).")
        window = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation, strict=True)]
        return [tuple(p) for p in jax.lax.padtype_to_pads(spatial, window, strides,
                                                           padding.upper())]
    if isinstance(padding, int):
        return [(padding, padding)] * n
    pads = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]
    return pads * n if len(pads) == 1 else pads


def nir_shape(shape: Sequence[int]) -> np.ndarray:
    """NIR's (channels-first) per-sample shape of a braintrace (channels-last) one."""
    shape = tuple(int(s) for s in shape)
    return np.array(shape if len(shape) == 1 else (shape[-1], *shape[:-1]))


def as_tuple(value: Any, n: int) -> tuple[int, ...]:
    """``n`` ints from an int, a sequence or a numpy array (``None`` is 1)."""
    flat = np.atleast_1d(np.asarray(1 if value is None else value)).astype(int).tolist()
    return tuple(flat * n if len(flat) == 1 else flat)
