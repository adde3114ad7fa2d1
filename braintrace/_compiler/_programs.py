"""Run-time programs of a graph: the step, the operands, and the Jacobians ``D`` and ``Df``.

Each is a function of an :class:`~braintrace.ETraceGraph` and one
:class:`StepLeaves` record, evaluated by the one value interpreter
(``_interpret.evaluate``) with options:

* :func:`forward`: the model step, also recording each relation's input
  ``x``; optionally with feedback-alignment operands, probes on the
  relations' outputs (:func:`output_probes`), on the new hidden states
  (:func:`state_probes`) or on relations' inputs, and recurrent kernels
  transposed once for the learning signal's pullback (:func:`x_pullbacks`);
* :func:`reader_jacobians`: ``∂x'/∂h^t`` of the relations that read a group's
  new state unit by unit (``_readers.py``);
* :func:`operands` / :func:`operand_pullback`: each relation's trainable
  operands ``θ`` from the Params (masks and transforms included), and the map
  of operand gradients back to Param gradients;
* the hidden Jacobians :func:`jacobians`, :func:`coupled_jacobians` and
  :func:`full_jacobians`, from ``_jacobians`` (its docstring says how).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from braintrace._compiler._interpret import bind_equation, evaluate
from braintrace._compiler._jacobians import (
    arranges_colours,
    assemble_jacobians,
    can_pull_jacobians,
    coupled_jacobians,
    full_jacobians,
    jacobian_responses,
    jacobians,
    pulls_jacobians,
)
from braintrace._compiler._layout import StepLeaves, StepOutputs
from braintrace._primitives import etp_dense_batched_p, etp_dense_p

if TYPE_CHECKING:
    from braintrace._compiler._graph import ETraceGraph

__all__ = [
    "arranges_colours",
    "assemble_jacobians",
    "can_pull_jacobians",
    "coupled_jacobians",
    "forward",
    "forward_cutting_inputs",
    "full_jacobians",
    "jacobian_responses",
    "jacobians",
    "operand_pullback",
    "operands",
    "output_probes",
    "pulls_jacobians",
    "reader_jacobians",
    "state_probes",
    "x_pullbacks",
]


def forward(graph: ETraceGraph, leaves: StepLeaves,
            feedback: dict[int, dict[int, jax.Array]] | None = None,
            output_probes: Sequence[jax.Array | None] | None = None,
            state_probes: Sequence[jax.Array] | None = None,
            x_pullbacks: dict[int, tuple[Any, jax.Array]] | None = None,
            input_probes: Mapping[int, jax.Array] | None = None,
            ) -> tuple[StepOutputs, list[jax.Array | None]]:
    """One step of the model, and each relation's input ``x`` (``None`` without input).

    Differentiating its output with respect to ``leaves.params`` and
    ``leaves.hidden`` gives the exact same-step gradient ``∂L_t/∂θ`` (every
    path of the step) and the learning signal ``∂L_t/∂h^{t-1}``.

    Args:
        graph: The graph.
        leaves: The step's input leaves.
        feedback: ``{eqn index: {operand position: B}}``: those ETP equations
            send derivatives to their input through ``B`` instead of their
            trainable operands (e-prop's random feedback); values and
            derivatives with respect to the operands stay exact.
        output_probes: Per relation, zeros shaped like its output ``y`` (or
            ``None``), added to ``y``; the relations' trainable operands are
            then cut from the derivative *through the relation* (their other
            uses keep it). Differentiating with respect to the probes gives
            each relation's output cotangent ``∂L_t/∂y``, from which the
            relation's own share of ``∂L_t/∂θ`` is ``xy_to_dw(x, ∂L_t/∂y)``.
        state_probes: Per hidden leaf, zeros shaped like its new value ``h^t``
            (:func:`state_probes`), added where ``h^t`` is defined
            (``graph.new_state_vars()``: before a cast into the state's dtype), so that
            every read of ``h^t`` in the step (the readout, a later state)
            sees it; the relations' trainable operands are cut as with
            ``output_probes``. Differentiating with respect to the probes gives
            ``∂L_t/∂h^t`` with ``h^t`` an input of everything after it (no
            derivative through the recurrent kernels); with respect to the
            Params, their same-step gradient by every path but the traced
            relations. A leaf whose new value is a literal, or the same
            variable as an earlier leaf's, gets a zero derivative.
        x_pullbacks: From :func:`x_pullbacks`: those ETP equations pull their
            input's derivative back through a kernel transposed in advance
            (the same derivatives; reverse mode only).
        input_probes: ``{relation index: zeros shaped like its input x}``, added
            to ``x`` where the relation's equation reads it, and there alone:
            differentiating with respect to a probe gives ``∂L_t/∂x`` through that
            read (the equation's operand; other reads of the same ``x`` — another
            operation, a direct path to the output — are not in it), OTPE's signal
            at a group's readers.
    """
    outs, rel_x, _ = forward_cutting_inputs(graph, leaves, (), feedback, output_probes,
                                            state_probes, x_pullbacks, input_probes)
    return outs, rel_x


def forward_cutting_inputs(graph: ETraceGraph, leaves: StepLeaves, cut_inputs: Sequence[int],
                           feedback: dict[int, dict[int, jax.Array]] | None = None,
                           output_probes: Sequence[jax.Array | None] | None = None,
                           state_probes: Sequence[jax.Array] | None = None,
                           x_pullbacks: dict[int, tuple[Any, jax.Array]] | None = None,
                           input_probes: Mapping[int, jax.Array] | None = None,
                           ) -> tuple[StepOutputs, list[jax.Array | None], list[jax.Array]]:
    """:func:`forward`, with the input ``x`` of each ETP equation of ``cut_inputs`` passing
    no derivative back through the equation (its other reads keep theirs), and returned.

    Returns:
        ``(outputs, rel_x, cut_x)``: :func:`forward`'s two and the input of each equation
        of ``cut_inputs``, in that order (a learning signal's ``input_objective`` reads them).
    """
    eqns = graph.jaxpr.eqns
    inputs = [graph.relation_input_var(r) for r in graph.input_relations]
    inputs += [eqns[i].invars[eqns[i].primitive.x_invar_index] for i in cut_inputs]
    stops: dict[int, tuple[int, ...]] = {i: (eqns[i].primitive.x_invar_index,)
                                         for i in cut_inputs}
    injections = {}
    cut = output_probes if output_probes is not None else (
        [None] * len(graph.relations) if state_probes is not None else ())
    for r, probe in zip(graph.relations, cut):
        stops[r.eqn_index] = (*stops.get(r.eqn_index, ()), *r.operands.values())
        if probe is not None:
            injections[r.eqn_index] = (r.primitive.y_outvar_index, probe)
    probed: dict[Any, jax.Array] = {}
    for var, probe in zip(graph.new_state_vars(), state_probes or ()):
        if not isinstance(var, jex_core.Literal) and var not in probed:
            probed[var] = probe.astype(var.aval.dtype)  # h^t computed wider than stored
    at_reads: dict[int, dict[int, jax.Array]] = {}
    for index, probe in (input_probes or {}).items():
        r = graph.relations[index]
        read = at_reads.setdefault(r.eqn_index, {})
        position = r.primitive.x_invar_index
        read[position] = read[position] + probe if position in read else probe
    outs, recorded = evaluate(graph.jaxpr, graph.consts, leaves.args(), feedback=feedback,
                              stop_operands=stops, injections=injections,
                              var_injections=probed, operand_injections=at_reads,
                              record=inputs, x_pullbacks=x_pullbacks)
    count = len(graph.input_relations)
    by_relation = dict(zip((r.index for r in graph.input_relations), recorded[:count]))
    return (graph.layout.split_outputs(outs),
            [by_relation.get(r.index) for r in graph.relations], list(recorded[count:]))


def reader_jacobians(graph: ETraceGraph, leaves: StepLeaves,
                     found: Sequence[Sequence[int]]) -> list[tuple[jax.Array, ...]]:
    """Per hidden group ``g``, for each relation ``r'`` reading it (``found``, from
    ``_readers.readers``), ``ψ = ∂x'/∂h_g^t`` on ``g``'s units: ``(*V, S)``, entry ``[v, s]``
    is ``∂x'[v]/∂h_g^t[v, s]``.

    One JVP per state of a group with readers, a tangent of ones on that state at every
    position: exact because a reader's ``x'[v]`` depends on position ``v`` alone. Forward
    mode through ``custom_vjp`` functions as :func:`evaluate` makes it.
    """
    jaxpr = graph.jaxpr
    probes = state_probes(graph)
    first = {}
    for k, var in enumerate(graph.new_state_vars()):
        if not isinstance(var, jex_core.Literal):
            first.setdefault(var, k)

    def inputs(values, readers):
        injected = {var: values[k].astype(var.aval.dtype) for var, k in first.items()}
        _, recorded = evaluate(jaxpr, graph.consts, leaves.args(), var_injections=injected,
                               record=[graph.relation_input_var(graph.relations[i])
                                       for i in readers], forward_mode=True)
        return recorded

    found_psi = []
    for g, readers in zip(graph.groups, found):
        if not readers:
            found_psi.append(())
            continue
        columns = []
        for leaf in g.leaves:
            tangent = [jnp.ones_like(p) if k == leaf else jnp.zeros_like(p)
                       for k, p in enumerate(probes)]
            columns.append(jax.jvp(lambda v, rs=readers: inputs(v, rs), (probes,), (tangent,))[1])
        found_psi.append(tuple(jnp.stack([c[j] for c in columns], axis=-1)
                               for j in range(len(readers))))
    return found_psi


def x_pullbacks(graph: ETraceGraph, operands_: Sequence[dict[str, jax.Array]],
                feedback: dict[int, Any] | None = None) -> dict[int, tuple[Any, jax.Array]]:
    """For :func:`forward`: each dense relation whose input reads the hidden state (a
    recurrent kernel), its kernel ``T(K)ᵀ`` transposed once, to pull the learning signal
    back through: ``∂/∂x = (∂/∂y) T(K)ᵀ``.

    Made outside the time loop, the transposed copy is a loop invariant that the step's
    product reads in order; JAX's transpose of the product reads ``K`` across its rows in
    every step (XLA:CPU: 97 against 50 µs per step for a GRU's ``(16, 768) × (768, 256)``).
    Input layers are left alone (nothing differentiates the data); so are feedback
    equations (their pullback is the feedback matrix's).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace._compiler import programs
        >>> model = layers.Stateful(layers.GRUCell(3, 4, rngs=nnx.Rngs(0)))
        >>> braintrace.init_states(model, 2)
        >>> graph = braintrace.compile_graph(model, jnp.ones((2, 3)))
        >>> params = braintrace._compiler.split_model(model)[1]
        >>> pulls = programs.x_pullbacks(graph, programs.operands(graph, jax.tree.leaves(params)))
        >>> [graph.relations[i].param_paths for i, r in enumerate(graph.relations)
        ...  if r.eqn_index in pulls]  # the recurrent kernel only
        [{'kernel': ('cell.dense_h.kernel',)}]
        >>> [k.shape for _, k in pulls.values()]
        [(12, 4)]
    """
    feedback = feedback or {}
    reads_hidden = _reads_hidden(graph)
    pulls: dict[int, tuple[Any, jax.Array]] = {}
    for r, theta in zip(graph.relations, operands_):
        eqn = graph.jaxpr.eqns[r.eqn_index]
        if (eqn.primitive not in (etp_dense_p, etp_dense_batched_p) or r.eqn_index in feedback
                or r.eqn_index in pulls or graph.relation_input_var(r) not in reads_hidden):
            continue
        transform = eqn.params["kernel_transform"]
        kernel = theta["kernel"] if transform is None else transform(theta["kernel"])
        precision = eqn.params["precision"]
        pulls[r.eqn_index] = (
            lambda ct, kernel_t, p=precision: jnp.matmul(ct, kernel_t.astype(ct.dtype),
                                                         precision=p),
            jnp.transpose(kernel))
    return pulls


def _reads_hidden(graph: ETraceGraph) -> set[Any]:
    """The jaxpr variables that depend on the hidden state the step starts from."""
    reached = set(graph.layout.hidden_invars(graph.jaxpr))
    for eqn in graph.jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in reached for v in eqn.invars):
            reached.update(v for v in eqn.outvars if not isinstance(v, jex_core.DropVar))
    return reached


def output_probes(graph: ETraceGraph) -> list[jax.Array | None]:
    """Zero probes for :func:`forward`: one per ETP equation (``None`` for a relation whose
    equation an earlier relation already probes)."""
    seen: set[int] = set()
    probes: list[jax.Array | None] = []
    for r in graph.relations:
        var = graph.relation_output_var(r.eqn_index)
        probes.append(None if r.eqn_index in seen else jnp.zeros(var.aval.shape, var.aval.dtype))
        seen.add(r.eqn_index)
    return probes


def state_probes(graph: ETraceGraph) -> list[jax.Array]:
    """Zero probes for :func:`forward`: one per hidden leaf, shaped like its new value."""
    return [jnp.zeros(v.aval.shape, v.aval.dtype)
            for v in graph.layout.hidden_outvars(graph.jaxpr)]


def operands(graph: ETraceGraph, params: Sequence[jax.Array]) -> list[dict[str, jax.Array]]:
    """Each relation's trainable operands ``θ``, computed from the Params."""
    jaxpr = graph.jaxpr
    targets = [jaxpr.eqns[r.eqn_index].invars[i] for r in graph.relations
               for i in r.operands.values()]
    needed = {t for t in targets if not isinstance(t, jex_core.Literal)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if not isinstance(v, jex_core.DropVar)):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, graph.consts))
    env.update(zip(graph.layout.param_invars(jaxpr), params))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
    for eqn in reversed(eqns):
        for v, o in zip(eqn.outvars, bind_equation(eqn, [read(v) for v in eqn.invars])):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    values = iter(read(t) for t in targets)
    return [{key: next(values) for key in r.operands} for r in graph.relations]


def operand_pullback(graph: ETraceGraph, params: Sequence[jax.Array],
                     cotangents: Sequence[dict[str, jax.Array]]) -> list[jax.Array]:
    """Maps gradients of the relations' operands to gradients of the Params.

    Each cotangent is cast to its operand's dtype (traces keep the Params'
    dtype, while an operand may be promoted, e.g. by Flax's ``dtype``).
    """
    values, pullback = jax.vjp(lambda p: operands(graph, p), list(params))
    cotangents = jax.tree.map(lambda c, o: c.astype(o.dtype), list(cotangents), values)
    (grads,) = pullback(cotangents)
    return grads
