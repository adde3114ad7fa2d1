"""The ETP primitive contract: every rule of every primitive against ``jax.vjp``/``jax.jacobian``.

Each primitive of :data:`primitive_cases.CASES` runs unbatched and batched, on
non-square shapes drawn by hypothesis, with ``S > 1`` states where a rule has a
state axis. The oracles are JAX's own derivatives of the primitive's impl:

* ``xy_to_dw`` is the pullback (``jax.vjp``) of ``θ -> impl(x, θ)``; batched,
  the sum of the per-sample pullbacks.
* ``dt_to_t`` scales a trace as it scales the cotangent that made it, and the
  instantaneous trace is the ``y``↔``θ`` diagonal of ``jax.jacobian``.
* ``init_drtrl`` / ``init_pp`` are zero traces with a trailing state axis.
* ``xy_to_trace`` / ``trace_to_dw`` round-trip to ``xy_to_dw``; ``contract``
  is ``dt_to_t`` summed over the leading axes.
* All of them together, as D-RTRL runs them, give ``jax.grad`` of an unrolled
  leaky integrator ``h_t = λ_t ⊙ h_{t-1} + g_t ⊙ f(x_t, θ)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from primitive_cases import CASES, Operands, PrimitiveCase

BATCH = 3
STEPS = 3
SIZES = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5)).filter(
    lambda s: s[0] != s[-1])
DTYPES = st.sampled_from(["float32", "float64"])
SEEDS = st.integers(0, 2**16)

every_case = pytest.mark.parametrize("case", CASES, ids=str)
both_forms = pytest.mark.parametrize("batched", [False, True], ids=["sample", "batched"])


def _cases_with(rule: str) -> list[PrimitiveCase]:
    return [c for c in CASES if c.primitive.has_rule(rule)]


# -- the primitive as the algorithms see it ------------------------------------------------


def _has_x(case: PrimitiveCase) -> bool:
    return case.primitive.x_invar_index is not None


def _form(case: PrimitiveCase, batched: bool):
    """The primitive bound: the batched counterpart when ``x`` has a batch axis."""
    return case.primitive.batched_counterpart if batched and _has_x(case) else case.primitive


def _target(ops: Operands, batched: bool) -> tuple[int, ...]:
    """Shape of the hidden state ``y`` feeds: ``(B?, *hidden)``."""
    return ((BATCH,) if batched else ()) + ops.hidden


def _y(prim, ops: Operands, theta: dict, target: tuple[int, ...]) -> jax.Array:
    """The impl as a function of ``θ``, broadcast to the hidden state it feeds."""
    by_position = {**{i: theta[k] for k, i in prim.trainable_invars(ops.params).items()},
                   **ops.frozen}
    if prim.x_invar_index is not None:
        by_position[prim.x_invar_index] = ops.x
    out = prim.impl_fn(*(by_position[i] for i in range(len(by_position))), **ops.params)
    if isinstance(out, (tuple, list)):
        out = out[prim.y_outvar_index]
    return jnp.broadcast_to(out, target)


def _per_sample(case: PrimitiveCase, batched: bool, fn):
    """``fn`` over the batch axis of ``x`` (a ``hidden`` trace holds the batch itself)."""
    return jax.vmap(fn) if batched and _has_x(case) else fn


def _enter(case: PrimitiveCase, prim, x, d, theta: dict, params: dict) -> dict:
    """The instantaneous D-RTRL trace term of a per-sample cotangent ``d``."""
    if case.layout == "hidden":
        return {key: d for key in prim.trainable_invars(params)}
    rule = prim.rule("xy_to_trace") if prim.has_rule("xy_to_trace") else prim.rule("xy_to_dw")
    return rule(x, d, theta, **params)


def _leave(case: PrimitiveCase, prim, g: dict, theta: dict, params: dict) -> dict:
    """A contracted trace mapped to ``{key: dθ}``."""
    if case.layout == "hidden":
        (total,) = g.values()
        return prim.rule("xy_to_dw")(None, total, theta, **params)
    if prim.has_rule("trace_to_dw"):
        return prim.rule("trace_to_dw")(g, theta, **params)
    return dict(g)


def _contract(prim, d, trace: dict, params: dict, lead: int) -> dict:
    """``Σ_lead dt_to_t(d, trace)``: the ``contract`` rule, or its general form."""
    if prim.has_rule("contract"):
        return prim.rule("contract")(d, trace, **params)
    fn = lambda d, t: prim.rule("dt_to_t")(d, t, **params)
    for _ in range(lead):
        fn = jax.vmap(fn)
    return jax.tree.map(lambda a: a.sum(axis=tuple(range(lead))), fn(d, trace))


# -- checking ------------------------------------------------------------------------------


def _close(got, want, dtype: str) -> None:
    """Equal pytrees (same keys), leaf by leaf, to float32 or float64 precision."""
    tol = 1e-5 if dtype == "float32" else 1e-10
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol,
                                   err_msg=jax.tree_util.keystr(path))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _example(case: PrimitiveCase, batched: bool, sizes, seed: int, dtype: str, lead=()):
    rng = np.random.default_rng(seed)
    batch = (BATCH,) if batched and _has_x(case) else ()
    return rng, case.operands(sizes, (*lead, *batch), rng, dtype)


def _diagonal(case: PrimitiveCase, key: str, jacobian: jax.Array, params: dict) -> jax.Array:
    """The ``y``↔``θ[key]`` diagonal of ``jacobian (*y, *θ_key)``: the case's, or ``y_o``
    paired with ``θ[..., o]``."""
    if case.diagonal is not None:
        return case.diagonal(key, jacobian, params)
    return jnp.diagonal(jacobian, axis1=0, axis2=jacobian.ndim - 1)


# -- one rule at a time ---------------------------------------------------------------------


@every_case
@both_forms
@settings(max_examples=6, deadline=None)
@given(sizes=SIZES, seed=SEEDS, dtype=DTYPES)
def test_xy_to_dw_is_the_pullback_of_the_impl(case, batched, sizes, seed, dtype):
    with jax.enable_x64(dtype == "float64"):
        rng, ops = _example(case, batched, sizes, seed, dtype)
        prim, target = _form(case, batched), _target(ops, batched)
        d = _normal(rng, target, dtype)
        rule = lambda p, x, d: p.rule("xy_to_dw")(x, d, ops.theta, **ops.params)

        def compute():
            got = rule(prim, ops.x, d)
            (want,) = jax.vjp(lambda th: _y(prim, ops, th, target), ops.theta)[1](d)
            if not batched:
                return got, want, want
            # The whole-batch pullback is the sum of the per-sample ones.
            x_axis = 0 if _has_x(case) else None
            per = jax.vmap(lambda x, d: rule(case.primitive, x, d), (x_axis, 0))(ops.x, d)
            return got, want, jax.tree.map(lambda g: g.sum(0), per)

        got, want, summed = jax.jit(compute)()
        for key, value in ops.theta.items():
            assert got[key].shape == value.shape and got[key].dtype == value.dtype
        _close(got, want, dtype)
        _close(got, summed, dtype)


@every_case
@both_forms
@settings(max_examples=6, deadline=None)
@given(sizes=SIZES, seed=SEEDS, dtype=DTYPES)
def test_dt_to_t_scales_a_trace_as_it_scales_its_cotangent(case, batched, sizes, seed, dtype):
    """``dt_to_t(d, ε(c)) = ε(c ⊙ d)``.

    In θ space the instantaneous trace is ``ε(c)[..., o] = ∂(c ⊙ y)_o/∂θ[..., o]``.
    """
    with jax.enable_x64(dtype == "float64"):
        rng, ops = _example(case, batched, sizes, seed, dtype)
        prim, target = _form(case, batched), _target(ops, batched)
        c, d = _normal(rng, target, dtype), _normal(rng, target, dtype)
        enter = _per_sample(case, batched,
                            lambda x, c: _enter(case, prim, x, c, ops.theta, ops.params))
        scale = _per_sample(case, batched, lambda d, e: prim.rule("dt_to_t")(d, e, **ops.params))
        theta_space = case.layout == "output_axis" and not prim.has_rule("xy_to_trace")

        def leave(g):  # the batch summed, then mapped to θ
            if batched and _has_x(case):
                g = jax.tree.map(lambda a: a.sum(0), g)
            return _leave(case, prim, g, ops.theta, ops.params)

        def compute():
            got, want = scale(d, enter(ops.x, c)), enter(ops.x, c * d)
            got, want = (got, leave(got)), (want, leave(want))
            if not theta_space:
                return got, want, {}, {}
            # One sample, against the diagonal of jax.jacobian pairing θ[..., o] with y_o.
            one = ops._replace(x=ops.x[0]) if batched else ops
            c0, d0 = (c[0], d[0]) if batched else (c, d)
            jac = jax.jacobian(lambda th: c0 * d0 * _y(case.primitive, one, th, one.hidden))
            diagonal = {k: _diagonal(case, k, j, ops.params) for k, j in jac(ops.theta).items()}
            sample = prim.rule("dt_to_t")(d0, _enter(case, prim, one.x, c0, ops.theta,
                                                     ops.params), **ops.params)
            return got, want, sample, diagonal

        got, want, sample, diagonal = jax.jit(compute)()
        _close(got, want, dtype)
        _close(sample, diagonal, dtype)


@every_case
@both_forms
@settings(max_examples=4, deadline=None)
@given(sizes=SIZES, seed=SEEDS, num_states=st.integers(1, 3))
def test_init_rules_are_zero_traces_with_a_state_axis(case, batched, sizes, seed, num_states):
    dtype = "float32"
    _, ops = _example(case, batched, sizes, seed, dtype)
    prim, target = _form(case, batched), _target(ops, batched)
    # Per sample, as the algorithms call them: x and y without the batch axis, except
    # for a hidden-shaped trace, which holds the whole group.
    x = None if ops.x is None else jnp.zeros(ops.x.shape[batched:], ops.x.dtype)
    y = jnp.zeros(target if case.layout == "hidden" else ops.hidden, dtype)
    term = jax.eval_shape(lambda: _enter(case, prim, x, y, ops.theta, ops.params))
    trace = prim.rule("init_drtrl")(x, y, ops.theta, num_states)
    assert set(trace) == set(term)
    for key, value in trace.items():
        assert value.shape == (*term[key].shape, num_states)
        assert value.dtype == term[key].dtype == dtype and not jnp.any(value)
    if prim.has_rule("init_pp"):  # not where IO-dim traces do not apply (an embedding's index)
        pp = prim.rule("init_pp")(x, y, ops.theta, num_states)
        assert pp.shape == (*y.shape, num_states) and pp.dtype == dtype and not jnp.any(pp)


@pytest.mark.parametrize("case", _cases_with("xy_to_trace"), ids=str)
@both_forms
@settings(max_examples=5, deadline=None)
@given(sizes=SIZES, seed=SEEDS, dtype=DTYPES)
def test_trace_space_round_trips_to_xy_to_dw(case, batched, sizes, seed, dtype):
    """``trace_to_dw(dt_to_t(1, xy_to_trace(x, d))) == xy_to_dw(x, d)``, whole batch."""
    with jax.enable_x64(dtype == "float64"):
        rng, ops = _example(case, batched, sizes, seed, dtype)
        prim = _form(case, batched)
        d = _normal(rng, _target(ops, batched), dtype)
        rule = lambda name: lambda *a: prim.rule(name)(*a, **ops.params)

        def compute():
            trace = rule("xy_to_trace")(ops.x, d, ops.theta)
            scaled = rule("dt_to_t")(jnp.ones(ops.hidden, dtype), trace)
            return rule("trace_to_dw")(scaled, ops.theta), rule("xy_to_dw")(ops.x, d, ops.theta)

        got, want = jax.jit(compute)()
        for key, value in ops.theta.items():
            assert got[key].shape == value.shape
        _close(got, want, dtype)


@pytest.mark.parametrize("case", _cases_with("contract"), ids=str)
@settings(max_examples=6, deadline=None)
@given(sizes=SIZES, seed=SEEDS, lead=st.sampled_from([(), (4,), (2, 3)]))
def test_contract_is_dt_to_t_summed_over_leading_axes(case, sizes, seed, lead):
    rng, ops = _example(case, False, sizes, seed, "float32")
    prim = case.primitive
    terms = jax.eval_shape(lambda: _enter(case, prim, ops.x, jnp.zeros(ops.hidden), ops.theta,
                                          ops.params))
    trace = {k: _normal(rng, (*lead, *t.shape), "float32") for k, t in terms.items()}
    d = _normal(rng, (*lead, *ops.hidden), "float32")
    fn = lambda d, t: prim.rule("dt_to_t")(d, t, **ops.params)
    for _ in lead:
        fn = jax.vmap(fn)

    def compute(d, trace):
        general = jax.tree.map(lambda a: a.reshape(-1, *a.shape[len(lead):]).sum(0),
                               fn(d, trace))
        return prim.rule("contract")(d, trace, **ops.params), general

    _close(*jax.jit(compute)(d, trace), "float32")


# -- all rules together: D-RTRL on a leaky integrator equals jax.grad ---------------------------


def _drtrl_gradient(case, batched, ops, lam, gain, signal, num_states) -> dict:
    """D-RTRL with the primitive's rules, state by state and step by step.

    ``ε_t = dt_to_t(λ_t, ε_{t-1}) + enter(x_t, g_t)``; the gradient is
    ``leave(Σ_t contract(c_t, ε_t))``.
    """
    prim, theta, params = _form(case, batched), ops.theta, ops.params
    states = lambda fn: jax.vmap(fn, in_axes=-1, out_axes=-1)
    sampled = batched and _has_x(case)
    x_one = None if ops.x is None else ops.x[(0, 0) if sampled else 0]
    y_one = jnp.zeros(lam.shape[1 + sampled:-1], lam.dtype)
    eps = prim.rule("init_drtrl")(x_one, y_one, theta, num_states)
    if sampled:
        eps = jax.tree.map(lambda e: jnp.broadcast_to(e, (BATCH, *e.shape)), eps)

    def update(x, decay, gain, e):
        return jax.tree.map(jnp.add, prim.rule("dt_to_t")(decay, e, **params),
                            _enter(case, prim, x, gain, theta, params))

    update = _per_sample(case, batched, update)
    contract = states(lambda c, e: _contract(prim, c, e, params, int(sampled)))
    total = None
    for t in range(STEPS):
        x_t = None if ops.x is None else ops.x[t]
        eps = states(functools.partial(update, x_t))(lam[t], gain[t], eps)
        term = jax.tree.map(lambda a: a.sum(-1), contract(signal[t], eps))
        total = term if total is None else jax.tree.map(jnp.add, total, term)
    return _leave(case, prim, total, theta, params)


@every_case
@both_forms
@settings(max_examples=3, deadline=None)
@given(sizes=SIZES, seed=SEEDS, num_states=st.integers(2, 3))
def test_drtrl_with_the_rules_equals_grad_of_a_leaky_integrator(case, batched, sizes, seed,
                                                                 num_states):
    with jax.enable_x64(True):
        rng, ops = _example(case, batched, sizes, seed, "float64", lead=(STEPS,))
        prim, target = _form(case, batched), _target(ops, batched)
        shape = (STEPS, *target, num_states)
        lam = jnp.asarray(rng.uniform(0.2, 0.9, shape))
        gain, signal = _normal(rng, shape, "float64"), _normal(rng, shape, "float64")

        def loss(theta):
            h, total = jnp.zeros((*target, num_states)), 0.0
            for t in range(STEPS):
                step = ops if ops.x is None else ops._replace(x=ops.x[t])
                h = lam[t] * h + gain[t] * _y(prim, step, theta, target)[..., None]
                total = total + jnp.sum(signal[t] * h)
            return total

        def compute():
            got = _drtrl_gradient(case, batched, ops, lam, gain, signal, num_states)
            return got, jax.grad(loss)(ops.theta)

        got, want = jax.jit(compute)()
        assert all(float(jnp.abs(w).sum()) > 0 for w in want.values())  # a live reference
        _close(got, want, "float64")
