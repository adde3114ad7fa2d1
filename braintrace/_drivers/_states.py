"""Helpers that (re)initialise the hidden states of a model for a batch size."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._arguments import check_integer
from braintrace._hidden import HiddenState

__all__ = ["KEEP", "check_batch_size", "check_sample_shapes", "init_states",
           "runs_at_batch_size"]

KEEP: Any = type("Keep", (), {"__repr__": lambda self: "KEEP"})()
"""The default batch size of ``learner.reset`` and ``online.init``: keep the current one
(``None`` means per sample, so it cannot be the default)."""


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
        ValueError: It is not (a float or a bool is not one: then an
            :class:`~braintrace._arguments.ArgumentTypeError`, also a ``TypeError``);
            the message starts with ``name`` and ends with ``note``.
    """
    return check_integer(name, batch_size, minimum=1, what="a positive int or None", note=note)


def _declared_batched(model: nnx.Module, batch_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, sample_shape)`` of the hidden states whose per-sample shape leads with
    ``batch_size``."""
    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, HiddenState):
            sample = tuple(node.get_metadata("sample_shape", node.shape))
            if sample and sample[0] == batch_size:
                found.append((".".join(str(part) for part in path), sample))
    return found


def _step_shapes(model: nnx.Module, example_x: Any, batch_size: int) -> None:
    """Steps a copy of ``model`` abstractly at ``batch_size``; checks its states keep their
    shapes (raises what the model raises)."""
    copy = nnx.clone(model)
    init_states(copy, batch_size)
    before = [tuple(v.shape) for _, v in nnx.iter_graph(copy) if isinstance(v, HiddenState)]
    graphdef, state = nnx.split(copy)
    example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (batch_size, *np.shape(a)[1:]), jnp.result_type(a)), example_x)

    def step(state: Any, x: Any) -> list[tuple[int, ...]]:
        stepped = nnx.merge(graphdef, state, copy=True)
        stepped(x)
        return [v[...] for _, v in nnx.iter_graph(stepped) if isinstance(v, HiddenState)]

    after = [tuple(a.shape) for a in jax.eval_shape(step, state, example)]
    if after != before:
        raise ValueError(f"the hidden states change shape in a step: {before} -> {after}")


def runs_at_batch_size(model: nnx.Module, example_x: Any, batch_size: int | None) -> bool:
    """Whether a copy of ``model``, its states initialised for ``batch_size`` (``None``: per
    sample), steps on ``example_x`` as it is, keeping their shapes (traced for shapes only;
    the model is not touched)."""
    copy = nnx.clone(model)
    init_states(copy, batch_size)
    before = [tuple(v.shape) for _, v in nnx.iter_graph(copy) if isinstance(v, HiddenState)]
    graphdef, state = nnx.split(copy)

    def step(state: Any, x: Any) -> list[Any]:
        stepped = nnx.merge(graphdef, state, copy=True)
        stepped(x)
        return [v[...] for _, v in nnx.iter_graph(stepped) if isinstance(v, HiddenState)]

    try:
        after = jax.eval_shape(step, state, example_x)
    except Exception:  # noqa: BLE001 -- any failure of the model's step means it does not
        return False
    return [tuple(a.shape) for a in after] == before


def check_sample_shapes(model: nnx.Module, example_x: Any, batch_size: int | None) -> None:
    """Refuses hidden states declared with a batch axis, before they are batched again.

    A :class:`~braintrace.HiddenState` is declared per sample and
    :func:`init_states` adds the batch axis. A state declared as
    ``(batch_size, H)`` becomes ``(batch_size, batch_size, H)``: each sample's
    state then mixes every sample's input. Only a state whose declared shape
    leads with ``batch_size`` is suspect; it is refused when the model does not
    run at another batch size (a copy is stepped abstractly at
    ``batch_size + 1``; the model is not touched).

    Args:
        model: The model about to be compiled.
        example_x: One step's input at ``batch_size`` (batch axis leading).
        batch_size: The batch size it is compiled at (``None``: per sample,
            nothing to check).

    Raises:
        ValueError: Such a state (the message names its path, its declared shape
            and the per-sample shape to declare; the model's error is chained).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> class Doubly(nnx.Module):
        ...     def __init__(self):
        ...         self.h = braintrace.HiddenState(jnp.zeros((2, 3)))  # (batch, H)
        ...     def __call__(self, x):
        ...         self.h[...] = 0.5 * self.h[...] + x
        ...         return self.h[...]
        >>> try:
        ...     check_sample_shapes(Doubly(), jnp.ones((2, 3)), 2)
        ... except ValueError as err:
        ...     print(str(err).split(', and')[0])
        Hidden state 'h' was declared with shape (2, 3), which leads with the batch size 2
    """
    suspects = [] if batch_size is None else _declared_batched(model, batch_size)
    if not suspects:
        return
    try:
        _step_shapes(model, example_x, batch_size + 1)
    except Exception as err:  # the model's own error, chained below
        path, sample = suspects[0]
        raise ValueError(
            f"Hidden state '{path}' was declared with shape {sample}, which leads with the "
            f"batch size {batch_size}, and the model does not run at another batch size "
            f"({type(err).__name__}: {err}). braintrace.init_states adds the batch axis "
            f"(here to {(batch_size, *sample)}): declare the per-sample shape "
            f"{sample[1:]} instead, e.g. braintrace.HiddenState(jnp.zeros({sample[1:]})). "
            "Nothing was changed.") from err
