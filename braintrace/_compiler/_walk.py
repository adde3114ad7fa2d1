"""Walks over a flat jaxpr shared by the compiler passes: producers, sources, reach.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compiler._walk import feeding, reached
    >>> jaxpr = jax.make_jaxpr(lambda a, b: (jnp.sin(a), a * b))(1.0, 2.0).jaxpr
    >>> a, b = jaxpr.invars
    >>> values, eqns = reached(jaxpr, [b])
    >>> eqns  # only the product reads b
    [1]
    >>> a in feeding(jaxpr, [jaxpr.outvars[0]]), b in feeding(jaxpr, [jaxpr.outvars[0]])
    (True, False)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import jax.extend.core as jex_core
import jax.numpy as jnp

__all__ = ["cast_source", "feeding", "is_var", "producers", "reached", "sources_of"]


def is_var(v: Any) -> bool:
    """Whether ``v`` is a variable (not a literal, not a dropped output)."""
    return not isinstance(v, (jex_core.Literal, jex_core.DropVar))


def producers(jaxpr: jex_core.Jaxpr) -> dict[Any, int]:
    """``{variable: index of the equation that computes it}``."""
    return {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars if is_var(v)}


def cast_source(jaxpr: jex_core.Jaxpr, var: Any, producer: Mapping[Any, int]) -> Any:
    """The computed value ``var`` is a floating-point cast of, or ``var`` itself.

    Follows ``convert_element_type`` equations from one floating dtype to another back to
    the value they cast, when that value is computed by an equation of its own (a cast
    of a jaxpr input is left as it is): the step's float64 value that a float32 hidden state
    stores (``_flatten``'s whole-operand scatter). ``producer`` is :func:`producers`'s.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda a: jnp.sin(a).astype(jnp.bfloat16))(1.0).jaxpr
        >>> cast_source(jaxpr, jaxpr.outvars[0], producers(jaxpr)) is jaxpr.eqns[0].outvars[0]
        True
    """
    source = var
    while is_var(source) and source in producer:
        eqn = jaxpr.eqns[producer[source]]
        if not (eqn.primitive.name == "convert_element_type" and _floating(eqn.invars[0])
                and _floating(source)):
            return source
        source = eqn.invars[0]
    return var


def _floating(v: Any) -> bool:
    return is_var(v) and jnp.issubdtype(v.aval.dtype, jnp.floating)


def sources_of(jaxpr: jex_core.Jaxpr, start: Iterable[Any], producer: Mapping[Any, int],
               stop_eqns: Collection[int] = ()) -> set[Any]:
    """The jaxpr inputs (invars, constvars) that ``start`` is computed from.

    The walk goes backwards through producing equations, except those in
    ``stop_eqns``, whose outputs count as sources themselves.
    """
    stack, seen, found = list(start), set(), set()
    while stack:
        v = stack.pop()
        if not is_var(v) or v in seen:
            continue
        seen.add(v)
        if v in producer and producer[v] not in stop_eqns:
            stack.extend(jaxpr.eqns[producer[v]].invars)
        else:
            found.add(v)
    return found


def feeding(jaxpr: jex_core.Jaxpr, targets: Iterable[Any]) -> set[Any]:
    """Variables from which some variable of ``targets`` is computed (``targets`` included)."""
    found = {v for v in targets if is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in found for v in eqn.outvars if is_var(v)):
            found.update(v for v in eqn.invars if is_var(v))
    return found


def reached(jaxpr: jex_core.Jaxpr, sources: Iterable[Any],
            blocked: Collection[tuple[int, int]] = ()) -> tuple[set[Any], list[int]]:
    """Variables and equations computed from ``sources``.

    An equation does not pass on a value that enters it only through an
    ``(equation index, operand position)`` listed in ``blocked``.
    """
    found = {v for v in sources if is_var(v)}
    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if any(is_var(v) and v in found and (i, k) not in blocked
               for k, v in enumerate(eqn.invars)):
            eqns.append(i)
            found.update(v for v in eqn.outvars if is_var(v))
    return found, eqns
