"""Making an ETP primitive: every standard JAX rule derived from its implementation.

:func:`register_primitive` creates an :class:`~braintrace.ETPPrimitive` and
installs impl, abstract evaluation, lowering, JVP (transpose follows) and an
identity-preserving batching rule, all from one plain-JAX ``impl_fn``;
:func:`register_batched_counterpart` names the primitive that batching binds;
:func:`etp_primitives` lists every primitive made so far.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax.interpreters import ad, batching, mlir

from braintrace._primitives._core import ETPPrimitive, shape_struct
from braintrace._primitives._rules import ETPRules

__all__ = [
    "FALLBACK_SCOPE",
    "decomposed_in",
    "etp_primitives",
    "register_batched_counterpart",
    "register_pair",
    "register_primitive",
    "silent_fallback",
]

_REGISTRY: dict[str, ETPPrimitive] = {}

FALLBACK_SCOPE = "etp_fallback:"
"""The named scope (``jax.named_scope``) of the plain ops that a vmapped ETP primitive
without a batched counterpart is decomposed into, followed by the primitive's name."""

_SILENT_FALLBACK = contextvars.ContextVar("etp_silent_fallback", default=False)
"""Whether a vmapped ETP primitive's fallback warns nothing (:func:`silent_fallback`)."""


@contextlib.contextmanager
def silent_fallback() -> Iterator[None]:
    """Within the block, a vmapped ETP primitive's fallback does not warn by itself.

    Two places know better than the fallback whether its warning is true: the drivers'
    loops, which evaluate a step whose eligibility traces are compiled already (a
    ``jax.vmap`` of ``online_grad`` over stacked states or models loses nothing there),
    and the compiler, which finds the fallback's plain ops in the step it compiles by their
    named scope (:func:`decomposed_in`) and warns once, naming the module.

    Example:
        >>> import warnings, jax, jax.numpy as jnp
        >>> from braintrace._primitives import matmul, silent_fallback
        >>> with silent_fallback(), warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     jax.vmap(matmul)(jnp.ones((2, 3)), jnp.ones((2, 3, 4))).shape
        (2, 4)
    """
    token = _SILENT_FALLBACK.set(True)
    try:
        yield
    finally:
        _SILENT_FALLBACK.reset(token)


def register_primitive(
    name: str,
    impl_fn: Callable[..., Any],
    *,
    batched: bool = False,
    gradient_enabled: bool = False,
    trainable_invars_fn: Callable[[Mapping[str, Any]], dict[str, int]] | None = None,
    x_invar_index: int | None = 0,
    y_outvar_index: int = 0,
) -> ETPPrimitive:
    """Create an ETPPrimitive with all JAX rules auto-derived.

    Only the four ETP-specific rules need hand-writing: call the returned
    primitive's ``register_*`` methods. Installed automatically: impl, abstract
    evaluation (``jax.eval_shape`` of the impl), lowering (``mlir.lower_fun``),
    JVP (``jax.jvp`` of the impl; transpose follows) and an identity-preserving
    batching rule (see :func:`register_batched_counterpart`).

    Args:
        name: Primitive name (e.g. ``'etp_mm'``).
        impl_fn: Implementation ``impl_fn(*operands, **params)`` in plain JAX.
        batched: Whether this primitive operates on batched inputs.
        gradient_enabled: If True, the compiler evaluates this primitive when
            walking ``y -> h`` (identity-like ops such as the elementwise one).
        trainable_invars_fn: ``eqn.params -> {key: invar_index}`` declaring
            every trainable input; ``None`` means ``{'weight': 1}``, or
            ``{'weight': 0}`` when ``x_invar_index`` is ``None``.
        x_invar_index: Position of the input ``x`` in the operands, or ``None``
            for primitives with no external input.
        y_outvar_index: Position of the output ``y`` among the outputs.

    Returns:
        The registered primitive, an ordinary JAX op whatever its layout; the
        layout is checked when a model using it is compiled
        (:meth:`ETPPrimitive.check_layout`).

    Raises:
        TypeError: ``impl_fn`` or ``trainable_invars_fn`` is not callable.
        ValueError: An index is negative.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import braintrace
        >>> mm = braintrace.register_primitive(
        ...     'doc_mm', lambda x, w: x @ w,
        ...     trainable_invars_fn=lambda params: {'kernel': 1})
        >>> x, w = jnp.ones(3), jnp.ones((3, 2))
        >>> mm(x, w)
        Array([3., 3.], dtype=float32)
        >>> 'doc_mm' in str(jax.make_jaxpr(mm)(x, w))
        True
    """
    _check_arguments(name, impl_fn, trainable_invars_fn, x_invar_index, y_outvar_index)
    prim = ETPPrimitive(name, impl_fn, batched=batched, gradient_enabled=gradient_enabled,
                        trainable_invars_fn=trainable_invars_fn, x_invar_index=x_invar_index,
                        y_outvar_index=y_outvar_index)
    _install_jax_rules(prim)
    _REGISTRY[name] = prim
    return prim


def _check_arguments(name: str, impl_fn: Any, trainable_invars_fn: Any,
                     x_invar_index: int | None, y_outvar_index: int) -> None:
    if not callable(impl_fn):
        raise TypeError(
            f"register_primitive('{name}'): impl_fn must be callable, got "
            f"{type(impl_fn).__name__}.")
    if trainable_invars_fn is not None and not callable(trainable_invars_fn):
        raise TypeError(
            f"register_primitive('{name}'): trainable_invars_fn must be callable or None, "
            f"got {type(trainable_invars_fn).__name__}.")
    if x_invar_index is not None and x_invar_index < 0:
        raise ValueError(f"register_primitive('{name}'): x_invar_index must be >= 0 or None.")
    if y_outvar_index < 0:
        raise ValueError(f"register_primitive('{name}'): y_outvar_index must be >= 0.")


def _install_jax_rules(prim: ETPPrimitive) -> None:
    prim.def_impl(prim.impl_fn)
    prim.def_abstract_eval(functools.partial(_abstract_eval, prim))
    mlir.register_lowering(prim, functools.partial(_lowering, prim))
    ad.primitive_jvps[prim] = functools.partial(_jvp, prim)
    batching.primitive_batchers[prim] = functools.partial(_batch, prim)


def register_batched_counterpart(primitive: ETPPrimitive, batched_primitive: ETPPrimitive) -> None:
    """Declares the primitive bound when ``primitive`` is vmapped over ``x`` alone.

    Under ``jax.vmap`` with only ``x`` mapped, ``primitive`` is replaced by
    ``batched_primitive`` (same operands and params, batch axis of ``x`` moved
    to the front), so the operation stays visible to the compiler.

    Args:
        primitive: The per-sample primitive.
        batched_primitive: Its counterpart taking ``x`` with a leading batch axis.

    Example:
        >>> import warnings, jax, jax.numpy as jnp
        >>> import braintrace
        >>> f = lambda x, w: x @ w
        >>> one = braintrace.register_primitive('doc_one', f)
        >>> many = braintrace.register_primitive('doc_many', f, batched=True)
        >>> braintrace.register_batched_counterpart(one, many)
        >>> jaxpr = jax.make_jaxpr(jax.vmap(one, (0, None)))(jnp.ones((4, 3)), jnp.ones((3, 2)))
        >>> 'doc_many' in str(jaxpr)
        True
    """
    for p, role in ((primitive, "primitive"), (batched_primitive, "batched_primitive")):
        if not isinstance(p, ETPPrimitive):
            raise TypeError(
                f"register_batched_counterpart: {role} must be an ETPPrimitive made by "
                f"register_primitive, got {type(p).__name__}.")
    if primitive.x_invar_index is None:
        raise ValueError(
            f"register_batched_counterpart: '{primitive.name}' has no input x "
            "(x_invar_index=None), so it has nothing to batch over.")
    if batched_primitive.x_invar_index != primitive.x_invar_index:
        raise ValueError(
            f"register_batched_counterpart: '{primitive.name}' and '{batched_primitive.name}' "
            "must take x at the same operand position.")
    primitive.batched_counterpart = batched_primitive


def register_pair(
    name: str,
    impl_fn: Callable[..., Any],
    rules: ETPRules,
    *,
    trainable_invars_fn: Callable[[Mapping[str, Any]], dict[str, int]] | None = None,
) -> tuple[ETPPrimitive, ETPPrimitive]:
    """Registers a per-sample primitive and its batched counterpart, both with ``rules``.

    ``name`` takes ``x: (I,)`` and ``name + '_batched'`` takes ``x: (B, I)``;
    both run ``impl_fn`` (which must accept either) and declare the same
    trainable inputs. This is how the dense and LoRA primitives are made.

    Args:
        name: Name of the per-sample primitive.
        impl_fn: Implementation ``impl_fn(x, *operands, **params)``, ``x`` first.
        rules: The eligibility-trace rules of both primitives.
        trainable_invars_fn: As in :func:`register_primitive`.

    Returns:
        ``(per_sample, batched)``; vmapping ``per_sample`` over ``x`` binds ``batched``.

    Example:
        >>> from braintrace._primitives import ETPRules, register_pair, scale_output_axis
        >>> one, many = register_pair('doc_pair', lambda x, w: x @ w,
        ...                           ETPRules(dt_to_t=scale_output_axis))
        >>> many.name, many.batched, one.batched_counterpart is many
        ('doc_pair_batched', True, True)
        >>> many.has_rule('dt_to_t') and not many.has_rule('xy_to_dw')
        True
    """
    per_sample = register_primitive(name, impl_fn, trainable_invars_fn=trainable_invars_fn)
    batched = register_primitive(f"{name}_batched", impl_fn, batched=True,
                                 trainable_invars_fn=trainable_invars_fn)
    register_batched_counterpart(per_sample, batched)
    for prim in (per_sample, batched):
        prim.register_etp_rules(rules)
    return per_sample, batched


def etp_primitives() -> dict[str, ETPPrimitive]:
    """Returns every registered ETP primitive by name (latest registration wins).

    Example:
        >>> import braintrace
        >>> 'etp_dense' in braintrace.etp_primitives()
        True
    """
    return dict(_REGISTRY)


# -- auto-derived JAX rules ---------------------------------------------------


def _abstract_eval(prim: ETPPrimitive, *avals: Any, **params: Any) -> Any:
    structs = [shape_struct(a) for a in avals]
    out = jax.eval_shape(functools.partial(prim.impl_fn, **params), *structs)

    def to_aval(s: jax.ShapeDtypeStruct) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(s.shape, s.dtype, weak_type=s.weak_type)

    if prim.multiple_results:
        return [to_aval(s) for s in out]
    return to_aval(out)


def _lowering(prim: ETPPrimitive, ctx: Any, *args: Any, **params: Any) -> Any:
    lowered = mlir.lower_fun(prim.impl_fn, multiple_results=prim.multiple_results)
    return lowered(ctx, *args, **params)


def _jvp(prim: ETPPrimitive, primals: Any, tangents: Any, **params: Any) -> Any:
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    impl = functools.partial(prim.impl_fn, **params)
    primal_out, tangent_out = jax.jvp(impl, tuple(primals), tuple(tangents))
    if prim.multiple_results:
        return list(primal_out), list(tangent_out)
    return primal_out, tangent_out


def decomposed_in(name_stack: Any) -> tuple[str, ...]:
    """The ETP primitives whose batching fallback an equation of ``name_stack`` belongs to.

    Vmapped with more than ``x`` mapped, or with no batched counterpart, an ETP
    primitive is computed as ``jax.vmap`` of its impl, inside the named scope
    :data:`FALLBACK_SCOPE` + its name: the same values and derivatives, but
    plain ops, and a ``UserWarning`` that the weights drop out of
    eligibility-trace compilation. The compiler reads ``name_stack`` of the
    step it compiles and warns once per primitive, naming the module, also when
    an inner ``jit`` reused a trace made before (the fallback did not run
    then); the drivers' loops, which evaluate steps compiled already, and the
    compiler's own tracing keep the fallback silent (:func:`silent_fallback`).

    Args:
        name_stack: An equation's ``source_info.name_stack`` (or its string).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace._primitives import decomposed_in, matmul, silent_fallback
        >>> per_weight = jax.vmap(matmul)          # the weight mapped too: the fallback
        >>> with silent_fallback():                # (which would warn here)
        ...     jaxpr = jax.make_jaxpr(per_weight)(jnp.ones((2, 3)), jnp.ones((2, 3, 4)))
        >>> [decomposed_in(eqn.source_info.name_stack) for eqn in jaxpr.eqns]
        [('etp_dense',)]
    """
    return tuple(re.findall(re.escape(FALLBACK_SCOPE) + r"([^/()]+)", str(name_stack)))


def _batch(prim: ETPPrimitive, args: Any, dims: Any, **params: Any) -> Any:
    x_index = prim.x_invar_index
    has_x = x_index is not None and x_index < len(args)
    only_x_mapped = (
        has_x
        and dims[x_index] is not None
        and all(d is None for i, d in enumerate(dims) if i != x_index))
    counterpart = prim.batched_counterpart
    if only_x_mapped and counterpart is not None:
        args = list(args)
        args[x_index] = jax.numpy.moveaxis(args[x_index], dims[x_index], 0)
        out = counterpart.bind(*args, **params)
        out_dims = [0] * len(out) if counterpart.multiple_results else 0
        return out, out_dims
    if not _SILENT_FALLBACK.get():
        warnings.warn(
            f"ETP primitive '{prim.name}' is vmapped with no batched counterpart for these "
            "mapped operands, so it is decomposed into plain JAX ops: its weights drop out "
            "of eligibility-trace learning. Register a counterpart with "
            "braintrace.register_batched_counterpart, or map only x.",
            UserWarning,
            stacklevel=2,
        )
    # The scope lets the compiler find the plain ops in a step it compiles, also when the
    # fallback ran before (an inner ``jit`` reusing its trace), and warn then too.
    with jax.named_scope(FALLBACK_SCOPE + prim.name):
        out = jax.vmap(functools.partial(prim.impl_fn, **params), in_axes=tuple(dims))(*args)
    if prim.multiple_results:
        return list(out), [0] * len(out)
    return out, 0
