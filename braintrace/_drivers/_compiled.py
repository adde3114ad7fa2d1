"""A model analysed for one algorithm: a compiled graph per mode and batch size.

``braintrace.compile`` analyses one model step (``compile_graph``) and binds the
algorithm to the graph (``algorithm.rules(graph)``). The result depends on the
model's static structure — its graph definition, which holds Flax's mode
attributes (``Dropout.deterministic``, ``BatchNorm.use_running_average``, set by
``model.eval()`` / ``model.train()``) — and on the batch size of its hidden
states. :class:`CompiledModel` keeps one :class:`Entry` per such pair, made the
first time it is asked for (on the host, also while an outer ``jax.jit`` traces)
and reused after: a mode or batch size met before costs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from braintrace._algorithms import AbstractAlgorithm, GraphRules
from braintrace._compiler import ETraceGraph, compile_graph, programs, split_model
from braintrace._drivers._model_state import LeafAvals, leaf_avals, model_leaves, runs_at
from braintrace._drivers._neuron_sharding import hidden_specs, param_specs, trace_specs
from braintrace._drivers._sharding import Layout, batched_leaves, check_mesh, layout
from braintrace._drivers._states import init_states
from braintrace._hidden import state_batch_size

__all__ = ["CompiledModel", "Entry"]


@dataclasses.dataclass(frozen=True, eq=False)
class Entry:
    """What was compiled for one mode and batch size (hashable by identity: a static
    argument of the jitted programs).

    Attributes:
        graph: The compiled graph.
        rules: The algorithm bound to it.
        example: The input of one step, as ``jax.ShapeDtypeStruct`` leaves.
        leaf_avals: Shapes and dtypes of the Params, hidden states and other Variables.
        batch_size: The batch size (``None``: per sample).
        layout: Where each array lives on the mesh (``None`` without one).
        param_dtype: The dtype the Params promote to (the loss weights').
    """

    graph: ETraceGraph
    rules: GraphRules
    example: Any
    leaf_avals: LeafAvals
    batch_size: int | None
    layout: Layout | None
    param_dtype: Any = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        dtypes = (dtype for _, dtype in self.leaf_avals[:self.graph.num_params])
        object.__setattr__(self, "param_dtype", jnp.result_type(*dtypes))


class CompiledModel:
    """The analysis of a model for one algorithm, per mode and batch size (module docstring).

    Args:
        model: The model, hidden states initialised for its batch size.
        algorithm: The algorithm (bound to the model here).
        example_x: The input of one step at that batch size.
        strict: Refuse approximate traces (the graph's or the algorithm's).
        mesh: Data (and neuron) parallel over this mesh, or ``None``.
        data_axis: The mesh axis the batch is split over.
        neuron_axis: The mesh axis the hidden units are split over, or ``None``.
        trace_dtype: The dtype the traces are stored in (checked), or ``None``: the
            algorithm's own.

    Raises:
        ValueError: The model cannot be compiled (the message says why), or
            ``strict`` and the traces are approximate.
    """

    def __init__(self, model: nnx.Module, algorithm: AbstractAlgorithm, example_x: Any, *,
                 strict: bool, mesh: jax.sharding.Mesh | None, data_axis: str | None,
                 neuron_axis: str | None = None, trace_dtype: np.dtype | None = None):
        self.model = model
        self.algorithm = algorithm.bind(model)
        self.trace_dtype = trace_dtype
        self.strict = strict
        self.mesh = mesh
        self.data_axis = data_axis
        self.neuron_axis = neuron_axis
        batch_size = state_batch_size(model)
        self._data_axes: dict[int | None, str | None] = {}
        if mesh is not None:
            self._data_axis_at(batch_size)
        self._entries: dict[tuple[Any, int | None], Entry] = {}
        self._trace_shapes: dict[Entry, Any] = {}
        self._trace_avals: dict[Entry, tuple[Any, list[tuple[Any, Any]]]] = {}
        self._fresh: dict[Entry, Any] = {}
        entry = self._compile(model, example_x, batch_size)
        self.base_batch_size = batch_size
        self._base_example = entry.example
        self._entries[(nnx.graphdef(model), batch_size)] = entry

    # -- entries -----------------------------------------------------------------------

    def entry(self, graphdef: Any, batch_size: int | None) -> Entry:
        """The entry of the model structure (and mode) ``graphdef`` at ``batch_size``.

        Compiled the first time (a copy of the model is merged with ``graphdef`` and
        initialised for ``batch_size``; the live model is not touched).

        Raises:
            ValueError: The model cannot be compiled there (the model's error is chained).
        """
        key = (graphdef, batch_size)
        found = self._entries.get(key)
        if found is None:
            found = self._entries[key] = self._compile_copy(graphdef, batch_size)
        return found

    def entry_of(self, model: nnx.Module, batch_size: int | None) -> Entry:
        """:meth:`entry` for ``model``'s current structure and mode."""
        return self.entry(nnx.graphdef(model), batch_size)

    def _data_axis_at(self, batch_size: int | None) -> str | None:
        """The mesh axis the batch is split over at ``batch_size`` (``None``: not split),
        checked once per batch size (``check_mesh``'s errors)."""
        if batch_size not in self._data_axes:
            self._data_axes[batch_size] = check_mesh(self.mesh, self.data_axis, batch_size,
                                                     self.neuron_axis)
        return self._data_axes[batch_size]

    def _compile_copy(self, graphdef: Any, batch_size: int | None) -> Entry:
        if self.mesh is not None:
            self._data_axis_at(batch_size)
        with jax.ensure_compile_time_eval():
            try:
                copy = nnx.merge(graphdef, nnx.state(self.model), copy=True)
            except Exception as err:
                raise ValueError(
                    "The model's structure changed after braintrace.compile (its Variables "
                    f"no longer match: {type(err).__name__}: {err}). Compile it again with "
                    "braintrace.compile(model, ...).") from err
            init_states(copy, batch_size)
            drop = 0 if self.base_batch_size is None else 1
            example = jax.tree.map(
                lambda s: jnp.zeros(s.shape[drop:] if batch_size is None
                                    else (batch_size, *s.shape[drop:]), s.dtype),
                self._base_example)
            try:
                return self._compile(copy, example, batch_size)
            except Exception as err:
                shapes = [tuple(a.shape) for a in jax.tree.leaves(example)]
                raise ValueError(
                    f"The model cannot be compiled {runs_at(batch_size)} in its current mode "
                    f"(inputs of shape {', '.join(map(str, shapes))}; {type(err).__name__}: "
                    f"{err}). Nothing was changed.") from err

    def _compile(self, model: nnx.Module, example_x: Any, batch_size: int | None) -> Entry:
        graph = compile_graph(model, example_x, strict=self.strict, algorithm=self.algorithm)
        rules = self._rules(graph)
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
                               example_x)
        lay = None if self.mesh is None else self._layout_for(model, rules, example)
        return Entry(graph, rules, example, leaf_avals(model_leaves(model)), batch_size, lay)

    def _rules(self, graph: ETraceGraph) -> GraphRules:
        """The algorithm bound to ``graph``, its traces stored in :attr:`trace_dtype`."""
        rules = self.algorithm.rules(graph)
        if self.trace_dtype is None:
            return rules
        return dataclasses.replace(rules, trace_dtype=self.trace_dtype)

    def _layout_for(self, model: nnx.Module, rules: GraphRules, example: Any) -> Layout:
        """Where each array lives on the mesh: what grows with the batch size is split over
        the data axis, the hidden units over the neuron axis (``_neuron_sharding``)."""
        batch_size = state_batch_size(model)
        at_b = _shapes(model, rules)
        if batch_size is None:
            at_2b = at_b
        else:
            twice = nnx.clone(model)
            init_states(twice, 2 * batch_size)
            example_2b = jax.tree.map(
                lambda s: jnp.zeros((2 * batch_size, *s.shape[1:]), s.dtype), example)
            graph_2b = compile_graph(twice, example_2b, scope=self.algorithm.scope)
            at_2b = _shapes(twice, self._rules(graph_2b))
        axis = self._data_axis_at(batch_size)
        samples = (None if self.neuron_axis is None
                   else _neuron_specs(model, rules.graph, at_b, at_2b, self.mesh, self.neuron_axis))
        return layout(self.mesh, axis, batch_size, at_b, at_2b, samples, self.neuron_axis)

    def batch_size_of(self, hidden: list[Any]) -> int | None:
        """The batch size of hidden-state leaves (``None``: per sample), by their rank."""
        if not hidden:
            return None
        base = self._entries[next(iter(self._entries))]
        graph = base.graph
        shape = base.leaf_avals[graph.num_params][0]
        sample_rank = len(shape) - (self.base_batch_size is not None)
        leaf_shape = np.shape(hidden[0])
        return None if len(leaf_shape) == sample_rank else int(leaf_shape[0])

    # -- traces --------------------------------------------------------------------------

    def zero_traces(self, entry: Entry, params: list[jax.Array]) -> Any:
        """Fresh (zero) traces of ``entry`` for ``params``."""
        return entry.rules.init(programs.operands(entry.graph, params))

    def fresh_traces(self, entry: Entry, params: list[jax.Array]) -> Any:
        """:meth:`zero_traces` as one program (compiled once per entry; made array by array
        they cost a dispatch each, a millisecond per reset on a two-layer network)."""
        if entry not in self._fresh:
            self._fresh[entry] = jax.jit(functools.partial(self.zero_traces, entry))
        return self._fresh[entry](params)

    def trace_shapes(self, entry: Entry) -> Any:
        """The traces of ``entry`` as ``jax.ShapeDtypeStruct`` leaves (computed once per entry:
        an ``eval_shape`` costs ~0.3 ms)."""
        if entry not in self._trace_shapes:
            params = [jax.ShapeDtypeStruct(s, d)
                      for s, d in entry.leaf_avals[:entry.graph.num_params]]
            self._trace_shapes[entry] = jax.eval_shape(lambda p: self.zero_traces(entry, p),
                                                       params)
            leaves, treedef = jax.tree.flatten(self._trace_shapes[entry])
            self._trace_avals[entry] = (treedef, [(a.shape, a.dtype) for a in leaves])
        return self._trace_shapes[entry]

    def trace_mismatch(self, entry: Entry, traces: Any) -> str | None:
        """How ``traces`` differ from ``entry``'s (their structure, or the first array of
        another shape or dtype), in words; ``None`` when they fit.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 2)), batch_size=2)
            >>> compiled, entry = learner.compiled, learner.compiled.entry_of(model, 2)
            >>> compiled.trace_mismatch(entry, learner.traces) is None
            True
            >>> print(compiled.trace_mismatch(entry, []))
            they are 0 arrays as []; this learner's are 2 arrays as [({'bias': *, 'kernel': *},)]
        """
        want = self.trace_shapes(entry)
        want_def, want_avals = self._trace_avals[entry]
        leaves, treedef = jax.tree.flatten(traces)
        if treedef != want_def:
            return f"they are {_structure(traces)}; this learner's are {_structure(want)}"
        if _avals(leaves) == want_avals:
            return None  # each of exactly its shape and dtype (a quick test first)
        return next((f"one is {_aval(b)} where this learner's is {tuple(a.shape)} {a.dtype}"
                     for a, b in zip(jax.tree.leaves(want), leaves, strict=True)
                     if (tuple(a.shape), a.dtype) != (tuple(np.shape(b)), jnp.result_type(b))),
                    None)


def _structure(tree: Any) -> str:
    """A tree's structure in a few words: ``4 arrays as [IOTrace(*, *, *, *)]``."""
    text = str(jax.tree.structure(tree)).removeprefix("PyTreeDef(").removesuffix(")")
    text = re.sub(r"CustomNode\(namedtuple\[(\w+)\], \[([^\]]*)\]\)", r"\1(\2)", text)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{len(jax.tree.leaves(tree))} arrays as {text}"


def _avals(arrays: list[Any]) -> list[tuple[Any, Any]] | None:
    """Each array's ``(shape, dtype)`` as it is (``None`` if one has none: not an array)."""
    try:
        return [(a.shape, a.dtype) for a in arrays]
    except AttributeError:
        return None


def _aval(a: Any) -> str:
    return f"{tuple(np.shape(a))} {jnp.result_type(a)}"


def _neuron_specs(model: nnx.Module, graph: ETraceGraph, at_b: tuple[Any, ...],
                  at_2b: tuple[Any, ...], mesh: jax.sharding.Mesh, axis: str) -> tuple[Any, ...]:
    """The sample spec of every Param, hidden state, other Variable and trace leaf."""
    batched = [batched_leaves(a, b) for a, b in zip(at_b, at_2b, strict=True)]
    _, params_state, _, _ = split_model(model)
    variables = jax.tree.leaves(params_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    params = param_specs(variables, graph.param_paths, mesh, axis)
    hidden = hidden_specs([np.shape(h)[int(b):] for h, b in zip(at_b[1], batched[1])], mesh,
                          axis)
    other = [P() for _ in at_b[2]]
    traces = trace_specs(graph, at_b[3], batched[3], dict(zip(graph.param_paths, params)),
                         mesh, axis)
    return params, hidden, other, traces


def _shapes(model: nnx.Module, rules: GraphRules) -> tuple[Any, ...]:
    leaves = model_leaves(model)
    traces = jax.eval_shape(
        lambda p: rules.init(programs.operands(rules.graph, p)), leaves.params)
    return (*leaves, traces)
