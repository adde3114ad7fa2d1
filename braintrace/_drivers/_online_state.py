"""What the pure functions carry from one call to the next: :class:`OnlineState`, made and checked.

:func:`~braintrace.online_grad` and :func:`~braintrace.online_update` are pure
in the hidden state and the traces: those live in an :class:`OnlineState` that
the caller carries. This module

* makes one (:func:`init_state`): the model's hidden states as they are, or
  fresh ones at any batch size (each batch size is compiled once, then reused),
  every array its own, so a train step may donate the state;
* checks one given to a call (:func:`check_state`): a state made by another
  learner, algorithm, batch size or model is a clear error naming what differs,
  not an error from inside the time loop;
* writes back what belongs to the model rather than to a sequence
  (:func:`write_model_variables`): its RNG counters and batch statistics
  advance with every call, as a call of the model itself advances them.

Every check reads shapes, dtypes and tree structure only: nothing syncs with the
host, so all of it runs while the caller's ``jit`` traces.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._compiler import leaf_paths, split_model
from braintrace._drivers._buffers import own_buffers
from braintrace._drivers._compiled import CompiledModel, Entry
from braintrace._drivers._model_state import Leaves, check_leaves, runs_at, strong
from braintrace._drivers._states import KEEP, check_batch_size, init_states
from braintrace._hidden import HiddenState

__all__ = ["CheckedState", "OnlineState", "check_state", "compiled_of", "init_state",
           "write_model_variables"]


_MAKE_ONE = ("Make the state with this learner's init: state = online.init(model), or "
             "online.init(model, batch_size=...) for another batch size.")


class OnlineState(NamedTuple):
    """What online learning carries from one call to the next (a pytree).

    Attributes:
        hidden: The model's differentiable hidden states, an ``nnx.State``.
        other: Its other Variables (RNG counters, batch statistics, integer
            states), an ``nnx.State``.
        traces: The algorithm's eligibility traces.
    """

    hidden: nnx.State
    other: nnx.State
    traces: Any


class CheckedState(NamedTuple):
    """An :class:`OnlineState` checked for a call: what it runs, and its arrays.

    Attributes:
        entry: What was compiled for the model's mode at the state's batch size.
        leaves: The model's Params and the state's hidden states and other
            Variables, flat, in the graph's order.
        hidden_def: The tree structure of ``state.hidden``.
        other_def: The tree structure of ``state.other``.
        model_other_def: The tree structure of the model's own other Variables
            (``nnx.Variable`` leaves, for :func:`write_model_variables`).
    """

    entry: Entry
    leaves: Leaves
    hidden_def: Any
    other_def: Any
    model_other_def: Any


def compiled_of(name: str, learner: Any) -> CompiledModel:
    """The analysis a pure function runs (``learner.compiled``), after checking ``learner``.

    Raises:
        TypeError: ``learner`` is not what :func:`braintrace.compile` returns
            (a model, for instance); the message says how to make one.
    """
    compiled = getattr(learner, "compiled", None)
    if isinstance(compiled, CompiledModel):
        return compiled
    what = ("an nnx.Module (the model itself)" if isinstance(learner, nnx.Module)
            else f"a {type(learner).__name__}")
    raise TypeError(
        f"braintrace.{name} takes the learner that braintrace.compile returns, got {what}. "
        f"Compile the model first: learner = braintrace.compile(model, algorithm, example_x, "
        f"batch_size=...); then braintrace.{name}(learner, ...).")


def init_state(compiled: CompiledModel, model: nnx.Module, batch_size: Any = KEEP
               ) -> OnlineState:
    """The state online learning starts from, with zero traces.

    It is a value: every array in it is its own, neither the model's (copied
    where it would be) nor another leaf's, so a train step may donate it
    (``nnx.jit(step, donate_argnums=...)``) and the model keeps its arrays.

    Args:
        compiled: The learner's analysis of the model.
        model: The model (read, never written).
        batch_size: ``KEEP`` (the default): the model's hidden states and other
            Variables as they are. Otherwise every hidden state's initial value at
            this batch size (``None``: per sample), as :func:`braintrace.init_states`
            gives, on a copy; the model's other Variables (RNG counters, batch
            statistics) as they are.

    Raises:
        ValueError: ``batch_size`` is not a positive int or ``None``, or the model
            cannot be compiled at it (the model's error is chained).
    """
    held = jax.tree.leaves(nnx.state(model))
    if batch_size is not KEEP:
        if batch_size is not None:
            batch_size = check_batch_size("init: batch_size", batch_size)
        model = nnx.clone(model)
        init_states(model, batch_size)
    _, params, hidden, other = split_model(model)
    hidden = jax.tree.map(strong, hidden)
    entry = compiled.entry_of(model, compiled.batch_size_of(jax.tree.leaves(hidden)))
    traces = compiled.zero_traces(entry, jax.tree.leaves(params))
    return own_buffers(OnlineState(hidden, other, traces), held)


def check_state(name: str, compiled: CompiledModel, model: nnx.Module, state: Any
                ) -> CheckedState:
    """The entry ``state`` runs in and its arrays, after checking it was made for this learner.

    The state's batch size (its hidden states') chooses the entry: a batch size
    met for the first time is compiled then (also while a ``jit`` traces).

    Args:
        name: The call, for messages (``'online_grad: grad'``).
        compiled: The learner's analysis of the model.
        model: The model (its Params and mode).
        state: What the caller passed as the state.

    Raises:
        TypeError: ``state`` is not an :class:`OnlineState`.
        ValueError: It was made for another model (other hidden states or
            Variables), by another learner (another algorithm, or the traces of
            another batch size or model mode), or the model's Params changed
            after compiling. Each message names what differs and what to do.
    """
    if not isinstance(state, OnlineState):
        raise TypeError(_not_a_state(name, state))
    _, params, hidden, other = split_model(model)
    for field, given, want in (("hidden", state.hidden, hidden), ("other", state.other, other)):
        if leaf_paths(given) != leaf_paths(want):
            raise ValueError(
                f"{name}: state.{field} holds {_listed(leaf_paths(given))}, but the model's "
                f"{'hidden states are' if field == 'hidden' else 'other Variables are'} "
                f"{_listed(leaf_paths(want))}: the state was made for another model. "
                f"{_MAKE_ONE}")
    state_hidden = [strong(h) for h in jax.tree.leaves(state.hidden)]
    state_other = jax.tree.leaves(state.other)
    batch_size = compiled.batch_size_of(state_hidden)
    entry = compiled.entry_of(model, batch_size)
    _check_state_arrays(name, entry, state_hidden, state_other)
    leaves = check_leaves(Leaves(jax.tree.leaves(params), state_hidden, state_other),
                          entry.graph, entry.leaf_avals, batch_size)
    _check_traces(name, compiled, entry, state.traces)
    return CheckedState(entry, leaves, jax.tree.structure(state.hidden),
                        jax.tree.structure(state.other), jax.tree.structure(other))


def write_model_variables(name: str, model: nnx.Module, model_other_def: Any,
                          other: list[Any]) -> None:
    """Writes the model's own Variables after a call into ``model``.

    ``other`` are the other Variables after the call (in the graph's order);
    those that belong to the model rather than to a sequence, every one but a
    :class:`~braintrace.HiddenState` (RNG counters, batch statistics), are
    written, as a call of the model advances them. Under ``nnx.jit`` the write
    reaches the caller's model; under ``jax.jit`` it is dropped, as for any
    Flax module (the state's ``other`` still carries it).

    Raises:
        flax.errors.TraceContextError: ``model`` was closed over by a ``jax.jit``-ed
            function, where Flax refuses to write it (as it refuses a call of the
            model there); the message says to pass the model as an argument.
    """
    written = nnx.filter_state(jax.tree.unflatten(model_other_def, list(other)),
                               nnx.Not(HiddenState))
    try:
        nnx.update(model, written)
    except flax.errors.TraceContextError as err:
        raise flax.errors.TraceContextError(
            f"{name} writes the model's RNG counters and batch statistics "
            f"({_listed(leaf_paths(written))}) after the sequence, as a call of the model "
            "does, but the model was closed over by a jit-ed function, where Flax cannot "
            "write it. Pass the model as an argument: nnx.jit(lambda model, state, xs, ys: "
            "...)(model, state, xs, ys) keeps the new values in it.") from err


def _not_a_state(name: str, state: Any) -> str:
    """Why ``state`` is not an :class:`OnlineState`, and what to pass."""
    pair = (isinstance(state, tuple) and len(state) == 2
            and isinstance(state[1], OnlineState))
    hint = (" It looks like the (opt_state, state) pair of online_update's init: pass its "
            "second item." if pair else "")
    return (f"{name}: state must be the braintrace.OnlineState that init(model) returns, got "
            f"a {type(state).__name__}.{hint}")


def _listed(paths: tuple[str, ...]) -> str:
    shown = ", ".join(repr(p) for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
    return f"[{shown}]" if paths else "nothing"


def _aval(a: Any) -> str:
    return f"{tuple(np.shape(a))} {jnp.result_type(a)}"


def _check_state_arrays(name: str, entry: Entry, hidden: list[Any], other: list[Any]) -> None:
    """Checks the state's hidden states and other Variables have the shapes and dtypes the
    learner runs them at (at the state's batch size). Another number of them is a model whose
    structure changed after compiling: ``check_leaves`` says so."""
    graph = entry.graph
    avals = entry.leaf_avals[graph.num_params:]
    fields = [("hidden", p) for p in graph.hidden_paths] + [("other", p)
                                                           for p in graph.other_paths]
    if len(fields) != len(hidden) + len(other):
        return
    for (field, path), leaf, (shape, dtype) in zip(fields, [*hidden, *other], avals,
                                                  strict=True):
        if tuple(np.shape(leaf)) != shape or jnp.result_type(leaf) != dtype:
            raise ValueError(
                f"{name}: state.{field} '{path}' is {_aval(leaf)}, but this learner runs it as "
                f"{shape} {dtype} ({runs_at(entry.batch_size)}): the state was made by another "
                f"learner or for another model. {_MAKE_ONE}")


def _check_traces(name: str, compiled: CompiledModel, entry: Entry, traces: Any) -> None:
    """Checks ``traces`` have the structure, shapes and dtypes of ``entry``'s traces."""
    detail = compiled.trace_mismatch(entry, traces)
    if detail is not None:
        raise ValueError(
            f"{name}: state.traces were not made by this learner, which runs algorithm "
            f"'{entry.rules.name}' {runs_at(entry.batch_size)} in the model's current mode "
            f"({detail}). The state was made by another learner (another algorithm, model or "
            "trace_dtype), or before the model's mode changed (model.eval() / model.train()). "
            f"{_MAKE_ONE}")
