"""Evaluating a flat jaxpr with the hooks the eligibility-trace programs need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core

__all__ = ["bind_equation", "evaluate"]


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
    stop_operands: Mapping[int, Sequence[int]] | None = None,
    injections: Mapping[int, tuple[int, Any]] | None = None,
    perturb: Mapping[jex_core.Var, Any] | None = None,
    record: Sequence[Any] = (),
) -> tuple[list[Any], list[Any]]:
    """Evaluates ``jaxpr`` like ``jax.core.eval_jaxpr``, with hooks.

    Args:
        jaxpr: A flat jaxpr.
        consts: Values of its constvars.
        args: Values of its invars.
        stop_eqns: Equations whose outputs pass through ``lax.stop_gradient``.
        stop_operands: ``{eqn_index: operand positions}`` read through
            ``lax.stop_gradient`` by that equation only.
        injections: ``{eqn_index: (output position, value)}`` added to that
            output right after it is computed (zero-valued tangent entry points).
        perturb: ``{var: value}`` added to a variable right at its definition
            (cast to its dtype), so every later use (and the jaxpr output) sees
            the sum.
        record: Variables (or literals) whose values to return as well.

    Returns:
        The jaxpr outputs and the recorded values.
    """
    stop_operands = stop_operands or {}
    injections = injections or {}
    perturb = perturb or {}
    env: dict[jex_core.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def write(v: Any, value: Any) -> None:
        if isinstance(v, jex_core.DropVar):
            return
        if v in perturb:
            value = value + jax.lax.convert_element_type(perturb[v], jax.numpy.result_type(value))
        env[v] = value

    for v, value in zip(jaxpr.constvars, consts):
        write(v, value)
    for v, value in zip(jaxpr.invars, args):
        write(v, value)
    for index, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        for position in stop_operands.get(index, ()):
            invals[position] = jax.lax.stop_gradient(invals[position])
        outs = bind_equation(eqn, invals)
        if index in stop_eqns:
            outs = [jax.lax.stop_gradient(o) for o in outs]
        if index in injections:
            position, value = injections[index]
            outs[position] = outs[position] + value
        for v, value in zip(eqn.outvars, outs):
            write(v, value)
    return [read(v) for v in jaxpr.outvars], [read(v) for v in record]
