"""``braintrace.compile``: a model and an algorithm, ready to learn online.

:class:`OnlineLearner` is a thin shell over pure functions: it holds the model,
the traces and the programs compiled for every batch size it has run at. The
programs (``_driver_programs.grad_program``, ``_algorithms._scan.evolve``) work
on flat arrays; ``_learner_state`` moves those in and out of the model.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._algorithms import DNI, AbstractAlgorithm
from braintrace._algorithms._blocked import resolve_block_size
from braintrace._checkpoint import restore_arrays, save_arrays
from braintrace._compiler import ETraceGraph, compile_graph
from braintrace._compiler import _programs as programs
from braintrace._driver_programs import GradArgs, evolve_program, grad_program
from braintrace._inputs import check_algorithm_inputs, check_inputs, loss_weights, static_chunk_size
from braintrace._learner_state import (
    LeafAvals,
    Leaves,
    check_leaves,
    leaf_avals,
    model_leaves,
    named_arrays,
    param_state,
    runs_at,
    state_batch_size,
    state_from_arrays,
    write_params,
    write_state,
)
from braintrace._sharding import Layout, check_mesh, host_array, layout, place, place_inputs
from braintrace._states import init_states

__all__ = ["OnlineLearner"]

UNCHANGED = ("the model's Params and hidden state and the learner's traces are as they were "
             "before this call")


class _Compiled(NamedTuple):
    """What the learner compiled for one batch size; reused when that size comes back."""

    graph: ETraceGraph
    example: Any
    leaf_avals: LeafAvals
    grad_fn: Callable[..., Any]
    evolve_fn: Callable[..., Any]
    layout: Layout | None


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
        mesh: The device mesh of data parallel, or ``None``.
        data_axis: The mesh axis the batch is split over.

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
                 strict: bool = False, mesh: jax.sharding.Mesh | None = None,
                 data_axis: str = "data"):
        self.model = model
        self.algorithm = algorithm
        self.strict = strict
        self.mesh = mesh
        self.data_axis = data_axis
        self._base_batch_size = state_batch_size(model)
        if mesh is not None:
            check_mesh(mesh, data_axis, self._base_batch_size)
        if isinstance(algorithm, DNI):
            algorithm.bind(model)
        compiled = self._compile(model, example_x)
        self._base_example = compiled.example
        self._cache = {self._base_batch_size: compiled}
        self._use(self._base_batch_size, compiled)
        self._place_model()
        self.traces = self._fresh_traces()

    def _compile(self, model: nnx.Module, example_x: Any) -> _Compiled:
        graph = compile_graph(model, example_x, strict=self.strict, algorithm=self.algorithm)
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
                               example_x)
        lay = None if self.mesh is None else self._layout_for(model, graph, example)
        grad_fn = jax.jit(functools.partial(grad_program, graph, self.algorithm, layout=lay),
                          static_argnames=("loss_fn", "chunk_size", "block_size"))
        evolve_fn = jax.jit(functools.partial(evolve_program, graph, self.algorithm, layout=lay))
        return _Compiled(graph, example, leaf_avals(model_leaves(model)), grad_fn, evolve_fn,
                         lay)

    def _layout_for(self, model: nnx.Module, graph: ETraceGraph, example: Any) -> Layout:
        """Where each array lives on the mesh: what grows with the batch size is split."""
        batch_size = state_batch_size(model)
        twice = nnx.clone(model)
        init_states(twice, 2 * batch_size)
        example_2b = jax.tree.map(lambda s: jnp.zeros((2 * batch_size, *s.shape[1:]), s.dtype),
                                  example)
        graph_2b = compile_graph(twice, example_2b, scope=self.algorithm.scope,
                                 strict=self.strict)
        return layout(self.mesh, self.data_axis, batch_size, self._shapes(model, graph),
                      self._shapes(twice, graph_2b))

    def _shapes(self, model: nnx.Module, graph: ETraceGraph) -> tuple[Any, ...]:
        leaves = model_leaves(model)
        traces = jax.eval_shape(
            lambda p: self.algorithm.init(graph, programs.operands(graph, p)), leaves.params)
        return (*leaves, traces)

    def _place_model(self) -> None:
        """Puts the model's Params and states on the mesh (nothing without one)."""
        lay = self._layout_now
        if lay is not None:
            params, hidden, other = model_leaves(self.model)
            write_params(self.model, place(params, lay.params))
            write_state(self.model, place(hidden, lay.hidden), place(other, lay.other))

    def _use(self, batch_size: int | None, compiled: _Compiled) -> None:
        self._batch_size = batch_size
        self.graph = compiled.graph
        self._example = compiled.example
        self._leaf_avals = compiled.leaf_avals
        self._grad_fn = compiled.grad_fn
        self._evolve_fn = compiled.evolve_fn
        self._layout_now = compiled.layout

    def _fresh_traces(self) -> Any:
        params = model_leaves(self.model).params
        traces = self.algorithm.init(self.graph, programs.operands(self.graph, params))
        lay = self._layout_now
        return traces if lay is None else place(traces, lay.traces)

    # -- state ---------------------------------------------------------------

    @property
    def batch_size(self) -> int | None:
        """The batch size this learner runs at (``None``: per sample, no batch axis)."""
        return self._batch_size

    def leaves(self) -> Leaves:
        """The model's Params, hidden states and other Variables, as the programs take them.

        Each is a flat list in the order of the graph's ``param_paths``,
        ``hidden_paths`` and ``other_paths``.

        Raises:
            ValueError: A leaf no longer has the shape and dtype this learner
                was compiled for (e.g. ``braintrace.init_states`` was called
                with another batch size: the message says to call :meth:`reset`).

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
            >>> params, hidden, other = learner.leaves()
            >>> learner.graph.hidden_paths, [h.shape for h in hidden]
            (('layers.1.v',), [(2, 4)])
        """
        leaves = check_leaves(model_leaves(self.model), self.graph, self._leaf_avals,
                              self._batch_size)
        lay = self._layout_now
        if lay is None:
            return leaves
        return Leaves(place(leaves.params, lay.params), place(leaves.hidden, lay.hidden),
                      place(leaves.other, lay.other))

    def check_inputs(self, xs: Any) -> int:
        """The number of time steps of ``xs``, after checking each step has the compiled shape.

        Raises:
            ValueError: ``xs`` has another structure, leaves of different
                lengths, or a step shape other than the compiled one.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
            >>> learner.check_inputs(jnp.ones((7, 2, 3)))
            7
        """
        return check_inputs(xs, self._example)

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
        if self.mesh is not None:
            check_mesh(self.mesh, self.data_axis, target)
        compiled = self._cache.get(target)
        if compiled is None:
            compiled = self._compile_for(target)
            self._cache[target] = compiled
        init_states(self.model, target)
        self._use(target, compiled)
        self._place_model()
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
                f"is unchanged and still runs {runs_at(self._batch_size)} (inputs of shape "
                f"{', '.join(str(tuple(s.shape)) for s in jax.tree.leaves(self._example))}). "
                "Make the model accept that batch axis, or keep this batch size.") from err

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs: Params, hidden and other state, traces."""
        params, hidden, other = model_leaves(self.model)
        return {"params": params, "hidden": hidden, "other": other, "traces": self.traces}

    def load_state(self, state: dict[str, Any]) -> None:
        """Loads a :meth:`state` into the model and the learner (onto the mesh, if any)."""
        lay = self._layout_now
        if lay is not None:
            state = {"params": place(state["params"], lay.params),
                     "hidden": place(state["hidden"], lay.hidden),
                     "other": place(state["other"], lay.other),
                     "traces": place(state["traces"], lay.traces)}
        write_params(self.model, state["params"])
        write_state(self.model, state["hidden"], state["other"])
        self.traces = state["traces"]

    def save(self, path: str) -> None:
        """Saves Params, hidden and other state (RNG keys included) and traces to ``path``.

        ``path`` becomes an orbax checkpoint directory (replacing one there),
        sharded arrays included; on several hosts every process calls this. It
        carries a SHA-256 digest of its contents, checked by :meth:`restore`.

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
        save_arrays(path, named_arrays(self.graph, self.state()))

    def restore(self, path: str) -> None:
        """Restores what :meth:`save` wrote, so the run continues identically.

        The arrays are read onto this learner's devices: a checkpoint saved on
        another mesh (or without one) restores here.

        Raises:
            ValueError: The checkpoint is damaged or not one, or it does not
                match this learner; the message names the file and the first
                offending leaf. The model and the learner are then unchanged.
        """
        arrays = restore_arrays(path, named_arrays(self.graph, self.state()))
        self.load_state(state_from_arrays(self.graph, self.traces, arrays))

    def report(self) -> str:
        """The compiled graph's report for this algorithm: what is approximate (the graph's
        traces and the algorithm's own approximations) and what to do, then the details."""
        return self.graph.report(self.algorithm)

    # -- running -------------------------------------------------------------

    def __call__(self, x: Any) -> Any:
        """One time step without gradients: advances hidden state and traces."""
        ys = self.etrace_evolve(jax.tree.map(lambda a: jnp.asarray(a)[None], x))
        return jax.tree.map(lambda a: a[0], ys)

    def etrace_evolve(self, xs: Any) -> Any:
        """Advances hidden state and traces over ``xs`` (time axis leading); returns outputs."""
        xs = self._place_inputs(xs)
        self.check_inputs(xs)
        params, hidden, other = self.leaves()
        ys, hidden, other, traces = self._evolve_fn(params, hidden, other, self.traces, xs)
        write_state(self.model, hidden, other)
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
        block_size: int | None = None,
        reduction: str = "mean",
        return_losses: bool = False,
        modulators: dict[str, jax.Array] | None = None,
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
            block_size: Single-step mode advances the traces in blocks of this
                many steps, with matrix products (exactly the per-step result;
                see ``braintrace/_algorithms/_blocked.py``); ``1`` is the
                per-step form. Default: 16 where the algorithm has a blocked
                form (D_RTRL, ES_D_RTRL), else 1. Ignored in windowed mode.
            reduction: ``'mean'`` or ``'sum'`` over time.
            return_losses: Also return each step's loss ``(T,)``.
            modulators: :class:`~braintrace.ThreeFactor`'s ``{hidden path: (T, *state_shape)}``.

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
        args = self.grad_args(xs, ys, mask=mask, chunk_size=chunk_size, reduction=reduction,
                              modulators=modulators)
        grads, hidden, other, traces, losses, finite = self._grad_fn(
            *args, loss_fn=loss_fn, chunk_size=static_chunk_size(chunk_size),
            block_size=self._block_size(block_size))
        self._raise_if_not_finite(host_array(losses), host_array(finite))
        write_state(self.model, hidden, other)
        self.traces = traces
        state = param_state(self.model, grads)
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
                          block_size: int | None = None, reduction: str = "mean",
                          modulators: dict[str, jax.Array] | None = None) -> jax.stages.Lowered:
        """The lowered ``etrace_grad`` program (``.compile().memory_analysis()`` measures it).

        ``xs``/``ys`` may be ``jax.ShapeDtypeStruct``s, so long sequences need no data.
        """
        args = self.grad_args(xs, ys, mask=mask, chunk_size=chunk_size, reduction=reduction,
                              modulators=modulators)
        return self._grad_fn.lower(*args, loss_fn=loss_fn, chunk_size=static_chunk_size(chunk_size),
                                   block_size=self._block_size(block_size))

    def _block_size(self, block_size: int | None) -> int:
        """The checked ``K`` of the time-blocked traces (``etrace_grad``'s ``block_size``)."""
        return resolve_block_size(self.algorithm, self.graph, block_size)

    def grad_args(self, xs: Any, ys: Any, *, mask: jax.Array | None = None,
                  chunk_size: int | None = None, reduction: str = "mean",
                  modulators: dict[str, jax.Array] | None = None) -> GradArgs:
        """The checked arguments of the ``etrace_grad`` program for these inputs.

        Given to the compiled :meth:`lower_etrace_grad`, they run the very
        program that was lowered (and measured) without compiling it again; it
        returns a ``GradResult`` (gradients per Param leaf, final hidden and
        other state and traces, losses, finiteness per Param). Nothing is
        written back to the model or the learner.

        Raises:
            ValueError: As :meth:`etrace_grad`.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((4, 2)), batch_size=4)
            >>> xs, ys = jnp.ones((5, 4, 2)), jnp.zeros((5, 4, 3))
            >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
            >>> compiled = learner.lower_etrace_grad(xs, ys, mse).compile()
            >>> grads, hidden, other, traces, losses, finite = compiled(*learner.grad_args(xs, ys))
            >>> losses.shape, bool(finite.all())
            ((5,), True)
        """
        xs, ys = self._place_inputs(xs), self._place_inputs(ys)
        weights = loss_weights(xs, ys, self._example, mask, chunk_size, reduction)
        params, hidden, other = self.leaves()
        mods = self._place_inputs(check_algorithm_inputs(
            self.algorithm, self.graph, hidden, modulators, chunk_size, len(weights)))
        weights = jnp.asarray(weights, jnp.result_type(*params))
        if self._layout_now is not None:
            weights = place(weights, self._layout_now.replicated)
        return GradArgs(params, hidden, other, self.traces, xs, ys, weights, mods)

    def _place_inputs(self, tree: Any) -> Any:
        """Inputs or targets split over the mesh's data axis (as they are without a mesh).

        ``jax.ShapeDtypeStruct`` leaves (for :meth:`lower_etrace_grad`) stay as they are.
        """
        lay = self._layout_now
        if lay is None or any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(tree)):
            return tree
        return place_inputs(lay, tree)
