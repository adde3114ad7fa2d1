"""The einsum ETP primitive: ``y = einsum(spec, x, kernel) (+ bias)`` with the kernel as given.

The trainable operand is the kernel in its own shape (``nnx.Einsum``'s or
``nnx.LinearGeneral``'s), so the compiler traces it back to the Param with no
reshape in between. Registered as ``etp_einsum`` (per sample) and
``etp_einsum_batched`` (a leading batch axis on ``x`` and ``y``).

The equation parameter ``spec = "X,K->Y"`` is the per-sample contraction, one
letter per axis. The rules hold when every axis of ``y`` is an axis of the
kernel (``Y ⊆ K``: per sample, each kernel entry feeds exactly one output
unit) and every kernel axis is an axis of ``x`` or ``y``. Axes of ``x`` and
``y`` that the kernel lacks are batch axes: :func:`einsum` moves them to the
leading batch axis before binding.

Rules (per sample, cotangent ``d`` shaped like ``y``; ``d↑K`` is ``d`` laid out
along ``K``'s axes, size 1 where ``K`` has an axis ``y`` lacks):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dK = \\mathrm{einsum}(X, Y \\to K;\\; x, d),
    \\qquad db = \\mathrm{reshape}(d, b.\\mathrm{shape})

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon_K \\mapsto \\epsilon_K \\odot d{\\uparrow}K,
    \\qquad \\epsilon_b \\mapsto \\epsilon_b \\odot \\mathrm{reshape}(d, b.\\mathrm{shape})

The D-RTRL trace is shaped like the kernel (and the bias), ``(*K, S)`` per sample.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import ETPRules, zeros_like_output, zeros_like_params

__all__ = ["EINSUM_RULES", "einsum", "etp_einsum_batched_p", "etp_einsum_p", "split_spec"]


def split_spec(spec: str) -> tuple[str, str, str]:
    """``"X,K->Y"`` as ``(X, K, Y)``, spaces removed.

    Example:
        >>> from braintrace._primitives._einsum import split_spec
        >>> split_spec("nta, hab -> nthb")
        ('nta', 'hab', 'nthb')
    """
    spec = spec.replace(" ", "")
    if spec.count("->") != 1 or spec.count(",") != 1:
        raise ValueError(f"einsum string '{spec}' must have the form 'x,kernel->y' with exactly "
                         "two operands (the input, then the kernel) and an explicit '->'.")
    inputs, y = spec.split("->")
    x, kernel = inputs.split(",")
    return x, kernel, y


def _check_per_sample(x: str, kernel: str, y: str, spec: str) -> None:
    """Raises unless ``Y ⊆ K``, ``X ⊆ K`` and ``K ⊆ X ∪ Y``, letters only, none repeated."""
    for labels in (x, kernel, y):
        if not labels.isalpha() and labels:
            raise ValueError(f"einsum string '{spec}': use one letter per axis ('...' only "
                             "leading, for batch axes).")
        if len(set(labels)) != len(labels):
            raise ValueError(f"einsum string '{spec}': an operand repeats an axis letter "
                             f"('{labels}'); traces need each axis once.")
    problems = [(set(x) - set(kernel) - set(y), "input axes summed without a weight"),
                (set(kernel) - set(x) - set(y), "kernel axes summed without an input"),
                (set(y) - set(kernel), "output axes the kernel lacks")]
    for labels, what in problems:
        if labels:
            raise ValueError(
                f"einsum string '{spec}' is not supported by the ETP einsum: it has {what} "
                f"({', '.join(sorted(labels))}). Every output axis must be a kernel axis or a "
                "leading batch axis of the input, and every kernel axis an input or output "
                "axis; sum or broadcast such axes outside the layer.")


def _einsum_impl(x, kernel, *bias, spec: str, has_bias: bool, precision):
    del has_bias
    xs, ks, ys = split_spec(spec)
    y = jnp.einsum(f"...{xs},{ks}->...{ys}", x, kernel, precision=precision)
    if bias:
        y = y + bias[0].reshape(y.shape[y.ndim - len(ys):])
    return y


def _einsum_layout(params) -> dict[str, int]:
    return {"kernel": 1, "bias": 2} if params["has_bias"] else {"kernel": 1}


def _as_bias(d: jax.Array, num_y_axes: int, bias_shape: tuple[int, ...]) -> jax.Array:
    """``d (..., *Y)`` reshaped to ``(..., *bias_shape)``."""
    return d.reshape(*d.shape[:d.ndim - num_y_axes], *bias_shape)


def _along_kernel(d: jax.Array, ys: str, ks: str) -> jax.Array:
    """``d (..., *Y)`` laid out along the kernel's axes: ``(..., *K)``, size 1 off ``Y``."""
    in_kernel_order = "".join(c for c in ks if c in ys)
    d = jnp.einsum(f"...{ys}->...{in_kernel_order}", d) if in_kernel_order != ys else d
    lead = d.shape[:d.ndim - len(ys)]
    sizes = dict(zip(in_kernel_order, d.shape[len(lead):], strict=True))
    return d.reshape(*lead, *(sizes.get(c, 1) for c in ks))


def einsum_xy_to_dw(x, d, theta, *, spec: str, **params) -> dict[str, jax.Array]:
    """Pullback at ``(x, θ)``: ``dK = einsum(X,Y->K)`` and the bias, leading axes summed."""
    del params
    xs, ks, ys = split_spec(spec)
    kernel = theta["kernel"]
    grads = {"kernel": jnp.einsum(f"...{xs},...{ys}->{ks}", x, d.astype(kernel.dtype)
                                  ).astype(kernel.dtype)}
    if "bias" in theta:
        bias = theta["bias"]
        total = d.reshape(-1, math.prod(d.shape[d.ndim - len(ys):])).sum(0)
        grads["bias"] = total.reshape(bias.shape).astype(bias.dtype)
    return grads


def einsum_dt_to_t(d, trace, *, spec: str, **params) -> dict[str, jax.Array]:
    """``ε_K ⊙ d↑K`` and ``ε_b ⊙ reshape(d, b.shape)``."""
    del params
    _, ks, ys = split_spec(spec)
    out = {}
    for key, value in trace.items():
        if key == "kernel":
            out[key] = value * _along_kernel(d, ys, ks)
        else:
            out[key] = value * _as_bias(d, len(ys), value.shape[d.ndim - len(ys):])
    return out


def einsum_contract(d, trace, *, spec: str, **params) -> dict[str, jax.Array]:
    """``Σ_lead einsum_dt_to_t(d, trace)``: one einsum per key."""
    del params
    _, ks, ys = split_spec(spec)
    out = {}
    for key, value in trace.items():
        if key == "kernel":
            out[key] = jnp.einsum(f"...{ks},...{ys}->{ks}", value, d.astype(value.dtype))
        else:
            shape = value.shape[d.ndim - len(ys):]
            scaled = value * _as_bias(d, len(ys), shape).astype(value.dtype)
            out[key] = scaled.reshape(-1, *shape).sum(0)
    return out


EINSUM_RULES = ETPRules(
    xy_to_dw=einsum_xy_to_dw,
    dt_to_t=einsum_dt_to_t,
    init_drtrl=zeros_like_params,
    init_pp=functools.partial(zeros_like_output, dtype_of="kernel"),
    contract=einsum_contract,
)
"""The einsum rules: traces shaped like the kernel and bias, scaled at the unit each entry feeds."""

etp_einsum_p, etp_einsum_batched_p = register_pair(
    "etp_einsum", _einsum_impl, EINSUM_RULES, trainable_invars_fn=_einsum_layout)


def _batch_labels(xs: str, ks: str, ys: str) -> str:
    """Axes of ``x`` and ``y`` that the kernel lacks, in ``y``'s order."""
    return "".join(c for c in ys if c in xs and c not in ks)


def _expand_ellipsis(xs: str, ys: str, ndim: int, spec: str) -> tuple[str, str]:
    """``'...'`` replaced by fresh upper-case letters; only a leading one is accepted."""
    if "..." not in xs and "..." not in ys:
        return xs, ys
    if not (xs.startswith("...") and ys.startswith("...")) or xs.count(".") != 3:
        raise ValueError(f"einsum string '{spec}': '...' is accepted only at the start of both "
                         "the input and the output (leading batch axes).")
    count = ndim - (len(xs) - 3)
    fresh = "".join(chr(ord("A") + i) for i in range(count))
    return fresh + xs[3:], fresh + ys[3:]


def einsum(spec: str, x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
           precision=None) -> jax.Array:
    """``einsum(spec, x, kernel) + bias`` as one ETP op, the kernel kept in its own shape.

    Axes of ``x`` that also appear in the output but not in the kernel are
    batch axes; they must lead the output (e.g. ``'nta,hab->nthb'``: ``n, t``
    are batch axes). The bias, if any, has as many entries as one sample's
    output (the output axes the kernel has, in output order), as in
    :class:`flax.nnx.Einsum`.

    Args:
        spec: ``'x,kernel->y'``, one letter per axis; a leading ``'...'`` on
            the input and output stands for batch axes.
        x: The input.
        kernel: The trainable kernel.
        bias: Optional bias.
        precision: ``jax.lax.Precision`` of the contraction.

    Returns:
        The output, shaped as ``spec`` says.

    Raises:
        ValueError: ``spec`` has axes the rules cannot trace (an input axis
            summed without a weight, a kernel axis summed without an input,
            batch axes that do not lead the output), or a shape does not fit.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> braintrace.einsum('nta,hab->nthb', jnp.ones((2, 5, 3)), jnp.ones((4, 3, 6))).shape
        (2, 5, 4, 6)
        >>> braintrace.einsum('ab,bc->c', jnp.ones((2, 3)), jnp.ones((3, 4)))
        Traceback (most recent call last):
        ...
        ValueError: einsum string 'ab,bc->c' is not supported by the ETP einsum: it has input ...
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    xs, ks, ys = split_spec(spec)
    xs, ys = _expand_ellipsis(xs, ys, x.ndim, spec)
    batch = _batch_labels(xs, ks, ys)
    if ys[:len(batch)] != batch:
        raise ValueError(f"einsum string '{spec}': the batch axes ({batch}) must lead the "
                         "output; transpose the output after the layer instead.")
    x_rest, y_rest = "".join(c for c in xs if c not in batch), ys[len(batch):]
    _check_per_sample(x_rest, ks, y_rest, spec)
    if x.ndim != len(xs) or kernel.ndim != len(ks):
        raise ValueError(f"einsum string '{spec}' does not fit x of shape {x.shape} and kernel "
                         f"of shape {kernel.shape}.")
    sizes = dict(zip(xs, x.shape, strict=True))
    y_shape = tuple(sizes[c] if c in sizes else kernel.shape[ks.index(c)] for c in y_rest)
    operands = [jnp.einsum(f"{xs}->{batch}{x_rest}", x) if batch else x, kernel]
    if bias is not None:
        if math.prod(jnp.shape(bias)) != math.prod(y_shape):
            raise ValueError(f"einsum bias of shape {jnp.shape(bias)} does not fit one sample's "
                             f"output {y_shape} (axes '{y_rest}') of '{spec}'.")
        operands.append(jnp.asarray(bias))
    params = {"spec": f"{x_rest},{ks}->{y_rest}", "has_bias": bias is not None,
              "precision": precision}
    if not batch:
        return etp_einsum_p.bind(*operands, **params)
    batch_shape = tuple(sizes[c] for c in batch)
    operands[0] = operands[0].reshape(-1, *operands[0].shape[len(batch):])
    y = etp_einsum_batched_p.bind(*operands, **params)
    return y.reshape(*batch_shape, *y.shape[1:])
