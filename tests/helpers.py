"""Small helpers shared by the test modules (importable: ``tests`` is on ``pythonpath``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex_core

__all__ = ["primitive_names"]


def primitive_names(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Names of the primitives in the jaxpr of ``fn(*args)``, nested bodies included.

    Example:
        >>> import jax.numpy as jnp
        >>> sorted(primitive_names(lambda x: jax.jit(jnp.sin)(x) * 2.0, 1.0))
        ['jit', 'mul', 'sin']
    """
    names: set[str] = set()

    def walk(jaxpr: jex_core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names
