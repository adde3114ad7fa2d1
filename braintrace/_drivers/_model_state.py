"""A learner's state as data: the model's arrays in the order the compiled programs take them.

The drivers (:class:`~braintrace.OnlineLearner`, :class:`~braintrace.OnlineTrainer`)
hold a stateful model; their compiled programs are pure functions of flat lists
of arrays. This module converts between the two:

* :func:`model_leaves` reads the model's Params, hidden states and other
  Variables as a :class:`Leaves` record (in the order of the graph's
  ``param_paths``, ``hidden_paths`` and ``other_paths``);
* :func:`check_leaves` checks them against the shapes and dtypes a program was
  compiled for (:func:`leaf_avals`), with an error that says what to do;
* :func:`write_params` and :func:`write_state` put a program's results back;
* :class:`ModelView` does all three from one walk of the model's graph, for the
  drivers' per-call path; a :class:`ViewCache` keeps it while the graph is unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._compiler import ETraceGraph, split_model
from braintrace._drivers._graph_snapshot import GraphSnapshot

__all__ = [
    "LeafAvals",
    "Leaves",
    "ModelView",
    "ViewCache",
    "check_leaves",
    "leaf_avals",
    "model_leaves",
    "param_state",
    "runs_at",
    "strong",
    "write_params",
    "write_state",
]

LeafAvals = tuple[tuple[tuple[int, ...], Any], ...]


class Leaves(NamedTuple):
    """A model's arrays as the compiled programs take them.

    Attributes:
        params: The Params, in the order of ``graph.param_paths``.
        hidden: The hidden states (strongly typed), in the order of ``graph.hidden_paths``.
        other: Every other Variable (RNG keys, counters), in the order of ``graph.other_paths``.
    """

    params: list[jax.Array]
    hidden: list[jax.Array]
    other: list[jax.Array]


def model_leaves(model: nnx.Module) -> Leaves:
    """The model's Params, hidden states and other Variables as flat lists.

    Example:
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> leaves = model_leaves(model)
        >>> [len(leaves.params), len(leaves.hidden), len(leaves.other)]
        [3, 1, 0]
    """
    _, params, hidden, other = split_model(model)
    return Leaves(jax.tree.leaves(params), [strong(h) for h in jax.tree.leaves(hidden)],
                  jax.tree.leaves(other))


class ModelView:
    """A model's structure and Variables from one walk of its graph (``nnx.split``).

    ``nnx.split`` hands out the model's own Variable objects, so one walk
    serves a whole driver call, and, kept in a :class:`ViewCache`, every call
    while the model's graph is unchanged: the graphdef finds the compiled entry,
    the Variables give the arrays (:meth:`leaves`), take the program's results
    back (:meth:`write_state`, as ``nnx.update`` sets them) and shape the
    gradients (:meth:`param_state`). Separate ``nnx.graphdef`` / ``nnx.split`` /
    ``nnx.update`` calls would walk the graph four times, which dominated a
    learner's time per call on an accelerator.

    Attributes:
        graphdef: The model's structure and mode.
        params: Its Params (an ``nnx.State`` of the model's own Variables).
        hidden: Its differentiable hidden states.
        other: Every other Variable.
        model: The model.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> view = ModelView.of(model)
        >>> view.write_state([jnp.ones((3,))], [])
        >>> model.carry[...].tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, graphdef: Any, params: nnx.State, hidden: nnx.State, other: nnx.State,
                 model: nnx.Module):
        self.graphdef, self.params, self.hidden, self.other = graphdef, params, hidden, other
        self.model = model
        self.params_def = jax.tree.structure(params)
        self._defs = (self.params_def, jax.tree.structure(hidden), jax.tree.structure(other))
        groups = [_variables(state) for state in (params, hidden, other)]
        # Variables one per leaf (a module's bare arrays only nnx.update can replace)
        self._variables = groups if all(
            _one_leaf_each(state, variables)
            for state, variables in zip((params, hidden, other), groups)) else None

    @classmethod
    def of(cls, model: nnx.Module) -> ModelView:
        """The view of ``model`` as it is now."""
        return cls(*split_model(model), model)

    def leaves(self) -> Leaves:
        """The arrays, as :func:`model_leaves` reads them."""
        raw = self._raw_values()
        if raw is not None and all(map(isinstance, chain(*raw), repeat(_ARRAYS))):
            return _strong_hidden(raw)
        return Leaves(jax.tree.leaves(self.params),
                      [strong(h) for h in jax.tree.leaves(self.hidden)],
                      jax.tree.leaves(self.other))

    def checked_leaves(self, graph: ETraceGraph, avals: LeafAvals,
                       batch_size: int | None) -> Leaves:
        """:meth:`leaves`, checked against the compiled ``avals`` (:func:`check_leaves`).

        Where every Variable holds an array of exactly its compiled shape and dtype
        (the usual case), that is found in one pass over the Variables' arrays.
        """
        raw = self._raw_values()
        if raw is not None and _fits(raw, avals):
            return _strong_hidden(raw)
        return check_leaves(self.leaves(), graph, avals, batch_size)

    def _raw_values(self) -> tuple[list[Any], list[Any], list[Any]] | None:
        """The values the Variables hold (params, hidden, other), ``None`` where the model
        also holds bare arrays."""
        if self._variables is None:
            return None
        params, hidden, other = ([*map(_raw_value, group)] for group in self._variables)
        return params, hidden, other

    def variables(self) -> list[nnx.Variable] | None:
        """The model's Variables (Params, hidden states, the rest), ``None`` if it also holds
        bare arrays."""
        return None if self._variables is None else [v for g in self._variables for v in g]

    def param_state(self, arrays: Sequence[jax.Array]) -> nnx.State:
        """``arrays`` (one per Param leaf) in the structure of ``nnx.state(model, nnx.Param)``."""
        return jax.tree.unflatten(self.params_def, list(arrays))

    def write_params(self, params: Sequence[jax.Array]) -> None:
        """Sets the Params (in :class:`Leaves` order) in the model."""
        if not self._set(0, params):
            nnx.update(self.model, self.param_state(params))

    def write_state(self, hidden: Sequence[jax.Array], other: Sequence[jax.Array]) -> None:
        """Sets the hidden states and other Variables (in :class:`Leaves` order) in the model."""
        if not (self._settable(1, hidden) and self._settable(2, other)):
            nnx.update(self.model, jax.tree.unflatten(self._defs[1], list(hidden)),
                       jax.tree.unflatten(self._defs[2], list(other)))
            return
        _set_all(chain(self._variables[1], self._variables[2]), chain(hidden, other))

    def _settable(self, group: int, values: Sequence[jax.Array]) -> bool:
        """Whether Variable ``group`` (params, hidden, other) takes ``values`` one each."""
        return self._variables is not None and len(self._variables[group]) == len(values)

    def _set(self, group: int, values: Sequence[jax.Array]) -> bool:
        """Sets each Variable of ``group`` (the model's own) to the next of ``values``; ``False``
        (nothing set) where :meth:`_settable` says it cannot."""
        if not self._settable(group, values):
            return False
        _set_all(self._variables[group], values)
        return True


class ViewCache:
    """A model's :class:`ModelView`, reused while a :class:`GraphSnapshot` says its graph is
    unchanged (a check of a few microseconds instead of a walk of 0.1–0.3 ms).

    A Param added, removed or replaced, a switched mode (``model.eval()``) or
    any other change of the graph makes a new view (and with it a new graphdef,
    which finds or compiles its own entry); so does another model.

    Example:
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
        >>> views = ViewCache()
        >>> views(model) is views(model)
        True
        >>> model.layers.append(layers.LIF(3))
        >>> views(model).graphdef == nnx.graphdef(model)
        True
    """

    def __init__(self) -> None:
        self._view: ModelView | None = None
        self._snapshot: GraphSnapshot | None = None

    def __call__(self, model: nnx.Module) -> ModelView:
        """The view of ``model`` as it is now."""
        view, snapshot = self._view, self._snapshot
        if view is None or view.model is not model or not snapshot.holds():
            self._snapshot = GraphSnapshot.of(model)
            view = self._view = ModelView.of(model)
        return view


_ARRAYS = (jax.Array, np.ndarray)
_raw_value = nnx.Variable.get_raw_value  # final in Flax: no Variable type overrides it
_shape_dtype = operator.attrgetter("shape", "dtype")


def _strong_hidden(raw: tuple[list[Any], list[Any], list[Any]]) -> Leaves:
    """``raw`` values as :class:`Leaves`, the hidden states strongly typed (:func:`strong`)."""
    params, hidden, other = raw
    return Leaves(params, [*map(strong, hidden)], other)


def _set_all(variables: Iterable[nnx.Variable], values: Iterable[jax.Array]) -> None:
    """Sets each of the model's own ``variables`` to the next of ``values``."""
    for variable, value in zip(variables, values):
        variable.set_raw_value(value)  # as nnx.update sets an array leaf


def _variables(state: nnx.State) -> list[Any]:
    return jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _one_leaf_each(state: nnx.State, variables: list[Any]) -> bool:
    """Whether ``state``'s leaves are Variables holding one leaf each (a module may also
    hold bare arrays, which only ``nnx.update`` can replace)."""
    return (all(isinstance(v, nnx.Variable) for v in variables)
            and len(variables) == len(jax.tree.leaves(state)))


def leaf_avals(leaves: Leaves) -> LeafAvals:
    """The ``(shape, dtype)`` of every leaf, params first: what a program is compiled for."""
    return tuple((tuple(np.shape(a)), jnp.result_type(a)) for group in leaves for a in group)


def check_leaves(leaves: Leaves, graph: ETraceGraph, avals: LeafAvals,
                 batch_size: int | None) -> Leaves:
    """``leaves``, after checking they still have the compiled shapes and dtypes ``avals``.

    Raises:
        ValueError: The model's structure changed after compiling, or a leaf
            has another shape or dtype; the message names the leaf's path and,
            for a hidden state of another batch size, says to call
            ``learner.reset``.
    """
    if _fits(leaves, avals):
        return leaves
    kinds = (["Param"] * len(leaves.params) + ["hidden state"] * len(leaves.hidden)
             + ["Variable"] * len(leaves.other))
    paths = (*graph.param_paths, *graph.hidden_paths, *graph.other_paths)
    flat = [*leaves.params, *leaves.hidden, *leaves.other]
    if len(flat) != len(avals):
        raise ValueError(
            f"The model now has {len(flat)} Param and state arrays, but this learner was "
            f"compiled for {len(avals)}: its structure changed after compiling. "
            "Compile a new learner with braintrace.compile(model, ...).")
    for kind, path, leaf, (shape, dtype) in zip(kinds, paths, flat, avals):
        if tuple(np.shape(leaf)) != shape or jnp.result_type(leaf) != dtype:
            raise ValueError(_changed_leaf(kind, path, leaf, shape, dtype, batch_size))
    return leaves


def _fits(leaves: Sequence[Sequence[Any]], avals: LeafAvals) -> bool:
    """Whether every leaf is an array of exactly its compiled shape and dtype (what
    :func:`check_leaves` accepts, without converting a dtype: a quick test first)."""
    try:
        return tuple(map(_shape_dtype, chain.from_iterable(leaves))) == avals
    except AttributeError:  # not an array
        return False


def _changed_leaf(kind: str, path: str, leaf: Any, shape: tuple[int, ...], dtype: Any,
                  batch_size: int | None) -> str:
    now = f"{tuple(np.shape(leaf))} {jnp.result_type(leaf)}"
    where = f"{kind} '{path}' is {now}, but this learner was compiled for {shape} {dtype}"
    if kind != "hidden state" or jnp.result_type(leaf) != dtype:
        return f"The model's {where}. Compile a new learner with braintrace.compile(model, ...)."
    batched = len(np.shape(leaf)) == len(shape) + (batch_size is None)
    hint = f"batch_size={np.shape(leaf)[0]}" if batched and np.shape(leaf) else ""
    return (f"The model's {where} ({runs_at(batch_size)}); was "
            "braintrace.init_states called on the model after compiling? Call "
            f"learner.reset({hint}) to re-initialise the hidden states and traces for the "
            "batch size you mean (a new batch size is compiled once, then reused).")


def param_state(model: nnx.Module, arrays: Sequence[jax.Array]) -> nnx.State:
    """``arrays`` (one per Param leaf) in the structure of ``nnx.state(model, nnx.Param)``."""
    return ModelView.of(model).param_state(arrays)


def write_params(model: nnx.Module, params: Sequence[jax.Array]) -> None:
    """Writes Param leaves (in :class:`Leaves` order) into the model."""
    ModelView.of(model).write_params(params)


def write_state(model: nnx.Module, hidden: Sequence[jax.Array],
                other: Sequence[jax.Array]) -> None:
    """Writes hidden-state and other Variable leaves (in :class:`Leaves` order) into the model."""
    ModelView.of(model).write_state(hidden, other)


def runs_at(batch_size: int | None) -> str:
    """How a learner at ``batch_size`` runs, in words (for error messages)."""
    return "per sample (no batch axis)" if batch_size is None else f"at batch size {batch_size}"


def strong(a: jax.Array) -> jax.Array:
    """Drops weak typing so a state that comes back from a program hits the same cache."""
    if isinstance(a, jax.Array) and not a.weak_type:
        return a
    a = jnp.asarray(a)
    return jax.lax.convert_element_type(a, a.dtype) if getattr(a, "weak_type", False) else a
