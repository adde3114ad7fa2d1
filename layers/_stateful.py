"""``Stateful``: keeps a cell's carry in hidden states so that ``model(x)`` is one time step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from braintrace._hidden import HiddenState

from ._checks import check_step_input

__all__ = ["Stateful"]


def _is_state(node: Any) -> bool:
    return isinstance(node, HiddenState)


def _key_name(key: Any) -> str:
    for field in ("idx", "key", "name"):
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _initial_carry(cell: nnx.Module, rngs: nnx.Rngs | None) -> Any:
    """``cell.initialize_carry((in_features,), rngs)``; without ``rngs``, a failure is a
    ValueError naming the cell and the argument to pass."""
    if rngs is not None:
        return cell.initialize_carry((cell.in_features,), rngs)
    try:
        return cell.initialize_carry((cell.in_features,), None)
    except (ValueError, TypeError, AttributeError) as error:
        cls = type(cell)
        name = f"nnx.{cls.__name__}" if cls.__module__.startswith("flax.") else cls.__name__
        raise ValueError(
            f"Stateful({name}) was given no rngs, but {name}.initialize_carry needs them to "
            f"draw the initial carry ({type(error).__name__}: {error}). A Flax cell's "
            "initialize_carry takes rngs: pass them as layers.Stateful(cell, "
            "rngs=nnx.Rngs(0)).") from error


class Stateful(nnx.Module):
    """Wraps a Flax-protocol cell so that a call is one time step on stored state.

    The cell's per-sample carry (from ``cell.initialize_carry((in_features,),
    rngs)``) is kept in :class:`~braintrace.HiddenState`\\ s at ``carry``, one
    per carry array (``(c, h)`` for an LSTM), each ``(hidden_features,)`` per
    sample. ``model(x)`` reads the carry, steps the cell and writes it back, so
    stateful layers compose in ordinary NNX modules (e.g. ``nnx.Sequential``);
    use :func:`braintrace.init_states` to batch or reset them.

    Args:
        cell: A cell with ``__call__(carry, x) -> (carry, y)``,
            ``initialize_carry(input_shape, rngs)`` and ``in_features``.
        rngs: Passed to ``initialize_carry`` (Flax's own cells, such as
            ``nnx.GRUCell``, require it; braintrace's cells start at zeros
            without it).

    Raises:
        ValueError: ``rngs`` is not given and ``cell.initialize_carry`` fails
            without it (the message names the cell and says to pass ``rngs=``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> rngs = nnx.Rngs(0)
        >>> model = nnx.Sequential(layers.Stateful(layers.GRUCell(3, 8, rngs=rngs)),
        ...                        layers.Stateful(layers.LSTMCell(8, 2, rngs=rngs)))
        >>> braintrace.init_states(model, batch_size=4)
        >>> model(jnp.ones((4, 3))).shape
        (4, 2)
        >>> [s.shape for s in model.layers[1].carry]
        [(4, 2), (4, 2)]
    """

    def __init__(self, cell: nnx.Module, *, rngs: nnx.Rngs | None = None):
        carry = _initial_carry(cell, rngs)
        self.cell = cell
        self.carry = nnx.data(jax.tree.map(HiddenState, carry))

    def __call__(self, x: ArrayLike) -> Any:
        """One step on ``x`` of shape ``(*batch, in_features)``; returns the cell's output."""
        with_paths = jax.tree_util.tree_flatten_with_path(self.carry, is_leaf=_is_state)[0]
        states = [state for _, state in with_paths]
        attr = ".".join(["carry", *(_key_name(key) for key in with_paths[0][0])])
        name = f"{type(self).__name__}({type(self.cell).__name__})"
        check_step_input(name, jnp.shape(x), states[0], self.cell.in_features, attr)
        carry = jax.tree.map(lambda s: s[...], self.carry, is_leaf=_is_state)
        carry, y = self.cell(carry, x)
        for state, value in zip(states, jax.tree.leaves(carry), strict=True):
            state[...] = value.astype(state[...].dtype)
        return y
