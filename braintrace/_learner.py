"""``braintrace.compile``: a model and an algorithm, ready to learn online."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._algorithms import AbstractAlgorithm, get_algorithm
from braintrace._algorithms._scan import evolve, online_gradients, windowed_gradients
from braintrace._checkpoint import restore_leaves, save_leaves
from braintrace._compiler._compile import compile_graph
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._step import split_model
from braintrace._hidden import HiddenState
from braintrace._states import init_states

__all__ = ["OnlineLearner", "compile"]

REDUCTIONS = ("mean", "sum")


def compile(  # noqa: A001  (the verb users expect: braintrace.compile)
    model: nnx.Module,
    algorithm: str | AbstractAlgorithm,
    example_x: Any,
    *,
    batch_size: int | None = None,
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
    return OnlineLearner(model, algorithm, example_x)


class OnlineLearner:
    """A model compiled for online learning: steps it, keeps hidden state and traces.

    Create with :func:`braintrace.compile`. Hidden states live in the model (and
    are written back after every call); traces live in the learner.

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

    def __init__(self, model: nnx.Module, algorithm: AbstractAlgorithm, example_x: Any):
        self.model = model
        self.algorithm = algorithm
        self._example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a),
                                                                    jnp.result_type(a)),
                                     example_x)
        self.graph: ETraceGraph = compile_graph(model, example_x, scope=algorithm.scope)
        self.traces = self._fresh_traces()
        self._grad_fn = jax.jit(self._grad_impl, static_argnames=("loss_fn", "chunk_size"))
        self._evolve_fn = jax.jit(self._evolve_impl)

    # -- state ---------------------------------------------------------------

    def _leaves(self) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        _, params, hidden, other = split_model(self.model)
        return (jax.tree.leaves(params), [_strong(h) for h in jax.tree.leaves(hidden)],
                jax.tree.leaves(other))

    def _write_back(self, hidden: list[jax.Array], other: list[jax.Array]) -> None:
        _, _, hidden_state, other_state = split_model(self.model)
        nnx.update(self.model, jax.tree.unflatten(jax.tree.structure(hidden_state), hidden),
                   jax.tree.unflatten(jax.tree.structure(other_state), other))

    def _fresh_traces(self) -> Any:
        params, _, _ = self._leaves()
        return self.algorithm.init(self.graph, self.graph.operands(params))

    @property
    def batch_size(self) -> int | None:
        """The batch size of the hidden states (``None`` for per-sample states)."""
        for _, node in nnx.iter_graph(self.model):
            if isinstance(node, HiddenState):
                sample_shape = tuple(node.get_metadata("sample_shape", node.shape))
                return node.shape[0] if len(node.shape) > len(sample_shape) else None
        return None

    def reset(self, batch_size: int | None = None) -> None:
        """Re-initialises hidden states and traces, for a new ``batch_size`` if given.

        A new batch size recompiles the graph for the new shapes.
        """
        current = self.batch_size
        init_states(self.model, current if batch_size is None else batch_size)
        if batch_size is not None and batch_size != current:
            example = jax.tree.map(
                lambda s: jnp.zeros((batch_size, *s.shape[1:]), s.dtype), self._example)
            self.__init__(self.model, self.algorithm, example)
        else:
            self.traces = self._fresh_traces()

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

    def save(self, path: str) -> None:
        """Saves Params, hidden state and traces to ``path`` (Flax msgpack serialisation).

        Example:
            >>> import os, tempfile, jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((1, 2)), batch_size=1)
            >>> path = os.path.join(tempfile.mkdtemp(), 'run.msgpack')
            >>> learner.save(path)
            >>> learner.restore(path)
        """
        save_leaves(path, self.state())

    def restore(self, path: str) -> None:
        """Restores what :meth:`save` wrote, so the run continues identically."""
        self.load_state(restore_leaves(path, self.state()))

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
        params, hidden, other = self._leaves()
        ys, hidden, other, traces = self._evolve_fn(params, hidden, other, self.traces, xs)
        self._write_back(hidden, other)
        self.traces = traces
        return ys

    def _evolve_impl(self, params, hidden, other, traces, xs):
        return evolve(self.graph, self.algorithm, params, hidden, other, traces, xs)

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

        Args:
            xs: Inputs, time axis leading (any pytree).
            ys: Targets, time axis leading (any pytree).
            loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step.
            mask: Optional ``(T,)`` weights of the steps.
            chunk_size: Windowed mode: exact reverse mode inside windows of this
                many steps, traces carrying credit across windows. ``None`` is
                single-step mode.
            reduction: ``'mean'`` or ``'sum'`` over time.
            return_losses: Also return each step's loss ``(T,)``.

        Returns:
            An ``nnx.State`` of gradients for every Param (the structure of
            ``nnx.state(model, nnx.Param)``), accepted by
            ``nnx.Optimizer.update(model, grads)``; and the losses if asked.

        Raises:
            ValueError: ``xs``/``ys``/``mask`` lengths differ, an input has the
                wrong shape, ``reduction`` or ``chunk_size`` is invalid, or
                ``loss_fn`` returns a non-scalar.
            FloatingPointError: The loss became NaN; names the first step.
        """
        args = self._grad_args(xs, ys, mask, chunk_size, reduction)
        grads, hidden, other, traces, losses = self._grad_fn(
            *args, loss_fn=loss_fn, chunk_size=chunk_size)
        nan = np.flatnonzero(np.isnan(np.asarray(losses)))
        if nan.size:
            raise FloatingPointError(
                f"The loss became NaN at time step {int(nan[0])}; no gradient is returned and "
                "the model's Params are unchanged. Lower the learning rate or check the inputs.")
        self._write_back(hidden, other)
        self.traces = traces
        _, param_state, _, _ = split_model(self.model)
        state = jax.tree.unflatten(jax.tree.structure(param_state), grads)
        return (state, losses) if return_losses else state

    def lower_etrace_grad(self, xs: Any, ys: Any, loss_fn: Callable[[Any, Any], jax.Array], *,
                          mask: jax.Array | None = None, chunk_size: int | None = None,
                          reduction: str = "mean") -> jax.stages.Lowered:
        """The lowered ``etrace_grad`` program (``.compile().memory_analysis()`` measures it).

        ``xs``/``ys`` may be ``jax.ShapeDtypeStruct``s, so long sequences need no data.
        """
        args = self._grad_args(xs, ys, mask, chunk_size, reduction)
        return self._grad_fn.lower(*args, loss_fn=loss_fn, chunk_size=chunk_size)

    def _grad_args(self, xs, ys, mask, chunk_size, reduction):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        length = self._check_inputs(xs)
        y_lengths = {_shape(a)[0] if _shape(a) else None for a in jax.tree.leaves(ys)}
        if y_lengths != {length}:
            raise ValueError(
                f"xs has {length} time steps but ys has {sorted(y_lengths, key=str)}; give one "
                "target per step (time axis leading).")
        weights = jnp.ones((length,)) if mask is None else jnp.asarray(mask)
        if weights.shape != (length,):
            raise ValueError(f"mask must have shape ({length},), got {weights.shape}.")
        total = jnp.sum(weights) if reduction == "mean" else 1.0
        weights = weights / total
        if chunk_size is not None and (chunk_size < 1 or length % chunk_size):
            raise ValueError(
                f"chunk_size must be a positive divisor of the sequence length {length}, got "
                f"{chunk_size}.")
        params, hidden, other = self._leaves()
        weights = weights.astype(jnp.result_type(*params))
        return params, hidden, other, self.traces, xs, ys, weights

    def _grad_impl(self, params, hidden, other, traces, xs, ys, weights, *, loss_fn,
                   chunk_size):
        if chunk_size is None:
            grads, carry, losses = online_gradients(
                self.graph, self.algorithm, loss_fn, params, hidden, other, traces, xs, ys,
                weights)
        else:
            grads, carry, losses = windowed_gradients(
                self.graph, self.algorithm, loss_fn, params, hidden, other, traces, xs, ys,
                weights, chunk_size)
        return grads, carry.hidden, carry.other, carry.traces, losses

    def _check_inputs(self, xs: Any) -> int:
        leaves = jax.tree.leaves(xs)
        examples = jax.tree.leaves(self._example)
        if len(leaves) != len(examples):
            raise ValueError(
                f"xs has {len(leaves)} input arrays per step; the model was compiled for "
                f"{len(examples)}.")
        lengths = {_shape(a)[0] if _shape(a) else None for a in leaves}
        if len(lengths) != 1 or None in lengths:
            raise ValueError("Every input in xs needs the same leading time axis.")
        for a, e in zip(leaves, examples):
            if tuple(_shape(a)[1:]) != tuple(e.shape):
                raise ValueError(
                    f"Each step's input has shape {tuple(_shape(a)[1:])}, but the model was "
                    f"compiled for {tuple(e.shape)} (batch axis first). Call "
                    "learner.reset(batch_size) for a new batch size.")
        return lengths.pop()


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(a.shape) if hasattr(a, "shape") else tuple(np.shape(a))


def _strong(a: jax.Array) -> jax.Array:
    """Drops weak typing so a state that comes back from a program hits the same cache."""
    a = jnp.asarray(a)
    return jax.lax.convert_element_type(a, a.dtype) if getattr(a, "weak_type", False) else a
