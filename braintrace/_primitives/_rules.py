"""The eligibility-trace rules of a primitive, as one record, and the rules shared by primitives.

A primitive computes ``y = f(x, θ)`` with ``θ = {key: array}``; "per sample"
means without the batch axis, and a hidden group has ``S`` states per unit.
Its rules (:class:`ETPRules`) tell the algorithms how to build eligibility
traces for ``θ`` without differentiating ``f`` at run time.

The rules below are the ones several built-in primitives share, written once:
a trace that keeps ``y``'s output axis last (dense, LoRA) or is shaped like the
hidden group itself (elementwise) is scaled by a ``y``-shaped vector with
:func:`scale_output_axis`, and contracted with a learning signal by
:func:`output_axis_contract`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._platform import by_platform

__all__ = [
    "RULE_NAMES",
    "ETPRules",
    "outer_sum",
    "output_axis_contract",
    "scale_output_axis",
    "sum_leading",
    "zeros_like_output",
    "zeros_like_params",
]

Rule = Callable[..., Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ETPRules:
    """The eligibility-trace rules of one primitive; a field left ``None`` is not registered.

    Attributes:
        xy_to_dw: ``xy_to_dw(x, d, θ, **params) -> {key: dθ}``: the pullback of
            ``f`` at ``(x, θ)`` with output cotangent ``d``, ``∂⟨d, f(x, θ)⟩/∂θ``;
            leading (batch) axes of ``x`` and ``d`` are summed.
        dt_to_t: ``dt_to_t(d, trace, **params) -> trace``: a per-sample trace
            scaled by a ``y``-shaped vector ``d`` through the ``y``↔trace
            adjacency (dense: ``trace[i, o]·d[o]``).
        init_drtrl: ``init_drtrl(x, y, θ, num_states) -> {key: zeros}``: the
            per-sample D-RTRL trace, a trailing axis of ``S`` states.
        init_pp: ``init_pp(x, y, θ, num_states) -> zeros``: the per-sample
            IO-dim output-side trace, ``(*y.shape, S)``.
        xy_to_trace: Optional. ``xy_to_trace(x, d, θ, **params) -> trace``: the
            instantaneous D-RTRL term of a trace that is not shaped like ``θ``
            (LoRA's ``lora_a``); without it, ``xy_to_dw``.
        trace_to_dw: Optional. ``trace_to_dw(g, θ, **params) -> {key: dθ}``: a
            contracted trace mapped to the gradient; without it, the identity.
        contract: Optional. ``contract(d, trace, **params) -> trace``: the
            closed form of ``Σ_lead dt_to_t(d, trace)``, a trace contracted with
            a signal and summed over the leading axes they share.

    Example:
        >>> from braintrace._primitives import ETPRules, scale_output_axis
        >>> rules = ETPRules(dt_to_t=scale_output_axis)
        >>> rules.registered()
        ('dt_to_t',)
        >>> rules.merged(ETPRules(contract=len)).registered()
        ('dt_to_t', 'contract')
        >>> ETPRules(init_pp='zeros')
        Traceback (most recent call last):
        ...
        TypeError: rule 'init_pp' must be callable, got str.
    """

    xy_to_dw: Rule | None = None
    dt_to_t: Rule | None = None
    init_drtrl: Rule | None = None
    init_pp: Rule | None = None
    xy_to_trace: Rule | None = None
    trace_to_dw: Rule | None = None
    contract: Rule | None = None

    def __post_init__(self) -> None:
        for name in RULE_NAMES:
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"rule '{name}' must be callable, got {type(fn).__name__}.")

    def registered(self) -> tuple[str, ...]:
        """Names of the rules this record sets, in field order."""
        return tuple(name for name in RULE_NAMES if getattr(self, name) is not None)

    def source(self, name: str) -> str | None:
        """The registered rule that serves ``name``: ``name`` itself, or its default.

        The optional rules default to others: ``xy_to_trace`` to ``xy_to_dw``,
        ``contract`` (on one sample) to ``dt_to_t``; ``trace_to_dw`` to the
        identity (``None`` here). A required rule that is not set has no source
        (``None``).

        Example:
            >>> from braintrace import ETPRules
            >>> rules = ETPRules(xy_to_dw=lambda x, d, theta: {})
            >>> rules.source('xy_to_trace'), rules.source('xy_to_dw'), rules.source('dt_to_t')
            ('xy_to_dw', 'xy_to_dw', None)
        """
        if getattr(self, name) is not None:
            return name
        default = _DEFAULTS.get(name)
        return None if default is None else self.source(default)

    def resolved(self, name: str) -> Rule:
        """The rule ``name``, or the rule its default stands for (module docstring of
        :meth:`source`); ``trace_to_dw`` defaults to the identity.

        Raises:
            LookupError: Neither ``name`` nor its default is registered.

        Example:
            >>> from braintrace import ETPRules
            >>> ETPRules().resolved('trace_to_dw')({'kernel': 1.0}, {})
            {'kernel': 1.0}
        """
        if name == "trace_to_dw" and self.trace_to_dw is None:
            return _identity_to_dw
        source = self.source(name)
        if source is None:
            raise LookupError(f"rule '{name}' is not registered (nor a default for it).")
        return getattr(self, source)

    def merged(self, update: ETPRules) -> ETPRules:
        """This record with every rule that ``update`` sets replaced by ``update``'s."""
        return dataclasses.replace(self, **{name: getattr(update, name)
                                            for name in update.registered()})


RULE_NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(ETPRules))
"""Every rule an ETP primitive can carry, in :class:`ETPRules` field order."""

_DEFAULTS = {"xy_to_trace": "xy_to_dw", "contract": "dt_to_t"}
"""The rule an optional rule defaults to."""


def _identity_to_dw(g: Any, theta: dict[str, jax.Array], **params: Any) -> dict[str, Any]:
    """``trace_to_dw``'s default: a contracted trace already shaped like ``θ`` is the gradient."""
    del theta, params
    return dict(g)


# -- rules shared by several primitives ---------------------------------------------------


def scale_output_axis(d: jax.Array, trace: dict[str, jax.Array], **params: Any
                      ) -> dict[str, jax.Array]:
    """The ``dt_to_t`` of traces whose trailing axes are ``y``'s: ``ε[..., o] · d[o]``.

    Dense and LoRA traces end with the output axis; the elementwise trace is
    shaped like the hidden group ``y`` feeds. Either way ``d`` broadcasts
    against the trace from the right.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives import scale_output_axis
        >>> scale_output_axis(jnp.array([1.0, 2.0]), {'kernel': jnp.ones((3, 2))})['kernel']
        Array([[1., 2.],
               [1., 2.],
               [1., 2.]], dtype=float32)
    """
    del params
    return {key: value * d for key, value in trace.items()}


def output_axis_contract(d: jax.Array, trace: dict[str, jax.Array], **params: Any
                         ) -> dict[str, jax.Array]:
    """``Σ_{lead} scale_output_axis(d, trace)`` as one einsum per key (the ``contract`` rule).

    ``d`` is ``(*lead, O)``, each trace ``(*lead, O)`` or ``(*lead, X, O)``;
    the shared leading (batch) axes are summed.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives import output_axis_contract
        >>> d, trace = jnp.ones((4, 2)), {'kernel': jnp.ones((4, 3, 2))}
        >>> output_axis_contract(d, trace)['kernel'].shape
        (3, 2)
    """
    del params
    out = {}
    for key, value in trace.items():
        spec = "...o,...o->o" if value.ndim == d.ndim else "...xo,...o->xo"
        out[key] = jnp.einsum(spec, value, d.astype(value.dtype))
    return out


def outer_sum(x: jax.Array, d: jax.Array) -> jax.Array:
    """``Σ_lead x[..., i] d[..., o]``; per sample a broadcast product XLA can fuse.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives import outer_sum
        >>> outer_sum(jnp.ones((4, 3)), jnp.ones((4, 2))).tolist()
        [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
    """
    if x.ndim == 1 and d.ndim == 1:
        return x[:, None] * d[None, :]
    return jnp.einsum("...i,...o->io", x, d)


def sum_leading(d: jax.Array) -> jax.Array:
    """``d`` summed over every axis but the last: the gradient of a bias added to ``y``.

    On the CPU computed as ``1ᵀ d`` (a matrix-vector product at full precision): XLA:CPU's
    reduce over the leading axis of a wide ``(R, N)`` value is far slower (``(96, 131072)``:
    59 ms against 1.1 ms; ``(16, 768)``: 75 against 35 µs). Elsewhere a plain reduction
    (``platform.by_platform``), which accelerators run as vector adds.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace.primitives import sum_leading
        >>> sum_leading(jnp.arange(12.0).reshape(2, 2, 3))
        Array([18., 22., 26.], dtype=float32)
    """
    rows = d.reshape(-1, d.shape[-1])
    return by_platform(cpu=lambda rows: jnp.matmul(jnp.ones((rows.shape[0],), rows.dtype), rows,
                                                   precision=jax.lax.Precision.HIGHEST),
                       accelerator=lambda rows: jnp.sum(rows, axis=0))(rows)


def zeros_like_params(x: Any, y: Any, theta: dict[str, jax.Array], num_states: int
                      ) -> dict[str, jax.Array]:
    """The ``init_drtrl`` of traces shaped like ``θ``: ``(*θ_key.shape, S)`` zeros per key."""
    del x, y
    return {key: jnp.zeros((*value.shape, num_states), value.dtype) for key, value in theta.items()}


def zeros_like_output(x: Any, y: Any, theta: dict[str, jax.Array], num_states: int, *,
                      dtype_of: str) -> jax.Array:
    """The ``init_pp`` of every built-in: ``(*y.shape, S)`` zeros in ``θ[dtype_of]``'s dtype.

    Bind ``dtype_of`` with :func:`functools.partial` to get the rule.
    """
    del x
    return jnp.zeros((*jnp.shape(y), num_states), theta[dtype_of].dtype)
