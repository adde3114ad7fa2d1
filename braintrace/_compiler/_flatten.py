"""Normalisation pass: flatten one model step's jaxpr before compilation.

The eligibility-trace compiler walks the equations of *one* model time step.
It only understands a flat program: every equation that touches a weight or a
hidden state must sit at the top level, where the compiler can see it. This
pass rewrites a :class:`jax.extend.core.ClosedJaxpr` into an equivalent one
that has that shape. It is an interpreter over the jaxpr whose results are
re-traced with :func:`jax.make_jaxpr`, so every inlined call site gets fresh
variables.

While interpreting, the pass propagates *taint*: the set of top-level inputs
flagged in ``tracked`` (weights and hidden states) a value depends on. The
rewrite rules are:

* ``jit``/``pjit``, ``closed_call``, ``call``/``core_call`` and
  ``remat``/``checkpoint``: inlined, recursively.
* ``custom_jvp_call`` and ``custom_vjp_call``: kept opaque and re-bound with
  their params, so the custom derivative rule (surrogate spike functions)
  survives. ETP primitives found inside such a body are reported, because the
  compiler cannot see them.
* ``cond``: if any operand (the index included) is tainted, converted to a
  select of branches: every branch is evaluated inline (recursively flattened)
  and the outputs are combined with :func:`jax.lax.select_n`. Otherwise kept.
* ``scan``: if any operand is tainted and ``length <= max_unroll``, or the model
  asked for it (``jax.lax.scan(..., unroll=True)``), unrolled (``reverse``
  respected, ``ys`` stacked). A longer tainted scan is an error that says how
  to unroll it. Otherwise kept.
* ``while``: a tainted operand is an error (a weight or hidden state inside a
  loop with a dynamic trip count cannot be compiled into eligibility traces).
  Otherwise kept.
* ``scatter`` that writes its whole operand (one window at the origin, of the
  operand's shape): replaced by its update. Flax writes ``variable[...] = value``
  so when ``value`` differs from the Variable in dtype (a float32 step into a
  bfloat16 hidden state), shape or sharding; the result is the update, and the
  compiler follows it into the hidden state like any other value.
* Everything else is re-bound unchanged.

Control flow that is kept (untainted ``cond``/``scan``/``while``) has its
bodies normalised as well, so no ``jit`` equation remains anywhere outside
opaque custom-derivative bodies.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compiler._flatten import flatten_jaxpr
    >>> def step(w, h):
    ...     return jax.jit(lambda w, h: jnp.tanh(w * h))(w, h)
    >>> closed = jax.make_jaxpr(step)(1.0, 2.0)
    >>> flat = flatten_jaxpr(closed, [True, True])
    >>> [eqn.primitive.name for eqn in flat.closed_jaxpr.eqns]
    ['mul', 'tanh']
    >>> flat.notes
    ("jit '<lambda>' at eqn 0 inlined",)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np
from jax import lax
from jax.extend import source_info_util

from braintrace._compiler._modules import SCOPE_PREFIX

__all__ = ["FlatJaxpr", "flatten_jaxpr", "walk_eqns"]

INLINE_PRIMITIVES = frozenset(
    {"pjit", "jit", "closed_call", "call", "core_call", "remat", "remat2", "checkpoint"})
"""Call-like primitives whose body is inlined."""

OPAQUE_PRIMITIVES = frozenset(
    {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})
"""Custom-derivative primitives that are re-bound unchanged."""

_Taint = frozenset  # frozenset[int]: indices of the top-level tracked invars.
_EMPTY: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class FlatJaxpr:
    """Result of :func:`flatten_jaxpr`.

    Attributes:
        closed_jaxpr: A new closed jaxpr computing the same function as the
            input, with the same invars/outvars order and avals.
        notes: Human-readable descriptions of what was converted, in order of
            first occurrence and without duplicates.
    """

    closed_jaxpr: jex_core.ClosedJaxpr
    notes: tuple[str, ...]


def flatten_jaxpr(
    closed_jaxpr: jex_core.ClosedJaxpr,
    tracked: Sequence[bool],
    *,
    max_unroll: int = 32,
    invar_names: Sequence[str] | None = None,
    module_label: Callable[[str], str] | None = None,
) -> FlatJaxpr:
    """Inlines calls and removes control flow that touches tracked inputs.

    Args:
        closed_jaxpr: One model step, e.g. from :func:`jax.make_jaxpr`.
        tracked: One flag per invar: ``True`` for weights and hidden states.
        max_unroll: Longest ``scan`` over tracked inputs that is unrolled unless the
            scan itself asks to be unrolled whole (``unroll=True``).
        invar_names: Optional names of the invars (e.g. ``"cell.kernel"``),
            used in error messages.
        module_label: Names a module path for the notes (e.g. ``'`rnn.neuron`
            (LIF)'``); equations traced in a module scope (see ``_modules.py``)
            are then located by module too.

    Returns:
        The flattened program and notes on what was converted.

    Raises:
        ValueError: If ``tracked``/``invar_names`` do not match the invars, a
            ``while`` loop consumes a tracked input, or a ``scan`` over a
            tracked input is longer than ``max_unroll`` and not ``unroll=True``.
    """
    jaxpr = closed_jaxpr.jaxpr
    num_invars = len(jaxpr.invars)
    tracked = [bool(t) for t in tracked]
    if len(tracked) != num_invars:
        raise ValueError(
            f"flatten_jaxpr: got {len(tracked)} tracked flag(s) for a jaxpr with "
            f"{num_invars} invar(s); pass one flag per invar.")
    if invar_names is not None and len(invar_names) != num_invars:
        raise ValueError(
            f"flatten_jaxpr: got {len(invar_names)} invar name(s) for a jaxpr with "
            f"{num_invars} invar(s); pass one name per invar.")
    if max_unroll < 0:
        raise ValueError(f"flatten_jaxpr: max_unroll must be >= 0, got {max_unroll}.")
    flattener = _Flattener(max_unroll=max_unroll, invar_names=invar_names,
                           module_label=module_label)
    taints = [frozenset({i}) if t else _EMPTY for i, t in enumerate(tracked)]

    def fun(*args):
        outs, _ = flattener.eval(jaxpr, closed_jaxpr.consts, args, taints, ())
        return _coerce_all(outs, closed_jaxpr.out_avals)

    new_closed = _retrace(fun, closed_jaxpr.in_avals)
    return FlatJaxpr(closed_jaxpr=new_closed, notes=tuple(dict.fromkeys(flattener.notes)))


# -- helpers -------------------------------------------------------------------


def _retrace(fun: Callable[..., list[Any]], in_avals: Sequence[Any]) -> jex_core.ClosedJaxpr:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in in_avals]
    return jax.make_jaxpr(fun)(*specs)


def _coerce(x: Any, aval: Any) -> Any:
    """Casts ``x`` to ``aval``'s dtype and weak type when they differ.

    Unrolling and select-of-branches may change only the *weak type* of a
    value (e.g. a weakly typed scan carry that the body makes strong); this
    restores the aval the original equation promised.
    """
    if not (hasattr(aval, "dtype") and hasattr(aval, "weak_type")):
        return x
    current = jax.typeof(x)
    if current.dtype == aval.dtype and getattr(current, "weak_type", False) == aval.weak_type:
        return x
    return lax.convert_element_type_p.bind(x, new_dtype=aval.dtype, weak_type=aval.weak_type,
                                           sharding=None)


def _coerce_all(xs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    return [_coerce(x, a) for x, a in zip(xs, avals, strict=True)]


def _split_closed(jaxpr: Any) -> tuple[jex_core.Jaxpr, Sequence[Any]]:
    """``(open jaxpr, consts)`` of a closed or open jaxpr param."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _inner_jaxpr(params: dict[str, Any]) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params:
            return params[key]
    raise KeyError(f"no jaxpr param among {sorted(params)}")


def _union(taints: Sequence[frozenset[int]]) -> frozenset[int]:
    out: frozenset[int] = _EMPTY
    for t in taints:
        out = out | t
    return out


def walk_eqns(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
    """All equations of ``jaxpr``, recursing into every sub-jaxpr."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from walk_eqns(sub)


def _writes_whole_operand(eqn: jex_core.JaxprEqn) -> bool:
    """Whether a ``scatter`` equation overwrites every element of its operand with its update.

    One window (an index vector of length 0 and no batch of indices) at the origin, of
    the operand's shape, with no inserted or batching dimension: the result is the update
    (as ``x.at[...].set(v)`` writes it).
    """
    operand, indices, update = (v.aval for v in eqn.invars)
    dims = eqn.params["dimension_numbers"]
    return (indices.shape == (0,) and tuple(update.shape) == tuple(operand.shape)
            and tuple(dims.update_window_dims) == tuple(range(len(operand.shape)))
            and not dims.inserted_window_dims and not dims.scatter_dims_to_operand_dims
            and not dims.operand_batching_dims)


def _contains_inlinable(jaxpr: jex_core.Jaxpr) -> bool:
    return any(eqn.primitive.name in INLINE_PRIMITIVES for eqn in walk_eqns(jaxpr))


def _where(path: tuple[str, ...], index: int) -> str:
    loc = f"eqn {index}"
    return f"{loc} in {' > '.join(path)}" if path else loc


def _call_name(eqn: jex_core.JaxprEqn) -> str:
    name = eqn.params.get("name")
    if name is None:
        return eqn.primitive.name
    return f"{eqn.primitive.name} '{name}'"


class _Flattener:
    """Interpreter that re-binds a jaxpr while applying the rewrite rules."""

    def __init__(self, *, max_unroll: int, invar_names: Sequence[str] | None,
                 module_label: Callable[[str], str] | None):
        self.max_unroll = max_unroll
        self.invar_names = invar_names
        self.module_label = module_label
        self.notes: list[str] = []

    def _where(self, path: tuple[str, ...], index: int) -> str:
        """``'eqn 3 in jit 'f'``, and the module it runs in (from the current name stack)."""
        where = _where(path, index)
        if self.module_label is None:
            return where
        scopes = [s[len(SCOPE_PREFIX):]
                  for s in str(source_info_util.current_name_stack()).split("/")
                  if s.startswith(SCOPE_PREFIX)]
        return f"{where} in {self.module_label(scopes[-1])}" if scopes else where

    def _names(self, taint: frozenset[int]) -> str:
        if self.invar_names is None:
            return ", ".join(f"invar {i}" for i in sorted(taint))
        return ", ".join(repr(str(self.invar_names[i])) for i in sorted(taint))

    # -- interpreter -------------------------------------------------------

    def eval(
        self,
        jaxpr: jex_core.Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        arg_taints: Sequence[frozenset[int]],
        path: tuple[str, ...],
    ) -> tuple[list[Any], list[frozenset[int]]]:
        """Evaluates ``jaxpr`` on ``args``; returns outputs and their taints."""
        env: dict[Any, Any] = {}
        tenv: dict[Any, frozenset[int]] = {}

        def read(v: Any) -> tuple[Any, frozenset[int]]:
            if isinstance(v, jex_core.Literal):
                return v.val, _EMPTY
            return env[v], tenv[v]

        def write(v: Any, val: Any, taint: frozenset[int]) -> None:
            if isinstance(v, jex_core.DropVar):
                return
            env[v] = val
            tenv[v] = taint

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            write(v, c, _EMPTY)
        for v, a, t in zip(jaxpr.invars, args, arg_taints, strict=True):
            write(v, a, t)

        for index, eqn in enumerate(jaxpr.eqns):
            invals, intaints = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback,
                                                name_stack=name_stack),
                  eqn.ctx.manager):
                outs, outtaints = self._eqn(eqn, index, list(invals), list(intaints), path)
            for v, val, t in zip(eqn.outvars, outs, outtaints, strict=True):
                write(v, val, t)

        outs, taints = zip(*map(read, jaxpr.outvars)) if jaxpr.outvars else ((), ())
        return list(outs), list(taints)

    def _eqn(self, eqn, index, invals, intaints, path):
        name = eqn.primitive.name
        where = self._where(path, index)
        if name in INLINE_PRIMITIVES:
            inner, consts = _split_closed(_inner_jaxpr(eqn.params))
            self.notes.append(f"{_call_name(eqn)} at {where} inlined")
            return self.eval(inner, consts, invals, intaints,
                             (*path, f"{_call_name(eqn)} at eqn {index}"))
        if name in OPAQUE_PRIMITIVES:
            self._note_opaque(eqn, where)
        elif name == "cond" and any(intaints):
            return self._cond_to_select(eqn, index, invals, intaints, path)
        elif name == "scan" and any(intaints):
            return self._unroll_scan(eqn, index, invals, intaints, path)
        elif name == "while" and any(intaints):
            taint = _union(intaints)
            raise ValueError(
                f"while_loop at {where} consumes tracked input(s) {self._names(taint)}. "
                "Weights and hidden states inside a while_loop cannot be compiled into "
                "eligibility traces (its trip count is dynamic). Use jax.lax.scan with a "
                "static length, or jax.lax.fori_loop with static Python-int bounds (which "
                "lowers to scan), or move the loop out of the model step.")
        elif name == "scatter" and _writes_whole_operand(eqn):
            self.notes.append(f"scatter at {where} writes its whole operand: replaced by its "
                              "update")
            return [_coerce(invals[2], eqn.outvars[0].aval)], [intaints[2]]
        params = eqn.params
        if name in ("cond", "scan", "while"):
            params = self._normalise_bodies(eqn, index, path)
        return self._bind(eqn.primitive, params, invals, intaints)

    @staticmethod
    def _bind(primitive, params, invals, intaints):
        bind_params = primitive.get_bind_params(params)
        ans = primitive.bind(*invals, **bind_params)
        outs = list(ans) if primitive.multiple_results else [ans]
        return outs, [_union(intaints)] * len(outs)

    # -- rules -------------------------------------------------------------

    def _note_opaque(self, eqn, where):
        label = _call_name(eqn)
        self.notes.append(f"{label} at {where} kept opaque")
        body, _ = _split_closed(eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
        if body is None:
            return
        from braintrace._primitives import ETPPrimitive  # local: avoid import cycles

        seen: list[str] = []
        for inner in walk_eqns(body):
            if isinstance(inner.primitive, ETPPrimitive) and inner.primitive.name not in seen:
                seen.append(inner.primitive.name)
        for prim_name in seen:
            self.notes.append(
                f"ETP primitive {prim_name} inside {label} body at {where} is excluded "
                "from trace learning")

    def _cond_to_select(self, eqn, index, invals, intaints, path):
        branches = eqn.params["branches"]
        num = len(branches)
        where = self._where(path, index)
        self.notes.append(f"cond at {where} converted to select of {num} branches")
        if any(branch.effects for branch in branches):
            self.notes.append(
                f"cond at {where}: side effects of every branch now run unconditionally")
        idx, ops = invals[0], invals[1:]
        idx_taint, op_taints = intaints[0], intaints[1:]
        branch_outs, branch_taints = [], []
        for b, branch in enumerate(branches):
            inner, consts = _split_closed(branch)
            outs, taints = self.eval(inner, consts, ops, op_taints,
                                     (*path, f"cond at eqn {index} branch {b}"))
            branch_outs.append(outs)
            branch_taints.append(taints)
        if num == 1:
            return (_coerce_all(branch_outs[0], [v.aval for v in eqn.outvars]),
                    [t | idx_taint for t in branch_taints[0]])
        idx = lax.convert_element_type(idx, np.int32)
        # The cond primitive runs the last branch for any out-of-range index
        # (negative included); the unsigned comparison catches both ends.
        in_range = lax.lt(lax.convert_element_type(idx, np.uint32), np.uint32(num))
        idx = lax.select(in_range, idx, lax.full_like(idx, num - 1))
        outs = [lax.select_n(idx, *cases) for cases in zip(*branch_outs, strict=True)]
        taints = [_union(ts) | idx_taint for ts in zip(*branch_taints, strict=True)]
        return _coerce_all(outs, [v.aval for v in eqn.outvars]), taints

    def _unroll_scan(self, eqn, index, invals, intaints, path):
        params = eqn.params
        length, reverse = params["length"], params["reverse"]
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        where = self._where(path, index)
        if length > self.max_unroll and params.get("unroll", 1) < length:
            raise ValueError(
                f"scan at {where} has length {length} and consumes tracked input(s) "
                f"{self._names(_union(intaints))}. Weights and hidden states inside a rolled "
                "loop cannot be compiled into eligibility traces, and the compiler unrolls "
                f"such a scan itself only up to {self.max_unroll} steps. Unroll it in the "
                "model (jax.lax.scan(..., unroll=True), or a Python for loop), or move the "
                "loop out of the model step (one step per call).")
        self.notes.append(
            f"scan at {where} unrolled ({length} iteration(s){', reversed' if reverse else ''})")
        inner, body_consts = _split_closed(params["jaxpr"])
        consts, carry, xs = (invals[:num_consts], invals[num_consts:num_consts + num_carry],
                             invals[num_consts + num_carry:])
        c_taints = intaints[:num_consts]
        carry_taints = intaints[num_consts:num_consts + num_carry]
        x_taints = intaints[num_consts + num_carry:]
        ys_per_step: list[list[Any]] = [[] for _ in range(length)]
        y_taints = [_EMPTY] * (len(inner.outvars) - num_carry)
        sub_path = (*path, f"scan at eqn {index}")
        carry_avals = [v.aval for v in inner.invars[num_consts:num_consts + num_carry]]
        for i in (reversed(range(length)) if reverse else range(length)):
            x_t = [lax.index_in_dim(x, i, 0, keepdims=False) for x in xs]
            outs, taints = self.eval(inner, body_consts, [*consts, *carry, *x_t],
                                     [*c_taints, *carry_taints, *x_taints], sub_path)
            carry = _coerce_all(outs[:num_carry], carry_avals)
            carry_taints = taints[:num_carry]
            ys_per_step[i] = outs[num_carry:]
            y_taints = [a | b for a, b in zip(y_taints, taints[num_carry:], strict=True)]
        ys = []
        for k, var in enumerate(inner.outvars[num_carry:]):
            if length == 0:
                aval = var.aval
                ys.append(lax.full((0, *aval.shape), 0, aval.dtype))
            else:
                ys.append(lax.concatenate(
                    [lax.expand_dims(step[k], (0,)) for step in ys_per_step], 0))
        outs = _coerce_all([*carry, *ys], [v.aval for v in eqn.outvars])
        return outs, [*carry_taints, *y_taints]

    def _normalise_bodies(self, eqn, index, path):
        """Params of a kept ``cond``/``scan``/``while`` with flattened bodies."""
        keys = {"cond": ("branches",), "scan": ("jaxpr",),
                "while": ("cond_jaxpr", "body_jaxpr")}[eqn.primitive.name]
        params = dict(eqn.params)
        changed = False
        for key in keys:
            value = params[key]
            bodies = value if isinstance(value, tuple) else (value,)
            if not any(_contains_inlinable(b.jaxpr) for b in bodies):
                continue
            sub_path = (*path, f"{eqn.primitive.name} at eqn {index}")
            new = tuple(self._flatten_body(b, sub_path) for b in bodies)
            params[key] = new if isinstance(value, tuple) else new[0]
            changed = True
        return params if changed else eqn.params

    def _flatten_body(self, closed, path):
        """Re-traces an untainted sub-jaxpr with calls inlined; consts stay closed."""
        inner, consts = closed.jaxpr, closed.consts
        taints = [_EMPTY] * len(inner.invars)

        def fun(*args):
            return _coerce_all(self.eval(inner, consts, args, taints, path)[0], closed.out_avals)

        return _retrace(fun, closed.in_avals)
