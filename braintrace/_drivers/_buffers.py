"""A state whose every array is a buffer of its own, so that it can be donated.

``jax.jit(step, donate_argnums=...)`` (or ``nnx.jit``) hands each donated
array's device buffer to the program, which writes its results into it: the
array is deleted. That is how a long-sequence user halves the memory of a
train step, and it needs every leaf of the donated state to be its own buffer:

* one that is also a Variable of the model deletes the model's array (XLA:
  "Attempt to donate a buffer which is also used by the same call" when the
  model is an argument of the same call);
* one buffer in two leaves is donated twice ("Attempt to donate the same
  buffer twice"): a rule's zero trace stored in two places (e-prop's
  ``FilteredTrace(trace, trace)``).

:func:`own_buffers` copies exactly those leaves, once, where a state is made.
A program's results are always new buffers, each its own, so the states that
the train step returns need nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["own_buffers"]


def own_buffers(tree: Any, held: Iterable[Any] = ()) -> Any:
    """``tree`` with every array leaf in a buffer of its own.

    A leaf that is one of ``held`` (the arrays the model keeps) or an earlier
    leaf of ``tree`` is copied; every other leaf is kept as it is (a fresh
    array costs nothing). Under a trace (leaves that are tracers) nothing is
    copied: the traced program's results are new buffers.

    Args:
        tree: A pytree of arrays (a state as it is made).
        held: Arrays that must stay alive when ``tree`` is donated.

    Returns:
        ``tree``, its leaves distinct arrays, none of them one of ``held``.

    Example:
        >>> import jax.numpy as jnp
        >>> zeros, kept = jnp.zeros(3), jnp.ones(2)
        >>> a, b, c = own_buffers((zeros, zeros, kept), held=[kept])
        >>> a is zeros, b is zeros, c is kept, bool((b == 0).all() and (c == 1).all())
        (True, False, False, True)
    """
    taken = {id(a) for a in held}

    def own(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            return leaf
        if id(leaf) in taken:
            leaf = jnp.copy(leaf)
        taken.add(id(leaf))
        return leaf

    return jax.tree.map(own, tree)
