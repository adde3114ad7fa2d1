"""The eligibility-trace graph of one model step, and how it is built.

Building the graph is a sequence of passes over the flat jaxpr of one step:

1. **Hidden groups.** Walk forward from every hidden state ``h^{t-1}``,
   stopping at ETP primitives and at operations that mix positions
   (``dot_general``, reductions, ...). States whose transitions then couple
   elementwise form one group: ``h_g^t = f_g(h_g^{t-1}; c)``, all of one shape
   ``V``, ``S`` states stacked on a trailing axis.
2. **Diagonality.** Within each group, position maps prove that
   ``h^t[v]`` depends on ``h^{t-1}`` only at the same position ``v``;
   any operation that breaks this is cut (reported as an approximation).
3. **Relations.** For every ETP equation ``y = prim(x, θ)``, position maps
   from ``y`` to each group's ``h^t`` (not crossing another trainable ETP
   operation) give the structural map ``y → h``: for an operation with an
   input, each output unit must feed at most one hidden unit (fused gates such
   as GRU's ``(in, 3h)`` kernel qualify); for the elementwise primitive each
   hidden unit must read at most one output unit. Anything else is excluded,
   with its reason.
4. **Weight programs.** Each trainable operand is traced back to the Param
   leaves it is computed from (masks and transforms included).

At run time the graph evaluates, per step, the model with a zero perturbation
at every ``h^t`` (its cotangent is the learning signal ``∂L_t/∂h^t``), the
inputs ``x`` of every traced operation, and, by forward-mode differentiation of
the cut step, each group's ``D = ∂h^t/∂h^{t-1}`` ``(*V, S, S)`` and each
relation's ``Df = ∂h^t/∂y`` — one JVP per state and per colour, exact because
the cut step is position-diagonal.
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
    """

    index: int
    leaves: tuple[int, ...]
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any

    @property
    def num_states(self) -> int:
        """``S``, the number of states per position."""
        return len(self.leaves)

    @property
    def size(self) -> int:
        """``N``, the number of positions."""
        return int(np.prod(self.shape, dtype=np.int64))


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
        perturbation: Sequence[jax.Array] | None = None,
    ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array]]:
        """One step with a perturbation added at the definition of every ``h^t``.

        Trainable operands of traced equations are read through
        ``stop_gradient``, so differentiating the result with respect to
        ``params`` gives only the same-step gradient of untraced sites, and with
        respect to ``perturbation`` the learning signal ``∂L/∂h^t``.

        Returns:
            ``(y_leaves, hidden_out, other_out, relation_inputs)`` where
            ``relation_inputs[r]`` is relation ``r``'s ``x`` (or ``None``).
        """
        perturb = {}
        if perturbation is not None:
            for var, p in zip(self._hidden_out_vars(), perturbation):
                perturb[var] = perturb[var] + p if var in perturb else p
        stop_operands = {
            eqn: tuple(self.jaxpr.eqns[eqn].primitive.trainable_invars(
                self.jaxpr.eqns[eqn].params).values())
            for eqn in self.traced_eqns}
        record = [self._x_var(r) for r in self.relations if r.has_input]
        outs, recorded = evaluate(
            self.jaxpr, self.consts, self._args(params, hidden, other, x),
            stop_operands=stop_operands, perturb=perturb, record=record)
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
        """Maps gradients of the relations' operands to gradients of the Params."""
        _, pullback = jax.vjp(self._operand_fn, list(params))
        (grads,) = pullback(list(cotangents))
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
                               injections=inj)
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
        slots: list[tuple[str, int, int]] = []
        t_h: list[list[jax.Array]] = []
        t_y: list[list[jax.Array]] = []
        zeros_h = [jnp.zeros_like(h) for h in hidden_in]
        zeros_y = [jnp.zeros(aval.shape, aval.dtype) for (_, _, aval) in inj_specs]
        for g in self.groups:
            for s, leaf in enumerate(g.leaves):
                th = list(zeros_h)
                th[leaf] = jnp.ones_like(hidden_in[leaf])
                t_h.append(th)
                t_y.append(list(zeros_y))
                slots.append(("group", g.index, s))
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
                slots.append(("relation", r.index, c))
        stack = lambda rows: [jnp.stack(col) for col in zip(*rows)]  # noqa: E731
        return stack(t_h), stack(t_y), slots

    def _assemble(self, outs: list[jax.Array], slots: list[tuple[str, int, int]]):
        """Builds D and Df from the batched JVP outputs (one row per tangent)."""
        row = {slot: i for i, slot in enumerate(slots)}

        def group_response(g: HiddenGroup, i: int) -> jax.Array:
            # (*V, S): response of every state of g to tangent row i.
            return jnp.stack([outs[leaf][i] for leaf in g.leaves], axis=-1)

        d_list = []
        for g in self.groups:
            cols = [group_response(g, row[("group", g.index, s)]) for s in range(g.num_states)]
            d_list.append(jnp.stack(cols, axis=-1))  # (*V, S, S'): D[..., s, s']
        df_list = []
        for r in self.relations:
            g = self.groups[r.group]
            responses = jnp.stack(
                [group_response(g, row[("relation", r.index, c)]) for c in range(r.num_colours)])
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
            outs, _ = evaluate(self.jaxpr, self.consts, call_args, stop_eqns=stop)
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
    needed = set(t for t in targets if not isinstance(t, jex_core.Literal))
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if not isinstance(v, jex_core.DropVar)):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars[:num_params], params))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
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
    stops_at_etp = lambda i, e: (  # noqa: E731
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
    group_of_leaf = {k: g.index for g in groups for k in g.leaves}

    # Pass 2: every group's step is position-diagonal once mixing ops are cut.
    for g in groups:
        sources = {hidden_in[k]: positions.source_map(g.shape) for k in g.leaves}
        diag_cuts: list[int] = []
        positions.propagate(jaxpr, sources, cut=stops_at_etp,
                            on_mixing=lambda i, e: diag_cuts.append(i),
                            max_sources=1)
        for i in diag_cuts:
            if i not in cut_eqns and jaxpr.eqns[i].primitive.name in (
                    positions.ELEMENTWISE | positions.MOVEMENT):
                warnings.append(
                    f"Hidden group {list(g.paths)}: '{jaxpr.eqns[i].primitive.name}' (eqn {i}) "
                    "combines different positions of the group; its derivative is ignored "
                    "(diagonal approximation).")
            cut_eqns.add(i)
    for i in sorted(cut_eqns):
        name = jaxpr.eqns[i].primitive.name
        warnings.append(
            f"'{name}' (eqn {i}) mixes positions of hidden-derived values; its derivative is "
            "ignored by the diagonal hidden Jacobian (recurrent coupling is approximated)."
            if scope == "diagonal" else
            f"'{name}' (eqn {i}) mixes positions; the coupled scope keeps only per-position "
            "blocks of its Jacobian.")

    # Pass 3: relations.
    relations: list[Relation] = []
    exclusions: list[Exclusion] = []
    param_set = {v: k for k, v in enumerate(jaxpr.invars[:n_p])}
    for e in sorted(etp_eqns):
        eqn = jaxpr.eqns[e]
        prim: ETPPrimitive = eqn.primitive
        layout = prim.trainable_invars(eqn.params)
        origin, problem = _trace_operands(jaxpr, e, layout, n_p, param_set, param_paths)
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

        def cut(i, other_eqn, _e=e):
            if i != _e and stops_at_etp(i, other_eqn):
                crossings.append(f"'{other_eqn.primitive.name}' (eqn {i})")
                return True
            return i in cut_eqns

        env_y = positions.propagate(
            jaxpr, {y_var: positions.source_map(y_shape)}, cut=cut,
            on_mixing=lambda i, oe: mixing.append(f"'{oe.primitive.name}' (eqn {i})"))
        reached = False
        for g in groups:
            maps = [env_y.get(hidden_out[k]) if not isinstance(hidden_out[k], jex_core.Literal)
                    else None for k in g.leaves]
            maps = [m for m in maps if m is not None]
            if not maps:
                continue
            reached = True
            union = positions._union(  # noqa: SLF001
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
        elif mixing:
            warnings.append(
                f"'{prim.name}' (eqn {e}) with Params {list(all_paths)} also reaches hidden "
                f"state through {', '.join(sorted(set(mixing)))}; that path is ignored.")

    return ETraceGraph(
        jaxpr=jaxpr, consts=tuple(closed.consts), param_paths=tuple(param_paths),
        hidden_paths=tuple(hidden_paths), other_paths=tuple(other_paths),
        num_outputs=num_outputs, out_treedef=out_treedef, groups=tuple(groups),
        relations=tuple(relations), exclusions=tuple(exclusions),
        cut_eqns=frozenset(cut_eqns), etp_eqns=etp_eqns, scope=scope,
        notes=tuple(notes), warnings=tuple(dict.fromkeys(warnings)))


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


def _trace_operands(jaxpr, e, layout, num_params, param_set, param_paths):
    """Traces each trainable operand of equation ``e`` back to the Param leaves.

    Returns:
        ``({key: Param paths}, problem)`` where ``problem`` says why the operand
        cannot be traced (it depends on the input or the hidden state).
    """
    producer = {}
    for i, eqn in enumerate(jaxpr.eqns[:e]):
        for v in eqn.outvars:
            producer[v] = i
    origin: dict[str, tuple[str, ...]] = {}
    for key, position in layout.items():
        var = jaxpr.eqns[e].invars[position]
        stack = [var]
        seen = set()
        leaves: set[int] = set()
        while stack:
            v = stack.pop()
            if isinstance(v, jex_core.Literal) or v in seen:
                continue
            seen.add(v)
            if v in param_set:
                leaves.add(param_set[v])
            elif v in producer:
                stack.extend(jaxpr.eqns[producer[v]].invars)
            elif v in jaxpr.invars:
                kind = "hidden state or input"
                return origin, (f"its trainable input '{key}' is computed from the {kind}, not "
                                "only from Params; it cannot be traced")
        origin[key] = tuple(param_paths[k] for k in sorted(leaves))
    return origin, None
