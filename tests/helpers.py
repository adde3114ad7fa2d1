"""Small helpers shared by the test modules (importable: ``tests`` is on ``pythonpath``)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex_core

__all__ = ["compilations", "primitive_names"]


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Collects the names of the programs XLA compiles inside the block (``jit(name)``).

    Example:
        >>> import jax.numpy as jnp
        >>> def twice(x):
        ...     return 2 * x
        >>> with compilations() as names:
        ...     _ = jax.jit(twice)(jnp.ones(3))
        ...     _ = jax.jit(twice)(jnp.ones(3))
        >>> names.count('twice')
        1
    """
    names: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
            if found:
                names.append(found.group(1))

    logger = logging.getLogger("jax")
    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


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
