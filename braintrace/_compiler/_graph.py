"""The eligibility-trace graph of one model step, and how it is built.

Building the graph is a sequence of passes over the flat jaxpr of one step:

1. **Hidden groups.** Walk forward from every hidden state ``h^{t-1}``,
   stopping at ETP primitives and at operations that mix positions
   (``dot_general``, reductions, ...). States whose transitions then couple
   elementwise form one group: ``h_g^t = f_g(h_g^{t-1}; c)``, all of one shape
   ``V``, ``S`` states stacked on a trailing axis.
2. **Positions.** Within each group, position maps give the positions of
   ``h^{t-1}`` each ``h^t[v]`` depends on. Usually that is ``v`` alone and one
   JVP per state gives ``D`` exactly. A step that moves values between
   positions (a roll, a flip) gets a colouring of the positions, one JVP per
   colour and state, so ``D`` is still exactly the per-position block of the
   cut step's Jacobian (the approximation is reported).
3. **Relations.** For every ETP equation ``y = prim(x, θ)``, position maps
   from ``y`` to each group's ``h^t`` (not crossing another trainable ETP
   operation) give the structural map ``y → h``: for an operation with an
   input, each output unit must feed at most one hidden unit (fused gates such
   as GRU's ``(in, 3h)`` kernel qualify); for the elementwise primitive each
   hidden unit must read at most one output unit. Anything else is excluded,
   with its reason. Paths from ``y`` through operations that mix positions
   are cut in ``Df`` (and reported). ETP primitives hidden in opaque bodies
   (``custom_jvp``) are reported as exclusions.
4. **Weight programs.** Each trainable operand is traced back to the Param
   leaves it is computed from (masks and transforms included).

At run time the graph evaluates, per step, the model with a zero perturbation
at every ``h^t`` (its cotangent is the learning signal ``∂L_t/∂h^t``), the
inputs ``x`` of every traced operation, and, by forward-mode differentiation of
the cut step, each group's ``D = ∂h^t/∂h^{t-1}`` ``(*V, S, S)`` and each
relation's ``Df = ∂h^t/∂y`` — one JVP per state and colour of a group and per
colour of a relation, exact because units of one colour never meet in one
output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from braintrace._compiler import _positions as positions
from braintrace._compiler._approximations import Approximation, find_approximations
from braintrace._compiler._approximations import reached as reached_from
from braintrace._compiler._interpret import bind_equation, evaluate
from braintrace._primitive import ETPPrimitive

__all__ = ["ETraceGraph", "Exclusion", "HiddenGroup", "Relation", "build_graph"]

@dataclasses.dataclass(frozen=True)
class HiddenGroup:
    """Hidden states whose transitions couple elementwise.

    Attributes:
        index: Position of the group in ``ETraceGraph.groups``.
        leaves: Hidden-leaf indices of its states, in state order.
        paths: Their state paths (e.g. ``'layer.v'``).
        shape: The common shape ``V`` of the states (batch axis included).
        dtype: The dtype of the first state.
        colours: ``None`` when each ``h^t[v]`` depends on ``h^{t-1}`` only at
            position ``v``; otherwise flat position -> colour, where positions
            one output depends on have distinct colours, so one JVP per colour
            and state gives the exact per-position blocks of ``D``.
    """

    index: int
    leaves: tuple[int, ...]
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any
    colours: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @property
    def num_states(self) -> int:
        """``S``, the number of states per position."""
        return len(self.leaves)

    @property
    def size(self) -> int:
        """``N``, the number of positions."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def num_colours(self) -> int:
        """The number of JVPs per state needed for ``D``."""
        return 1 if self.colours is None else int(self.colours.max(initial=0)) + 1


@dataclasses.dataclass(frozen=True, eq=False)
class Relation:
    """One traced ETP operation feeding one hidden group.

    Attributes:
        index: Position in ``ETraceGraph.relations``.
        eqn_index: The ETP equation in the flat jaxpr.
        primitive: The ETP primitive.
        params: The equation parameters.
        group: Index of the hidden group it feeds.
        operands: ``{key: operand position}`` of its trainable inputs.
        param_paths: ``{key: Param paths}`` each operand is computed from.
        x_shape: Shape of the input ``x`` (``None`` without input).
        y_shape: Shape of the output ``y``.
        group_shape: Shape ``V`` of the group it feeds.
        y_to_hidden: For operations with an input: flat ``y`` position ->
            flat group position, ``-1`` where the unit feeds nothing.
        colours: Flat ``y`` position -> colour; units of one colour feed
            distinct hidden units, so one JVP per colour gives ``Df``.
        hidden_to_y: For the elementwise primitive: flat group position ->
            the flat ``y`` position it reads, ``-1`` for none.
    """

    index: int
    eqn_index: int
    primitive: ETPPrimitive
    params: dict[str, Any]
    group: int
    operands: dict[str, int]
    param_paths: dict[str, tuple[str, ...]]
    x_shape: tuple[int, ...] | None
    y_shape: tuple[int, ...]
    group_shape: tuple[int, ...]
    y_to_hidden: np.ndarray | None
    colours: np.ndarray | None
    hidden_to_y: np.ndarray | None

    @property
    def has_input(self) -> bool:
        """Whether the operation has an input ``x`` (dense-like) or not (elementwise)."""
        return self.x_shape is not None

    @property
    def num_colours(self) -> int:
        """The number of JVPs needed for ``Df``."""
        return 1 if self.colours is None else int(self.colours.max(initial=0)) + 1

    @property
    def batched(self) -> bool:
        """Whether ``x`` and ``y`` carry a leading batch axis."""
        return self.primitive.batched

    def gather_hidden(self, value: jax.Array) -> jax.Array:
        """Maps a group-shaped ``(*V, ...)`` array to ``y`` positions ``(*y, ...)``.

        Units that feed no hidden unit get zeros.
        """
        tail = value.shape[len(self.group_shape):]
        flat = value.reshape(-1, *tail)
        mask = (self.y_to_hidden >= 0).reshape(-1, *([1] * len(tail)))
        out = jnp.where(mask, flat[np.maximum(self.y_to_hidden, 0)], 0)
        return out.reshape(*self.y_shape, *tail)

    def scatter_to_y(self, value: jax.Array) -> jax.Array:
        """Sums a group-shaped ``(*V,)`` array into the ``y`` positions each unit reads."""
        size = int(np.prod(self.y_shape, dtype=np.int64))
        index = np.where(self.hidden_to_y >= 0, self.hidden_to_y, size)
        out = jax.ops.segment_sum(value.reshape(-1), index, num_segments=size + 1)[:size]
        return out.reshape(self.y_shape)


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """An ETP operation (or one of its targets) that is not traced online.

    Attributes:
        eqn_index: The ETP equation.
        primitive: Its name.
        param_paths: The Params it reads.
        reason: Why it is not traced; its Params get their same-step gradient.
    """

    eqn_index: int
    primitive: str
    param_paths: tuple[str, ...]
    reason: str


@dataclasses.dataclass(frozen=True, eq=False)
class ETraceGraph:
    """The compiled eligibility-trace graph of one model step.

    Produced by :func:`braintrace.compile_graph`; consumed by the algorithms.
    The step's jaxpr takes ``[*params, *hidden, *other, *x]`` leaves and returns
    ``[*y, *params, *hidden, *other]`` leaves.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> braintrace.init_states(model, 4)
        >>> graph = braintrace.compile_graph(model, jnp.ones((4, 2)))
        >>> [(g.paths, g.num_states) for g in graph.groups]
        [(('carry',), 1)]
        >>> [r.num_colours for r in graph.relations]
        [3, 3]

    Attributes:
        jaxpr: The flat jaxpr of one step.
        consts: Values of its constvars.
        param_paths / hidden_paths / other_paths: Leaf paths of each kind.
        num_outputs: Number of output leaves.
        out_treedef: Tree structure of the step output.
        groups: The hidden groups.
        relations: The traced relations.
        exclusions: ETP operations (or targets) not traced, with reasons.
        cut_eqns: Equations whose derivative is ignored in ``D`` and ``Df``.
        etp_eqns: Every ETP equation.
        approximations: Where the traces are not the exact influence of a
            Param on the hidden state (see :class:`Approximation`); empty
            when D-RTRL equals BPTT.
        scope: ``'diagonal'`` or ``'coupled'``.
        notes: What the normalisation pass changed.
        warnings: Approximations a person should know about.
    """

    jaxpr: jex_core.Jaxpr
    consts: tuple[Any, ...]
    param_paths: tuple[str, ...]
    hidden_paths: tuple[str, ...]
    other_paths: tuple[str, ...]
    num_outputs: int
    out_treedef: Any
    groups: tuple[HiddenGroup, ...]
    relations: tuple[Relation, ...]
    exclusions: tuple[Exclusion, ...]
    cut_eqns: frozenset[int]
    etp_eqns: frozenset[int]
    approximations: tuple[Approximation, ...]
    scope: str
    notes: tuple[str, ...]
    warnings: tuple[str, ...]

    def report(self) -> str:
        """A person-readable summary: groups, traced Params, same-step Params, warnings."""
        from braintrace._compiler._report import graph_report

        return graph_report(self)

    def __str__(self) -> str:
        return self.report()

    # -- layout helpers ------------------------------------------------------

    @property
    def num_params(self) -> int:
        return len(self.param_paths)

    @property
    def num_hidden(self) -> int:
        return len(self.hidden_paths)

    @property
    def input_avals(self) -> list[tuple[tuple[int, ...], Any]]:
        """``(shape, dtype)`` of each input leaf ``x`` of one step."""
        start = self.num_params + self.num_hidden + len(self.other_paths)
        return [(tuple(v.aval.shape), v.aval.dtype) for v in self.jaxpr.invars[start:]]

    @property
    def traced_eqns(self) -> frozenset[int]:
        """ETP equations with at least one relation."""
        return frozenset(r.eqn_index for r in self.relations)

    @property
    def traced_param_paths(self) -> tuple[str, ...]:
        """Params that learn (at least partly) by eligibility traces."""
        paths = {p for r in self.relations for ps in r.param_paths.values() for p in ps}
        return tuple(p for p in self.param_paths if p in paths)

    def _hidden_out_vars(self) -> list[jex_core.Var]:
        start = self.num_outputs + self.num_params
        return list(self.jaxpr.outvars[start:start + self.num_hidden])

    def _args(self, params, hidden, other, x) -> list[Any]:
        return [*params, *hidden, *other, *x]

    # -- run-time programs ---------------------------------------------------

    def forward(
        self,
        params: Sequence[jax.Array],
        hidden: Sequence[jax.Array],
        other: Sequence[jax.Array],
        x: Sequence[jax.Array],
        feedback: dict[int, dict[int, jax.Array]] | None = None,
    ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array]]:
        """One step of the model, also returning each relation's input ``x``.

        Differentiating its output with respect to ``params`` and ``hidden``
        gives the exact same-step gradient ``∂L_t/∂θ`` (every path of the
        step) and the learning signal ``∂L_t/∂h^{t-1}``.

        Args:
            params, hidden, other, x: The step's leaves.
            feedback: ``{eqn index: {operand position: B}}``: those ETP
                equations send derivatives to their input through ``B``
                instead of their trainable operands (e-prop's random feedback);
                values and derivatives with respect to the operands stay exact.

        Returns:
            ``(y_leaves, hidden_out, other_out, relation_inputs)`` where
            ``relation_inputs[r]`` is relation ``r``'s ``x`` (or ``None``).
        """
        record = [self._x_var(r) for r in self.relations if r.has_input]
        outs, recorded = evaluate(
            self.jaxpr, self.consts, self._args(params, hidden, other, x), feedback=feedback,
            record=record)
        recorded = iter(recorded)
        rel_x = [next(recorded) if r.has_input else None for r in self.relations]
        n_out, n_p, n_h = self.num_outputs, self.num_params, self.num_hidden
        return (outs[:n_out], outs[n_out + n_p:n_out + n_p + n_h],
                outs[n_out + n_p + n_h:], rel_x)

    def _x_var(self, relation: Relation) -> Any:
        eqn = self.jaxpr.eqns[relation.eqn_index]
        return eqn.invars[relation.primitive.x_invar_index]

    def operands(self, params: Sequence[jax.Array]) -> list[dict[str, jax.Array]]:
        """Each relation's trainable operands ``θ``, computed from the Params."""
        return self._operand_fn(params)

    def _operand_fn(self, params: Sequence[jax.Array]) -> list[dict[str, jax.Array]]:
        vars_ = [self.jaxpr.eqns[r.eqn_index].invars[i]
                 for r in self.relations for i in r.operands.values()]
        values = _evaluate_from_params(self.jaxpr, self.consts, self.num_params, params, vars_)
        it = iter(values)
        return [{key: next(it) for key in r.operands} for r in self.relations]

    def operand_pullback(
        self, params: Sequence[jax.Array], cotangents: Sequence[dict[str, jax.Array]]
    ) -> list[jax.Array]:
        """Maps gradients of the relations' operands to gradients of the Params.

        Each cotangent is cast to its operand's dtype (traces keep the Params'
        dtype, while an operand may be promoted, e.g. by Flax's ``dtype``).
        """
        operands, pullback = jax.vjp(self._operand_fn, list(params))
        cotangents = jax.tree.map(lambda c, o: c.astype(o.dtype), list(cotangents), operands)
        (grads,) = pullback(cotangents)
        return grads

    def jacobians(
        self,
        params: Sequence[jax.Array],
        hidden: Sequence[jax.Array],
        other: Sequence[jax.Array],
        x: Sequence[jax.Array],
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """Each group's ``D`` ``(*V, S, S)`` and each relation's ``Df``.

        ``Df`` is ``(*y, S)`` for an operation with an input (entry ``[k, s]``
        is ``∂h[π(k), s]/∂y[k]``) and ``(*V, S)`` for the elementwise primitive
        (entry ``[v, s]`` is ``∂h[v, s]/∂y[σ(v)]``).
        """
        args = self._args(params, hidden, other, x)
        n_p = self.num_params
        injection_eqns = sorted(self.traced_eqns)
        inj_specs = []
        for e in injection_eqns:
            eqn = self.jaxpr.eqns[e]
            y_var = eqn.outvars[eqn.primitive.y_outvar_index]
            inj_specs.append((e, eqn.primitive.y_outvar_index, y_var.aval))
        stop = self.cut_eqns | frozenset(
            e for e in self.etp_eqns if not self.jaxpr.eqns[e].primitive.gradient_enabled)

        def cut_step(hidden_in, injections):
            call_args = list(args)
            call_args[n_p:n_p + self.num_hidden] = hidden_in
            inj = {e: (pos, value) for (e, pos, _), value in zip(inj_specs, injections)}
            outs, _ = evaluate(self.jaxpr, self.consts, call_args, stop_eqns=stop,
                               injections=inj, forward_mode=True)
            return self._select_hidden_out(outs)

        hidden_in = list(hidden)
        zero_inj = [jnp.zeros(aval.shape, aval.dtype) for (_, _, aval) in inj_specs]
        _, jvp = jax.linearize(cut_step, hidden_in, zero_inj)
        tangents_h, tangents_y, slots = self._tangents(hidden_in, inj_specs, injection_eqns)
        if not slots:
            return [], []
        outs = jax.vmap(jvp)(tangents_h, tangents_y)
        return self._assemble(outs, slots)

    def _select_hidden_out(self, outs: list[jax.Array]) -> list[jax.Array]:
        start = self.num_outputs + self.num_params
        return outs[start:start + self.num_hidden]

    def _tangents(self, hidden_in, inj_specs, injection_eqns):
        """Stacks one tangent per (group, state) and per (relation, colour)."""
        slots: list[tuple[str, int, int, int]] = []
        t_h: list[list[jax.Array]] = []
        t_y: list[list[jax.Array]] = []
        zeros_h = [jnp.zeros_like(h) for h in hidden_in]
        zeros_y = [jnp.zeros(aval.shape, aval.dtype) for (_, _, aval) in inj_specs]
        for g in self.groups:
            for s, leaf in enumerate(g.leaves):
                for c in range(g.num_colours):
                    th = list(zeros_h)
                    if g.colours is None:
                        th[leaf] = jnp.ones_like(hidden_in[leaf])
                    else:
                        th[leaf] = jnp.asarray((g.colours == c).reshape(g.shape),
                                               hidden_in[leaf].dtype)
                    t_h.append(th)
                    t_y.append(list(zeros_y))
                    slots.append(("group", g.index, s, c))
        position = {e: i for i, e in enumerate(injection_eqns)}
        for r in self.relations:
            j = position[r.eqn_index]
            aval = inj_specs[j][2]
            for c in range(r.num_colours):
                ty = list(zeros_y)
                if r.colours is None:
                    ty[j] = jnp.ones(aval.shape, aval.dtype)
                else:
                    ty[j] = jnp.asarray((r.colours == c).reshape(aval.shape), aval.dtype)
                t_h.append(list(zeros_h))
                t_y.append(ty)
                slots.append(("relation", r.index, 0, c))
        stack = lambda rows: [jnp.stack(col) for col in zip(*rows)]
        return stack(t_h), stack(t_y), slots

    def _assemble(self, outs: list[jax.Array], slots: list[tuple[str, int, int, int]]):
        """Builds D and Df from the batched JVP outputs (one row per tangent)."""
        row = {slot: i for i, slot in enumerate(slots)}

        def group_response(g: HiddenGroup, i: int) -> jax.Array:
            # (*V, S): response of every state of g to tangent row i.
            return jnp.stack([outs[leaf][i] for leaf in g.leaves], axis=-1)

        d_list = []
        for g in self.groups:
            cols = []
            for s in range(g.num_states):
                responses = [group_response(g, row[("group", g.index, s, c)])
                             for c in range(g.num_colours)]
                if g.colours is None:
                    cols.append(responses[0])
                    continue
                # Position v reads the response to the tangent of its own colour.
                flat = jnp.stack(responses).reshape(g.num_colours, g.size, g.num_states)
                picked = flat[g.colours, np.arange(g.size)]
                cols.append(picked.reshape(*g.shape, g.num_states))
            d_list.append(jnp.stack(cols, axis=-1))  # (*V, S, S'): D[..., s, s']
        df_list = []
        for r in self.relations:
            g = self.groups[r.group]
            responses = jnp.stack(
                [group_response(g, row[("relation", r.index, 0, c)])
                 for c in range(r.num_colours)])
            if not r.has_input:
                df_list.append(responses[0])
                continue
            flat = responses.reshape(r.num_colours, g.size, g.num_states)
            pi = np.maximum(r.y_to_hidden, 0)
            df = flat[r.colours, pi] * (r.y_to_hidden >= 0)[:, None]
            df_list.append(df.reshape(*r.y_shape, g.num_states))
        return d_list, df_list

    def coupled_jacobians(
        self,
        params: Sequence[jax.Array],
        hidden: Sequence[jax.Array],
        other: Sequence[jax.Array],
        x: Sequence[jax.Array],
    ) -> list[jax.Array]:
        """Per-position blocks ``D[v, s, s'] = ∂h[v,s]/∂h[v,s']`` of the full Jacobian.

        Unlike :meth:`jacobians`, only ETP operations are cut: coupling through
        other operations (a fixed recurrent matrix) is kept in the Jacobian and
        its diagonal blocks are returned. Costs ``N·S`` JVPs per group.
        """
        args = self._args(params, hidden, other, x)
        n_p = self.num_params
        stop = frozenset(
            e for e in self.etp_eqns if not self.jaxpr.eqns[e].primitive.gradient_enabled)

        def step_hidden(hidden_in):
            call_args = list(args)
            call_args[n_p:n_p + self.num_hidden] = hidden_in
            outs, _ = evaluate(self.jaxpr, self.consts, call_args, stop_eqns=stop,
                               forward_mode=True)
            return self._select_hidden_out(outs)

        hidden_in = list(hidden)
        _, jvp = jax.linearize(step_hidden, hidden_in)
        d_list = []
        for g in self.groups:
            n, s_num = g.size, g.num_states
            eye = jnp.eye(n, dtype=g.dtype)
            blocks = []
            for s_in, leaf_in in enumerate(g.leaves):
                tangents = [jnp.zeros((n, *h.shape), h.dtype) for h in hidden_in]
                tangents[leaf_in] = eye.reshape(n, *g.shape)
                out = jax.vmap(jvp)(tangents)
                # out[leaf][j, ...] = ∂h_leaf / ∂h_in[j]; keep the diagonal j = v.
                cols = [jnp.diagonal(out[leaf].reshape(n, n)) for leaf in g.leaves]
                blocks.append(jnp.stack(cols, axis=-1))  # (N, S) over s for this s'
            d = jnp.stack(blocks, axis=-1).reshape(*g.shape, s_num, s_num)
            d_list.append(d)
        return d_list


def _evaluate_from_params(jaxpr, consts, num_params, params, targets) -> list[Any]:
    """Evaluates ``targets`` that depend only on Param invars (and constants)."""
    needed = {t for t in targets if not isinstance(t, jex_core.Literal)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if not isinstance(v, jex_core.DropVar)):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars[:num_params], params))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
    for eqn in reversed(eqns):
        outs = bind_equation(eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(t) for t in targets]


# -- building ------------------------------------------------------------------


def build_graph(
    closed: jex_core.ClosedJaxpr,
    *,
    param_paths: Sequence[str],
    hidden_paths: Sequence[str],
    other_paths: Sequence[str],
    num_outputs: int,
    out_treedef: Any,
    scope: str = "diagonal",
    notes: Sequence[str] = (),
    warnings: Sequence[str] = (),
) -> ETraceGraph:
    """Builds the :class:`ETraceGraph` of a flat step jaxpr (see module docstring)."""
    if scope not in ("diagonal", "coupled"):
        raise ValueError(f"scope must be 'diagonal' or 'coupled', got {scope!r}.")
    jaxpr = closed.jaxpr
    n_p, n_h = len(param_paths), len(hidden_paths)
    hidden_in = jaxpr.invars[n_p:n_p + n_h]
    hidden_out = jaxpr.outvars[num_outputs + n_p:num_outputs + n_p + n_h]
    warnings = list(warnings)

    etp_eqns = frozenset(i for i, e in enumerate(jaxpr.eqns) if isinstance(e.primitive, ETPPrimitive))
    stops_at_etp = lambda i, e: (
        i in etp_eqns and not e.primitive.gradient_enabled)

    # Pass 1: hidden groups.
    cut_eqns: set[int] = set()
    leaf_sources = {v: np.full((*v.aval.shape, 1), k, np.int64) for k, v in enumerate(hidden_in)}
    env = positions.propagate(jaxpr, leaf_sources, cut=stops_at_etp,
                              on_mixing=lambda i, e: cut_eqns.add(i))
    parent = list(range(n_h))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for j, var in enumerate(hidden_out):
        m = env.get(var) if not isinstance(var, jex_core.Literal) else None
        if m is None:
            continue
        for i in np.unique(m[m >= 0]):
            parent[find(int(i))] = find(j)
    members: dict[int, list[int]] = {}
    for k in range(n_h):
        members.setdefault(find(k), []).append(k)
    groups = []
    for leaves in sorted(members.values()):
        shapes = {tuple(hidden_in[k].aval.shape) for k in leaves}
        if len(shapes) > 1:
            listing = ", ".join(f"'{hidden_paths[k]}' {tuple(hidden_in[k].aval.shape)}"
                                for k in leaves)
            raise ValueError(
                f"Hidden states {listing} update each other elementwise but have different "
                "shapes, so they cannot form one hidden group. Give coupled states one shape "
                "(broadcast the smaller one when creating it).")
        groups.append(HiddenGroup(
            index=len(groups), leaves=tuple(leaves),
            paths=tuple(hidden_paths[k] for k in leaves),
            shape=tuple(hidden_in[leaves[0]].aval.shape), dtype=hidden_in[leaves[0]].aval.dtype))

    # Pass 2: position maps of each group's step; colour positions where the
    # step moves values between positions, so that D stays exact per position.
    group_list = []
    for g in groups:
        sources = {hidden_in[k]: positions.source_map(g.shape) for k in g.leaves}
        over: list[int] = []
        env_g = positions.propagate(
            jaxpr, sources, cut=lambda i, e: i in cut_eqns or stops_at_etp(i, e),
            on_mixing=lambda i, e, _over=over: _over.append(i))
        cut_eqns.update(over)
        maps = [env_g.get(hidden_out[k]) for k in g.leaves
                if not isinstance(hidden_out[k], jex_core.Literal)]
        maps = [m for m in maps if m is not None]
        colours = None
        if maps:
            deps = positions._union([m.reshape(g.size, -1) for m in maps], (g.size,))
            own = np.arange(g.size)[:, None]
            if not np.all((deps == own) | (deps < 0)):
                colours = _colour_positions(deps)
        group_list.append(dataclasses.replace(g, colours=colours))
    groups = group_list
    # Pass 3: relations.
    output_mixing: dict[int, list[int]] = {}
    relations: list[Relation] = []
    exclusions: list[Exclusion] = []
    kinds = ["Param"] * n_p + ["hidden state"] * n_h + ["non-Param Variable"] * len(other_paths)
    names = [*param_paths, *hidden_paths, *other_paths]
    invar_kinds = {v: (kinds[k], names[k]) if k < len(names) else ("input", f"x[{k - len(names)}]")
                   for k, v in enumerate(jaxpr.invars)}
    for e in sorted(etp_eqns):
        eqn = jaxpr.eqns[e]
        prim: ETPPrimitive = eqn.primitive
        layout = prim.trainable_invars(eqn.params)
        origin, problem = _trace_operands(jaxpr, e, layout, invar_kinds)
        all_paths = tuple(sorted({p for ps in origin.values() for p in ps}))
        if problem is not None:
            exclusions.append(Exclusion(e, prim.name, all_paths, problem))
            continue
        if not all_paths:
            continue  # no trainable Param feeds it: nothing to learn here
        y_var = eqn.outvars[prim.y_outvar_index]
        y_shape = tuple(y_var.aval.shape)
        crossings: list[str] = []
        mixing: list[str] = []

        def cut(i, other_eqn, _e=e, _crossings=crossings):
            if i != _e and stops_at_etp(i, other_eqn):
                _crossings.append(f"'{other_eqn.primitive.name}' (eqn {i})")
                return True
            return i in cut_eqns

        y_mixing: list[int] = []

        def on_mixing(i, other_eqn, _mixing=mixing, _y_mixing=y_mixing):
            _mixing.append(f"'{other_eqn.primitive.name}' (eqn {i})")
            _y_mixing.append(i)

        env_y = positions.propagate(
            jaxpr, {y_var: positions.source_map(y_shape)}, cut=cut, on_mixing=on_mixing)
        # Df follows the structural paths only: the mixing ones are cut (and reported).
        output_mixing[e] = y_mixing
        reached = False
        for g in groups:
            maps = [env_y.get(hidden_out[k]) if not isinstance(hidden_out[k], jex_core.Literal)
                    else None for k in g.leaves]
            maps = [m for m in maps if m is not None]
            if not maps:
                continue
            reached = True
            union = positions._union(
                [m.reshape(g.size, -1) for m in maps], (g.size,))
            relation_or_reason = _make_relation(
                len(relations), e, prim, eqn, g, layout, origin, y_shape, union)
            if isinstance(relation_or_reason, str):
                exclusions.append(Exclusion(
                    e, prim.name, all_paths, f"for hidden group {list(g.paths)}: "
                    f"{relation_or_reason}"))
            else:
                relations.append(relation_or_reason)
        if not reached:
            if crossings:
                reason = ("reaches hidden state only through another trainable ETP operation "
                          f"({', '.join(sorted(set(crossings)))})")
            elif mixing:
                reason = ("reaches hidden state only through operations that mix positions "
                          f"({', '.join(sorted(set(mixing)))})")
            else:
                reason = "reaches no hidden state (a readout)"
            exclusions.append(Exclusion(e, prim.name, all_paths, reason))

    exclusions.extend(_opaque_exclusions(jaxpr, etp_eqns, invar_kinds))
    stops = cut_eqns | {i for i in etp_eqns if stops_at_etp(i, jaxpr.eqns[i])}
    from_hidden, _ = reached_from(jaxpr, hidden_in,
                             {(i, k) for i in stops for k in range(len(jaxpr.eqns[i].invars))})
    coupling = {i for i in stops
                if any(not isinstance(v, jex_core.Literal) and v in from_hidden
                       for v in jaxpr.eqns[i].invars)}
    approximations = find_approximations(
        jaxpr, num_outputs=num_outputs, param_paths=param_paths, hidden_paths=hidden_paths,
        other_paths=other_paths, groups=groups, relations=relations, exclusions=exclusions,
        coupling_eqns=coupling, output_mixing=output_mixing)

    return ETraceGraph(
        jaxpr=jaxpr, consts=tuple(closed.consts), param_paths=tuple(param_paths),
        hidden_paths=tuple(hidden_paths), other_paths=tuple(other_paths),
        num_outputs=num_outputs, out_treedef=out_treedef, groups=tuple(groups),
        relations=tuple(relations), exclusions=tuple(exclusions),
        cut_eqns=frozenset(cut_eqns.union(*output_mixing.values())), etp_eqns=etp_eqns,
        approximations=approximations, scope=scope,
        notes=tuple(notes), warnings=tuple(dict.fromkeys(warnings)))


def _inner_etp_names(jaxpr: jex_core.Jaxpr) -> list[str]:
    """Names of the ETP primitives anywhere inside ``jaxpr`` (nested bodies included)."""
    names: list[str] = []
    for eqn in jaxpr.eqns:
        if isinstance(eqn.primitive, ETPPrimitive) and eqn.primitive.name not in names:
            names.append(eqn.primitive.name)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            names.extend(n for n in _inner_etp_names(sub) if n not in names)
    return names


def _opaque_exclusions(jaxpr, etp_eqns, invar_kinds) -> list[Exclusion]:
    """An exclusion for every equation that hides ETP primitives in its body.

    A ``custom_jvp``/``custom_vjp`` body (or control flow the normalisation
    pass kept) is opaque to the compiler; the Params it reads (directly or
    through non-ETP operations) get their same-step gradient only.
    """
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    out = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in etp_eqns:
            continue
        inner = [n for sub in jex_core.jaxprs_in_params(eqn.params)
                 for n in _inner_etp_names(sub)]
        if not inner:
            continue
        stack, seen, paths = list(eqn.invars), set(), set()
        while stack:
            v = stack.pop()
            if isinstance(v, jex_core.Literal) or v in seen:
                continue
            seen.add(v)
            if v in producer and producer[v] not in etp_eqns:
                stack.extend(jaxpr.eqns[producer[v]].invars)
            elif v in invar_kinds and invar_kinds[v][0] == "Param":
                paths.add(invar_kinds[v][1])
        if not paths:
            continue  # no Param reaches it: nothing is lost
        names = ", ".join(dict.fromkeys(inner))
        out.append(Exclusion(
            i, eqn.primitive.name, tuple(sorted(paths)),
            f"ETP primitive(s) {names} inside this opaque '{eqn.primitive.name}' body are "
            "invisible to the compiler; call them outside custom_jvp/custom_vjp functions"))
    return out


def _colour_positions(deps: np.ndarray) -> np.ndarray:
    """Greedy colouring: positions in one row of ``deps`` other than the row get distinct colours.

    ``deps[v]`` lists (padded with ``-1``) the positions ``h^t[v]`` depends on.
    Position ``u != v`` in ``deps[v]`` must not share ``v``'s colour, so the
    response of ``h^t[v]`` to a tangent on one colour class is ``∂h^t[v]/∂h[v]``.
    """
    n = deps.shape[0]
    neighbours: list[set[int]] = [set() for _ in range(n)]
    rows, slots = np.nonzero((deps >= 0) & (deps != np.arange(n)[:, None]))
    for v, u in zip(rows.tolist(), deps[rows, slots].tolist()):
        neighbours[v].add(u)
        neighbours[u].add(v)
    colours = np.full(n, -1, np.int64)
    for v in range(n):
        used = {int(colours[u]) for u in neighbours[v]}
        c = 0
        while c in used:
            c += 1
        colours[v] = c
    return colours


def _make_relation(index, e, prim, eqn, g, layout, origin, y_shape, union):
    """A relation of equation ``e`` with group ``g``, or the reason there is none."""
    y_size = int(np.prod(y_shape, dtype=np.int64))
    x_shape = (None if prim.x_invar_index is None
               else tuple(eqn.invars[prim.x_invar_index].aval.shape))
    common = dict(index=index, eqn_index=e, primitive=prim, params=dict(eqn.params),
                  group=g.index, operands=dict(layout), param_paths=origin,
                  x_shape=x_shape, y_shape=y_shape, group_shape=g.shape)
    if x_shape is None:
        if union.shape[-1] > 1:
            return "a hidden unit reads several units of the elementwise output"
        return Relation(**common, y_to_hidden=None, colours=None, hidden_to_y=union[:, 0].copy())
    valid = union >= 0
    counts = np.bincount(union[valid], minlength=y_size)
    if np.any(counts > 1):
        return ("an output unit feeds several hidden units (e.g. a broadcast), so its trace "
                "cannot follow one hidden unit")
    y_to_hidden = np.full(y_size, -1, np.int64)
    colours = np.zeros(y_size, np.int64)
    rows, slots = np.nonzero(valid)
    y_to_hidden[union[rows, slots]] = rows
    colours[union[rows, slots]] = slots
    if prim.batched and x_shape and y_shape and x_shape[0] != y_shape[0]:
        return "the batched primitive's x and y disagree on the batch size"
    return Relation(**common, y_to_hidden=y_to_hidden, colours=colours, hidden_to_y=None)


def _trace_operands(jaxpr, e, layout, invar_kinds):
    """Traces each trainable operand of equation ``e`` back to the Param leaves.

    Args:
        jaxpr: The flat step.
        e: The ETP equation.
        layout: ``{key: operand position}`` of its trainable inputs.
        invar_kinds: ``{invar: (kind, path)}`` of every step input.

    Returns:
        ``({key: Param paths}, problem)`` where ``problem`` says why an operand
        cannot be traced (it depends on a value that changes during the step or
        between steps: hidden state, input or a non-Param Variable).
    """
    producer = {}
    for i, eqn in enumerate(jaxpr.eqns[:e]):
        for v in eqn.outvars:
            producer[v] = i
    origin: dict[str, tuple[str, ...]] = {}
    problem = None
    for key, position in layout.items():
        stack = [jaxpr.eqns[e].invars[position]]
        seen = set()
        leaves: list[str] = []
        while stack:
            v = stack.pop()
            if isinstance(v, jex_core.Literal) or v in seen:
                continue
            seen.add(v)
            if v in producer:
                stack.extend(jaxpr.eqns[producer[v]].invars)
            elif v in invar_kinds:
                kind, path = invar_kinds[v]
                if kind == "Param":
                    leaves.append(path)
                elif problem is None:
                    problem = (f"its trainable input '{key}' is computed from the {kind} "
                               f"'{path}', not only from Params, so it cannot be traced")
        origin[key] = tuple(sorted(set(leaves)))
    return origin, problem
