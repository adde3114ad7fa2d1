"""Checks of what a learner's call is given: inputs, targets, masks, chunk sizes, reductions.

Every check runs on the host before the compiled program, so a bad argument is
a clear error instead of a wrong result or an error from deep inside XLA.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

__all__ = ["REDUCTIONS", "check_chunk_size", "check_inputs", "check_signal_inputs", "check_targets",
           "loss_weights",
           "shape_of", "static_chunk_size", "step_weights"]

REDUCTIONS = ("mean", "sum")


def shape_of(a: Any) -> tuple[int, ...]:
    """The shape of an array, a ``jax.ShapeDtypeStruct`` or anything ``np.shape`` takes."""
    return tuple(a.shape) if hasattr(a, "shape") else tuple(np.shape(a))


def check_inputs(xs: Any, example: Any) -> int:
    """The number of time steps of ``xs``, after checking each step matches ``example``.

    Raises:
        ValueError: ``xs`` has another structure, leaves of different lengths,
            or a step shape other than the compiled one.
    """
    leaves = jax.tree.leaves(xs)
    examples = jax.tree.leaves(example)
    if len(leaves) != len(examples):
        raise ValueError(
            f"xs has {len(leaves)} input arrays per step; the model was compiled for "
            f"{len(examples)}.")
    lengths = {shape_of(a)[0] if shape_of(a) else None for a in leaves}
    if len(lengths) != 1 or None in lengths:
        raise ValueError("Every input in xs needs the same leading time axis.")
    for a, e in zip(leaves, examples):
        if shape_of(a)[1:] != tuple(e.shape):
            raise ValueError(_shape_mismatch(shape_of(a), tuple(e.shape)))
    return lengths.pop()


def _shape_mismatch(shape: tuple[int, ...], step: tuple[int, ...]) -> str:
    """Why inputs of ``shape`` do not fit a model compiled for steps of shape ``step``."""
    got = (f"xs has shape {shape}: {shape[0]} time steps of shape {shape[1:]}, but the model "
           f"was compiled for steps of shape {step}.")
    time_major = "Inputs are time-major: (T, batch, *features)."
    batch_major = (len(shape) == len(step) + 1 and len(step) >= 1 and shape[0] == step[0]
                   and shape[2:] == step[1:])
    if batch_major:
        return (f"{got} {time_major} This looks batch-major ({step[0]} sequences of "
                f"{shape[1]} steps): pass jnp.swapaxes(xs, 0, 1) (and the same for ys).")
    if len(shape) == len(step) + 1 and shape[2:] == step[1:]:
        return (f"{got} {time_major} For another batch size than {step[0]}, call "
                f"learner.reset(batch_size={shape[1]}) (or evaluate with learner.evaluate(xs), "
                "which runs at any batch size).")
    return f"{got} {time_major}"


def check_targets(ys: Any, length: int) -> None:
    """Checks that ``ys`` has one target per step of a sequence of ``length`` steps.

    Raises:
        ValueError: A leaf of ``ys`` has another leading (time) length.
    """
    y_lengths = {shape_of(a)[0] if shape_of(a) else None for a in jax.tree.leaves(ys)}
    if y_lengths != {length}:
        raise ValueError(
            f"xs has {length} time steps but ys has {sorted(y_lengths, key=str)}; give one "
            "target per step (time axis leading).")


def check_chunk_size(chunk_size: Any, length: int) -> None:
    """Checks that ``chunk_size`` is ``None`` or a positive int dividing ``length``.

    Raises:
        ValueError: It is not (a float or a bool is not an int).
    """
    if chunk_size is None:
        return
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
            or chunk_size < 1 or length % chunk_size):
        raise ValueError(
            f"chunk_size must be a positive int that divides the sequence length {length}, got "
            f"{chunk_size!r}. Use None for single-step mode.")


def step_weights(mask: Any, length: int, batch_size: int | None = None) -> np.ndarray:
    """The host float64 weights of a mask (all ones for ``None``), checked.

    A mask is ``(T,)`` (one weight per step) or, for a batched learner,
    ``(T, B)`` (one weight per step and sample: padded steps of shorter
    sequences get 0). A ``(T, B)`` mask is returned divided by ``B``, so that
    with a mean-reducing ``loss_fn`` it weighs a step as a ``(T,)`` mask does
    (``Σ_b m_tb ℓ_tb / B``; all ones give ``Σ_t L_t``).

    Raises:
        ValueError: The mask is traced, has another shape, is complex, or has a
            value that is not finite.

    Example:
        >>> step_weights([[1.0, 0.0], [1.0, 1.0]], 2, batch_size=2).tolist()
        [[0.5, 0.0], [0.5, 0.5]]
    """
    if mask is None:
        return np.ones((length,))
    if np.iscomplexobj(mask):
        raise ValueError("mask must be real: one weight per step (or per step and sample), "
                         f"got a complex array of dtype {getattr(mask, 'dtype', 'complex')}.")
    try:
        weights = np.asarray(mask, dtype=np.float64)
    except jax.errors.TracerArrayConversionError as err:
        raise ValueError("mask must be a concrete array (its values are checked on the "
                         "host), not a traced value.") from err
    shapes = [(length,)] + ([] if batch_size is None else [(length, batch_size)])
    if weights.shape not in shapes:
        per_sample = "" if batch_size is None else f" or ({length}, {batch_size}) per sample"
        raise ValueError(f"mask must have shape ({length},){per_sample}, got {weights.shape}.")
    bad = np.argwhere(~np.isfinite(weights))
    if bad.size:
        where = ", ".join(str(int(i)) for i in bad[0])
        raise ValueError(f"mask[{where}] is {weights[tuple(bad[0])]}; every weight must be "
                         "finite.")
    return weights / batch_size if weights.ndim == 2 else weights


def loss_weights(xs: Any, ys: Any, example: Any, mask: Any, chunk_size: Any,
                 reduction: str, batch_size: int | None = None) -> np.ndarray:
    """The host ``(T,)`` weights ``w_t`` of the loss ``Σ_t w_t L_t``, every argument checked.

    ``w_t`` is the mask (all ones for ``None``), divided by its sum for
    ``reduction='mean'``; a ``(T, B)`` mask gives ``(T, B)`` weights ``w_tb``
    (``'mean'``: the mean over the scored (step, sample) pairs).

    Args:
        xs: Inputs, time axis leading, checked against ``example`` (one step).
        ys: Targets, one per step of ``xs``.
        example: The compiled input of one step (``jax.ShapeDtypeStruct`` leaves).
        mask: ``None``, finite ``(T,)`` step weights or ``(T, B)`` weights per step
            and sample.
        chunk_size: ``None`` or a positive int dividing ``T``.
        reduction: One of :data:`REDUCTIONS`.
        batch_size: The learner's batch size (``None``: per sample).

    Raises:
        ValueError: ``reduction`` is unknown; ``xs`` is invalid (see
            :func:`check_inputs`) or has no steps; ``ys`` has another length;
            ``chunk_size`` or ``mask`` is invalid; or the mask sums to 0 with
            ``reduction='mean'``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> example = jax.ShapeDtypeStruct((2,), jnp.float32)
        >>> loss_weights(jnp.ones((4, 2)), jnp.ones((4,)), example, None, 2, 'mean').tolist()
        [0.25, 0.25, 0.25, 0.25]
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    length = check_inputs(xs, example)
    if length == 0:
        raise ValueError("xs has no time steps (T = 0): there is no loss to differentiate. "
                         "Give at least one step.")
    check_targets(ys, length)
    check_chunk_size(chunk_size, length)
    weights = step_weights(mask, length, batch_size)
    if reduction == "mean":
        if not weights.sum():
            raise ValueError(
                "The mask sums to 0, so reduction='mean' (which divides by the mask's sum) "
                "is undefined. Skip this batch, or use reduction='sum', whose gradient is "
                "then zero.")
        weights = weights / weights.sum()
    return weights


def check_signal_inputs(rules: Any, hidden: list[Any], given: dict[str, Any],
                        length: int) -> Any:
    """The algorithm's own per-step inputs, checked (``None`` for the loss's signal).

    Raises:
        ValueError: An input the algorithm's learning signal does not read, or
            one it reads is missing or invalid.
    """
    signal = rules.learning_signal
    unknown = [k for k in given if k != signal.input_name]
    if unknown:
        reads = (f"reads '{signal.input_name}'" if signal.input_name
                 else "reads no per-step input")
        raise ValueError(
            f"Algorithm '{rules.name}' {reads}; got {unknown}. Compile with the "
            "algorithm that reads it (e.g. braintrace.ThreeFactor() for modulators=) or drop "
            "the argument.")
    return signal.check_inputs(rules.graph, hidden, given.get(signal.input_name), length)


def static_chunk_size(chunk_size: Any) -> int | None:
    """A checked ``chunk_size`` as the static argument of the compiled program."""
    return None if chunk_size is None else int(chunk_size)
