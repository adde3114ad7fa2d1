"""Checks of what a learner's call is given: inputs, targets, masks, chunk sizes, reductions.

Every check runs on the host before the compiled program, so a bad argument is
a clear error instead of a wrong result or an error from deep inside XLA.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._arguments import ArgumentTypeError, check_integer

__all__ = [
    "REDUCTIONS",
    "cast_inputs",
    "check_chunk_size",
    "check_example_batch",
    "check_input_dtype",
    "check_inputs",
    "check_mask_dtype",
    "check_signal_inputs",
    "check_targets",
    "loss_weights",
    "refuse_traced",
    "shape_of",
    "static_chunk_size",
    "step_weights",
]

REDUCTIONS = ("mean", "sum")


def shape_of(a: Any) -> tuple[int, ...]:
    """The shape of an array, a ``jax.ShapeDtypeStruct`` or anything ``np.shape`` takes."""
    return tuple(a.shape) if hasattr(a, "shape") else tuple(np.shape(a))


def check_inputs(xs: Any, example: Any, *,
                 another_batch: Callable[[int], str] | None = None) -> int:
    """The number of time steps of ``xs``, after checking each step matches ``example``.

    Args:
        xs: Inputs, time axis leading.
        example: The compiled input of one step (``jax.ShapeDtypeStruct`` leaves).
        another_batch: What to do for inputs of another batch size ``b`` (the
            second axis), as ``another_batch(b)``; by default the stateful
            learner's advice (``learner.reset(batch_size=b)``). When it is given,
            inputs that could be either of another batch size or batch-major are
            told both.

    Raises:
        ValueError: ``xs`` has another structure, leaves of different lengths,
            or a step shape other than the compiled one.
        TypeError: A leaf's dtype cannot stand for the compiled one (see
            :func:`check_input_dtype`).
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
            raise ValueError(_shape_mismatch(shape_of(a), tuple(e.shape), another_batch))
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(xs), examples):
        check_input_dtype(f"xs{jax.tree_util.keystr(path)}", a, e.dtype)
    return lengths.pop()


def check_example_batch(example_x: Any, batch_size: int | None) -> None:
    """Checks that every leaf of ``example_x`` leads with the batch axis of ``batch_size``.

    Raises:
        ValueError: A leaf has no leading axis of ``batch_size`` (the message
            names it, its shape and what to pass); nothing for ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> check_example_batch(jnp.ones((2, 3)), 2)
        >>> try:
        ...     check_example_batch({'a': jnp.ones((3, 3))}, 2)
        ... except ValueError as err:
        ...     print(err)
        example_x['a'] has shape (3, 3), but batch_size=2: the leading axis of every input is
        the batch. Pass an example of shape (2, 3) (or compile with batch_size=3).
    """
    if batch_size is None:
        return
    for path, a in jax.tree_util.tree_leaves_with_path(example_x):
        shape = shape_of(a)
        if not shape or shape[0] != batch_size:
            other = f" (or compile with batch_size={shape[0]})" if shape else ""
            raise ValueError(
                f"example_x{jax.tree_util.keystr(path)} has shape {shape}, but "
                f"batch_size={batch_size}: the leading axis of every input is the batch. Pass "
                f"an example of shape {(batch_size, *shape[1:])}{other}.")


_KINDS = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)


def _kind_rank(dtype: Any) -> int:
    """0 bool, 1 integer, 2 floating (``bfloat16`` too), 3 complex, 4 anything else."""
    return next((rank for rank, kind in enumerate(_KINDS) if jnp.issubdtype(dtype, kind)),
                len(_KINDS))


def check_input_dtype(name: str, a: Any, compiled: Any) -> None:
    """Checks that input ``a`` may stand for an input of dtype ``compiled``.

    Integers may feed a floating-point input (they are promoted), and a float
    of another width a floating-point input (it is cast, see :func:`cast_inputs`),
    but floats may not feed integer indices (e.g. :class:`~braintrace.layers.ETPEmbed`'s)
    nor complex numbers a real input.

    Raises:
        ArgumentTypeError: They may not (a ``TypeError``, also a ``ValueError``);
            the message names the input ``name`` and the dtype to cast to.

    Example:
        >>> import jax.numpy as jnp
        >>> check_input_dtype("xs", jnp.ones((2,), jnp.int32), jnp.float32)
        >>> try:
        ...     check_input_dtype("xs", jnp.ones((2,)), jnp.int32)
        ... except TypeError as err:
        ...     print(err)
        xs has dtype float32, but the model was compiled for int32 inputs (e.g. integer
        indices); cast it: xs.astype(jnp.int32).
    """
    given = np.dtype(a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)
    compiled = np.dtype(compiled)
    if _kind_rank(given) > _kind_rank(compiled):
        hint = " (e.g. integer indices)" if _kind_rank(compiled) == 1 else ""
        raise ArgumentTypeError(
            f"{name} has dtype {given}, but the model was compiled for {compiled} inputs{hint}; "
            f"cast it: {name}.astype(jnp.{compiled}).")


def _shape_mismatch(shape: tuple[int, ...], step: tuple[int, ...],
                    another_batch: Callable[[int], str] | None = None) -> str:
    """Why inputs of ``shape`` do not fit a model compiled for steps of shape ``step``
    (``another_batch``: see :func:`check_inputs`)."""
    got = (f"xs has shape {shape}: {shape[0]} time steps of shape {shape[1:]}, but the model "
           f"was compiled for steps of shape {step}.")
    time_major = "Inputs are time-major: (T, batch, *features)."
    if len(shape) == len(step) + 2 and shape[2:] == step:  # batches on a per-sample model
        b = shape[1]
        other = (another_batch(b) if another_batch is not None
                 else f"call learner.reset(batch_size={b}).")
        return (f"{got} {time_major} The model was compiled for one sample (without batch_size);"
                f" for batches of {b}, compile with braintrace.compile(..., batch_size={b}), or "
                f"{other}")
    batched = len(shape) == len(step) + 1 and len(step) >= 1 and shape[2:] == step[1:]
    swap = (f"This looks batch-major ({step[0]} sequences of {shape[1]} steps): pass "
            "jnp.swapaxes(xs, 0, 1) (and the same for ys).")
    if batched and another_batch is not None:
        other = f"For a batch of {shape[1]}: {another_batch(shape[1])}"
        if shape[0] == step[0]:
            swap = (f"If it is batch-major ({step[0]} sequences of {shape[1]} steps), pass "
                    "jnp.swapaxes(xs, 0, 1) (and the same for ys).")
            return f"{got} {time_major} {other} {swap}"
        return f"{got} {time_major} {other}"
    if batched and shape[0] == step[0]:
        return f"{got} {time_major} {swap}"
    if batched:
        return (f"{got} {time_major} For another batch size than {step[0]}, call "
                f"learner.reset(batch_size={shape[1]}) (or evaluate with learner.evaluate(xs), "
                "which runs at any batch size).")
    return f"{got} {time_major}"


def cast_inputs(xs: Any, example: Any) -> Any:
    """``xs`` with each floating-point leaf cast to the floating dtype it was compiled for.

    A learner's programs carry hidden states and traces in the dtypes they were
    compiled for, so a float input of another width (``float64`` data into a
    ``float32`` learner under ``jax_enable_x64``, ``float32`` data into a
    ``bfloat16`` model) is cast to the compiled input's dtype, as a Flax layer
    casts its input to its compute dtype (``nnx.Linear(..., dtype=...)``).
    Other leaves (integers, booleans) are left as they are: the model promotes
    them as usual. Runs inside ``jit`` (no host work).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> example = jax.ShapeDtypeStruct((2,), jnp.bfloat16)
        >>> cast_inputs(jnp.ones((3, 2), jnp.float32), example).dtype
        dtype(bfloat16)
        >>> cast_inputs(jnp.ones((3, 2), jnp.int32), example).dtype
        dtype('int32')
    """
    leaves, treedef = jax.tree.flatten(xs)
    return jax.tree.unflatten(treedef, [
        jnp.asarray(a, e.dtype) if _float_to_float(jnp.result_type(a), e.dtype) else a
        for a, e in zip(leaves, jax.tree.leaves(example), strict=True)])


def _float_to_float(given: Any, compiled: Any) -> bool:
    """Whether ``given`` and ``compiled`` are two different floating-point dtypes."""
    return (jnp.issubdtype(given, jnp.floating) and jnp.issubdtype(compiled, jnp.floating)
            and np.dtype(given) != np.dtype(compiled))


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
        ValueError: It is not (a float or a bool is not an int: then an
            :class:`~braintrace._arguments.ArgumentTypeError`, also a ``TypeError``).
    """
    if chunk_size is None:
        return
    what = f"a positive int that divides the sequence length {length}"
    note = ". Use None for single-step mode"
    if length % check_integer("chunk_size", chunk_size, minimum=1, what=what, note=note):
        raise ValueError(f"chunk_size must be {what}, got {chunk_size!r}{note}.")


def check_mask_dtype(mask: Any) -> Any:
    """``mask`` (an array, possibly traced), after checking it holds real numbers.

    Raises:
        ArgumentTypeError: Its dtype is complex (the imaginary part would be
            dropped), a string or an object: a ``TypeError``, also a ``ValueError``.

    Example:
        >>> import jax.numpy as jnp
        >>> try:
        ...     check_mask_dtype(jnp.ones(3, jnp.complex64))
        ... except TypeError as err:
        ...     print(err)
        mask must hold real step weights (bool, int or float), got dtype complex64; take
        jnp.abs(mask) or jnp.real(mask).
    """
    dtype = np.dtype(mask.dtype)
    if dtype.kind not in "biuf":
        hint = "; take jnp.abs(mask) or jnp.real(mask)" if dtype.kind == "c" else ""
        raise ArgumentTypeError(
            f"mask must hold real step weights (bool, int or float), got dtype {dtype}{hint}.")
    return mask


def step_weights(mask: Any, length: int, batch_size: int | None = None) -> np.ndarray:
    """The host float64 weights of a mask (all ones for ``None``), checked.

    A mask is ``(T,)`` (one weight per step) or, for a batched learner,
    ``(T, B)`` (one weight per step and sample: padded steps of shorter
    sequences get 0). A ``(T, B)`` mask is returned divided by ``B``, so that
    with a mean-reducing ``loss_fn`` it weighs a step as a ``(T,)`` mask does
    (``Σ_b m_tb ℓ_tb / B``; all ones give ``Σ_t L_t``).

    Raises:
        ValueError: The mask is traced, has another shape, or has a value that
            is not finite.
        ArgumentTypeError: It is not real numbers (complex, strings): a
            ``TypeError`` that is also a ``ValueError``.

    Example:
        >>> step_weights([[1.0, 0.0], [1.0, 1.0]], 2, batch_size=2).tolist()
        [[0.5, 0.0], [0.5, 0.5]]
    """
    if mask is None:
        return np.ones((length,))
    try:
        weights = np.asarray(mask)
    except jax.errors.TracerArrayConversionError as err:
        raise ValueError("mask must be a concrete array (its values are checked on the "
                         "host), not a traced value.") from err
    weights = check_mask_dtype(weights).astype(np.float64)
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


def refuse_traced(method: str, *trees: Any) -> None:
    """Raises a clear error when an eager method is called inside ``jit`` (a traced input).

    Raises:
        TypeError: Some leaf is a tracer.
    """
    if any(map(isinstance, jax.tree.leaves(trees), repeat(jax.core.Tracer))):
        raise TypeError(
            f"{method} is the eager convenience: it checks its arguments on the host and "
            "writes the model, so it cannot run inside jax.jit / nnx.jit. Inside your own "
            "jit-ed train step use the pure functions: online = braintrace.online_grad("
            "learner, loss_fn); state = online.init(model); then grads, state, stats = "
            "online.grad(model, state, xs, ys) (README: 'Inside your own train step').")
