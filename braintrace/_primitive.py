"""ETP primitives: JAX primitives that mark an operation as learning online.

An ETP primitive computes an ordinary function ``y = f(x, θ)``. Its *identity*
is what matters: the compiler recognises its equations in a model step's jaxpr
and builds eligibility traces for its trainable inputs ``θ``. Every standard
JAX rule (impl, abstract evaluation, lowering, JVP, transpose, batching) is
derived from a plain implementation function; only the four eligibility-trace
rules are written by hand.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core as jex_core
from jax.interpreters import ad, batching, mlir

__all__ = [
    "ETPPrimitive",
    "MissingRuleError",
    "etp_primitives",
    "register_batched_counterpart",
    "register_primitive",
]

RULE_NAMES = ("dt_to_t", "xy_to_dw", "init_drtrl", "init_pp")
"""The eligibility-trace rules an ETP primitive can carry."""

TRACE_SPACE_RULE_NAMES = ("xy_to_trace", "trace_to_dw")
"""Optional rules for primitives whose D-RTRL trace is not shaped like ``θ``."""

FAST_RULE_NAMES = ("contract",)
"""Optional closed-form versions of what the algorithms otherwise build from ``dt_to_t``."""

_REGISTRY: dict[str, ETPPrimitive] = {}


class MissingRuleError(LookupError):
    """An algorithm needs an ETP rule that the primitive never registered.

    Example:
        >>> import braintrace
        >>> p = braintrace.register_primitive('doc_norules', lambda x, w: x * w)
        >>> try:
        ...     p.rule('dt_to_t')
        ... except braintrace.MissingRuleError as err:
        ...     print('dt_to_t' in str(err))
        True
    """


class ETPPrimitive(jex_core.Primitive):
    """A JAX primitive whose equations the eligibility-trace compiler recognises.

    Create one with :func:`register_primitive`, then attach its trace rules
    with :meth:`register_etp_rules` (or the single-rule ``register_*`` methods).

    Attributes:
        impl_fn: The plain-JAX implementation ``impl_fn(*operands, **params)``.
        batched: Whether the primitive's ``x`` carries a leading batch axis.
        gradient_enabled: Whether the compiler may differentiate through the
            primitive when walking from an output to hidden states.
        x_invar_index: Operand position of the input ``x``, or ``None``.
        y_outvar_index: Output position of ``y``.
        batched_counterpart: The primitive bound when only ``x`` is vmapped.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import braintrace
        >>> scale = braintrace.register_primitive(
        ...     'doc_scale', lambda x, w: x * w)
        >>> float(scale(jnp.float32(2.0), jnp.float32(3.0)))
        6.0
        >>> float(jax.grad(lambda w: scale(2.0, w))(3.0))
        2.0
    """

    def __init__(
        self,
        name: str,
        impl_fn: Callable[..., Any],
        *,
        batched: bool,
        gradient_enabled: bool,
        trainable_invars_fn: Callable[[Mapping[str, Any]], dict[str, int]] | None,
        x_invar_index: int | None,
        y_outvar_index: int,
    ):
        super().__init__(name)
        self.impl_fn = impl_fn
        self.batched = batched
        self.gradient_enabled = gradient_enabled
        self.x_invar_index = x_invar_index
        self.y_outvar_index = y_outvar_index
        self.batched_counterpart: ETPPrimitive | None = None
        self._trainable_invars_fn = trainable_invars_fn
        self._rules: dict[str, Callable[..., Any]] = {}
        self._multiple_results: bool | None = None

    # -- binding -----------------------------------------------------------

    def __call__(self, *operands: Any, **params: Any) -> Any:
        """Binds the primitive; same as :meth:`bind`."""
        return self.bind(*operands, **params)

    def bind(self, *operands: Any, **params: Any) -> Any:
        """Binds the primitive, whatever its declared layout.

        The layout (``x_invar_index``, ``y_outvar_index``, the trainable
        inputs) is checked only where the compiler uses it, by
        :meth:`check_layout`: a primitive is an ordinary JAX op everywhere else.
        """
        if self._multiple_results is None:
            structs = [_struct(jax.typeof(a)) for a in operands]
            out = jax.eval_shape(functools.partial(self.impl_fn, **params), *structs)
            multiple = isinstance(out, (tuple, list))
            self._multiple_results = multiple
            self.multiple_results = multiple
        out = super().bind(*operands, **params)
        # Eager execution returns whatever impl_fn returns, traced execution a
        # list: give multiple outputs one type everywhere.
        return tuple(out) if self.multiple_results else out

    # -- layout ------------------------------------------------------------

    def trainable_invars(self, params: Mapping[str, Any]) -> dict[str, int]:
        """Returns ``{key: operand_index}`` of the trainable inputs for ``params``.

        Args:
            params: The equation parameters (``eqn.params``).

        Returns:
            The layout declared by ``trainable_invars_fn``. Without one, the
            single trainable input follows ``x``: ``{'weight': 1}``, or
            ``{'weight': 0}`` for a primitive with no input
            (``x_invar_index=None``), whose only operand is the weight.

        Example:
            >>> import jax.numpy as jnp
            >>> import braintrace
            >>> p = braintrace.register_primitive('doc_layout', lambda x, w: x * w)
            >>> p.trainable_invars({})
            {'weight': 1}
            >>> gain = braintrace.register_primitive(
            ...     'doc_layout_gain', lambda w: jnp.exp(-w), x_invar_index=None)
            >>> gain.trainable_invars({})
            {'weight': 0}
        """
        if self._trainable_invars_fn is None:
            return {"weight": 1 if self.x_invar_index is not None else 0}
        return dict(self._trainable_invars_fn(params))

    def check_layout(self, eqn: jex_core.JaxprEqn) -> None:
        """Checks that the declared layout fits an equation of this primitive.

        The compiler calls this on every ETP equation of a traced step before
        reading ``x``, ``y`` and the trainable inputs by position. Binding,
        ``jit``, ``grad``, ``jvp`` and ``vmap`` work whatever the layout
        (``vmap`` falls back to ``jax.vmap`` of the impl, with a warning, when
        ``x`` is not one of the operands), so they never check it.

        Args:
            eqn: An equation whose primitive is ``self``.

        Raises:
            ValueError: ``x_invar_index`` or a trainable input's index is not
                one of the equation's operands, a trainable input is the input
                ``x``, or ``y_outvar_index`` is not one of its outputs. The
                message names the primitive, the key and the index.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> import braintrace
            >>> p = braintrace.register_primitive(
            ...     'doc_check', lambda x, w: x * w,
            ...     trainable_invars_fn=lambda params: {'kernel': 2})
            >>> float(p(2.0, 3.0))  # an ordinary op, whatever the layout
            6.0
            >>> eqn = jax.make_jaxpr(p)(2.0, 3.0).jaxpr.eqns[0]
            >>> p.check_layout(eqn)
            Traceback (most recent call last):
            ...
            ValueError: ETP primitive 'doc_check': trainable input 'kernel' has index 2, ...
        """
        num_operands, num_outputs = len(eqn.invars), len(eqn.outvars)
        operands = f"the {num_operands} operand(s) of its equation"
        x_index = self.x_invar_index
        if x_index is not None and not x_index < num_operands:
            raise ValueError(
                f"ETP primitive '{self.name}': x_invar_index={x_index} is outside {operands}. "
                "Register it with the position of x among the operands, or with "
                "x_invar_index=None if it has no input.")
        if not self.y_outvar_index < num_outputs:
            raise ValueError(
                f"ETP primitive '{self.name}': y_outvar_index={self.y_outvar_index} is "
                f"outside the {num_outputs} output(s) of its impl_fn. Register it with the "
                "position of y among the outputs.")
        for key, index in self.trainable_invars(eqn.params).items():
            if not isinstance(index, numbers.Integral) or not 0 <= index < num_operands:
                raise ValueError(
                    f"ETP primitive '{self.name}': trainable input '{key}' has index "
                    f"{index!r}, outside {operands}. Fix its trainable_invars_fn so that "
                    f"every index is an operand position (0 to {num_operands - 1}).")
            if index == x_index:
                raise ValueError(
                    f"ETP primitive '{self.name}': trainable input '{key}' has index "
                    f"{index}, which is the input x (x_invar_index={x_index}). Fix its "
                    "trainable_invars_fn so that a trainable input is another operand.")

    # -- eligibility-trace rules -------------------------------------------

    def register_dt_to_t(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``dt_to_t(d, trace, **params) -> trace``; returns ``fn``."""
        return self._register_rule("dt_to_t", fn)

    def register_xy_to_dw(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``xy_to_dw(x, d, θ, **params) -> {key: dθ}``; returns ``fn``."""
        return self._register_rule("xy_to_dw", fn)

    def register_init_drtrl(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``init_drtrl(x, y, θ, num_states) -> {key: zeros}``; returns ``fn``."""
        return self._register_rule("init_drtrl", fn)

    def register_init_pp(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Registers ``init_pp(x, y, θ, num_states) -> zeros``; returns ``fn``."""
        return self._register_rule("init_pp", fn)

    def register_trace_space_rules(
        self,
        *,
        xy_to_trace: Callable[..., Any],
        trace_to_dw: Callable[..., Any],
    ) -> None:
        """Registers rules for a D-RTRL trace that is not shaped like ``θ``.

        Most primitives keep a D-RTRL trace shaped like each trainable input and
        need none of this. A primitive whose output axis is missing from some
        trainable input (LoRA's ``lora_a``) keeps that input's trace in another
        space instead, and says how to enter and leave it:

        * ``xy_to_trace(x, d, θ, **params) -> trace``: the instantaneous trace
          term, shaped like :meth:`init_drtrl`'s trace without the state axis.
        * ``trace_to_dw(g, θ, **params) -> {key: dθ}``: maps a contracted trace
          ``g`` (``dt_to_t(δ, ε)`` summed over states) to the gradient.

        Without them, ``xy_to_trace`` is ``xy_to_dw`` and ``trace_to_dw`` is the
        identity.
        """
        self._register_rule("xy_to_trace", xy_to_trace)
        self._register_rule("trace_to_dw", trace_to_dw)

    def register_etp_rules(
        self,
        *,
        dt_to_t: Callable[..., Any] | None = None,
        xy_to_dw: Callable[..., Any] | None = None,
        init_drtrl: Callable[..., Any] | None = None,
        init_pp: Callable[..., Any] | None = None,
    ) -> None:
        """Registers several ETP rules at once; ``None`` leaves a rule unchanged."""
        given = {"dt_to_t": dt_to_t, "xy_to_dw": xy_to_dw, "init_drtrl": init_drtrl,
                 "init_pp": init_pp}
        for name, fn in given.items():
            if fn is not None:
                self._register_rule(name, fn)

    def _register_rule(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(
                f"ETP primitive '{self.name}': rule '{name}' must be callable, got "
                f"{type(fn).__name__}.")
        self._rules[name] = fn
        return fn

    def register_contract(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Registers a closed-form ``contract(d, trace, **params) -> trace``; returns ``fn``.

        ``contract`` must equal ``Σ_{lead} dt_to_t(d, trace)``: one state's trace
        (``(*lead, *θ)``) contracted with a signal ``d`` (``(*lead, *y)``) and
        summed over the leading (batch) axes they share. Without it, the
        algorithms build the same sum from ``dt_to_t``; with it, one einsum
        replaces a materialised product and a reduction over the batch axis.
        """
        return self._register_rule("contract", fn)

    def has_rule(self, name: str) -> bool:
        """Whether the rule ``name`` was registered."""
        return name in self._rules

    def rule(self, name: str) -> Callable[..., Any]:
        """Returns the registered rule ``name``.

        Raises:
            MissingRuleError: The rule was never registered; the message names
                the primitive, the rule and the method that registers it.
        """
        if name not in RULE_NAMES + TRACE_SPACE_RULE_NAMES + FAST_RULE_NAMES:
            raise ValueError(f"Unknown ETP rule '{name}'; known rules: "
                             f"{RULE_NAMES + TRACE_SPACE_RULE_NAMES + FAST_RULE_NAMES}.")
        try:
            return self._rules[name]
        except KeyError:
            raise MissingRuleError(
                f"ETP primitive '{self.name}' has no '{name}' rule, which this algorithm "
                f"needs. Register it with `{self.name}_p.register_{name}(fn)` or "
                "`register_etp_rules(...)`, or choose an algorithm that does not need it."
            ) from None


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    """An abstract value as a struct for ``jax.eval_shape``, keeping weak types.

    Dropping ``weak_type`` would make a Python-scalar operand promote like a
    strongly typed array (``2.0 * float32`` declared float64 under x64) while
    the lowered impl keeps float32.
    """
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


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
    primitive's ``register_*`` methods.

    The standard JAX rules are installed automatically: impl (eager execution),
    abstract_eval (``jax.eval_shape`` of the impl), lowering
    (``mlir.lower_fun`` of the impl), JVP (``jax.jvp`` of the impl), transpose
    (derived by JAX from the JVP) and an identity-preserving batching rule (see
    :func:`register_batched_counterpart`).

    Args:
        name: Primitive name (e.g. ``'etp_mm'``).
        impl_fn: Implementation ``impl_fn(*operands, **params)`` in plain JAX.
        batched: Whether this primitive operates on batched inputs.
        gradient_enabled: If True, the compiler evaluates this primitive when
            walking ``y -> h`` (identity-like ops such as the elementwise one).
        trainable_invars_fn: ``eqn.params -> {key: invar_index}`` declaring
            every trainable input; ``None`` means ``{'weight': 1}``, or
            ``{'weight': 0}`` when ``x_invar_index`` is ``None`` (the weight is
            then the only operand).
        x_invar_index: Position of the input ``x`` in the operands, or ``None``
            for primitives with no external input.
        y_outvar_index: Position of the output ``y`` among the outputs.

    Returns:
        The registered primitive. It is an ordinary JAX op whatever its layout:
        binding, ``jit``, ``grad``, ``jvp`` and ``vmap`` work on any operands
        ``impl_fn`` accepts. The layout is checked when a model using it is
        compiled (:meth:`ETPPrimitive.check_layout`).

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

        A primitive with no input ``x``: its one operand is the weight.

        >>> decay = braintrace.register_primitive(
        ...     'doc_decay', lambda w: jnp.exp(-w), gradient_enabled=True,
        ...     x_invar_index=None)
        >>> decay.trainable_invars({})
        {'weight': 0}
        >>> jax.grad(lambda w: decay(w).sum())(jnp.zeros(2))
        Array([-1., -1.], dtype=float32)
    """
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

    prim = ETPPrimitive(
        name,
        impl_fn,
        batched=batched,
        gradient_enabled=gradient_enabled,
        trainable_invars_fn=trainable_invars_fn,
        x_invar_index=x_invar_index,
        y_outvar_index=y_outvar_index,
    )
    prim.def_impl(impl_fn)
    prim.def_abstract_eval(functools.partial(_abstract_eval, prim))
    mlir.register_lowering(prim, functools.partial(_lowering, prim))
    ad.primitive_jvps[prim] = functools.partial(_jvp, prim)
    batching.primitive_batchers[prim] = functools.partial(_batch, prim)
    _REGISTRY[name] = prim
    return prim


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
    structs = [_struct(a) for a in avals]
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
    warnings.warn(
        f"ETP primitive '{prim.name}' is vmapped with no batched counterpart for these "
        "mapped operands, so it is decomposed into plain JAX ops: its weights drop out "
        "of eligibility-trace learning. Register a counterpart with "
        "braintrace.register_batched_counterpart, or map only x.",
        UserWarning,
        stacklevel=2,
    )
    in_axes = tuple(dims)
    out = jax.vmap(functools.partial(prim.impl_fn, **params), in_axes=in_axes)(*args)
    if prim.multiple_results:
        return list(out), [0] * len(out)
    return out, 0
