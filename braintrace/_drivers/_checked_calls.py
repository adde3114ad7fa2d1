"""What the host checks of a driver's call found, remembered by what they read.

The stateful drivers check every argument on the host before their program
runs (``_inputs.py``): the inputs' structure, shapes and dtypes against the
compiled step, the targets' length, the chunk and block sizes, the reduction,
then they choose the loop and put the loss weights on the device. Without a
mask all of it depends only on the arrays' shapes and dtypes and on a few
static arguments, so a call like an earlier one finds the result in a
:class:`CheckedCalls`, keyed by :func:`call_signature`, and skips the checks:
they would pass and give the same loop and weights. A call they would refuse
is never remembered (nothing is stored when a check raises), and a mask's
values are checked at every call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from itertools import repeat
from typing import Any, TypeVar

import jax
import numpy as np

__all__ = ["CheckedCalls", "call_signature", "signature_of"]

_STATICS = frozenset((type(None), bool, int, str))
_ARRAYS = (jax.Array, np.ndarray)
_shape_dtype = operator.attrgetter("shape", "dtype")
T = TypeVar("T")


def call_signature(*trees: Any, statics: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """What a call's host checks read: each tree's structure and its leaves' shapes and
    dtypes, and ``statics`` by type and value.

    ``None`` (nothing to remember the checks by) when a leaf is not an array
    (a Python number, a list, a ``jax.ShapeDtypeStruct``) or a static is not
    ``None``, a bool, an int or a string.

    Example:
        >>> import jax.numpy as jnp
        >>> key = call_signature({'a': jnp.ones((2, 3))}, statics=('mean', None))
        >>> key == call_signature({'a': jnp.zeros((2, 3))}, statics=('mean', None))
        True
        >>> key == call_signature({'a': jnp.zeros((2, 4))}, statics=('mean', None))
        False
        >>> call_signature([1.0, 2.0]) is None
        True
    """
    return signature_of(*jax.tree.flatten(trees), statics)  # one structure for all of them


def signature_of(leaves: list[Any], treedef: Any, statics: tuple[Any, ...]
                 ) -> tuple[Any, ...] | None:
    """:func:`call_signature` of trees already flattened (``jax.tree.flatten`` of the tuple of
    them): the same key, without flattening them again."""
    types = tuple(map(type, statics))
    if not (_STATICS.issuperset(types) and all(map(isinstance, leaves, repeat(_ARRAYS)))):
        return None
    return (treedef, *map(_shape_dtype, leaves), types, statics)


class CheckedCalls:
    """The results of the checks of recent calls, by where they ran and their
    :func:`call_signature` (at most ``size``; then all forgotten).

    Example:
        >>> import jax.numpy as jnp
        >>> calls, ran = CheckedCalls(), []
        >>> def checks():
        ...     ran.append(1)
        ...     return 'checked'
        >>> signature = call_signature(jnp.ones(3))
        >>> calls.check('entry', signature, checks), calls.check('entry', signature, checks)
        ('checked', 'checked')
        >>> len(ran)
        1
    """

    def __init__(self, size: int = 32):
        self._found: dict[Hashable, Any] = {}
        self._size = size

    def check(self, where: Hashable, signature: tuple[Any, ...] | None,
              checks: Callable[[], T]) -> T:
        """What ``checks()`` gave for a call of this ``signature`` at ``where`` before, else
        its result now (remembered unless it raises; run every time without a signature)."""
        if signature is None:
            return checks()
        key = (where, signature)
        found = self._found.get(key)
        if found is None:
            found = checks()
            if len(self._found) >= self._size:
                self._found.clear()
            self._found[key] = found
        return found
