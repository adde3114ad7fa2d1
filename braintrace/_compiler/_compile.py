"""``compile_graph``: one step of a stateful NNX module (or a pure step function) to a graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flax import nnx

from braintrace._compiler._alternatives import approximations_of, exact_alternatives
from braintrace._compiler._build import build_graph
from braintrace._compiler._flax_cells import drop_in, flax_cells
from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._layout import StepLayout
from braintrace._compiler._records import Approximation
from braintrace._compiler._step import TracedStep, trace_function_step, trace_model_step
from braintrace._primitives import ETPPrimitive

__all__ = ["AlgorithmLike", "compile_graph", "refuse_approximations"]


class AlgorithmLike(Protocol):
    """What the compiler asks of an algorithm (``braintrace.AbstractAlgorithm`` is one)."""

    name: str
    scope: str
    keeps_traces: bool

    def approximations(self, graph: ETraceGraph) -> Sequence[Approximation]:
        """What the algorithm approximates by construction on ``graph``."""

    def graph_approximations(self, graph: ETraceGraph) -> Sequence[Approximation]:
        """Which of ``graph.approximations`` hold for the algorithm."""


def compile_graph(
    model: nnx.Module | Callable[..., Any],
    example_x: Any,
    *,
    scope: str | None = None,
    params: Any = None,
    hidden: Any = None,
    strict: bool = False,
    algorithm: AlgorithmLike | None = None,
) -> ETraceGraph:
    """Compiles one time step of ``model`` into an eligibility-trace graph.

    ``model(x)`` must be one time step that reads and writes the model's
    :class:`braintrace.HiddenState` variables. Hidden states must already have
    their batch shape (see :func:`braintrace.init_states`).

    Alternatively ``model`` is a pure step function
    ``fn(params, hidden, x) -> (hidden, y)`` and ``params`` and ``hidden`` are
    pytrees of arrays (e.g. dicts): Param and state paths are their key paths.
    The graph's leaves are then ``jax.tree.leaves(params)``,
    ``jax.tree.leaves(hidden)``, no other state, and ``jax.tree.leaves(x)``.

    Args:
        model: A stateful NNX module, or a pure step function.
        example_x: An input of one step (any pytree of arrays).
        scope: ``'diagonal'`` (the default without ``algorithm``): the hidden
            Jacobian ignores operations that mix positions; ``'coupled'``: keep
            their per-position blocks (used by OSTL); ``'full'``: the full
            Jacobian through every path of the step (used by RTRL, SnAp, UORO).
            ``None``: the scope of ``algorithm``.
        params: The trainable parameters of a pure step function.
        hidden: The hidden state of a pure step function.
        strict: Refuse a model whose gradient would not be BPTT's: any
            approximation of the graph's traces (``graph.approximations``, unless
            ``algorithm`` keeps no traces: BPTT) or, with ``algorithm``, of the
            algorithm on this model (``algorithm.approximations(graph)``).
        algorithm: The algorithm the graph is compiled for (e.g.
            ``braintrace.SnAp(2)``): its scope, and what ``strict`` checks.

    Returns:
        The graph; ``print(graph.report())`` describes it.

    Raises:
        ValueError: No hidden state; no Param read by an ETP primitive (unless
            ``algorithm`` keeps no traces: BPTT differentiates any step); a Param
            written in the step; a step that changes a hidden state's shape; an
            ETP primitive whose declared layout (``x_invar_index``,
            ``y_outvar_index``, trainable inputs) does not fit its equation;
            ``scope`` is not the scope of ``algorithm``; with ``strict=True``,
            any approximation of the traces or of the algorithm.
            Errors of the model itself (a layer's input-shape check) propagate
            with a note naming the example's shapes and the hidden states.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> class Leaky(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.w = nnx.Param(jnp.ones((3, 2)))
        ...         self.h = braintrace.HiddenState(jnp.zeros((4, 2)))
        ...     def __call__(self, x):
        ...         self.h[...] = 0.9 * self.h[...] + braintrace.matmul(x, self.w[...])
        ...         return self.h[...]
        >>> graph = braintrace.compile_graph(Leaky(nnx.Rngs(0)), jnp.ones((4, 3)))
        >>> [g.paths for g in graph.groups]
        [('h',)]
        >>> graph.traced_param_paths
        ('w',)

        The same step as a pure function:

        >>> def step(params, hidden, x):
        ...     h = 0.9 * hidden['h'] + braintrace.matmul(x, params['w'])
        ...     return {'h': h}, h
        >>> graph = braintrace.compile_graph(
        ...     step, jnp.ones((4, 3)), params={'w': jnp.ones((3, 2))},
        ...     hidden={'h': jnp.zeros((4, 2))})
        >>> graph.traced_param_paths, graph.hidden_paths
        (('w',), ('h',))
    """
    if isinstance(model, nnx.Module):
        if params is not None or hidden is not None:
            raise TypeError(
                "compile_graph: params= and hidden= are for a pure step function; an NNX "
                "module carries its own Params and HiddenStates.")
        step = trace_model_step(model, example_x)
        name = type(model).__name__
    elif callable(model):
        if params is None or hidden is None:
            raise TypeError(
                "compile_graph: a pure step function fn(params, hidden, x) -> (hidden, y) "
                "needs params= and hidden= (pytrees of arrays).")
        step = trace_function_step(model, params, hidden, example_x)
        name = getattr(model, "__name__", type(model).__name__)
    else:
        raise TypeError(
            f"compile_graph: expected an nnx.Module or a step function, got "
            f"{type(model).__name__}.")
    _check_layouts(name, step)
    graph = _build(step, _scope(scope, algorithm))
    if algorithm is None or algorithm.keeps_traces:
        _check_traceable(name, graph)
    if strict:
        refuse_approximations(name, graph, algorithm)
    return graph


def _scope(scope: str | None, algorithm: AlgorithmLike | None) -> str:
    if algorithm is None:
        return "diagonal" if scope is None else scope
    if scope is not None and scope != algorithm.scope:
        raise ValueError(
            f"compile_graph: scope={scope!r}, but algorithm '{algorithm.name}' runs in the "
            f"{algorithm.scope!r} scope; leave scope=None to use the algorithm's.")
    return algorithm.scope


def refuse_approximations(name: str, graph: ETraceGraph,
                          algorithm: AlgorithmLike | None = None) -> None:
    """Raises the ``strict=True`` error if the graph's traces or ``algorithm`` approximate.

    The message names the algorithm, gives one plain sentence per
    approximation (what is approximate, what to do) and the details after.
    """
    found = approximations_of(graph, algorithm)
    if not found:
        return
    who = ("the eligibility traces of this model are" if algorithm is None
           else f"the gradient of algorithm '{algorithm.name}' ({type(algorithm).__name__}) "
           "on this model is")
    sentences = "\n".join(f"  - {s}" for s in dict.fromkeys(a.summary for a in found))
    details = "\n".join(f"  - {a.describe()}" for a in found)
    raise ValueError(
        f"{name}: strict=True, but {who} approximate:\n{sentences}\n"
        f"{exact_alternatives(graph)}Details:\n"
        f"{details}\nChange these parts of the model or the algorithm, or compile with "
        "strict=False to accept the approximation.")


def _check_layouts(name: str, step: TracedStep) -> None:
    """Checks the declared layout of every ETP equation before the graph reads it."""
    for eqn in step.closed_jaxpr.jaxpr.eqns:
        if isinstance(eqn.primitive, ETPPrimitive):
            try:
                eqn.primitive.check_layout(eqn)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None


def _build(step: TracedStep, scope: str) -> ETraceGraph:
    layout = StepLayout(param_paths=step.param_paths, hidden_paths=step.hidden_paths,
                        other_paths=step.other_paths, num_outputs=step.num_outputs,
                        out_treedef=step.out_treedef)
    return build_graph(step.closed_jaxpr, layout, scope=scope, modules=step.modules,
                       notes=step.notes, warnings=step.warnings)


def _check_traceable(name: str, graph: ETraceGraph) -> None:
    """Raises if no Param is read by an ETP primitive (nothing could ever learn online)."""
    if graph.relations or any(x.param_paths for x in graph.exclusions):
        return
    listing = ", ".join(repr(p) for p in graph.param_paths)
    cells = flax_cells(graph.modules, graph.param_paths)
    drop_ins = "".join(f"; {drop_in(graph.modules, c)} instead of {graph.modules.label(c)}"
                       for c in cells)
    raise ValueError(
        f"{name}: no ETP primitive reads a Param, so nothing can learn by eligibility traces "
        f"(Params {listing} would get only same-step gradients). Route trainable operations "
        "through braintrace.matmul, braintrace.lora_matmul or braintrace.element_wise, or use "
        f"the layers in braintrace.layers (e.g. ETPLinear instead of nnx.Linear{drop_ins}).")
