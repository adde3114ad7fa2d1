"""Checks of scalar arguments where they enter (constructors, drivers): one helper per kind.

An argument of the wrong kind is refused with its name and what it must be,
before anything is changed; nothing is silently rounded (``2.5`` is not ``2``)
or reinterpreted (``True`` is not ``1``).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["ArgumentTypeError", "check_integer"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type.

    A :class:`TypeError`, and also a :class:`ValueError`, which these checks
    raised before (``except ValueError`` keeps catching them).

    Example:
        >>> issubclass(ArgumentTypeError, TypeError), issubclass(ArgumentTypeError, ValueError)
        (True, True)
    """


def _kind(minimum: int | None) -> str:
    if minimum is None:
        return "an int"
    return "a positive int" if minimum == 1 else f"an int >= {minimum}"


def check_integer(name: str, value: Any, *, minimum: int | None = None, what: str | None = None,
                  note: str = "") -> int:
    """``value`` as a Python int, after checking it is an integer of at least ``minimum``.

    Python and NumPy integers (and integer 0-d arrays) are integers; a bool, a
    float (even ``2.0``), a string or ``None`` is not.

    Args:
        name: How the message names the argument (e.g. ``"UORO: seed"``).
        value: The argument.
        minimum: The smallest value allowed; ``None``: any integer.
        what: What the message says it must be (default: from ``minimum``).
        note: Appended to the message (e.g. ``". Use None for ..."``).

    Returns:
        ``value`` as a Python int.

    Raises:
        ArgumentTypeError: ``value`` is not an integer (a ``TypeError`` that is
            also a ``ValueError``).
        ValueError: It is smaller than ``minimum``.

    Example:
        >>> import numpy as np
        >>> check_integer("n_steps", np.int64(2), minimum=1)
        2
        >>> try:
        ...     check_integer("n_steps", 2.5, minimum=1)
        ... except TypeError as err:
        ...     print(err)
        n_steps must be a positive int (a Python or NumPy integer, not a bool or a float), got
        2.5 of type float.
    """
    what = what or _kind(minimum)
    number = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None:
        raise ArgumentTypeError(
            f"{name} must be {what} (a Python or NumPy integer, not a bool or a float), got "
            f"{value!r} of type {type(value).__name__}{note}.")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}{note}.")
    return int(number)
