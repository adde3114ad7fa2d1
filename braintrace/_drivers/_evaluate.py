"""Evaluation: run a model over a sequence from fresh hidden states, touching nothing."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from braintrace._drivers._model_state import strong
from braintrace._drivers._states import check_batch_size, init_states

__all__ = ["batch_size_of", "evaluate"]


def evaluate(model: nnx.Module, xs: Any, *, batch_size: int | None) -> Any:
    """The model's outputs over ``xs`` (time axis leading), from its initial hidden states.

    A pure function of the model: it runs a copy, in the model's current mode
    (``model.eval()`` turns Dropout off and BatchNorm to its running averages),
    from every :class:`~braintrace.HiddenState`'s initial value at
    ``batch_size``. Nothing of the model changes (hidden states, RNG counters,
    batch statistics), no eligibility trace is made, and it runs under
    ``jax.jit`` and ``nnx.jit``. Eager calls are compiled once per mode and shape.

    Args:
        model: A stateful NNX module whose call ``model(x)`` is one time step.
        xs: Inputs, time axis leading.
        batch_size: The batch size of ``xs`` (its second axis), or ``None`` for one
            sample without a batch axis.

    Returns:
        The outputs of every step, time axis leading.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> braintrace.evaluate(model, jnp.ones((6, 10, 3)), batch_size=10).shape
        (6, 10, 4)
        >>> model.layers[1].v.shape                  # the model's own state is untouched
        (4,)
    """
    if batch_size is not None:
        batch_size = check_batch_size("evaluate: batch_size", batch_size)
    graphdef, state = nnx.split(model)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((state, xs))):
        return _run(graphdef, state, xs, batch_size)
    return _RUN(graphdef, state, xs, batch_size)


def _run(graphdef: Any, state: Any, xs: Any, batch_size: int | None) -> Any:
    model = nnx.merge(graphdef, state, copy=True)
    init_states(model, batch_size)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(strong, state)  # a weakly typed Variable would change type in the loop

    def step(state, x_t):
        m = nnx.merge(graphdef, state, copy=True)
        y = m(x_t)
        return nnx.split(m)[1], y

    return jax.lax.scan(step, state, xs)[1]


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
