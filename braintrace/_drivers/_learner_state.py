"""What an :class:`~braintrace.OnlineLearner` keeps between calls: hidden state, traces, placement.

The stateful learner's hidden states and other Variables live in its model and
its traces beside it, all at one batch size and, with a mesh, on their
shardings (``entry.layout``). These functions read that state for a program
(:func:`placed_leaves`, :func:`checked_traces`), make it afresh
(:func:`fresh_traces`, :func:`reset_state`), put a model or a saved state on
the mesh (:func:`place_model`, :func:`load_state`), and name it all as a
checkpoint's items (:func:`checkpoint_items`, :func:`restored_state`). Each one
that can fail checks everything before it writes, so a failure leaves the model
as it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx

from braintrace._compiler import ETraceGraph, split_model
from braintrace._drivers._buffers import own_buffers
from braintrace._drivers._checkpoint import Item, leaf_names, optimizer_item
from braintrace._drivers._compiled import CompiledModel, Entry
from braintrace._drivers._model_state import (
    Leaves,
    ModelView,
    model_leaves,
    runs_at,
    strong,
    write_params,
    write_state,
)
from braintrace._drivers._sharding import place
from braintrace._drivers._states import check_batch_size, init_states
from braintrace._hidden import HiddenState

__all__ = ["Reset", "checked_traces", "checkpoint_items", "fresh_traces", "load_state",
           "place_model", "placed_leaves", "reset_state", "restored_state"]


def placed_leaves(view: ModelView, entry: Entry, batch_size: int | None) -> Leaves:
    """The Params, hidden states and other Variables of ``view``'s model for ``entry``'s
    programs, checked against what was compiled (:meth:`ModelView.checked_leaves`) and on
    the mesh."""
    leaves = view.checked_leaves(entry.graph, entry.leaf_avals, batch_size)
    lay = entry.layout
    if lay is None:
        return leaves
    return Leaves(place(leaves.params, lay.params), place(leaves.hidden, lay.hidden),
                  place(leaves.other, lay.other))


def checked_traces(compiled: CompiledModel, entry: Entry, traces: Any) -> Any:
    """``traces``, after checking they fit ``entry`` (a mode may change what is traced).

    Raises:
        ValueError: They do not: the message says to call ``learner.reset()``.
    """
    if compiled.trace_mismatch(entry, traces) is not None:
        raise ValueError(
            "The model's mode (model.eval() / model.train()) or structure changed which "
            "operations are traced since the traces were made; call learner.reset() to "
            "start fresh traces in this mode.")
    return traces


def place_model(model: nnx.Module, entry: Entry) -> None:
    """Puts the model's Params and states on ``entry``'s mesh (nothing without one)."""
    lay = entry.layout
    if lay is not None:
        params, hidden, other = model_leaves(model)
        write_params(model, place(params, lay.params))
        write_state(model, place(hidden, lay.hidden), place(other, lay.other))


def fresh_traces(compiled: CompiledModel, entry: Entry, model: nnx.Module) -> Any:
    """Zero traces of ``entry`` for the model's Params, on the mesh, each array its own."""
    params = model_leaves(model).params
    traces = own_buffers(compiled.zero_traces(entry, params), params)
    return traces if entry.layout is None else place(traces, entry.layout.traces)


def reset_state(compiled: CompiledModel, model: nnx.Module, batch_size: int | None,
                target: Any) -> tuple[int | None, Any]:
    """Re-initialises the model's hidden states at ``target`` and makes fresh traces for it.

    Args:
        compiled: The learner's analysis of the model.
        model: The model (its hidden states are written, and it is placed on the mesh).
        batch_size: The batch size the learner runs at now (for messages).
        target: The new batch size (``None``: per sample).

    Returns:
        The checked batch size, and the traces (on the mesh).

    Raises:
        ValueError: ``target`` is not a positive int or ``None``, or the model
            cannot run at it (the model's error is chained); the model is then
            unchanged.
    """
    if target is not None:
        target = check_batch_size("reset: batch_size", target, note="; the learner is unchanged")
    try:
        entry = compiled.entry_of(model, target)
        fresh = nnx.clone(model)
        init_states(fresh, target)
        traces = compiled.fresh_traces(entry, model_leaves(fresh).params)
    except ValueError as err:
        raise ValueError(
            f"reset(batch_size={target}): {err} The learner is unchanged and still runs "
            f"{runs_at(batch_size)}.") from err
    init_states(model, target)
    place_model(model, entry)
    return target, traces if entry.layout is None else place(traces, entry.layout.traces)


class Reset(NamedTuple):
    """A reset that worked, to repeat while the model's graph is unchanged (its
    :class:`ModelView` is the same): each hidden state's initial value, as
    :func:`reset_state` set it, at ``entry``.

    Repeating it sets those arrays again (never written in place, they can be
    shared) and makes the traces with :meth:`CompiledModel.fresh_traces`,
    without the trial on a copy of the model, which cost milliseconds.
    """

    entry: Entry
    states: list[tuple[HiddenState, jax.Array]]

    @classmethod
    def after(cls, view: ModelView, entry: Entry) -> Reset | None:
        """What :func:`reset_state` just set in ``view``'s model at ``entry``; ``None`` where
        it cannot be repeated so (a bare array, a hook on a state's value)."""
        variables = view.variables()
        if variables is None:
            return None
        states = [(v, v.get_raw_value()) for v in variables if isinstance(v, HiddenState)]
        if any(not isinstance(value, jax.Array) or v.has_metadata("on_set_value")
               or v.has_metadata("on_get_value") for v, value in states):
            return None
        return cls(entry, states)

    def repeat(self, compiled: CompiledModel, view: ModelView) -> Any:
        """Sets the initial values again; returns fresh traces (on the mesh), or ``None``
        (nothing set) if a state's dtype changed since (its initial value would too)."""
        if any(getattr(v.get_raw_value(), "dtype", None) != value.dtype
               for v, value in self.states):
            return None
        for variable, value in self.states:
            variable.set_raw_value(value)
        traces = compiled.fresh_traces(self.entry, view.leaves().params)
        lay = self.entry.layout
        return traces if lay is None else place(traces, lay.traces)


def load_state(model: nnx.Module, entry: Entry, state: dict[str, Any]) -> Any:
    """Writes a learner's ``state()`` (Params, hidden and other state) into the model, on
    ``entry``'s mesh; returns its traces (on the mesh)."""
    lay = entry.layout
    if lay is not None:
        state = {"params": place(state["params"], lay.params),
                 "hidden": place(state["hidden"], lay.hidden),
                 "other": place(state["other"], lay.other),
                 "traces": place(state["traces"], lay.traces)}
    write_params(model, state["params"])
    write_state(model, state["hidden"], state["other"])
    return state["traces"]


def checkpoint_items(model: nnx.Module, graph: ETraceGraph, traces: Any,
                     optimizer: nnx.Optimizer | None) -> dict[str, Item]:
    """A learner's Params, hidden and other state and traces (and ``optimizer``'s state) as
    the named items of a checkpoint (``_checkpoint.py``): each Variable under its path."""
    _, params, hidden, other = split_model(model)
    items = {"params": Item(params, [f"params/{p}" for p in graph.param_paths]),
             "hidden": Item(hidden, [f"hidden/{p}" for p in graph.hidden_paths]),
             "other": Item(other, [f"other/{p}" for p in graph.other_paths]),
             "traces": Item(traces, leaf_names("traces", traces), flax=False)}
    if optimizer is not None:
        items["optimizer"] = optimizer_item(optimizer)
    return items


def restored_state(restored: dict[str, Any]) -> dict[str, Any]:
    """The restored items of :func:`checkpoint_items` as a learner's ``state()``."""
    return {"params": jax.tree.leaves(restored["params"]),
            "hidden": [strong(h) for h in jax.tree.leaves(restored["hidden"])],
            "other": jax.tree.leaves(restored["other"]),
            "traces": restored["traces"]}
