"""Helpers that (re)initialise the hidden states of a model for a batch size."""

from __future__ import annotations

import numbers
from typing import Any

from flax import nnx

from braintrace._hidden import HiddenState

__all__ = ["check_batch_size", "init_states"]


def init_states(model: nnx.Module, batch_size: int | None = None) -> None:
    """Resets every :class:`~braintrace.HiddenState` of ``model`` in place.

    Each state gets its per-sample initial value, broadcast to
    ``(batch_size, *sample_shape)`` (or left per sample when ``batch_size`` is
    ``None``). Call it before the first batched step and whenever the batch
    size changes or a new sequence starts. It also records each state's
    attribute path (metadata ``path``) so that shape errors can name it.

    Args:
        model: Any NNX module (or graph of modules).
        batch_size: Number of samples, or ``None`` for unbatched states.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.LIF(4)
        >>> braintrace.init_states(model, batch_size=2)
        >>> model.v.shape
        (2, 4)
        >>> model.v.get_metadata('path')
        'v'
        >>> braintrace.init_states(model)
        >>> model.v.shape
        (4,)
    """
    if batch_size is not None:
        batch_size = check_batch_size("init_states: batch_size", batch_size)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, HiddenState):
            node.set_value(node.initial_value(batch_size))
            name = ".".join(str(part) for part in path)
            if node.get_metadata("path", None) != name:
                node.set_metadata("path", name)


def check_batch_size(name: str, batch_size: Any, *, note: str = "") -> int:
    """``batch_size`` as an int, after checking it is a positive integer (NumPy ints too).

    Raises:
        ValueError: It is not (a float or a bool is not one); the message starts
            with ``name`` and ends with ``note``.
    """
    if (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1):
        raise ValueError(f"{name} must be a positive int or None, got {batch_size!r}{note}.")
    return int(batch_size)
