"""The ETP primitive: a JAX primitive that marks an operation as learning online.

An ETP primitive computes an ordinary function ``y = f(x, θ)``. Its *identity*
is what matters: the compiler recognises its equations in a model step's jaxpr
and builds eligibility traces for its trainable inputs ``θ``. This module holds
the primitive type, its layout (where ``x``, ``y`` and ``θ`` sit among the
operands and outputs) and its eligibility-trace rules (an
:class:`~braintrace._primitives._rules.ETPRules` record). Making one, with every
standard JAX rule derived from its implementation, is
:func:`~braintrace.register_primitive`.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core as jex_core

from braintrace._primitives._rules import RULE_NAMES, ETPRules

__all__ = ["ETPPrimitive", "MissingRuleError", "shape_struct"]

Rule = Callable[..., Any]


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

    Create one with :func:`~braintrace.register_primitive`, then attach its
    trace rules with :meth:`register_etp_rules` (a whole
    :class:`~braintrace.ETPRules` record, or single rules by
    keyword) or the single-rule ``register_*`` methods.

    Attributes:
        impl_fn: The plain-JAX implementation ``impl_fn(*operands, **params)``.
        batched: Whether the primitive's ``x`` carries a leading batch axis.
        gradient_enabled: Whether the compiler may differentiate through the
            primitive when walking from an output to hidden states.
        x_invar_index: Operand position of the input ``x``, or ``None``.
        y_outvar_index: Output position of ``y``.
        batched_counterpart: The primitive bound when only ``x`` is vmapped.
        rules: The registered eligibility-trace rules (read-only).

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
        self._rules = ETPRules()
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
            structs = [shape_struct(jax.typeof(a)) for a in operands]
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
        (``vmap`` falls back to ``jax.vmap`` of the impl when ``x`` is not one of
        the operands; the compiler warns if a step it compiles holds it), so they
        never check it.

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

    @property
    def rules(self) -> ETPRules:
        """The registered eligibility-trace rules, as one frozen record."""
        return self._rules

    def register_etp_rules(
        self,
        rules: ETPRules | None = None,
        /,
        *,
        dt_to_t: Rule | None = None,
        xy_to_dw: Rule | None = None,
        init_drtrl: Rule | None = None,
        init_pp: Rule | None = None,
        xy_to_trace: Rule | None = None,
        trace_to_dw: Rule | None = None,
        contract: Rule | None = None,
    ) -> None:
        """Registers several ETP rules at once; ``None`` leaves a rule unchanged.

        Args:
            rules: A whole :class:`~braintrace.ETPRules` record
                (its unset fields leave rules unchanged).
            dt_to_t, xy_to_dw, init_drtrl, init_pp, xy_to_trace, trace_to_dw, contract:
                Single rules, registered after ``rules``; see
                :class:`~braintrace.ETPRules` for their signatures.

        Raises:
            TypeError: A rule is not callable; the message names the primitive
                and the rule.
        """
        update = self._record(dt_to_t=dt_to_t, xy_to_dw=xy_to_dw, init_drtrl=init_drtrl,
                              init_pp=init_pp, xy_to_trace=xy_to_trace,
                              trace_to_dw=trace_to_dw, contract=contract)
        if rules is not None:
            if not isinstance(rules, ETPRules):
                raise TypeError(f"ETP primitive '{self.name}': rules must be an ETPRules "
                                f"record, got {type(rules).__name__}.")
            update = rules.merged(update)
        self._rules = self._rules.merged(update)

    def register_dt_to_t(self, fn: Rule) -> Rule:
        """Registers ``dt_to_t(d, trace, **params) -> trace``; returns ``fn``."""
        return self._register_one("dt_to_t", fn)

    def register_xy_to_dw(self, fn: Rule) -> Rule:
        """Registers ``xy_to_dw(x, d, θ, **params) -> {key: dθ}``; returns ``fn``."""
        return self._register_one("xy_to_dw", fn)

    def register_init_drtrl(self, fn: Rule) -> Rule:
        """Registers ``init_drtrl(x, y, θ, num_states) -> {key: zeros}``; returns ``fn``."""
        return self._register_one("init_drtrl", fn)

    def register_init_pp(self, fn: Rule) -> Rule:
        """Registers ``init_pp(x, y, θ, num_states) -> zeros``; returns ``fn``."""
        return self._register_one("init_pp", fn)

    def register_contract(self, fn: Rule) -> Rule:
        """Registers a closed-form ``contract(d, trace, **params) -> trace``; returns ``fn``.

        ``contract`` must equal ``Σ_{lead} dt_to_t(d, trace)``: one state's trace
        (``(*lead, *θ)``) contracted with a signal ``d`` (``(*lead, *y)``) and
        summed over the leading (batch) axes they share. Without it, the
        algorithms build the same sum from ``dt_to_t``; with it, one einsum
        replaces a materialised product and a reduction over the batch axis.
        """
        return self._register_one("contract", fn)

    def register_trace_space_rules(self, *, xy_to_trace: Rule, trace_to_dw: Rule) -> None:
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
        identity. Both are registered, or neither.
        """
        self._rules = self._rules.merged(self._record(
            required=True, xy_to_trace=xy_to_trace, trace_to_dw=trace_to_dw))

    def _register_one(self, name: str, fn: Rule) -> Rule:
        self._rules = self._rules.merged(self._record(required=True, **{name: fn}))
        return fn

    def _record(self, *, required: bool = False, **rules: Rule | None) -> ETPRules:
        """The rules as a record; ``required`` rejects ``None``. Errors name the primitive."""
        for name, fn in rules.items():
            if (required or fn is not None) and not callable(fn):
                raise TypeError(f"ETP primitive '{self.name}': rule '{name}' must be callable, "
                                f"got {type(fn).__name__}.")
        return ETPRules(**rules)

    def has_rule(self, name: str) -> bool:
        """Whether the rule ``name`` was registered."""
        return getattr(self._rules, name, None) is not None

    def rule(self, name: str) -> Rule:
        """Returns the registered rule ``name``.

        Raises:
            ValueError: ``name`` is not an ETP rule.
            MissingRuleError: The rule was never registered; the message names
                the primitive, the rule and the method that registers it.
        """
        if name not in RULE_NAMES:
            raise ValueError(f"Unknown ETP rule '{name}'; known rules: {RULE_NAMES}.")
        fn = getattr(self._rules, name)
        if fn is None:
            raise MissingRuleError(
                f"ETP primitive '{self.name}' has no '{name}' rule, which this algorithm "
                f"needs. Register it with `{self.name}_p.register_etp_rules({name}=fn)`, "
                "or choose an algorithm that does not need it.")
        return fn


def shape_struct(aval: Any) -> jax.ShapeDtypeStruct:
    """An abstract value as a struct for ``jax.eval_shape``, keeping weak types.

    Dropping ``weak_type`` would make a Python-scalar operand promote like a
    strongly typed array (``2.0 * float32`` declared float64 under x64) while
    the lowered impl keeps float32.
    """
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
