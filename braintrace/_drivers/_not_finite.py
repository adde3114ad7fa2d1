"""What a driver says when a loss or gradient is not finite (it returns nothing non-finite).

The pure programs return finiteness flags (``GradResult.finite``,
``TrainResult.bad_update_at`` / ``bad_params``) instead of raising inside
``jit``; the stateful drivers read them on the host, after the call and before
writing anything back, and raise with the step and the Param paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["raise_if_grad_not_finite", "raise_if_update_not_finite"]


def raise_if_grad_not_finite(param_paths: Sequence[str], losses: np.ndarray, finite: np.ndarray,
                             unchanged: str) -> None:
    """Raises ``FloatingPointError`` for the first non-finite loss, else for non-finite grads.

    Args:
        param_paths: The Params' paths, in the order of ``finite``.
        losses: Each step's loss ``(T,)``.
        finite: Per Param leaf, whether its gradient is finite.
        unchanged: What the call left as it was (ends the message's sentence).
    """
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        raise FloatingPointError(
            f"The loss at time step {int(bad[0])} is {losses[bad[0]]}, not finite; no "
            f"gradient is returned and {unchanged}. Check the inputs and targets at that "
            "step (and the Params: lower the learning rate if they grew).")
    bad = np.flatnonzero(~finite)
    if bad.size:
        names = ", ".join(f"'{param_paths[i]}'" for i in bad)
        raise FloatingPointError(
            f"The gradient of Param {names} is not finite although every loss is; no "
            f"gradient is returned and {unchanged}. A hidden state or trace overflowed: "
            "check the inputs' scale, use float64, or shorten the sequences.")


def raise_if_update_not_finite(param_paths: Sequence[str], losses: np.ndarray,
                               bad_update_at: int, bad_params: np.ndarray) -> None:
    """Raises ``FloatingPointError`` if a loss, or an update of the Params, was not finite.

    Args:
        param_paths: The Params' paths, in the order of ``bad_params``.
        losses: Each step's loss ``(T,)``.
        bad_update_at: The step after which an update made a Param non-finite (``-1``: none).
        bad_params: Per Param leaf, whether that update made it non-finite.
    """
    discarded = ("the whole call was discarded: the model's Params, the optimiser state, "
                 "hidden state and traces are as they were before it")
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size and (bad_update_at < 0 or bad[0] <= bad_update_at):
        raise FloatingPointError(
            f"The loss at time step {int(bad[0])} of this call is {losses[bad[0]]}, not "
            f"finite; {discarded}. Check the inputs and targets at that step, or lower the "
            "learning rate.")
    if bad_update_at >= 0:
        names = ", ".join(f"'{param_paths[i]}'" for i in np.flatnonzero(bad_params))
        raise FloatingPointError(
            f"The update after time step {bad_update_at} of this call made Param {names} "
            f"not finite although every loss up to it was finite; {discarded}. Lower the "
            "learning rate or clip the gradients (optax.clip_by_global_norm).")
