"""``braintrace.compile``: a model and an algorithm, ready to learn online."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._algorithms import AbstractAlgorithm, get_algorithm
from braintrace._algorithms._scan import evolve, online_gradients
from braintrace._algorithms._windowed import windowed_gradients
from braintrace._checkpoint import leaf_names, restore_arrays, save_arrays
from braintrace._compiler._compile import compile_graph
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler import _programs as programs
from braintrace._compiler._step import split_model
from braintrace._hidden import HiddenState
from braintrace._inputs import check_chunk_size, check_inputs, shape_of, step_weights
from braintrace._states import init_states

__all__ = ["OnlineLearner", "compile"]

REDUCTIONS = ("mean", "sum")
UNCHANGED = ("the model's Params and hidden state and the learner's traces are as they were "
             "before this call")


def compile(  # noqa: A001  (the verb users expect: braintrace.compile)
    model: nnx.Module,
    algorithm: str | AbstractAlgorithm,
    example_x: Any,
    *,
    batch_size: int | None = None,
    strict: bool = False,
) -> OnlineLearner:
    """Compiles a stateful model for online learning with ``algorithm``.

    Initialises the hidden states for ``batch_size`` (when given), compiles one
    step into an eligibility-trace graph and initialises the traces.

    Args:
        model: An NNX module whose call ``model(x)`` is one time step.
        algorithm: An instance (``braintrace.D_RTRL()``) or a name: ``'d_rtrl'``,
            ``'es_d_rtrl'``, ``'pp_prop'``, ``'eprop'``, ``'ostl_recurrent'``,
            ``'ostl_feedforward'``.
        example_x: The input of one step (with its batch axis, if batched).
        batch_size: Batch size to initialise hidden states for; ``None`` keeps
            the states as they are.
        strict: Refuse a model whose eligibility traces would be approximate
            (``learner.graph.approximations``; the report lists them), so that
            D-RTRL equals BPTT. The same-step gradient is exact either way.

    Returns:
        An :class:`OnlineLearner`.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.rnn = layers.LIF(4)
        ...         self.w_in = layers.ETPLinear(3, 4, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.rnn(self.w_in(x))
        >>> learner = braintrace.compile(Net(nnx.Rngs(0)), 'd_rtrl', jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> learner.graph.traced_param_paths
        ('w_in.bias', 'w_in.kernel')
    """
    algorithm = get_algorithm(algorithm)
    if batch_size is not None:
        init_states(model, batch_size)
    return OnlineLearner(model, algorithm, example_x, strict=strict)


class _Compiled(NamedTuple):
    """What the learner compiled for one batch size; reused when that size comes back."""

    graph: ETraceGraph
    example: Any
    leaf_avals: tuple[tuple[tuple[int, ...], Any], ...]
    grad_fn: Callable[..., Any]
    evolve_fn: Callable[..., Any]


class OnlineLearner:
    """A model compiled for online learning: steps it, keeps hidden state and traces.

    Create with :func:`braintrace.compile`. Hidden states live in the model (and
    are written back after every call); traces live in the learner. A call that
    raises leaves the model and the learner as they were before it.

    Attributes:
        model: The model.
        algorithm: The learning algorithm.
        graph: The compiled :class:`~braintrace.ETraceGraph`.
        traces: The algorithm's current trace state.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> learner = braintrace.compile(model, 'es_d_rtrl', jnp.ones((4, 2)), batch_size=4)
        >>> xs, ys = jnp.ones((5, 4, 2)), jnp.zeros((5, 4, 3))
        >>> grads = learner.etrace_grad(xs, ys, lambda y, t: jnp.mean((y - t) ** 2))
        >>> grads['cell']['dense_i']['kernel'].shape
        (2, 9)
        >>> learner.etrace_evolve(xs).shape
        (5, 4, 3)
    """

    def __init__(self, model: nnx.Module, algorithm: AbstractAlgorithm, example_x: Any, *,
                 strict: bool = False):
        self.model = model
        self.algorithm = algorithm
        self.strict = strict
        self._base_batch_size = _state_batch_size(model)
        compiled = self._compile(model, example_x)
        self._base_example = compiled.example
        self._cache = {self._base_batch_size: compiled}
        self._use(self._base_batch_size, compiled)
        self.traces = self._fresh_traces()

    def _compile(self, model: nnx.Module, example_x: Any) -> _Compiled:
        graph = compile_graph(model, example_x, scope=self.algorithm.scope, strict=self.strict)
        _, *states = split_model(model)
        leaf_avals = tuple((tuple(np.shape(a)), jnp.result_type(a))
                           for state in states for a in jax.tree.leaves(state))
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
                               example_x)
        grad_fn = jax.jit(functools.partial(_grad_program, graph, self.algorithm),
                          static_argnames=("loss_fn", "chunk_size"))
        evolve_fn = jax.jit(functools.partial(evolve, graph, self.algorithm))
        return _Compiled(graph, example, leaf_avals, grad_fn, evolve_fn)

    def _use(self, batch_size: int | None, compiled: _Compiled) -> None:
        self._batch_size = batch_size
        self.graph = compiled.graph
        self._example = compiled.example
        self._leaf_avals = compiled.leaf_avals
        self._grad_fn = compiled.grad_fn
        self._evolve_fn = compiled.evolve_fn

    # -- state ---------------------------------------------------------------

    def _leaves(self) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        _, params, hidden, other = split_model(self.model)
        return (jax.tree.leaves(params), [_strong(h) for h in jax.tree.leaves(hidden)],
                jax.tree.leaves(other))

    def _checked_leaves(self) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        """:meth:`_leaves`, after checking they still have the compiled shapes and dtypes."""
        params, hidden, other = self._leaves()
        g = self.graph
        kinds = (["Param"] * len(params) + ["hidden state"] * len(hidden)
                 + ["Variable"] * len(other))
        paths = (*g.param_paths, *g.hidden_paths, *g.other_paths)
        leaves = [*params, *hidden, *other]
        if len(leaves) != len(self._leaf_avals):
            raise ValueError(
                f"The model now has {len(leaves)} Param and state arrays, but this learner was "
                f"compiled for {len(self._leaf_avals)}: its structure changed after compiling. "
                "Compile a new learner with braintrace.compile(model, ...).")
        for kind, path, leaf, (shape, dtype) in zip(kinds, paths, leaves, self._leaf_avals):
            if tuple(np.shape(leaf)) != shape or jnp.result_type(leaf) != dtype:
                raise ValueError(self._changed_leaf(kind, path, leaf, shape, dtype))
        return params, hidden, other

    def _changed_leaf(self, kind: str, path: str, leaf: Any, shape: tuple[int, ...],
                      dtype: Any) -> str:
        now = f"{tuple(np.shape(leaf))} {jnp.result_type(leaf)}"
        where = f"{kind} '{path}' is {now}, but this learner was compiled for {shape} {dtype}"
        if kind != "hidden state" or jnp.result_type(leaf) != dtype:
            return f"The model's {where}. Compile a new learner with braintrace.compile(model, ...)."
        batched = len(np.shape(leaf)) == len(shape) + (self._batch_size is None)
        hint = f"batch_size={np.shape(leaf)[0]}" if batched and np.shape(leaf) else ""
        return (f"The model's {where} ({_runs_at(self._batch_size)}); was "
                "braintrace.init_states called on the model after compiling? Call "
                f"learner.reset({hint}) to re-initialise the hidden states and traces for the "
                "batch size you mean (a new batch size is compiled once, then reused).")

    def _write_back(self, hidden: list[jax.Array], other: list[jax.Array]) -> None:
        _, _, hidden_state, other_state = split_model(self.model)
        nnx.update(self.model, jax.tree.unflatten(jax.tree.structure(hidden_state), hidden),
                   jax.tree.unflatten(jax.tree.structure(other_state), other))

    def _fresh_traces(self) -> Any:
        params, _, _ = self._leaves()
        return self.algorithm.init(self.graph, programs.operands(self.graph, params))

    @property
    def batch_size(self) -> int | None:
        """The batch size this learner runs at (``None``: per sample, no batch axis)."""
        return self._batch_size

    def reset(self, batch_size: int | None = None) -> None:
        """Re-initialises hidden states and traces, for a new ``batch_size`` if given.

        The first use of a batch size compiles the graph for its shapes; the
        compiled graph and programs of every batch size are kept and reused. A
        learner compiled per sample gains a leading batch axis. If compiling
        fails, the model and the learner are left exactly as they were.

        Args:
            batch_size: The new batch size; ``None`` keeps the current one.

        Raises:
            ValueError: ``batch_size`` is not a positive int, or the model
                cannot run at that batch size (the model's error is chained).

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((4, 2)), batch_size=4)
            >>> learner.reset(batch_size=8)
            >>> learner.batch_size, learner.etrace_evolve(jnp.ones((5, 8, 2))).shape
            (8, (5, 8, 3))
        """
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
                batch_size, numbers.Integral) or batch_size < 1):
            raise ValueError(
                f"reset: batch_size must be a positive int or None, got {batch_size!r}; the "
                "learner is unchanged.")
        target = self._batch_size if batch_size is None else int(batch_size)
        compiled = self._cache.get(target)
        if compiled is None:
            compiled = self._compile_for(target)
            self._cache[target] = compiled
        init_states(self.model, target)
        self._use(target, compiled)
        self.traces = self._fresh_traces()

    def _compile_for(self, batch_size: int) -> _Compiled:
        """Compiles a copy of the model at ``batch_size``; the live model is not touched."""
        drop = 0 if self._base_batch_size is None else 1
        example = jax.tree.map(lambda s: jnp.zeros((batch_size, *s.shape[drop:]), s.dtype),
                               self._base_example)
        copy = nnx.clone(self.model)
        init_states(copy, batch_size)
        try:
            return self._compile(copy, example)
        except Exception as err:  # any failure of the model leaves the learner unchanged
            shapes = [tuple(a.shape) for a in jax.tree.leaves(example)]
            raise ValueError(
                f"reset(batch_size={batch_size}): the model cannot be compiled for inputs of "
                f"shape {', '.join(map(str, shapes))} ({type(err).__name__}: {err}). The learner "
                f"is unchanged and still runs {_runs_at(self._batch_size)} (inputs of shape "
                f"{', '.join(str(tuple(s.shape)) for s in jax.tree.leaves(self._example))}). "
                "Make the model accept that batch axis, or keep this batch size.") from err

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs: Params, hidden and other state, traces."""
        params, hidden, other = self._leaves()
        return {"params": params, "hidden": hidden, "other": other, "traces": self.traces}

    def load_state(self, state: dict[str, Any]) -> None:
        """Loads a :meth:`state` into the model and the learner."""
        _, param_state, _, _ = split_model(self.model)
        nnx.update(self.model, jax.tree.unflatten(jax.tree.structure(param_state),
                                                  list(state["params"])))
        self._write_back(list(state["hidden"]), list(state["other"]))
        self.traces = state["traces"]

    def _named_state(self) -> dict[str, Any]:
        """:meth:`state` as named leaves (``'params/w_in.kernel'``, ``'traces[0]'``), in order."""
        params, hidden, other = self._leaves()
        g = self.graph
        names = [*(f"params/{p}" for p in g.param_paths), *(f"hidden/{p}" for p in g.hidden_paths),
                 *(f"other/{p}" for p in g.other_paths), *leaf_names("traces", self.traces)]
        return dict(zip(names, [*params, *hidden, *other, *jax.tree.leaves(self.traces)],
                        strict=True))

    def save(self, path: str) -> None:
        """Saves Params, hidden and other state (RNG keys included) and traces to ``path``.

        The file carries a SHA-256 digest of its contents, checked by :meth:`restore`.

        Example:
            >>> import os, tempfile, jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((1, 2)), batch_size=1)
            >>> path = os.path.join(tempfile.mkdtemp(), 'run.ckpt')
            >>> learner.save(path)
            >>> learner.restore(path)
        """
        save_arrays(path, self._named_state())

    def restore(self, path: str) -> None:
        """Restores what :meth:`save` wrote, so the run continues identically.

        Raises:
            ValueError: The file is damaged or not a checkpoint, or it does not
                match this learner; the message names the file and the first
                offending leaf. The model and the learner are then unchanged.
        """
        self._load_named(restore_arrays(path, self._named_state()))

    def _load_named(self, leaves: list[jax.Array]) -> None:
        """Loads leaves in the order of :meth:`_named_state`."""
        g = self.graph
        ends = np.cumsum([g.num_params, g.num_hidden, len(g.other_paths)]).tolist()
        params, hidden, other, traces = (leaves[a:b] for a, b in
                                         zip([0, *ends], [*ends, len(leaves)], strict=True))
        self.load_state({"params": params, "hidden": hidden, "other": other,
                         "traces": jax.tree.unflatten(jax.tree.structure(self.traces), traces)})

    def report(self) -> str:
        """The compiled graph's report: groups, traced Params, same-step Params, warnings."""
        return f"algorithm: {self.algorithm.name}\n{self.graph.report()}"

    # -- running -------------------------------------------------------------

    def __call__(self, x: Any) -> Any:
        """One time step without gradients: advances hidden state and traces."""
        ys = self.etrace_evolve(jax.tree.map(lambda a: jnp.asarray(a)[None], x))
        return jax.tree.map(lambda a: a[0], ys)

    def etrace_evolve(self, xs: Any) -> Any:
        """Advances hidden state and traces over ``xs`` (time axis leading); returns outputs."""
        self._check_inputs(xs)
        params, hidden, other = self._checked_leaves()
        ys, hidden, other, traces = self._evolve_fn(params, hidden, other, self.traces, xs)
        self._write_back(hidden, other)
        self.traces = traces
        return ys

    def etrace_grad(
        self,
        xs: Any,
        ys: Any,
        loss_fn: Callable[[Any, Any], jax.Array],
        *,
        mask: jax.Array | None = None,
        chunk_size: int | None = None,
        reduction: str = "mean",
        return_losses: bool = False,
    ) -> nnx.State | tuple[nnx.State, jax.Array]:
        """Online gradients of the sequence loss, in one fused scan over time.

        The loss is ``Σ_t w_t · loss_fn(model_output_t, ys[t])`` with
        ``w_t = 1/T`` (``reduction='mean'``) or ``1`` (``'sum'``), times the
        mask if given (``'mean'`` then divides by the mask's sum). Hidden state
        and traces continue from where they are and are written back.

        A mask of all zeros has no mean: with ``reduction='mean'`` it is an
        error (skip the batch, or use ``reduction='sum'``, whose gradient is
        then zero). Nothing non-finite is ever returned: a loss or gradient
        that is not finite raises, and the model and learner stay as they were.

        Args:
            xs: Inputs, time axis leading (any pytree), at least one step.
            ys: Targets, time axis leading (any pytree).
            loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
            mask: Optional ``(T,)`` finite weights of the steps (a concrete array).
            chunk_size: Windowed mode: exact reverse mode inside windows of this
                many steps (a positive int dividing ``T``), traces carrying
                credit across windows. ``None`` is single-step mode.
            reduction: ``'mean'`` or ``'sum'`` over time.
            return_losses: Also return each step's loss ``(T,)``.

        Returns:
            An ``nnx.State`` of gradients for every Param (the structure of
            ``nnx.state(model, nnx.Param)``), accepted by
            ``nnx.Optimizer.update(model, grads)``; and the losses if asked.

        Raises:
            ValueError: ``xs`` has no steps; ``xs``/``ys``/``mask`` lengths
                differ; an input has the wrong shape; the model's hidden state
                no longer has the compiled batch size; ``reduction``,
                ``chunk_size`` or ``mask`` is invalid (non-finite, or all zeros
                with ``'mean'``); or ``loss_fn`` returns a non-scalar.
            FloatingPointError: A step's loss is not finite (names the first
                step), or a Param's gradient is not finite (names the Param).
        """
        args = self._grad_args(xs, ys, mask, chunk_size, reduction)
        grads, hidden, other, traces, losses, finite = self._grad_fn(
            *args, loss_fn=loss_fn, chunk_size=_static(chunk_size))
        self._raise_if_not_finite(np.asarray(losses), np.asarray(finite))
        self._write_back(hidden, other)
        self.traces = traces
        _, param_state, _, _ = split_model(self.model)
        state = jax.tree.unflatten(jax.tree.structure(param_state), grads)
        return (state, losses) if return_losses else state

    def _raise_if_not_finite(self, losses: np.ndarray, finite: np.ndarray) -> None:
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            raise FloatingPointError(
                f"The loss at time step {int(bad[0])} is {losses[bad[0]]}, not finite; no "
                f"gradient is returned and {UNCHANGED}. Check the inputs and targets at that "
                "step (and the Params: lower the learning rate if they grew).")
        bad = np.flatnonzero(~finite)
        if bad.size:
            names = ", ".join(f"'{self.graph.param_paths[i]}'" for i in bad)
            raise FloatingPointError(
                f"The gradient of Param {names} is not finite although every loss is; no "
                f"gradient is returned and {UNCHANGED}. A hidden state or trace overflowed: "
                "check the inputs' scale, use float64, or shorten the sequences.")

    def lower_etrace_grad(self, xs: Any, ys: Any, loss_fn: Callable[[Any, Any], jax.Array], *,
                          mask: jax.Array | None = None, chunk_size: int | None = None,
                          reduction: str = "mean") -> jax.stages.Lowered:
        """The lowered ``etrace_grad`` program (``.compile().memory_analysis()`` measures it).

        ``xs``/``ys`` may be ``jax.ShapeDtypeStruct``s, so long sequences need no data.
        """
        args = self._grad_args(xs, ys, mask, chunk_size, reduction)
        return self._grad_fn.lower(*args, loss_fn=loss_fn, chunk_size=_static(chunk_size))

    def _grad_args(self, xs, ys, mask, chunk_size, reduction):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        length = self._check_inputs(xs)
        if length == 0:
            raise ValueError("xs has no time steps (T = 0): there is no loss to differentiate. "
                             "Give at least one step.")
        y_lengths = {shape_of(a)[0] if shape_of(a) else None for a in jax.tree.leaves(ys)}
        if y_lengths != {length}:
            raise ValueError(
                f"xs has {length} time steps but ys has {sorted(y_lengths, key=str)}; give one "
                "target per step (time axis leading).")
        check_chunk_size(chunk_size, length)
        weights = step_weights(mask, length)
        if reduction == "mean":
            if not weights.sum():
                raise ValueError(
                    "The mask sums to 0, so reduction='mean' (which divides by the mask's sum) "
                    "is undefined. Skip this batch, or use reduction='sum', whose gradient is "
                    "then zero.")
            weights = weights / weights.sum()
        params, hidden, other = self._checked_leaves()
        weights = jnp.asarray(weights, jnp.result_type(*params))
        return params, hidden, other, self.traces, xs, ys, weights

    def _check_inputs(self, xs: Any) -> int:
        return check_inputs(xs, self._example)


def _static(chunk_size: Any) -> int | None:
    """A checked ``chunk_size`` as the static argument of the compiled program."""
    return None if chunk_size is None else int(chunk_size)


def _grad_program(graph, algorithm, params, hidden, other, traces, xs, ys, weights, *, loss_fn,
                  chunk_size):
    """The compiled ``etrace_grad``: gradients, final state, losses, finiteness per Param."""
    if chunk_size is None:
        grads, carry, losses = online_gradients(
            graph, algorithm, loss_fn, params, hidden, other, traces, xs, ys, weights)
    else:
        grads, carry, losses = windowed_gradients(
            graph, algorithm, loss_fn, params, hidden, other, traces, xs, ys, weights,
            chunk_size)
    finite = jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads])
    return grads, carry.hidden, carry.other, carry.traces, losses, finite


def _state_batch_size(model: nnx.Module) -> int | None:
    """The batch size of the model's hidden states (``None`` for per-sample states)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, HiddenState):
            sample_shape = tuple(node.get_metadata("sample_shape", node.shape))
            return node.shape[0] if len(node.shape) > len(sample_shape) else None
    return None


def _runs_at(batch_size: int | None) -> str:
    return "per sample (no batch axis)" if batch_size is None else f"at batch size {batch_size}"


def _strong(a: jax.Array) -> jax.Array:
    """Drops weak typing so a state that comes back from a program hits the same cache."""
    a = jnp.asarray(a)
    return jax.lax.convert_element_type(a, a.dtype) if getattr(a, "weak_type", False) else a
