"""Evaluating a flat jaxpr with the hooks the eligibility-trace programs need."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

__all__ = ["bind_equation", "bind_forward_differentiable", "bind_with_x_pullback", "evaluate",
           "feedback_outputs"]


def bind_equation(eqn: jex_core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals`` as ``eval_jaxpr`` does; returns its outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def evaluate(
    jaxpr: jex_core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    stop_eqns: frozenset[int] = frozenset(),
    injections: Mapping[int, tuple[int, Any]] | None = None,
    feedback: Mapping[int, Mapping[int, Any]] | None = None,
    stop_operands: Mapping[int, Sequence[int]] | None = None,
    var_injections: Mapping[Any, Any] | None = None,
    operand_injections: Mapping[int, Mapping[int, Any]] | None = None,
    record: Sequence[Any] = (),
    forward_mode: bool = False,
    x_pullbacks: Mapping[int, tuple[Callable[[Any, Any], Any], Any]] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Evaluates ``jaxpr`` like ``jax.core.eval_jaxpr``, with hooks.

    Args:
        jaxpr: A flat jaxpr.
        consts: Values of its constvars.
        args: Values of its invars.
        stop_eqns: Equations whose outputs pass through ``lax.stop_gradient``.
        injections: ``{eqn_index: (output position, value)}`` added to that
            output right after it is computed (zero-valued tangent entry points).
        feedback: ``{eqn_index: {operand position: B}}``: that equation keeps its
            value and its derivative with respect to every operand but its
            input ``x`` (operand ``x_position``), whose derivative is taken at the
            substituted operands ``B`` instead (see :func:`feedback_outputs`).
        stop_operands: ``{eqn_index: operand positions}``: those operands of that
            equation pass through ``lax.stop_gradient`` (no derivative reaches
            them through this equation; their other uses are unaffected).
        var_injections: ``{variable: value}`` added to that variable where it is
            defined (an equation's output or an input), so every read sees it.
        operand_injections: ``{eqn_index: {operand position: value}}`` added to
            that operand of that equation alone (one read of a variable: its other
            reads do not see it).
        record: Variables (or literals) whose values to return as well.
        forward_mode: Make ``custom_vjp`` functions forward-differentiable
            (see :func:`bind_forward_differentiable`), for ``jax.linearize``.
        x_pullbacks: ``{eqn_index: (fn, operand)}``: that ETP equation's
            derivative with respect to its input ``x`` is ``fn(∂/∂y, operand)``
            (the same map, computed another way: see
            :func:`bind_with_x_pullback`); reverse mode only.

    Returns:
        The jaxpr outputs and the recorded values.
    """
    bind = bind_forward_differentiable if forward_mode else bind_equation
    injections = injections or {}
    feedback = feedback or {}
    x_pullbacks = x_pullbacks or {}
    stop_operands = stop_operands or {}
    var_injections = var_injections or {}
    operand_injections = operand_injections or {}
    env: dict[jex_core.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def write(v: Any, value: Any) -> None:
        if not isinstance(v, jex_core.DropVar):
            env[v] = value + var_injections[v] if v in var_injections else value

    for v, value in zip(jaxpr.constvars, consts):
        write(v, value)
    for v, value in zip(jaxpr.invars, args):
        write(v, value)
    for index, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        for position, value in operand_injections.get(index, {}).items():
            invals[position] = invals[position] + value
        for position in stop_operands.get(index, ()):
            invals[position] = jax.lax.stop_gradient(invals[position])
        if index in feedback:
            outs = feedback_outputs(eqn, invals, feedback[index])
        elif index in x_pullbacks:
            outs = bind_with_x_pullback(eqn, invals, x_pullbacks[index])
        else:
            outs = bind(eqn, invals)
        if index in stop_eqns:
            outs = [jax.lax.stop_gradient(o) for o in outs]
        if index in injections:
            position, value = injections[index]
            outs[position] = outs[position] + value
        for v, value in zip(eqn.outvars, outs):
            write(v, value)
    return [read(v) for v in jaxpr.outvars], [read(v) for v in record]


CUSTOM_VJP = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})


def bind_forward_differentiable(eqn: jex_core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``; a ``custom_vjp`` function gets a JVP: the transpose of its VJP.

    JAX cannot differentiate a ``custom_vjp`` function in forward mode. Its
    backward rule ``v ↦ Jᵀ v`` is linear in ``v``, so its transpose is the
    JVP ``t ↦ J t`` at the same point, which :func:`jax.linear_transpose`
    derives. The value, and the user's derivative rule, are unchanged.
    """
    if eqn.primitive.name not in CUSTOM_VJP:
        return bind_equation(eqn, invals)

    def call(*args):
        return tuple(bind_equation(eqn, args))

    wrapped = jax.custom_jvp(call)

    def jvp_rule(primals, tangents):
        outs, pullback = jax.vjp(call, *primals)
        (out_tangents,) = jax.linear_transpose(pullback, outs)(tuple(tangents))
        return outs, out_tangents

    wrapped.defjvp(jvp_rule)
    return list(wrapped(*invals))


def bind_with_x_pullback(eqn: jex_core.JaxprEqn, invals: Sequence[Any],
                         pullback: tuple[Callable[[Any, Any], Any], Any]) -> list[Any]:
    """Binds the ETP equation ``eqn``; in reverse mode the cotangent of its input ``x`` is
    ``fn(∂/∂y, operand)`` for ``pullback = (fn, operand)``, the others' the equation's own.

    For a map the caller can pull back faster than JAX's transpose does, e.g. with a
    dense kernel transposed once outside a time loop (XLA:CPU otherwise reads the kernel
    transposed in every step's product). Value and derivatives are unchanged; ``operand``
    gets no derivative.
    """
    fn, operand = pullback
    x_position, y_position = eqn.primitive.x_invar_index, eqn.primitive.y_outvar_index
    x_dtype = jnp.result_type(invals[x_position])

    def call(args, operand):
        del operand
        return tuple(bind_equation(eqn, list(args)))

    wrapped = jax.custom_vjp(call)

    def forward(args, operand):
        outs, vjp = jax.vjp(lambda a: call(a, None), args)
        return outs, (vjp, operand)

    def backward(residuals, cotangents):
        vjp, operand = residuals
        (grads,) = vjp(cotangents)
        grads = list(grads)
        if jnp.issubdtype(x_dtype, jnp.inexact):
            grads[x_position] = fn(cotangents[y_position], operand).astype(x_dtype)
        return tuple(grads), jnp.zeros_like(operand)

    wrapped.defvjp(forward, backward)
    return list(wrapped(tuple(invals), operand))


def feedback_outputs(eqn: jex_core.JaxprEqn, invals: Sequence[Any],
                     substitutes: Mapping[int, Any]) -> list[Any]:
    """``f(sg(x), θ) + f(x, B) - f(sg(x), B)``: the value ``f(x, θ)``, derivatives mixed.

    The derivative with respect to the trainable operands ``θ`` is the real one;
    the derivative with respect to the input ``x`` is taken at the substituted
    operands ``B`` (feedback alignment). ``eqn`` is an ETP equation with an input.
    """
    x_position = eqn.primitive.x_invar_index
    stopped = list(invals)
    stopped[x_position] = jax.lax.stop_gradient(invals[x_position])
    alt, alt_stopped = list(invals), list(stopped)
    for position, value in substitutes.items():
        alt[position] = value
        alt_stopped[position] = value
    real = bind_equation(eqn, stopped)
    through_b = bind_equation(eqn, alt)
    through_b_stopped = bind_equation(eqn, alt_stopped)
    return [r + (b - s) for r, b, s in zip(real, through_b, through_b_stopped)]
