"""The ETP primitives that ``test_primitive_contract.py`` checks: one case per primitive.

A case is a primitive (its per-sample form; a batched form is its
``batched_counterpart``), a function making example operands for given sizes,
and its trace layout. Adding a primitive to the contract test is one line in
:data:`CASES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import braintrace

__all__ = ["CASES", "Operands", "PrimitiveCase"]

Layout = Literal["output_axis", "hidden"]
"""How a trace lines up with ``y``.

``"output_axis"``: ``y = f(x, θ)`` has an input; every trace ends with ``y``'s
output axis (dense, LoRA), and the instantaneous D-RTRL term is ``xy_to_trace``
(or ``xy_to_dw``). ``"hidden"``: no input; the trace is shaped like the hidden
group ``y`` is broadcast to (elementwise), its instantaneous term is the
cotangent itself and ``xy_to_dw`` maps it to ``θ``.
"""


class Operands(NamedTuple):
    """Example operands of one equation of a primitive."""

    x: jax.Array | None
    """The input, ``(*lead, I)``; ``None`` for a primitive without one."""
    theta: dict[str, jax.Array]
    """The trainable inputs by key, as ``trainable_invars`` names them."""
    params: dict[str, Any]
    """The equation parameters."""
    frozen: dict[int, jax.Array]
    """Operands that are neither ``x`` nor trainable, by position."""
    hidden: tuple[int, ...]
    """Per-sample shape of the hidden state that ``y`` feeds."""


MakeOperands = Callable[[tuple[int, int, int], tuple[int, ...], np.random.Generator, str],
                        Operands]
"""``operands(sizes, lead, rng, dtype)``: ``sizes`` are three positive ints,
the first and last different (a non-square map); ``lead`` the leading axes of ``x``."""


Diagonal = Callable[[str, jax.Array, dict[str, Any]], jax.Array]
"""``diagonal(key, jacobian, params)``: each entry of ``θ[key]`` paired with the one ``y``
unit it feeds."""


@dataclasses.dataclass(frozen=True)
class PrimitiveCase:
    """One primitive under the contract test."""

    name: str
    primitive: braintrace.ETPPrimitive
    operands: MakeOperands
    layout: Layout
    diagonal: Diagonal | None = None
    """The ``y``↔``θ`` diagonal of a Jacobian ``(*y, *θ_key)``, for ``"output_axis"``
    traces whose last axis is not ``y``'s only axis; ``None``: pair ``y_o`` with
    ``θ[..., o]``."""

    def __str__(self) -> str:
        return self.name


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


def decay(tau: jax.Array) -> jax.Array:
    """A learnable time constant's per-step decay factor."""
    return jnp.exp(-1.0 / tau)


DENSE_TRANSFORMS = (None, jnp.abs, jax.nn.softplus)
ELEMWISE_FNS = (decay, jax.nn.softplus, jax.nn.sigmoid)


def dense_operands(sizes, lead, rng, dtype) -> Operands:
    """``x (*lead, I) @ T(kernel (I, O)) (+ bias)``, ``T`` none, ``abs`` or ``softplus``."""
    i, _, o = sizes
    has_bias = bool(rng.integers(2))
    theta = {"kernel": _normal(rng, (i, o), dtype)}
    if has_bias:
        theta["bias"] = _normal(rng, (o,), dtype)
    params = {"has_bias": has_bias, "precision": None,
              "kernel_transform": DENSE_TRANSFORMS[rng.integers(len(DENSE_TRANSFORMS))]}
    return Operands(_normal(rng, (*lead, i), dtype), theta, params, {}, (o,))


def lora_operands(sizes, lead, rng, dtype) -> Operands:
    """``s·(x (*lead, I) @ lora_a (I, r)) @ lora_b (r, O) (+ bias) (+ x @ frozen base)``."""
    i, r, o = sizes
    has_bias, has_base = bool(rng.integers(2)), bool(rng.integers(2))
    theta = {"lora_a": _normal(rng, (i, r), dtype), "lora_b": _normal(rng, (r, o), dtype)}
    if has_bias:
        theta["bias"] = _normal(rng, (o,), dtype)
    frozen = {3 + has_bias: _normal(rng, (i, o), dtype)} if has_base else {}
    params = {"has_bias": has_bias, "has_base": has_base, "scaling": float(rng.choice([0.5, 1.5]))}
    return Operands(_normal(rng, (*lead, i), dtype), theta, params, frozen, (o,))


def elemwise_operands(sizes, lead, rng, dtype) -> Operands:
    """``fn(w)`` broadcast to a ``(H1, H2)`` hidden state; ``w`` scalar, a row, a column, ..."""
    del lead
    h1, _, h2 = sizes
    shapes = [(), (1,), (h2,), (1, h2), (h1, 1), (h1, h2)]
    w = jnp.asarray(rng.uniform(1.5, 6.0, shapes[rng.integers(len(shapes))]), dtype)
    params = {"fn": ELEMWISE_FNS[rng.integers(len(ELEMWISE_FNS))]}
    return Operands(None, {"weight": w}, params, {}, (h1, h2))


from linear_family_cases import (  # after Operands, which linear_family_cases imports
    einsum_diagonal,
    einsum_operands,
    embed_operands,
    grouped_diagonal,
    grouped_operands,
    sparse_diagonal,
    sparse_operands,
)


def conv_operands(sizes, lead, rng, dtype) -> Operands:
    """``conv(x (*lead, *spatial, G·I), kernel (*window, I, G·O)) (+ bias)``: 1-D to 3-D,
    strides, kernel and input dilation, ``'SAME'``/``'VALID'``/explicit padding, ``G`` groups.

    Explicit padding comes with input dilation and unit strides and kernel dilation, so
    that some window reads the input (not only padding) and the kernel stays live."""
    i, b, o = sizes
    num_spatial, groups = int(rng.choice([1, 2, 2, 3])), int(rng.integers(1, 3))
    window = tuple(int(k) for k in rng.integers(1, 4 if num_spatial < 3 else 3, num_spatial))
    padding = ["SAME", "VALID", tuple((int(lo), int(hi)) for lo, hi in
                                      rng.integers(0, 3, (num_spatial, 2)))][rng.integers(3)]
    explicit = isinstance(padding, tuple)
    ones = (1,) * num_spatial
    dilation = ones if explicit else tuple(int(r) for r in rng.integers(1, 3, num_spatial))
    spatial = tuple((k - 1) * r + b for k, r in zip(window, dilation))
    has_bias = bool(rng.integers(2))
    theta = {"kernel": _normal(rng, (*window, i, groups * o), dtype)}
    if has_bias:
        theta["bias"] = _normal(rng, (groups * o,), dtype)
    draw = lambda: tuple(int(v) for v in rng.integers(1, 3, num_spatial))
    params = {"strides": ones if explicit else draw(), "padding": padding,
              "kernel_dilation": dilation, "feature_group_count": groups,
              "input_dilation": draw() if explicit else ones,
              "has_bias": has_bias, "precision": None}
    x = _normal(rng, (*lead, *spatial, groups * i), dtype)
    y = jax.eval_shape(lambda: braintrace.etp_conv_p.bind(x[(0,) * len(lead)], *theta.values(),
                                                          **params))
    return Operands(x, theta, params, {}, y.shape)


CASES = [
    PrimitiveCase("dense", braintrace.etp_dense_p, dense_operands, "output_axis"),
    PrimitiveCase("conv", braintrace.etp_conv_p, conv_operands, "output_axis"),
    PrimitiveCase("lora", braintrace.etp_lora_p, lora_operands, "output_axis"),
    PrimitiveCase("elemwise", braintrace.etp_elemwise_p, elemwise_operands, "hidden"),
    PrimitiveCase("embed", braintrace.etp_embed_p, embed_operands, "output_axis"),
    PrimitiveCase("einsum", braintrace.etp_einsum_p, einsum_operands, "output_axis",
                  einsum_diagonal),
    PrimitiveCase("grouped", braintrace.etp_grouped_p, grouped_operands, "output_axis",
                  grouped_diagonal),
    PrimitiveCase("sparse", braintrace.etp_sparse_p, sparse_operands, "output_axis",
                  sparse_diagonal),
]
"""Every primitive the contract test checks, each unbatched and batched."""
