"""Position maps: which source positions each value of a jaxpr depends on.

A *position map* of a value with shape ``X`` is an integer array of shape
``(*X, K)``: entry ``[..., k]`` lists, padded with ``-1``, the flat positions
of a source array (a hidden state, or an ETP primitive's output) that this
element depends on. Maps are propagated structurally, never by numeric
probing:

* elementwise primitives take the union of their operands' sets;
* data-movement primitives (reshape, transpose, broadcast, slice, concatenate,
  pad, ...) are applied to the integer maps themselves;
* ``custom_jvp_call``/``custom_vjp_call`` are followed into their bodies;
* every other primitive that reads a source-derived value *mixes positions*:
  the walk is cut there and the caller decides what that means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ELEMENTWISE",
    "MOVEMENT",
    "PositionMap",
    "empty_map",
    "is_structural",
    "propagate",
    "source_map",
    "union",
]

PositionMap = np.ndarray

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos",
    "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1",
    "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not",
    "or", "pow", "real", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor",
    "stop_gradient",
})
"""Primitives whose output element depends only on the same element of each operand."""

MOVEMENT = frozenset({
    "broadcast_in_dim", "concatenate", "expand_dims", "pad", "reshape", "rev", "slice",
    "split", "squeeze", "transpose",
})
"""Primitives that move elements without combining them."""

OPAQUE_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})

MAX_SOURCES = 64


def is_structural(eqn: jex_core.JaxprEqn) -> bool:
    """Whether position maps can be propagated through ``eqn``."""
    name = eqn.primitive.name
    return name in ELEMENTWISE or name in MOVEMENT or name in OPAQUE_CALLS


def source_map(shape: Sequence[int]) -> PositionMap:
    """The map of a source array: element ``i`` depends on flat position ``i``."""
    size = int(np.prod(shape, dtype=np.int64))
    return np.arange(size, dtype=np.int64).reshape(*shape, 1)


def empty_map(shape: Sequence[int]) -> PositionMap:
    """The map of a value that depends on no source position."""
    return np.full((*shape, 1), -1, dtype=np.int64)


SORTING_NETWORK_WIDTH = 8
"""Sets up to this wide are sorted by compare-exchanges of whole slots (:func:`_descending`)."""


def _descending(m: PositionMap) -> PositionMap:
    """Each set of ``m`` sorted descending, in place; returns ``m`` (or a view of it).

    A few slots are sorted by an odd-even transposition network, each compare-exchange a
    ``maximum``/``minimum`` of two slots over all sets: at 1,048,576 neurons and batch 32
    a sort along a last axis of 2 or 3 slots (a copy and a sort per call) was most of
    ``compile``'s time.

    Example:
        >>> import numpy as np
        >>> from braintrace._compiler._positions import _descending
        >>> _descending(np.array([[1, 3, -1], [2, 2, 5]])).tolist()
        [[3, 1, -1], [5, 2, 2]]
    """
    width = m.shape[-1]
    if width > SORTING_NETWORK_WIDTH:
        m.sort(axis=-1)
        return m[..., ::-1]
    for rnd in range(width):
        for k in range(rnd % 2, width - 1, 2):
            low, high = m[..., k], m[..., k + 1]
            larger = np.maximum(low, high)
            np.minimum(low, high, out=high)
            low[...] = larger
    return m


def _normalise(m: PositionMap) -> PositionMap:
    """Sorts each set descending, drops duplicates and trailing padding (on a copy of ``m``)."""
    if m.shape[-1] == 1:
        return m
    m = _descending(np.array(m))
    m[..., 1:][m[..., 1:] == m[..., :-1]] = -1  # duplicates are adjacent
    m = _descending(m)
    width = max(1, int(np.max(np.sum(m >= 0, axis=-1), initial=0)))
    return m[..., :width]


def union(maps: Sequence[PositionMap], shape: Sequence[int]) -> PositionMap:
    """The element-wise union of position maps, broadcast to ``shape``.

    Maps equal to an earlier one are skipped (an operation reading one value
    twice, or values of one layout), and a single remaining map of the output
    shape is returned as it is: at 131k neurons concatenating and sorting copies
    of one map was most of ``compile``'s memory (``benchmarks/scale.py``).
    """
    distinct: list[PositionMap] = []
    for m in maps:
        if not any(m is o or (m.shape == o.shape and np.array_equal(m, o)) for o in distinct):
            distinct.append(m)
    if len(distinct) == 1 and distinct[0].shape[:-1] == tuple(shape):
        return distinct[0]
    parts = [np.broadcast_to(m, (*shape, m.shape[-1])) for m in distinct]
    return _normalise(np.concatenate(parts, axis=-1))


def _move(eqn: jex_core.JaxprEqn, maps: Sequence[PositionMap | None]) -> list[PositionMap]:
    """Applies a data-movement primitive to integer maps, one set slot at a time.

    Evaluated eagerly even when called under a trace (``jax.jit``,
    ``jax.eval_shape``): the maps are NumPy arrays, never traced values.
    """
    with jax.ensure_compile_time_eval():
        return _move_eagerly(eqn, maps)


def _move_eagerly(eqn: jex_core.JaxprEqn,
                  maps: Sequence[PositionMap | None]) -> list[PositionMap]:
    width = max(m.shape[-1] for m in maps if m is not None)
    slots = []
    for k in range(width):
        operands = []
        for var, m in zip(eqn.invars, maps):
            if m is None:
                # Operands that carry no map: pad values and the like.
                operands.append(jnp.full(np.shape(var.aval), -1, jnp.int32)
                                if np.shape(var.aval) else jnp.int32(-1))
            else:
                slot = m[..., k] if k < m.shape[-1] else np.full(m.shape[:-1], -1)
                operands.append(jnp.asarray(slot, jnp.int32))
        outs = eqn.primitive.bind(*operands, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        slots.append([np.asarray(o, np.int64) for o in outs])
    return [_normalise(np.stack(per_out, axis=-1)) for per_out in zip(*slots)]


def propagate(
    jaxpr: jex_core.Jaxpr,
    sources: dict[jex_core.Var, PositionMap],
    *,
    cut: Callable[[int, jex_core.JaxprEqn], bool] = lambda index, eqn: False,
    on_mixing: Callable[[int, jex_core.JaxprEqn], None] | None = None,
    max_sources: int = MAX_SOURCES,
) -> dict[jex_core.Var, PositionMap]:
    """Propagates position maps from ``sources`` through ``jaxpr``.

    Args:
        jaxpr: A flat jaxpr (see ``flatten_jaxpr``).
        sources: Initial maps of some variables (usually invars).
        cut: ``cut(index, eqn)`` says the walk stops at this equation: its
            outputs carry no map.
        on_mixing: Called for an equation that reads a mapped value but whose
            positions cannot be followed (a reduction, a matmul, ...), or whose
            result would depend on more than ``max_sources`` positions. Its
            outputs carry no map.
        max_sources: The largest set an element may depend on.

    Returns:
        The maps of every variable that depends on a source (others are absent).
    """
    env: dict[jex_core.Var, PositionMap] = dict(sources)

    def read(v: Any) -> PositionMap | None:
        if isinstance(v, jex_core.Literal):
            return None
        return env.get(v)

    for index, eqn in enumerate(jaxpr.eqns):
        maps = [read(v) for v in eqn.invars]
        if all(m is None for m in maps) or cut(index, eqn):
            continue
        outs = _propagate_eqn(eqn, maps)
        if outs is None or any(o.shape[-1] > max_sources for o in outs):
            if on_mixing is not None:
                on_mixing(index, eqn)
            continue
        for var, m in zip(eqn.outvars, outs):
            if np.any(m >= 0):
                env[var] = m
    return env


def _propagate_eqn(
    eqn: jex_core.JaxprEqn, maps: Sequence[PositionMap | None]
) -> list[PositionMap] | None:
    name = eqn.primitive.name
    out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    if name in ELEMENTWISE:
        present = [m for m in maps if m is not None]
        return [union(present, out_shapes[0])]
    if name in MOVEMENT:
        return _move(eqn, maps)
    if name in OPAQUE_CALLS:
        closed = eqn.params["call_jaxpr"]
        inner = closed.jaxpr
        num_consts = len(inner.invars) - len(maps)
        inner_sources = {
            v: m for v, m in zip(inner.invars[num_consts:], maps) if m is not None}
        mixed: list[int] = []
        env = propagate(inner, inner_sources, on_mixing=lambda i, e: mixed.append(i))
        if mixed:
            return None
        return [env.get(v, empty_map(s)) if not isinstance(v, jex_core.Literal)
                else empty_map(s) for v, s in zip(inner.outvars, out_shapes)]
    return None
