"""Tests for the jaxpr normalisation pass (braintrace._compiler._flatten)."""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import braintrace
from braintrace._compiler._flatten import FlatJaxpr, flatten_jaxpr

# -- helpers --------------------------------------------------------------------


def _prim_names(jaxpr, recursive: bool = True) -> list[str]:
    """Primitive names of ``jaxpr`` (and of every sub-jaxpr when ``recursive``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if recursive:
            for sub in jex_core.jaxprs_in_params(eqn.params):
                names.extend(_prim_names(sub))
    return names


def _top_names(closed) -> list[str]:
    return _prim_names(closed, recursive=False)


def _random_args(closed, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    args = []
    for aval in closed.in_avals:
        if jnp.issubdtype(aval.dtype, jnp.integer):
            args.append(rng.integers(-1, 4, size=aval.shape).astype(aval.dtype))
        elif aval.dtype == jnp.bool_:
            args.append(rng.random(aval.shape) < 0.5)
        else:
            args.append(rng.normal(size=aval.shape).astype(aval.dtype))
    return args


def _assert_same_function(closed, flat: FlatJaxpr, num_trials: int = 4, args=None) -> None:
    new = flat.closed_jaxpr
    jex_core.check_jaxpr(new.jaxpr)
    assert new.in_avals == closed.in_avals
    assert new.out_avals == closed.out_avals
    trials = [args] if args is not None else [_random_args(closed, s) for s in range(num_trials)]
    for trial in trials:
        want = jex_core.jaxpr_as_fun(closed)(*trial)
        got = jex_core.jaxpr_as_fun(new)(*trial)
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


F32 = jnp.float32


def _spec(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


# -- jit / remat inlining -------------------------------------------------------


def test_nested_jit_is_inlined():
    @jax.jit
    def inner(w, x):
        return jnp.tanh(x @ w)

    @jax.jit
    def middle(w, x):
        return inner(w, x) + inner(w, 2.0 * x)

    def step(w, h, x):
        return middle(w, x) * h, jax.jit(lambda a: a * 3.0)(h)

    closed = jax.make_jaxpr(step)(_spec(3, 4), _spec(4), _spec(3))
    assert "jit" in _top_names(closed)
    flat = flatten_jaxpr(closed, [True, True, False])
    names = _prim_names(flat.closed_jaxpr)
    assert "jit" not in names and "pjit" not in names
    assert names.count("tanh") == 2  # fresh copy per call site
    assert any("inlined" in note for note in flat.notes)
    assert any("eqn 0 in jit 'middle'" in note for note in flat.notes)
    _assert_same_function(closed, flat)


def test_remat_is_inlined():
    def step(w, x):
        return jax.checkpoint(lambda a, b: jnp.sin(a * b))(w, x)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, False])
    assert _top_names(flat.closed_jaxpr) == ["mul", "sin"]
    _assert_same_function(closed, flat)


def test_etp_primitive_in_nested_jit_survives():
    @jax.jit
    def layer(x, w, b):
        return jax.jit(braintrace.matmul)(x, w, b)

    def step(w, b, h, x):
        return jnp.tanh(layer(x, w, b) + h)

    closed = jax.make_jaxpr(step)(_spec(3, 4), _spec(4), _spec(4), _spec(3))
    flat = flatten_jaxpr(closed, [True, True, True, False])
    names = _top_names(flat.closed_jaxpr)
    assert "etp_dense" in names
    assert "jit" not in _prim_names(flat.closed_jaxpr)
    (eqn,) = [e for e in flat.closed_jaxpr.eqns if e.primitive.name == "etp_dense"]
    assert isinstance(eqn.primitive, braintrace.ETPPrimitive)
    assert eqn.primitive is braintrace.etp_dense_p
    _assert_same_function(closed, flat)


def test_literals_constvars_and_weak_types():
    table = jnp.arange(4.0, dtype=F32)  # closed over: a const of the jit's jaxpr

    def step(w, s):
        return jax.jit(lambda a: a * table + 1.0)(w) * s, 2 * s, 3.0

    closed = jax.make_jaxpr(step)(_spec(4), 1.0)  # s is weak-typed
    assert closed.in_avals[1].weak_type
    flat = flatten_jaxpr(closed, [True, False])
    _assert_same_function(closed, flat)

    # A closed jaxpr with top-level constvars: the jit's own body.
    (eqn,) = [e for e in closed.eqns if e.primitive.name == "jit"]
    inner = eqn.params["jaxpr"]
    assert inner.consts and inner.jaxpr.constvars
    flat_inner = flatten_jaxpr(inner, [True])
    _assert_same_function(inner, flat_inner)


# -- cond ------------------------------------------------------------------------


def _cond_step(w, h, x):
    def on(a, b):
        return jax.jit(jnp.tanh)(a * b), a

    def off(a, b):
        return a - b, b * 2.0

    return lax.cond(jnp.sum(h) > 0, on, off, w * x, h)


def test_cond_with_tracked_predicate_becomes_select():
    closed = jax.make_jaxpr(_cond_step)(_spec(3), _spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, True, False])
    names = _prim_names(flat.closed_jaxpr)
    assert "cond" not in names and "jit" not in names
    assert "select_n" in names
    assert any("converted to select of 2 branches" in n for n in flat.notes)
    x = np.ones(3, np.float32)
    w = np.full(3, 0.5, np.float32)
    for h in (np.full(3, 2.0, np.float32), np.full(3, -2.0, np.float32)):  # both branches
        _assert_same_function(closed, flat, args=[w, h, x])
    _assert_same_function(closed, flat)


def test_cond_with_untracked_operands_is_kept():
    def step(w, x, y):
        return w + lax.cond(jnp.sum(x) > 0, lambda a: a * 2.0, lambda a: -a, y)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, False, False])
    assert "cond" in _top_names(flat.closed_jaxpr)
    assert not any("converted" in n for n in flat.notes)
    _assert_same_function(closed, flat)


def test_cond_with_untracked_predicate_but_tracked_operand_is_converted():
    def step(w, x):
        return lax.cond(jnp.sum(x) > 0, lambda a: a * 2.0, lambda a: -a, w)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, False])
    assert "cond" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_cond_with_effects_is_noted():
    def step(w):
        def noisy(a):
            jax.debug.callback(lambda: None)
            return a * 2.0

        return lax.cond(jnp.sum(w) > 0, noisy, lambda a: a, w)

    closed = jax.make_jaxpr(step)(_spec(3))
    flat = flatten_jaxpr(closed, [True])
    assert any("side effects" in n for n in flat.notes)
    _assert_same_function(closed, flat)


def test_switch_with_tracked_index_matches_every_branch():
    def step(k, w):
        branches = [lambda a: a, lambda a: a + 1.0, lambda a: a * 3.0]
        return lax.switch(k, branches, w)

    closed = jax.make_jaxpr(step)(_spec(dtype=jnp.int32), _spec(2))
    flat = flatten_jaxpr(closed, [True, True])
    assert "cond" not in _prim_names(flat.closed_jaxpr)
    assert any("select of 3 branches" in n for n in flat.notes)
    w = np.array([1.0, -2.0], np.float32)
    for k in (-3, 0, 1, 2, 9):
        _assert_same_function(closed, flat, args=[np.int32(k), w])


# -- scan -----------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_short_scan_over_tracked_input_is_unrolled(reverse):
    def step(w, h, xs):
        def body(carry, x):
            a, b = carry
            a = jnp.tanh(a * w + x)
            return (a, b + a.sum()), (a * 2.0, b)

        (a, b), (ys, bs) = lax.scan(body, (h, 0.0), xs, reverse=reverse)
        return a, b, ys, bs

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3), _spec(5, 3))
    flat = flatten_jaxpr(closed, [True, True, False])
    names = _prim_names(flat.closed_jaxpr)
    assert "scan" not in names
    assert names.count("tanh") == 5
    assert any("scan at eqn" in n and "unrolled (5 iteration(s)" in n for n in flat.notes)
    _assert_same_function(closed, flat)


def test_scan_with_dropped_outputs_and_tracked_xs():
    def step(w, xs):
        _, ys = lax.scan(lambda c, x: (c + x * w, c), jnp.zeros(2), xs)
        return ys[-1]  # carry output is a DropVar in the jaxpr

    closed = jax.make_jaxpr(step)(_spec(2), _spec(4, 2))
    flat = flatten_jaxpr(closed, [False, True])
    assert "scan" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_zero_length_scan_over_tracked_input():
    def step(w, h):
        return lax.scan(lambda c, _: (c * w, c + 1.0), h, None, length=0)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, True])
    assert "scan" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_fori_loop_with_static_bounds_is_unrolled():
    def step(w, h):
        return lax.fori_loop(0, 4, lambda i, c: jnp.tanh(c * w + i), h)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, True])
    assert "scan" not in _prim_names(flat.closed_jaxpr)
    assert "while" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_untracked_scan_is_kept_and_its_body_normalised():
    def step(w, xs):
        total, _ = lax.scan(lambda c, x: (c + jax.jit(jnp.sin)(x).sum(), None), 0.0, xs)
        return w * total

    closed = jax.make_jaxpr(step)(_spec(3), _spec(5, 3))
    flat = flatten_jaxpr(closed, [True, False])
    assert "scan" in _top_names(flat.closed_jaxpr)
    assert "jit" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_long_scan_over_tracked_input_raises():
    def step(w, h):
        return lax.scan(lambda c, _: (c * w, None), h, None, length=40)[0]

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    with pytest.raises(ValueError, match=r"length 40 and consumes tracked input.*'cell\.kernel'"):
        flatten_jaxpr(closed, [True, True], invar_names=["cell.kernel", "cell.h"])
    flat = flatten_jaxpr(closed, [True, True], max_unroll=40)
    assert "scan" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat)


def test_nested_control_flow_inside_jit():
    @jax.jit
    def cell(w, h, xs):
        def body(c, x):
            c = lax.cond(jnp.sum(c) > 0, lambda a: a * w, lambda a: a + x, c)
            return c, jnp.sum(c)

        return lax.scan(body, h, xs)

    closed = jax.make_jaxpr(cell)(_spec(3), _spec(3), _spec(3, 3))
    flat = flatten_jaxpr(closed, [True, True, False])
    names = _prim_names(flat.closed_jaxpr)
    assert not {"jit", "scan", "cond"} & set(names)
    # Notes are de-duplicated across unrolled iterations.
    assert len(flat.notes) == len(set(flat.notes))
    assert sum("converted to select" in n for n in flat.notes) == 1
    _assert_same_function(closed, flat)


# -- custom derivatives ------------------------------------------------------------


@jax.custom_jvp
def _spike(v):
    return (v > 0).astype(v.dtype)


@_spike.defjvp
def _spike_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    return _spike(v), dv / (1.0 + jnp.abs(v)) ** 2


@jax.custom_vjp
def _clip_grad(x):
    return jnp.sin(x)


_clip_grad.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (7.0 * g,))


def test_custom_jvp_stays_opaque_and_keeps_its_derivative():
    def step(w, v):
        return jnp.sum(jax.jit(_spike)(v * w))

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    flat = flatten_jaxpr(closed, [True, True])
    assert "custom_jvp_call" in _top_names(flat.closed_jaxpr)
    assert any("custom_jvp_call" in n and "kept opaque" in n for n in flat.notes)
    _assert_same_function(closed, flat)

    w = jnp.array([0.5, -1.0, 2.0], F32)
    v = jnp.array([1.0, 0.3, -0.2], F32)
    grad_flat = jax.grad(lambda w: jex_core.jaxpr_as_fun(flat.closed_jaxpr)(w, v)[0])(w)
    u = v * w
    np.testing.assert_allclose(grad_flat, v / (1.0 + jnp.abs(u)) ** 2, rtol=1e-6)
    assert np.all(np.asarray(grad_flat) != 0)  # the primal (a step) has zero derivative


def test_custom_vjp_stays_opaque_and_keeps_its_derivative():
    def step(w):
        return jnp.sum(_clip_grad(w))

    closed = jax.make_jaxpr(step)(_spec(3))
    flat = flatten_jaxpr(closed, [True])
    assert "custom_vjp_call" in _top_names(flat.closed_jaxpr)
    w = jnp.array([0.1, 0.2, 0.3], F32)
    grad_flat = jax.grad(lambda w: jex_core.jaxpr_as_fun(flat.closed_jaxpr)(w)[0])(w)
    np.testing.assert_allclose(grad_flat, np.full(3, 7.0))


def test_etp_primitive_inside_custom_jvp_is_reported():
    @jax.custom_jvp
    def fused(x, w):
        return jnp.tanh(braintrace.matmul(x, w))

    @fused.defjvp
    def _fused_jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        return fused(x, w), dx @ w + x @ dw

    def step(w, x):
        return fused(x, w)

    closed = jax.make_jaxpr(step)(_spec(3, 2), _spec(3))
    flat = flatten_jaxpr(closed, [True, False])
    assert "custom_jvp_call" in _top_names(flat.closed_jaxpr)
    assert any("ETP primitive etp_dense inside custom_jvp_call" in n
               and "excluded from trace learning" in n for n in flat.notes)
    _assert_same_function(closed, flat)


# -- while --------------------------------------------------------------------------


def test_while_over_tracked_input_raises_with_name():
    def step(w, h):
        return lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c + jnp.abs(w) + 1.0, h)

    closed = jax.make_jaxpr(step)(_spec(3), _spec(3))
    with pytest.raises(ValueError, match=r"'cell\.kernel'.*while_loop.*lax\.scan.*fori_loop"):
        flatten_jaxpr(closed, [True, False], invar_names=["cell.kernel", "x"])
    with pytest.raises(ValueError, match="invar 0"):
        flatten_jaxpr(closed, [True, False])


def test_while_over_tracked_input_inside_jit_raises():
    def step(w, h):
        return jax.jit(lambda a, b: lax.while_loop(lambda c: c < 3.0, lambda c: c + a, b))(w, h)

    closed = jax.make_jaxpr(step)(_spec(), _spec())
    with pytest.raises(ValueError, match="'cell.h'"):
        flatten_jaxpr(closed, [False, True], invar_names=["x", "cell.h"])


def test_while_over_untracked_input_is_kept():
    def step(w, n):
        count = lax.while_loop(lambda c: c < n, lambda c: c + jax.jit(lambda a: a + 1)(c), 0)
        return w * count

    closed = jax.make_jaxpr(step)(_spec(3), _spec(dtype=jnp.int32))
    flat = flatten_jaxpr(closed, [True, False])
    assert "while" in _top_names(flat.closed_jaxpr)
    assert "jit" not in _prim_names(flat.closed_jaxpr)
    _assert_same_function(closed, flat, args=[np.ones(3, np.float32), np.int32(5)])


# -- scatter -------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_a_scatter_over_the_whole_operand_becomes_its_update():
    """``h.at[...].set(v)`` (how Flax writes ``variable[...] = v`` of another dtype) is ``v``;
    a scatter into part of the operand is kept."""
    def step(h, v):
        return h.at[...].set(v), h.at[1:].set(v[1:])

    closed = jax.make_jaxpr(step)(_spec(2, 3, dtype=jnp.bfloat16), _spec(2, 3))
    assert _top_names(closed).count("scatter") == 2
    flat = flatten_jaxpr(closed, [True, False])
    assert _top_names(flat.closed_jaxpr).count("scatter") == 1
    assert any("writes its whole operand: replaced by its update" in n for n in flat.notes)
    _assert_same_function(closed, flat)


# -- argument checks -------------------------------------------------------------


def test_argument_lengths_are_checked():
    closed = jax.make_jaxpr(lambda a, b: a + b)(1.0, 2.0)
    with pytest.raises(ValueError, match="tracked flag"):
        flatten_jaxpr(closed, [True])
    with pytest.raises(ValueError, match="invar name"):
        flatten_jaxpr(closed, [True, False], invar_names=["a"])
    flat = flatten_jaxpr(closed, [False, False])
    assert flat.notes == ()
    _assert_same_function(closed, flat)
