"""Evaluation: run a model over a sequence from fresh hidden states, touching nothing."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._compiler import leaf_paths
from braintrace._drivers._model_state import strong
from braintrace._drivers._states import check_batch_size, init_states

__all__ = ["SECOND_AXIS", "batch_size_of", "evaluate"]

SECOND_AXIS: Any = type("SecondAxis", (), {"__repr__": lambda self: "xs.shape[1]"})()
"""The default batch size of :func:`evaluate`: the second axis of ``xs`` (time-major inputs)."""


def evaluate(model: nnx.Module, xs: Any, *, batch_size: int | None = SECOND_AXIS) -> Any:
    """The model's outputs over ``xs`` (time axis leading), from its initial hidden states.

    A pure function of the model: it runs a copy, in the model's current mode
    (``model.eval()`` turns Dropout off and BatchNorm to its running averages),
    from every :class:`~braintrace.HiddenState`'s initial value at
    ``batch_size``. Nothing of the model changes (hidden states, RNG counters,
    batch statistics), no eligibility trace is made, and it runs under
    ``jax.jit`` and ``nnx.jit``. Eager calls are compiled once per mode and shape.
    ``xs`` is given to the model as it is (its layers promote or cast it as they
    do in a call of the model; ``learner.evaluate`` casts float inputs to the
    compiled dtype first).

    Args:
        model: A stateful NNX module whose call ``model(x)`` is one time step.
        xs: Inputs, time axis leading: ``(T, batch, *features)``.
        batch_size: The batch size of ``xs``, by default its second axis
            (``xs.shape[1]``, of every leaf); ``None`` for one sample without a batch
            axis, ``(T, *features)``.

    Returns:
        The outputs of every step, time axis leading.

    Raises:
        ValueError: ``batch_size`` is not a positive int or ``None``; it is not given
            and the leaves of ``xs`` have no second axis, or second axes of different
            lengths; the model's step fails on ``xs`` because its second axis is not the batch
            (batch-major inputs, or another batch size: the message says which to
            pass; the model's error is chained); or a step changes a state's
            dtype (a float input of another width: the message names the state and
            the dtype to cast ``xs`` to).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> braintrace.evaluate(model, jnp.ones((6, 10, 3))).shape  # batch_size=10
        (6, 10, 4)
        >>> model.layers[1].v.shape                  # the model's own state is untouched
        (4,)
        >>> braintrace.evaluate(model, jnp.ones((6, 3)), batch_size=None).shape  # one sample
        (6, 4)
    """
    inferred = batch_size is SECOND_AXIS
    if inferred:
        batch_size = _second_axis(xs)
    elif batch_size is not None:
        batch_size = check_batch_size("evaluate: batch_size", batch_size)
    graphdef, state = nnx.split(model)
    traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((state, xs)))
    try:
        return (_run if traced else _RUN)(graphdef, state, xs, batch_size)
    except Exception as err:  # the model's own error, told in terms of xs where that fits
        hint = _batch_axis_hint(xs, batch_size)
        if hint is None and inferred:
            hint = (f"batch_size was taken from xs's second axis ({batch_size}), and the model "
                    "fails on it. Inputs are time-major: (T, batch, *features); for one "
                    "sequence without a batch axis, (T, *features), pass batch_size=None.")
        if hint is None:
            raise
        raise ValueError(f"evaluate: {hint}") from err


def _second_axis(xs: Any) -> int:
    """The common length of the second axis of ``xs``'s leaves (the batch of time-major inputs).

    Raises:
        ValueError: A leaf has no second axis, or they differ.
    """
    shapes = [tuple(np.shape(a)) for a in jax.tree.leaves(xs)]
    lengths = {s[1] if len(s) >= 2 else None for s in shapes}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(
            f"evaluate: batch_size is by default the second axis of xs (time-major: T, batch, "
            f"*features), but xs has shape(s) {', '.join(map(str, shapes))}. Pass batch_size: "
            "None for one sequence without a batch axis, or the batch size.")
    return int(lengths.pop())


def _batch_axis_hint(xs: Any, batch_size: int | None) -> str | None:
    """What is wrong with ``xs`` when its second axis is not ``batch_size``, else ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> print(_batch_axis_hint(jnp.ones((4, 7, 2)), 4))
        xs has shape (4, 7, 2), but batch_size=4. Inputs are time-major: (T, batch,
        *features). This looks batch-major (4 sequences of 7 steps): pass
        jnp.swapaxes(xs, 0, 1).
        >>> print(_batch_axis_hint(jnp.ones((7, 3, 2)), 4))
        xs has shape (7, 3, 2), but batch_size=4. Inputs are time-major: (T, batch,
        *features), so its second axis is a batch of 3: pass batch_size=3.
        >>> print(_batch_axis_hint(jnp.ones((7, 4, 2)), 4))
        None
    """
    if batch_size is None:
        return None
    for path, a in jax.tree_util.tree_leaves_with_path(xs):
        shape = tuple(np.shape(a))
        if len(shape) < 2 or shape[1] == batch_size:
            continue
        got = (f"xs{jax.tree_util.keystr(path)} has shape {shape}, but batch_size={batch_size}. "
               "Inputs are time-major: (T, batch, *features)")
        if shape[0] == batch_size:
            return (f"{got}. This looks batch-major ({batch_size} sequences of {shape[1]} "
                    "steps): pass jnp.swapaxes(xs, 0, 1).")
        return f"{got}, so its second axis is a batch of {shape[1]}: pass batch_size={shape[1]}."
    return None


def _run(graphdef: Any, state: Any, xs: Any, batch_size: int | None) -> Any:
    model = nnx.merge(graphdef, state, copy=True)
    init_states(model, batch_size)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(strong, state)  # a weakly typed Variable would change type in the loop

    def step(state, x_t):
        m = nnx.merge(graphdef, state, copy=True)
        y = m(x_t)
        new = nnx.split(m)[1]
        _check_kept_dtypes(state, new, x_t)
        return new, y

    return jax.lax.scan(step, state, xs)[1]


def _check_kept_dtypes(state: Any, new: Any, x_t: Any) -> None:
    """Refuses a step that changes a Variable's dtype (a float input wider than the model's
    state, written with ``set_value``): the scan over time cannot carry it."""
    for path, old, now in zip(leaf_paths(state), jax.tree.leaves(state), jax.tree.leaves(new)):
        if jnp.result_type(old) != jnp.result_type(now):
            given = sorted({str(jnp.result_type(a)) for a in jax.tree.leaves(x_t)})
            raise ValueError(
                f"evaluate: one step of the model changes '{path}' from "
                f"{jnp.result_type(old)} to {jnp.result_type(now)} (xs is {', '.join(given)}); "
                "each state must keep its dtype over the sequence. Cast the inputs to the "
                f"model's dtype: xs.astype(jnp.{jnp.result_type(old)}).")


_RUN = jax.jit(_run, static_argnames=("graphdef", "batch_size"))


def batch_size_of(xs: Any, example: Any, compiled_batch_size: int | None) -> int | None:
    """The batch size of ``xs`` (``None``: per sample), by the rank of the compiled step input.

    Args:
        xs: Inputs, time axis leading, with or without a batch axis second.
        example: One step's input as compiled (``example_x``).
        compiled_batch_size: The batch size ``example`` has (``None``: no batch axis).

    Raises:
        ValueError: ``xs`` has neither rank.
    """
    example = jax.tree.leaves(example)[0]
    leaf = jax.tree.leaves(xs)[0]
    sample_rank = len(example.shape) - (compiled_batch_size is not None)
    if np.ndim(leaf) == sample_rank + 1:
        return None
    if np.ndim(leaf) == sample_rank + 2:
        return int(np.shape(leaf)[1])
    raise ValueError(
        f"xs has shape {np.shape(leaf)}; evaluate takes (T, batch, *features) or "
        f"(T, *features) with features of rank {sample_rank} (the compiled step's input "
        f"{tuple(example.shape)}).")
