"""Checks of arguments where they enter (constructors, drivers): one helper per kind.

An argument of the wrong kind is refused with its name and what it must be,
before anything is changed; nothing is silently rounded (``2.5`` is not ``2``)
or reinterpreted (``True`` is not ``1``). A user's ``loss_fn`` is called
through :func:`call_loss`, which tells a loss written the other way round
(``loss_fn(target, prediction)``) when its error shows it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["ArgumentTypeError", "call_loss", "check_integer"]


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


def _described(tree: Any) -> str:
    """``'float32 (8, 3)'``: the dtypes and shapes of a tree's leaves."""
    return ", ".join(f"{jax.numpy.result_type(a)} {tuple(np.shape(a))}"
                     for a in jax.tree.leaves(tree))


def _runs(fn: Callable[[Any, Any], Any], a: Any, b: Any) -> bool:
    """Whether ``fn(a, b)`` traces on arrays shaped like ``a`` and ``b`` (nothing runs)."""
    spec = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), tree)
    try:
        jax.eval_shape(fn, spec(a), spec(b))
    except Exception:  # noqa: BLE001 -- any failure means it does not run that way either
        return False
    return True


def call_loss(loss_fn: Callable[[Any, Any], Any], prediction: Any, target: Any) -> Any:
    """``loss_fn(prediction, target)``: the user's loss of one step, called as documented.

    Where it raises a ``TypeError`` or ``ValueError`` (as a loss does on integer
    labels given as predictions) but runs with its arguments swapped, the error
    says that ``loss_fn`` is called as ``loss_fn(prediction, target)``; any other
    such error gets a note with what the two arguments were.

    Raises:
        ArgumentTypeError: ``loss_fn`` expects ``(target, prediction)``: a
            ``TypeError`` that is also a ``ValueError``; its cause is the loss's error.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> swapped = lambda labels, logits: jnp.mean(
        ...     optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        >>> try:
        ...     call_loss(swapped, jnp.zeros((2, 3)), jnp.zeros((2,), jnp.int32))
        ... except TypeError as err:
        ...     print(str(err).split(';')[0])
        loss_fn(prediction, target) raised TypeError, but loss_fn(target, prediction) runs
    """
    try:
        return loss_fn(prediction, target)
    except (TypeError, ValueError) as err:
        given = (f"prediction: the model's output of one step, {_described(prediction)}; "
                 f"target: that step's ys[t], {_described(target)}")
        if _runs(loss_fn, target, prediction):
            raise ArgumentTypeError(
                f"loss_fn(prediction, target) raised {type(err).__name__}, but "
                f"loss_fn(target, prediction) runs; braintrace calls loss_fn as "
                f"loss_fn(prediction, target) ({given}). Swap its arguments, e.g. "
                "loss_fn = lambda prediction, target: my_loss(target, prediction).") from err
        err.add_note(f"braintrace called loss_fn(prediction, target) with {given}.")
        raise
