"""``OnlineLearner``: a model compiled for online learning, as a stateful convenience.

A thin shell over the pure programs (``_programs.py``, the same ones the pure
:func:`~braintrace.online_grad` runs): it holds the model (its Params and hidden
states live in it) and the traces, checks every argument on the host with clear
errors, runs a program under ``jax.jit`` and writes the results back. A call that
raises leaves the model and the learner as they were. It never waits for the
device: a call's finiteness check is read by the next call, or by :meth:`sync`
(``_deferred.py``), which puts back the state a call that went wrong started
from. It reads the model's mode (``model.eval()`` / ``model.train()``) at every
call: each mode is compiled once, then reused. What does not change between
calls is kept (``_learner_binding.py``: the model's view, the checks of arguments
shaped like an earlier call's, a reset that worked), so that a call costs the
host tens of microseconds, not a walk of the model; the arrays' shapes and
dtypes are checked at every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from braintrace._algorithms import AbstractAlgorithm, GraphRules
from braintrace._compiler import ETraceGraph
from braintrace._drivers._checked_calls import call_signature
from braintrace._drivers._compiled import CompiledModel
from braintrace._drivers._evaluate import batch_size_of, evaluate
from braintrace._drivers._inputs import cast_inputs, check_inputs, refuse_traced
from braintrace._drivers._learner_binding import LearnerBinding
from braintrace._drivers._model_state import Leaves, model_leaves
from braintrace._drivers._not_finite import grad_verdict
from braintrace._drivers._programs import (
    CHECKED_GRAD_PROGRAM,
    EVOLVE_PROGRAM,
    GradArgs,
    GradResult,
)
from braintrace._drivers._states import KEEP

__all__ = ["OnlineLearner"]

CHECKED_LATER = "the last call, checked by the next call or learner.sync()"
_GRAD_CALL = f"learner.etrace_grad ({CHECKED_LATER})"


class OnlineLearner(LearnerBinding):
    """A model compiled for online learning: steps it, keeps hidden state and traces.

    Create with :func:`braintrace.compile`. Hidden states live in the model (and
    are written back after every call); traces live in the learner. A call that
    raises leaves the model and the learner as they were before it.

    No call waits for the device: each returns once its program is dispatched,
    and its finiteness check is read by the next call or :meth:`sync`
    (:meth:`etrace_grad` says what happens then).

    Attributes:
        model: The model.
        compiled: The analysis of the model (one compiled graph per mode and batch size).

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
                 data_axis: str | None = "data", neuron_axis: str | None = None,
                 trace_dtype: Any = None):
        super().__init__(model, CompiledModel(model, algorithm, example_x, strict=strict,
                                              mesh=mesh, data_axis=data_axis,
                                              neuron_axis=neuron_axis, trace_dtype=trace_dtype))

    # -- what was compiled ---------------------------------------------------------------

    @property
    def traces(self) -> Any:
        """The algorithm's current trace state."""
        return self._traces

    @traces.setter
    def traces(self, traces: Any) -> None:
        self._traces, self._fitting = traces, None

    @property
    def algorithm(self) -> AbstractAlgorithm:
        """The learning algorithm (bound to the model)."""
        return self.compiled.algorithm

    @property
    def strict(self) -> bool:
        """Whether approximate traces are refused."""
        return self.compiled.strict

    @property
    def trace_dtype(self) -> Any:
        """The dtype the traces are stored in, or ``None`` (the algorithm's own)."""
        return self.compiled.trace_dtype

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The device mesh of data (and neuron) parallel, or ``None``."""
        return self.compiled.mesh

    @property
    def data_axis(self) -> str | None:
        """The mesh axis the batch is split over."""
        return self.compiled.data_axis

    @property
    def neuron_axis(self) -> str | None:
        """The mesh axis the hidden units are split over, or ``None``."""
        return self.compiled.neuron_axis

    @property
    def graph(self) -> ETraceGraph:
        """The compiled graph of the model's current mode and batch size."""
        return self._entry().graph

    @property
    def rules(self) -> GraphRules:
        """The algorithm bound to :attr:`graph`."""
        return self._entry().rules

    @property
    def batch_size(self) -> int | None:
        """The batch size this learner runs at (``None``: per sample, no batch axis)."""
        return self._batch_size

    # -- state ---------------------------------------------------------------

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
        view, entry = self._view_entry()
        return self._leaves(entry, view)

    def check_inputs(self, xs: Any) -> int:
        """The number of time steps of ``xs``, after checking each step has the compiled shape.

        Raises:
            ValueError: ``xs`` has another structure, leaves of different
                lengths, or a step shape other than the compiled one (the message
                says so when the shapes look batch-major or of another batch size).

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
        return check_inputs(xs, self._entry().example)

    def reset(self, batch_size: int | None = KEEP) -> None:
        """Re-initialises hidden states and traces, for a new ``batch_size`` if given.

        The first use of a batch size compiles the graph for its shapes; the
        compiled graph and programs of every batch size are kept and reused.
        ``batch_size=None`` runs per sample (no batch axis). If anything fails
        (compiling, a trace budget, a mesh that cannot split the batch), the model
        and the learner are left exactly as they were.

        Args:
            batch_size: The new batch size, ``None`` for per sample; by default the
                current one.

        Raises:
            ValueError: ``batch_size`` is not a positive int or ``None``, or the
                model cannot run at that batch size (the model's error is chained).

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
        self._reset(self._batch_size if batch_size is KEEP else batch_size)

    def sync(self) -> None:
        """Waits for the calls dispatched so far; raises the error of one that went wrong.

        Each call returns once its program is dispatched, and its finiteness
        check is read by the next call. ``sync()`` reads it now: after it, every
        call so far has finished, and none of them returned anything non-finite.

        Raises:
            FloatingPointError: The last call's loss or gradient was not finite
                (it returned zero gradients; the hidden state and traces it
                started from are put back); the message names the step, the
                Param or the input. Raised once.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
            >>> mse = lambda y, t: jnp.mean((y - t) ** 2)
            >>> ys = jnp.zeros((5, 2, 4)).at[3].set(jnp.nan)   # a NaN target at step 3
            >>> grads = learner.etrace_grad(jnp.ones((5, 2, 3)), ys, mse)   # returns at once
            >>> learner.sync()
            Traceback (most recent call last):
            ...
            FloatingPointError: learner.etrace_grad (the last call, ...): the loss at time step 3 is nan, not finite. ...
        """
        self._deferred.settle()
        jax.block_until_ready((self._traces, self._views(self.model).leaves()))

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs: Params, hidden and other state, traces.

        Raises:
            FloatingPointError: The last call went wrong (see :meth:`sync`).
        """
        self._deferred.settle()
        params, hidden, other = model_leaves(self.model)
        return {"params": params, "hidden": hidden, "other": other, "traces": self.traces}

    def load_state(self, state: dict[str, Any]) -> None:
        """Loads a :meth:`state` into the model and the learner (onto the mesh, if any)."""
        self._load_state(state)

    def report(self, verbose: bool = False) -> str:
        """The compiled graph's report for this algorithm: which Params learn by traces,
        what is approximate (the graph's traces and the algorithm's own approximations)
        and what to do; ``verbose=True`` adds every Param, operation and equation
        (:meth:`ETraceGraph.report`)."""
        return self.graph.report(self.algorithm, verbose=verbose)

    # -- running -------------------------------------------------------------

    def __call__(self, x: Any) -> Any:
        """One time step without gradients: advances hidden state and traces."""
        ys = self.etrace_evolve(jax.tree.map(lambda a: jnp.asarray(a)[None], x))
        return jax.tree.map(lambda a: a[0], ys)

    def etrace_evolve(self, xs: Any) -> Any:
        """Advances hidden state and traces over ``xs`` (time axis leading); returns outputs.

        Raises:
            ValueError: ``xs`` does not fit the compiled step.
            FloatingPointError: The learner's last call went wrong (see :meth:`sync`);
                this one then changes nothing.
        """
        refuse_traced("learner.etrace_evolve", xs)
        view, entry = self._view_entry()
        xs = self._place_inputs(entry, xs)
        self._checked.check(entry, call_signature(xs), lambda: check_inputs(xs, entry.example))
        params, hidden, other = self._leaves(entry, view)
        traces = self._checked_traces(entry)
        ys, hidden, other, traces = EVOLVE_PROGRAM(entry, params, hidden, other, traces, xs)
        self._deferred.settle()  # the last call's check, while the device runs this call
        view.write_state(hidden, other)
        self._set_traces(traces, entry)
        return ys

    def evaluate(self, xs: Any) -> Any:
        """The model's outputs over ``xs`` from fresh hidden states, at any batch size.

        For evaluation: the model runs in its current mode (``model.eval()``) from
        its hidden states' initial values; neither hidden state, traces nor any
        Variable of the model or the learner change, and no training program is
        compiled (see :func:`braintrace.evaluate`). Float inputs of another width
        are cast to the compiled input's dtype, as in every other call.

        Args:
            xs: Inputs, time axis leading; the batch axis (second) may have any size.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
            >>> learner.evaluate(jnp.ones((6, 50, 3))).shape
            (6, 50, 4)
        """
        refuse_traced("learner.evaluate", xs)
        example = self._entry().example
        return evaluate(self.model, cast_inputs(xs, example),
                        batch_size=batch_size_of(xs, example, self._batch_size))

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
        **signal_inputs: Any,
    ) -> nnx.State | tuple[nnx.State, jax.Array]:
        """Online gradients of the sequence loss, in one fused scan over time.

        The loss is ``Σ_t w_t · loss_fn(model_output_t, ys[t])`` with
        ``w_t = 1/T`` (``reduction='mean'``) or ``1`` (``'sum'``), times the
        mask if given (``'mean'`` then divides by the mask's sum). Hidden state
        and traces continue from where they are and are written back.

        A mask of all zeros has no mean: with ``reduction='mean'`` it is an
        error (skip the batch, or use ``reduction='sum'``, whose gradient is
        then zero). No gradient that is not finite is ever returned: the call
        returns without waiting for the device, and if its loss or gradient is
        not finite it returns zero gradients (so an optimiser that applies them
        adds nothing non-finite to the Params). Its check is read by the
        learner's next call (``etrace_grad``, ``etrace_evolve``, a trainer's
        step; it then changes nothing), or by :meth:`sync`, :meth:`save` or
        :meth:`state`, whichever comes first: the hidden state and traces it
        started from are then put back and its ``FloatingPointError`` is raised.

        Args:
            xs: Inputs, time axis leading (any pytree), at least one step.
            ys: Targets, time axis leading (any pytree).
            loss_fn: ``loss_fn(y_pred, y_target) -> scalar`` for one step. Traced once
                per function object (and shapes), as ``jax.jit`` traces a static
                function: a value it reads from outside (a global, a closure, an
                attribute) keeps the value it had at the first call. Pass a value that
                changes with the targets, e.g. ``ys=(targets, weights)`` with ``weights``
                ``(T,)`` and ``loss_fn(y, (t, w)) = w * ...`` (one program for all
                values), or give a new function object.
            mask: Optional finite weights (a concrete array): ``(T,)`` per step, or
                ``(T, batch)`` per step and sample (``'mean'`` then averages over
                the scored pairs).
            chunk_size: Windowed mode: exact reverse mode inside windows of this
                many steps (a positive int dividing ``T``), traces carrying
                credit across windows. ``None`` is single-step mode (BPTT:
                the whole sequence).
            block_size: Single-step mode advances the traces in blocks of this
                many steps, with matrix products (exactly the per-step result;
                see ``braintrace/_loops/_blocked.py``); ``1`` is the per-step
                form. Default where the algorithm has a blocked form (D_RTRL,
                ES_D_RTRL): as many steps as fit 256 MiB of the block's stacked
                per-step values, between 2 and 32 (32 for small models; 2 for
                ES-D-RTRL on 131,072 neurons at batch 32; on a TPU fewer for
                small traces, up to 64 for traces that bound the step:
                ``braintrace._loops.default_block_size``), else 1. Ignored in
                windowed mode.
            reduction: ``'mean'`` or ``'sum'`` over time.
            return_losses: Also return each step's loss ``(T,)`` (with a mask: over the
                step's scored samples; 0 at a step it scores nothing of).
            **signal_inputs: An algorithm's own per-step inputs:
                :class:`~braintrace.ThreeFactor`'s ``modulators={hidden path: (T,
                *state_shape)}``.

        Returns:
            An ``nnx.State`` of gradients for every Param (the structure of
            ``nnx.state(model, nnx.Param)``), accepted by
            ``nnx.Optimizer.update(model, grads)``; and the losses if asked.

        Raises:
            TypeError: Called inside ``jit`` (use :func:`braintrace.online_grad` there).
            ValueError: ``xs`` has no steps; ``xs``/``ys``/``mask`` lengths
                differ; an input has the wrong shape; the model's hidden state
                no longer has the compiled batch size; ``reduction``,
                ``chunk_size`` or ``mask`` is invalid (non-finite, or all zeros
                with ``'mean'``); or ``loss_fn`` returns a non-scalar.
            FloatingPointError: The learner's *last* call's loss at a step was not
                finite (names the first step), or a Param's gradient was not
                finite (names the Param); this call then changes nothing. The
                error of this call itself is raised by the next call or
                :meth:`sync`.
        """
        refuse_traced("learner.etrace_grad", xs, ys, mask)
        view, entry = self._view_entry()
        _, spec, args = self._grad_call(xs, ys, mask=mask, chunk_size=chunk_size,
                                        block_size=block_size, reduction=reduction,
                                        signal_inputs=signal_inputs, bound=(view, entry))
        result: GradResult = CHECKED_GRAD_PROGRAM(entry, loss_fn, spec, *args,
                                                  masked=mask is not None)
        self._deferred.settle()  # the last call's check, while the device runs this call
        view.write_state(result.hidden, result.other)
        self._set_traces(result.traces, entry)
        put_back = functools.partial(self._put_back, result.traces, args.hidden, args.other,
                                     args.traces)
        self._deferred.defer((result.finite,), functools.partial(
            grad_verdict, _GRAD_CALL, entry.graph.param_paths,
            args.xs, args.weights, result.losses, put_back))
        state = view.param_state(result.grads)
        return (state, result.losses) if return_losses else state

    def lower_etrace_grad(self, xs: Any, ys: Any, loss_fn: Callable[[Any, Any], jax.Array], *,
                          mask: jax.Array | None = None, chunk_size: int | None = None,
                          block_size: int | None = None, reduction: str = "mean",
                          **signal_inputs: Any) -> jax.stages.Lowered:
        """The lowered ``etrace_grad`` program (``.compile().memory_analysis()`` measures it):
        :func:`~braintrace._drivers._programs.checked_grad_program`.

        ``xs``/``ys`` may be ``jax.ShapeDtypeStruct`` objects, so long sequences need no data.
        """
        entry, spec, args = self._grad_call(xs, ys, mask=mask, chunk_size=chunk_size,
                                            block_size=block_size, reduction=reduction,
                                            signal_inputs=signal_inputs)
        return CHECKED_GRAD_PROGRAM.lower(entry, loss_fn, spec, *args, masked=mask is not None)

    def grad_args(self, xs: Any, ys: Any, *, mask: jax.Array | None = None,
                  chunk_size: int | None = None, reduction: str = "mean",
                  **signal_inputs: Any) -> GradArgs:
        """The checked arguments of the ``etrace_grad`` program for these inputs.

        Given to the compiled :meth:`lower_etrace_grad`, they run the very
        program that was lowered (and measured) without compiling it again; it
        returns a ``GradResult`` (gradients per Param leaf, final hidden and
        other state and traces, losses, and per Param whether its gradient and
        every loss are finite; zero gradients where one is not). Nothing is
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
        return self._grad_call(xs, ys, mask=mask, chunk_size=chunk_size, block_size=None,
                               reduction=reduction, signal_inputs=signal_inputs)[2]
