"""The convolution ETP primitive: ``y = conv(x, kernel) (+ bias)`` and its trace rules.

Channels last, as :class:`flax.nnx.Conv`: ``x (*spatial, C)`` per sample,
``kernel (*window, C // G, O)`` with ``G = feature_group_count``, ``y (*out, O)``.
Registered as ``etp_conv`` (per sample) and ``etp_conv_batched`` (``x (B, *spatial, C)``).

In the im2col view a sample's output at position ``p`` is
``y[p, o] = Σ_{w, c} P[p, w, g(o), c] K[w, c, o] + b[o]``, with ``P`` the input
patches split into ``G`` channel groups and ``g(o)`` the group of output
channel ``o``. Each kernel entry feeds *every* output position, so a trace shaped
like ``K`` cannot be discounted position by position: the exact D-RTRL trace is
kept per output position, ``ε_K[p, w, c, o]`` (and ``ε_b[p, o]``). Rules
(per sample, cotangent ``d (*out, O)``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dK = \\sum_p P[p, \\cdot, g(o), \\cdot] \\otimes d[p, o],
    \\qquad db = \\sum_p d[p]

    \\mathrm{xy\\_to\\_trace}: \\quad \\epsilon_K[p, w, c, o] = P[p, w, g(o), c]\\, d[p, o],
    \\qquad \\epsilon_b[p, o] = d[p, o]

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon_K[p, w, c, o] \\mapsto
        \\epsilon_K[p, w, c, o]\\, d[p, o]

    \\mathrm{trace\\_to\\_dw}: \\quad dK = \\sum_p \\epsilon_K[p],
        \\qquad db = \\sum_p \\epsilon_b[p]

The group structure is exact: ``ε_K[p, w, c, o]`` only ever reads input
channel ``g(o)·C/G + c``. ``xy_to_dw`` is the convolution's own pullback.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import ETPRules, sum_leading, zeros_like_output

__all__ = ["CONV_RULES", "conv", "etp_conv_batched_p", "etp_conv_p"]

#: Paddings done by padding the input outside the primitive (as :class:`flax.nnx.Conv`).
INPUT_PADDINGS = {"CIRCULAR": "wrap", "REFLECT": "reflect"}


def _dimension_numbers(num_spatial: int) -> jax.lax.ConvDimensionNumbers:
    """Channels-last ``(N, *spatial, C)``, ``(*window, I, O)``, ``(N, *spatial, O)``."""
    ndim = num_spatial + 2
    lhs = (0, ndim - 1, *range(1, ndim - 1))
    return jax.lax.ConvDimensionNumbers(lhs, (ndim - 1, ndim - 2, *range(ndim - 2)), lhs)


def _conv_args(params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``lax.conv_general_dilated`` (and its patches) in ``params``."""
    num_spatial = len(params["strides"])
    return {"window_strides": params["strides"], "padding": params["padding"],
            "lhs_dilation": params["input_dilation"], "rhs_dilation": params["kernel_dilation"],
            "dimension_numbers": _dimension_numbers(num_spatial)}


def _with_batch(x: jax.Array, num_spatial: int) -> tuple[jax.Array, tuple[int, ...]]:
    """``x (*lead, *spatial, C)`` as ``(L, *spatial, C)``, and ``lead``."""
    lead = x.shape[:x.ndim - num_spatial - 1]
    return x.reshape(-1, *x.shape[len(lead):]), lead


def _conv_impl(x, kernel, *bias, strides, padding, input_dilation, kernel_dilation,
               feature_group_count, has_bias, precision):
    del has_bias
    params = {"strides": strides, "padding": padding, "input_dilation": input_dilation,
              "kernel_dilation": kernel_dilation}
    flat, lead = _with_batch(x, len(strides))
    dtype = jnp.result_type(flat, kernel)
    y = jax.lax.conv_general_dilated(flat.astype(dtype), kernel.astype(dtype),
                                     **_conv_args(params),
                                     feature_group_count=feature_group_count,
                                     precision=precision)
    if bias:
        y = y + bias[0]
    return y.reshape(*lead, *y.shape[1:])


def _conv_layout(params) -> dict[str, int]:
    return {"kernel": 1, "bias": 2} if params["has_bias"] else {"kernel": 1}


def _lead_axes(d: jax.Array, params: dict[str, Any]) -> int:
    """How many leading (batch) axes a ``y``-shaped ``d (*lead, *out, O)`` has."""
    return d.ndim - len(params["strides"]) - 1


def conv_xy_to_dw(x, d, theta, **params) -> dict[str, jax.Array]:
    """Pullback of the convolution at ``(x, θ)`` with cotangent ``d``; leading axes summed."""
    num_spatial = len(params["strides"])
    flat_x, _ = _with_batch(x, num_spatial)
    flat_d, _ = _with_batch(d, num_spatial)
    kernel = theta["kernel"]
    _, pullback = jax.vjp(
        lambda k: jax.lax.conv_general_dilated(
            flat_x.astype(k.dtype), k, **_conv_args(params),
            feature_group_count=params["feature_group_count"], precision=params["precision"]),
        kernel)
    grads = {"kernel": pullback(flat_d.astype(kernel.dtype))[0]}
    if "bias" in theta:
        grads["bias"] = sum_leading(flat_d).astype(theta["bias"].dtype)
    return grads


def _grouped_patches(x: jax.Array, window: Sequence[int], groups: int,
                     params: dict[str, Any]) -> jax.Array:
    """The input patches of ``x (L, *spatial, C)``: ``(L, P, W, G, C/G)``.

    ``P`` output positions, ``W`` window offsets (both flattened in row-major order).
    """
    patches = jax.lax.conv_general_dilated_patches(
        x, tuple(window), **_conv_args(params), precision=jax.lax.Precision.HIGHEST)
    channels, size = x.shape[-1], math.prod(window)
    patches = patches.reshape(x.shape[0], -1, groups, channels // groups, size)
    return jnp.moveaxis(patches, -1, 2)


def conv_xy_to_trace(x, d, theta, **params) -> dict[str, jax.Array]:
    """The instantaneous D-RTRL term, per output position: ``P[p, w, g(o), c] d[p, o]``.

    ``x (*lead, *spatial, C)``, ``d (*lead, *out, O)``; leading axes are summed.
    Returns ``kernel (*out, *kernel.shape)`` and ``bias (*out, O)``.
    """
    kernel = theta["kernel"]
    window, groups = kernel.shape[:-2], params["feature_group_count"]
    num_spatial = len(params["strides"])
    flat_x, _ = _with_batch(x, num_spatial)
    flat_d, _ = _with_batch(d, num_spatial)
    out_shape = flat_d.shape[1:-1]
    patches = _grouped_patches(flat_x.astype(kernel.dtype), window, groups, params)
    signal = flat_d.reshape(flat_d.shape[0], -1, groups, kernel.shape[-1] // groups)
    term = jnp.einsum("lpwgc,lpgo->pwcgo", patches, signal.astype(kernel.dtype))
    trace = {"kernel": term.reshape(*out_shape, *kernel.shape)}
    if "bias" in theta:
        trace["bias"] = jnp.sum(flat_d, axis=0).astype(theta["bias"].dtype)
    return trace


def _scaled(d: jax.Array, trace: dict[str, jax.Array], params: dict[str, Any]
            ) -> dict[str, tuple[jax.Array, tuple[int, ...], int]]:
    """``ε[..., p, w, c, o] · d[..., p, o]`` per key, on few axes: ``(product, item, rank)``.

    For the kernel the positions ``p`` and the window and input channels ``(w, c)`` are each
    one axis: ``product (*lead, P, W·C, O)``; the bias's product is ``(*lead, *out, O)``.
    ``item`` is the trace's shape without its leading axes and ``rank`` the number of
    trailing axes of ``product`` that hold it. Few axes on purpose: XLA:CPU (jaxlib 0.10.2)
    crashes on some products of seven axes summed over the first (a 2-D convolution's
    kernel trace under one leading axis, :func:`conv_contract`).
    """
    num_spatial = len(params["strides"])
    d_lead = _lead_axes(d, params)
    positions = math.prod(d.shape[d_lead:-1])
    flat_d = d.reshape(*d.shape[:d_lead], positions, 1, d.shape[-1])
    scaled = {}
    for key, value in trace.items():
        if key == "kernel":
            item = value.shape[value.ndim - 2 * num_spatial - 2:]  # (*out, *window, C, O)
            flat = value.reshape(*value.shape[:value.ndim - len(item)], positions, -1, item[-1])
            scaled[key] = (flat * flat_d.astype(value.dtype), item, 3)
        else:
            item = value.shape[value.ndim - num_spatial - 1:]  # (*out, O)
            scaled[key] = (value * d.astype(value.dtype), item, len(item))
    return scaled


def _unflattened(product: jax.Array, item: tuple[int, ...], rank: int) -> jax.Array:
    """``product (*lead, <rank axes>)`` as ``(*lead, *item)``."""
    return product.reshape(*product.shape[:product.ndim - rank], *item)


def conv_dt_to_t(d, trace, **params) -> dict[str, jax.Array]:
    """``ε[..., p, w, c, o] · d[..., p, o]``: a per-position trace scaled along ``(p, o)``."""
    return {key: _unflattened(product, item, rank)
            for key, (product, item, rank) in _scaled(d, trace, params).items()}


def conv_contract(d, trace, **params) -> dict[str, jax.Array]:
    """``Σ_lead dt_to_t(d, trace)``: the signal applied and the leading (batch) axes summed
    (summed before the trace's axes are unflattened: :func:`_scaled`)."""
    lead = tuple(range(_lead_axes(d, params)))
    return {key: _unflattened(jnp.sum(product, axis=lead), item, rank)
            for key, (product, item, rank) in _scaled(d, trace, params).items()}


def conv_trace_to_dw(g, theta, **params) -> dict[str, jax.Array]:
    """A contracted trace ``(*out, *θ_key)`` summed over its positions: ``{key: dθ}``."""
    del params
    return {key: jnp.sum(value, axis=tuple(range(value.ndim - theta[key].ndim))).astype(
        theta[key].dtype) for key, value in g.items()}


def conv_init_drtrl(x, y, theta, num_states: int) -> dict[str, jax.Array]:
    """Per-sample D-RTRL traces: ``kernel (*out, *kernel.shape, S)``, ``bias (*out, O, S)``."""
    del x
    out = jnp.shape(y)[:-1]
    return {key: jnp.zeros((*out, *value.shape, num_states), value.dtype)
            for key, value in theta.items()}


CONV_RULES = ETPRules(
    xy_to_dw=conv_xy_to_dw,
    dt_to_t=conv_dt_to_t,
    init_drtrl=conv_init_drtrl,
    init_pp=functools.partial(zeros_like_output, dtype_of="kernel"),
    xy_to_trace=conv_xy_to_trace,
    trace_to_dw=conv_trace_to_dw,
    contract=conv_contract,
)
"""The convolution rules: traces per output position, scaled along ``(p, o)``."""

etp_conv_p, etp_conv_batched_p = register_pair(
    "etp_conv", _conv_impl, CONV_RULES, trainable_invars_fn=_conv_layout)


def _per_axis(name: str, value: int | Sequence[int] | None, num_spatial: int) -> tuple[int, ...]:
    """A stride or dilation as one positive int per spatial axis (``None`` means 1)."""
    value = 1 if value is None else value
    values = (value,) * num_spatial if isinstance(value, int) else tuple(value)
    if len(values) != num_spatial or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(
            f"braintrace.conv: {name}={value!r} must be a positive int or {num_spatial} "
            f"positive ints, one per spatial axis.")
    return values


def _explicit_padding(padding: Any, num_spatial: int) -> tuple[tuple[int, int], ...]:
    pads = [padding] * num_spatial if isinstance(padding, int) else list(padding)
    pairs = tuple((p, p) if isinstance(p, int) else tuple(p) for p in pads)
    if len(pairs) != num_spatial or not all(len(p) == 2 and all(isinstance(v, int) for v in p)
                                            for p in pairs):
        raise ValueError(
            f"braintrace.conv: padding={padding!r} must be 'SAME', 'VALID', 'SAME_LOWER', "
            f"'CIRCULAR', 'REFLECT', 'CAUSAL', an int, or {num_spatial} ints or (low, high) "
            "pairs, one per spatial axis.")
    return pairs


def _pad_input(x: jax.Array, padding: Any, window: Sequence[int],
               kernel_dilation: tuple[int, ...]) -> tuple[jax.Array, Any]:
    """Applies ``'CIRCULAR'``/``'REFLECT'``/``'CAUSAL'`` to ``x`` as :class:`flax.nnx.Conv`
    does (an input pad, then ``'VALID'``); returns ``x`` and the primitive's padding."""
    num_spatial = len(window)
    if not isinstance(padding, str):
        return x, _explicit_padding(padding, num_spatial)
    name = padding.upper()
    dilated = [(k - 1) * r + 1 for k, r in zip(window, kernel_dilation)]
    lead = [(0, 0)] * (x.ndim - num_spatial - 1)
    if name in INPUT_PADDINGS:
        pads = lead + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        return jnp.pad(x, pads, mode=INPUT_PADDINGS[name]), "VALID"
    if name == "CAUSAL":
        if num_spatial != 1:
            raise ValueError("braintrace.conv: padding='CAUSAL' is only defined for a 1-D "
                             f"convolution; this kernel has {num_spatial} spatial axes.")
        return jnp.pad(x, [*lead, (dilated[0] - 1, 0), (0, 0)]), "VALID"
    if name not in ("SAME", "VALID", "SAME_LOWER"):
        _explicit_padding(padding, num_spatial)  # raises with the accepted forms
    return x, name


def _check_shapes(x_shape: tuple[int, ...], kernel_shape: tuple[int, ...], groups: Any) -> None:
    num_spatial = len(kernel_shape) - 2
    if (num_spatial < 1 or len(x_shape) < num_spatial + 1 or not isinstance(groups, int)
            or groups < 1 or x_shape[-1] != kernel_shape[-2] * groups
            or kernel_shape[-1] % groups):
        raise ValueError(
            f"braintrace.conv: x of shape {x_shape} does not match kernel of shape "
            f"{kernel_shape} with feature_group_count={groups!r}; expected x (*batch, "
            "*spatial, C), kernel (*window, C // groups, O) with O divisible by groups.")


def conv(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    strides: int | Sequence[int] = 1,
    padding: str | int | Sequence[int | tuple[int, int]] = "SAME",
    input_dilation: int | Sequence[int] = 1,
    kernel_dilation: int | Sequence[int] = 1,
    feature_group_count: int = 1,
    precision: Any = None,
) -> jax.Array:
    """A channels-last convolution (as :class:`flax.nnx.Conv`) through the conv ETP primitive.

    ``x (*batch, *spatial, C)`` with the number of spatial axes that of the
    kernel, ``kernel (*window, C // G, O)``; ``x (*spatial, C)`` binds the
    per-sample primitive, any number of batch axes the batched one on the
    batch flattened. ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'`` padding pad
    the input before a ``'VALID'`` convolution, as Flax does.

    Args:
        x: Input ``(*batch, *spatial, C)``.
        kernel: Kernel ``(*window, C // feature_group_count, O)``.
        bias: Optional bias ``(O,)``.
        strides: Window strides, an int or one per spatial axis.
        padding: ``'SAME'``, ``'VALID'``, ``'SAME_LOWER'``, ``'CIRCULAR'``,
            ``'REFLECT'``, ``'CAUSAL'`` (1-D), an int, or one int or
            ``(low, high)`` pair per spatial axis.
        input_dilation: Input (lhs) dilation, an int or one per spatial axis.
        kernel_dilation: Kernel (rhs) dilation, an int or one per spatial axis.
        feature_group_count: ``G``: input and output channels split into ``G``
            groups, group ``g`` of the output reading only group ``g`` of the input.
        precision: ``jax.lax.Precision`` of the convolution.

    Returns:
        The output ``(*batch, *out, O)``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> y = braintrace.conv(jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4)), padding='VALID')
        >>> y.shape, float(y[0, 0, 0, 0])
        ((2, 3, 3, 4), 27.0)
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    _check_shapes(x.shape, kernel.shape, feature_group_count)
    num_spatial, groups = kernel.ndim - 2, feature_group_count
    kernel_dilation = _per_axis("kernel_dilation", kernel_dilation, num_spatial)
    x, pad = _pad_input(x, padding, kernel.shape[:-2], kernel_dilation)
    params = {"strides": _per_axis("strides", strides, num_spatial), "padding": pad,
              "input_dilation": _per_axis("input_dilation", input_dilation, num_spatial),
              "kernel_dilation": kernel_dilation, "feature_group_count": groups,
              "has_bias": bias is not None, "precision": precision}
    operands = [x, kernel] if bias is None else [x, kernel, jnp.asarray(bias)]
    if x.ndim == num_spatial + 1:
        return etp_conv_p.bind(*operands, **params)
    operands[0], lead = _with_batch(x, num_spatial)
    y = etp_conv_batched_p.bind(*operands, **params)
    return y.reshape(*lead, *y.shape[1:])
