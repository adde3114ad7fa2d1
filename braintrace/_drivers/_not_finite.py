"""What a driver says when a loss or gradient is not finite (it returns nothing non-finite).

The pure programs return finiteness flags (``GradResult.finite``,
``TrainResult.bad_update_at`` / ``bad_params``) instead of raising inside
``jit``; the stateful drivers read them on the host a call later
(``_deferred.py``: the programs they run then returned nothing non-finite) and
raise with the step and the Param paths. Only then, on the way to the error,
are the inputs read on the host: a non-finite input that reaches a scored step
(:func:`first_non_finite_input`) is named with its step, since it, not the
learning rate or the inputs' scale, is then the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from braintrace._drivers._sharding import host_array
from braintrace._loops import reaches_scored

__all__ = ["NonFiniteInput", "first_non_finite_input", "grad_verdict", "raise_if_grad_not_finite",
           "raise_if_update_not_finite"]


class NonFiniteInput(NamedTuple):
    """An input entry that is not finite.

    Attributes:
        name: The entry, e.g. ``"xs['spikes'][3, 1, 0]"`` (time, then batch and features).
        value: Its value (``nan``, ``inf`` or ``-inf``).
        step: Its time step.
    """

    name: str
    value: float
    step: int

    def describe(self) -> str:
        """``"the input xs[3, 1, 0] at time step 3 is inf"``."""
        return f"the input {self.name} at time step {self.step} is {self.value}"


def first_non_finite_input(xs: Any, weights: Any) -> NonFiniteInput | None:
    """The earliest input entry that is not finite and reaches a scored step, or ``None``.

    Entries after their sample's last scored step are left out: the programs
    replace them by zeros (``braintrace._loops.ignore_masked``). Reads ``xs`` on
    the host: for error messages only. Arrays spread over several processes
    are not read (``None`` for them).

    Args:
        xs: The inputs, time axis leading (any pytree).
        weights: The loss weights, ``(T,)`` or ``(T, B)``; zeros are unscored.

    Example:
        >>> import jax.numpy as jnp
        >>> xs = {'a': jnp.array([[1.0, 2.0], [jnp.inf, 0.0], [jnp.nan, 1.0]])}
        >>> first_non_finite_input(xs, jnp.array([1.0, 1.0, 0.0])).describe()
        "the input xs['a'][1, 0] at time step 1 is inf"
    """
    reaches = np.asarray(reaches_scored(host_array(weights)))
    found = None
    for path, a in jax.tree_util.tree_leaves_with_path(xs):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            continue
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.inexact):
            continue
        keep = reaches.reshape(reaches.shape + (1,) * (a.ndim - reaches.ndim))
        bad = np.argwhere(~np.isfinite(a) & keep)
        if bad.size and (found is None or bad[0][0] < found.step):
            index = ", ".join(str(int(i)) for i in bad[0])
            found = NonFiniteInput(f"xs{jax.tree_util.keystr(path)}[{index}]",
                                   a[tuple(bad[0])].item(), int(bad[0][0]))
    return found


def raise_if_grad_not_finite(call: str, param_paths: Sequence[str], losses: np.ndarray,
                             finite: np.ndarray, *, xs: Any = None, weights: Any = None) -> None:
    """Raises ``FloatingPointError`` for the first non-finite loss, else for non-finite grads.

    Args:
        call: The call the flags are of, as the message starts (e.g. ``"learner.etrace_grad
            (the last call, ...)"``).
        param_paths: The Params' paths, in the order of ``finite``.
        losses: Each step's loss ``(T,)``.
        finite: Per Param leaf, whether its gradient is finite.
        xs, weights: The call's inputs and loss weights: read only to raise, to name a
            non-finite input that reaches a scored step (:func:`first_non_finite_input`).
    """
    returned = ("No gradient of it was returned (zeros instead), and the model's hidden state "
                "and the learner's traces are as they were before it.")
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        step = int(bad[0])
        culprit = _culprit(xs, weights, step)
        if culprit is not None:
            raise FloatingPointError(
                f"{call}: the loss at time step {step} is {losses[step]}, not finite: "
                f"{culprit.describe()}. {returned} {_replace(weights)}")
        raise FloatingPointError(
            f"{call}: the loss at time step {step} is {losses[step]}, not finite. {returned} "
            "Check the inputs and targets at that step (and the Params: lower the learning "
            "rate if they grew).")
    bad = np.flatnonzero(~finite)
    if bad.size:
        names = ", ".join(f"'{param_paths[i]}'" for i in bad)
        culprit = _culprit(xs, weights, len(losses) - 1)
        if culprit is not None:
            raise FloatingPointError(
                f"{call}: the gradient of Param {names} is not finite although every loss is: "
                f"{culprit.describe()}. {returned} {_replace(weights)}")
        raise FloatingPointError(
            f"{call}: the gradient of Param {names} is not finite although every loss is. "
            f"{returned} A hidden state or trace overflowed: check the inputs' scale, use "
            "float64, or shorten the sequences.")


def grad_verdict(call: str, param_paths: Sequence[str], xs: Any, weights: Any,
                 losses: jax.Array, put_back: Callable[[], None], finite: np.ndarray) -> None:
    """Reads the flag of a learner's gradient call on the host (``finite``: per Param, its
    gradient and every loss finite): if one was not, puts back the state the call started
    from (``put_back``) and raises (:func:`raise_if_grad_not_finite`; ``losses`` read then).
    """
    if finite.all():
        return
    put_back()
    raise_if_grad_not_finite(call, param_paths, host_array(losses), finite, xs=xs,
                             weights=weights)


def raise_if_update_not_finite(call: str, param_paths: Sequence[str], losses: np.ndarray,
                               bad_update_at: int, bad_params: np.ndarray, *, xs: Any = None,
                               weights: Any = None) -> None:
    """Raises ``FloatingPointError`` if a loss, or an update of the Params, was not finite.

    Args:
        call: The call the flags are of, as the message starts.
        param_paths: The Params' paths, in the order of ``bad_params``.
        losses: Each step's loss ``(T,)``.
        bad_update_at: The step after which an update made a Param non-finite (``-1``: none).
        bad_params: Per Param leaf, whether that update made it non-finite.
        xs, weights: As :func:`raise_if_grad_not_finite`.
    """
    discarded = ("the whole call was discarded: the model's Params, the optimiser state, "
                 "hidden state and traces are as they were before it")
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size and (bad_update_at < 0 or bad[0] <= bad_update_at):
        step = int(bad[0])
        culprit = _culprit(xs, weights, step)
        if culprit is not None:
            raise FloatingPointError(
                f"{call}: the loss at time step {step} of that call is {losses[step]}, not "
                f"finite: {culprit.describe()}; {discarded}. {_replace(weights)}")
        raise FloatingPointError(
            f"{call}: the loss at time step {step} of that call is {losses[step]}, not "
            f"finite; {discarded}. Check the inputs and targets at that step, or lower the "
            "learning rate.")
    if bad_update_at >= 0:
        names = ", ".join(f"'{param_paths[i]}'" for i in np.flatnonzero(bad_params))
        culprit = _culprit(xs, weights, bad_update_at)
        if culprit is not None:
            raise FloatingPointError(
                f"{call}: the update after time step {bad_update_at} of that call made Param "
                f"{names} not finite although every loss up to it was finite: "
                f"{culprit.describe()}; {discarded}. {_replace(weights)}")
        raise FloatingPointError(
            f"{call}: the update after time step {bad_update_at} of that call made Param "
            f"{names} not finite although every loss up to it was finite; {discarded}. Lower "
            "the learning rate or clip the gradients (optax.clip_by_global_norm).")


def _replace(weights: Any) -> str:
    """What to do about a non-finite input (and, with a mask, what a mask hides)."""
    advice = "Replace the non-finite inputs."
    if np.any(host_array(weights) == 0):
        advice += (" A mask does not hide an input that reaches a scored step through the "
                   "hidden state: only inputs after a sample's last scored step are ignored.")
    return advice


def _culprit(xs: Any, weights: Any, last: int) -> NonFiniteInput | None:
    """The first non-finite input that reaches a scored step, if it is at or before ``last``."""
    if xs is None or weights is None:
        return None
    found = first_non_finite_input(xs, weights)
    return found if found is not None and found.step <= last else None
