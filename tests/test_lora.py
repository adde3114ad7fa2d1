"""The LoRA ETP primitive: forward, derivatives, ETP rules and its effective-weight trace."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import etp_lora_batched_p, etp_lora_p, lora_matmul


def _plain(x, a, b, bias=None, base=None, scaling=1.0):
    x = x.astype(a.dtype)
    y = scaling * ((x @ a) @ b)
    if bias is not None:
        y = y + bias
    if base is not None:
        y = y + x @ base
    return y


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _data(i=5, r=2, o=3, lead=(), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"x": (*lead, i), "a": (i, r), "b": (r, o), "bias": (o,), "base": (i, o)}
    return {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}


def _compiled(fn):
    """Evaluates ``fn()`` under jit: one compilation instead of one per eager op."""
    return jax.jit(fn)()


def _close(a, b, dtype=jnp.float32):
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _prims(jaxpr):
    return [e.primitive.name for e in jaxpr.jaxpr.eqns]


# -- forward and derivatives --------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (4,), (2, 3, 4)], ids=["sample", "batch", "3lead"])
@pytest.mark.parametrize("bias, base", [(False, False), (True, True), (False, True)])
def test_forward_matches_plain(lead, bias, base):
    v = _data(lead=lead)
    kw = {"bias": v["bias"] if bias else None, "base": v["base"] if base else None}
    y = lora_matmul(v["x"], v["a"], v["b"], kw["bias"], base_kernel=kw["base"], scaling=0.5)
    assert y.shape == (*lead, 3)
    _close(y, _plain(v["x"], v["a"], v["b"], **kw, scaling=0.5))
    if len(lead) != 3:
        return
    jitted = jax.jit(lambda x: lora_matmul(x, v["a"], v["b"], kw["bias"],
                                           base_kernel=kw["base"], scaling=0.5))
    _close(jitted(v["x"]), _plain(v["x"], v["a"], v["b"], **kw, scaling=0.5))


@pytest.mark.parametrize("lead, prim", [((), "etp_lora"), ((2, 3, 4), "etp_lora_batched")])
def test_jaxpr_and_layout(lead, prim):
    v = _data(lead=lead)
    jaxpr = jax.make_jaxpr(lambda *o: lora_matmul(*o[:4], base_kernel=o[4], scaling=2.0))(
        v["x"], v["a"], v["b"], v["bias"], v["base"])
    names = _prims(jaxpr)
    assert names.count(prim) == 1 and "dot_general" not in names
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == prim)
    assert eqn.invars[0].aval.shape == ((5,) if not lead else (24, 5))
    assert eqn.params == {"has_bias": True, "has_base": True, "scaling": 2.0}
    # The frozen base kernel (operand 4) is not trainable.
    assert eqn.primitive.trainable_invars(eqn.params) == {"lora_a": 1, "lora_b": 2, "bias": 3}
    assert etp_lora_p.trainable_invars({"has_bias": False, "has_base": True}) == {
        "lora_a": 1, "lora_b": 2}
    assert etp_lora_p.batched_counterpart is etp_lora_batched_p
    assert braintrace.etp_primitives()["etp_lora"] is etp_lora_p


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="do not chain"):
        lora_matmul(jnp.ones(4), jnp.ones((3, 2)), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="do not chain"):
        lora_matmul(jnp.ones(3), jnp.ones((3, 2)), jnp.ones((3, 5)))


@pytest.mark.parametrize("lead", [(), (2, 3, 2)], ids=["sample", "3lead"])
def test_grad_matches_plain(lead):
    v = _data(lead=lead)

    def loss(f):
        return lambda x, a, b, bias, base: jnp.sum(jnp.tanh(f(x, a, b, bias, base)) ** 2)

    lm = lambda x, a, b, bias, base: lora_matmul(
        x, a, b, bias, base_kernel=base, scaling=0.7)
    pl = lambda x, a, b, bias, base: _plain(x, a, b, bias, base, scaling=0.7)
    args = (v["x"], v["a"], v["b"], v["bias"], v["base"])
    got = jax.jit(jax.grad(loss(lm), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.jit(jax.grad(loss(pl), argnums=(0, 1, 2, 3, 4)))(*args)
    for g, e in zip(got, want, strict=True):
        _close(g, e)
    assert float(jnp.abs(want[1]).sum()) > 0


def test_vmap_and_integer_inputs():
    v = _data(lead=(6,))
    counts = jnp.asarray(np.arange(30).reshape(6, 5) % 3, jnp.int32)
    f = jax.vmap(lambda x: lora_matmul(x, v["a"], v["b"], v["bias"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(f)(v["x"])
        y = f(counts)
        g = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(
            lambda x: lora_matmul(x, a, v["b"]))(counts) ** 2)))(v["a"])
    assert "etp_lora_batched" in _prims(jaxpr) and "etp_lora" not in _prims(jaxpr)
    _close(y, _plain(counts, v["a"], v["b"], v["bias"]))
    _close(g, jax.grad(lambda a: jnp.sum(_plain(counts, a, v["b"]) ** 2))(v["a"]))


# -- ETP rules against jax.vjp of the impl ----------------------------------------------------


def _theta(v, bias):
    theta = {"lora_a": v["a"], "lora_b": v["b"]}
    if bias:
        theta["bias"] = v["bias"]
    return theta


def _params(bias, base, scaling):
    return {"has_bias": bias, "has_base": base, "scaling": scaling}


def _impl_of(prim, x, theta, base, params):
    def f(theta):
        ops = [x, theta["lora_a"], theta["lora_b"]]
        ops += [theta["bias"]] if "bias" in theta else []
        ops += [base] if params["has_base"] else []
        return prim.impl_fn(*ops, **params)
    return f


def _rule_cases():
    cases = []
    combos = [(shape, batched, dtype) for dtype in (jnp.float32, jnp.float64)
              for shape in [(5, 2, 3), (3, 1, 4)] for batched in (False, True)]
    cycle = [(True, True), (False, False), (True, False), (False, True)]
    for n, (shape, batched, dtype) in enumerate(combos):
        bias, base = cycle[n % 4]
        name = (f"{'x'.join(map(str, shape))}-{'B' if batched else 'S'}-"
                f"{jnp.dtype(dtype).name}-{'bias' if bias else 'nobias'}-"
                f"{'base' if base else 'nobase'}")
        cases.append(pytest.param(shape, batched, dtype, bias, base, id=name))
    return cases


RULE_CASES = _rule_cases()


@pytest.mark.parametrize("shape, batched, dtype, bias, base", RULE_CASES)
def test_xy_to_dw_is_the_pullback(shape, batched, dtype, bias, base):
    i, r, o = shape
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_lora_batched_p if batched else etp_lora_p
        v = _data(i, r, o, lead=(4,) if batched else (), dtype=dtype, seed=1)
        d = _normal(2, (*v["x"].shape[:-1], o), dtype)
        params = _params(bias, base, 0.5)
        theta = _theta(v, bias)

        def compute():
            got = prim.rule("xy_to_dw")(v["x"], d, theta, **params)
            (want,) = jax.vjp(_impl_of(prim, v["x"], theta, v["base"], params), theta)[1](d)
            per = None
            if batched:  # the whole-batch pullback is the sum of per-sample ones
                per = jax.vmap(lambda x, d: etp_lora_p.rule("xy_to_dw")(x, d, theta, **params))
                per = jax.tree.map(lambda g: g.sum(0), per(v["x"], d))
            return got, want, per

        got, want, per = _compiled(compute)
        assert set(got) == set(theta)
        for key in theta:
            assert got[key].shape == theta[key].shape and got[key].dtype == dtype
            _close(got[key], want[key], dtype)
            if batched:
                _close(got[key], per[key], dtype)


@pytest.mark.parametrize("shape, batched, dtype, bias, base", RULE_CASES)
def test_trace_space_round_trip(shape, batched, dtype, bias, base):
    """trace_to_dw(dt_to_t(1, xy_to_trace(x, d))) == xy_to_dw(x, d) for every key."""
    i, r, o = shape
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_lora_batched_p if batched else etp_lora_p
        v = _data(i, r, o, lead=(4,) if batched else (), dtype=dtype, seed=3)
        d = _normal(4, (*v["x"].shape[:-1], o), dtype)
        params = _params(bias, base, 1.5)
        theta = _theta(v, bias)

        def compute():
            trace = prim.rule("xy_to_trace")(v["x"], d, theta, **params)
            scaled = prim.rule("dt_to_t")(jnp.ones(o, dtype), trace, **params)
            got = prim.rule("trace_to_dw")(scaled, theta, **params)
            return trace, got, prim.rule("xy_to_dw")(v["x"], d, theta, **params)

        trace, got, want = _compiled(compute)
        # lora_a's trace lives in the effective dense weight space (I, O).
        assert trace["lora_a"].shape == (i, o)
        assert trace["lora_b"].shape == (r, o)
        for key in trace:
            assert trace[key].dtype == dtype
        assert set(got) == set(theta)
        for key in theta:
            assert got[key].shape == theta[key].shape
            _close(got[key], want[key], dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dt_to_t_scales_the_output_axis(dtype):
    """Scaling a trace by d equals scaling its cotangent by d, and matches the Jacobian."""
    with jax.enable_x64(dtype == jnp.float64):
        v = _data(4, 2, 3, dtype=dtype, seed=5)
        c, d = _normal(6, (3,), dtype), _normal(7, (3,), dtype)
        params = _params(True, True, 0.5)
        theta = _theta(v, True)
        rule = etp_lora_p.rule

        def compute():
            got = rule("dt_to_t")(d, rule("xy_to_trace")(v["x"], c, theta, **params), **params)
            want = rule("xy_to_trace")(v["x"], c * d, theta, **params)
            # Jacobian oracles, ε[., o] = ∂y_o/∂θ[., o] and d·ε = ∂(d ⊙ y)_o/∂θ[., o]:
            # lora_b directly, lora_a through the effective weight W (y = x @ W + ...).
            f = _impl_of(etp_lora_p, v["x"], theta, v["base"], params)
            eps_b = jnp.einsum("oro->ro", jax.jacobian(f)(theta)["lora_b"])
            want_b = jnp.einsum("oro->ro", jax.jacobian(lambda t: d * f(t))(theta)["lora_b"])
            eff = lambda w: v["x"] @ w
            w_eff = 0.5 * v["a"] @ v["b"]
            eps_w = jnp.einsum("oio->io", jax.jacobian(eff)(w_eff))
            inst = rule("xy_to_trace")(v["x"], jnp.ones(3, dtype), theta, **params)
            oracle = {"lora_b": (rule("dt_to_t")(d, {"lora_b": eps_b}, **params)["lora_b"],
                                 want_b),
                      "inst_b": (inst["lora_b"], eps_b), "inst_w": (inst["lora_a"], eps_w)}
            return got, want, oracle

        got, want, oracle = _compiled(compute)
        for key in theta:
            _close(got[key], want[key], dtype)
        for a, b in oracle.values():
            _close(a, b, dtype)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("num_states", [1, 2])
def test_drtrl_recurrence_matches_grad(batched, num_states):
    """A D-RTRL recurrence with per-step diagonal factors gives jax.grad of the unrolled loss.

    ``h_t = λ_t ⊙ h_{t-1} + g_t ⊙ f(x_t, θ)`` and ``L = Σ_t ⟨c_t, h_t⟩``. With S states
    the same trace is carried S times (scaled differently per state) and the solve
    divides by S. The negative control keeps lora_a's trace in its own ``(I, r)`` space,
    where it can only be discounted by a per-step scalar (the mean of λ_t): it must fail.
    """
    steps, (i, r, o) = 4, (5, 2, 3)
    with jax.enable_x64(True):
        v = _data(i, r, o, dtype=jnp.float64, seed=11)
        lead = (2,) if batched else ()
        xs = _normal(12, (steps, *lead, i), jnp.float64)
        lam = jnp.asarray(np.random.default_rng(13).uniform(0.2, 0.9, (steps, *lead, o)))
        gain = _normal(14, (steps, *lead, o), jnp.float64)
        cs = _normal(15, (steps, *lead, o), jnp.float64)
        params = _params(True, True, 0.5)
        theta = _theta(v, True)
        state_w = jnp.arange(1.0, num_states + 1.0) / (num_states * (num_states + 1) / 2)

        def unrolled(theta):
            h, loss = jnp.zeros((*lead, o)), 0.0
            for t in range(steps):
                y = lora_matmul(xs[t], theta["lora_a"], theta["lora_b"], theta["bias"],
                                base_kernel=v["base"], scaling=0.5)
                h = lam[t] * h + gain[t] * y
                loss = loss + jnp.sum(cs[t] * h)
            return loss

        rule = etp_lora_p.rule
        over_states = lambda fn: jax.vmap(fn, in_axes=-1, out_axes=-1)

        def per_sample(x_seq, lam_seq, gain_seq, c_seq):
            y0 = _plain(x_seq[0], v["a"], v["b"], v["bias"], v["base"], 0.5)
            eps = rule("init_drtrl")(x_seq[0], y0, theta, num_states)
            acc = jax.tree.map(lambda e: jnp.zeros(e.shape[:-1], e.dtype), eps)
            eps_a, acc_a = jnp.zeros((i, r)), jnp.zeros((i, r))  # negative control
            for t in range(steps):
                inst = rule("xy_to_trace")(x_seq[t], gain_seq[t], theta, **params)
                decay = over_states(lambda e, t=t: rule("dt_to_t")(lam_seq[t], e, **params))
                eps = jax.tree.map(lambda e, n: e + n[..., None], decay(eps), inst)
                solve = over_states(lambda e, t=t: rule("dt_to_t")(c_seq[t], e, **params))
                acc = jax.tree.map(lambda a, e: a + e @ state_w, acc, solve(eps))
                dw = rule("xy_to_dw")(x_seq[t], gain_seq[t], theta, **params)["lora_a"]
                eps_a = jnp.mean(lam_seq[t]) * eps_a + dw
                acc_a = acc_a + jnp.mean(c_seq[t]) * eps_a
            return acc, acc_a

        def compute():
            if batched:
                acc, acc_a = jax.tree.map(
                    lambda a: a.sum(0), jax.vmap(per_sample, in_axes=1)(xs, lam, gain, cs))
            else:
                acc, acc_a = per_sample(xs, lam, gain, cs)
            return jax.grad(unrolled)(theta), rule("trace_to_dw")(acc, theta, **params), acc_a

        want, got, got_a_space = _compiled(compute)
        assert all(float(jnp.abs(w).sum()) > 0 for w in want.values())
        assert set(got) == set(want)
        for key in want:
            _close(got[key], want[key], jnp.float64)
        assert not np.allclose(got_a_space, want["lora_a"], rtol=1e-3)


@pytest.mark.parametrize("num_states, batched, dtype", [
    (1, False, jnp.float32), (3, True, jnp.float32), (3, False, jnp.float64),
    (1, True, jnp.float64)])
def test_init_rules(num_states, batched, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_lora_batched_p if batched else etp_lora_p
        v = _data(5, 2, 3, dtype=dtype)
        y = _plain(v["x"], v["a"], v["b"], v["bias"])
        for bias in (False, True):
            theta = _theta(v, bias)
            tr = prim.rule("init_drtrl")(v["x"], y, theta, num_states)
            shapes = {"lora_a": (5, 3, num_states), "lora_b": (2, 3, num_states),
                      "bias": (3, num_states)}
            assert set(tr) == set(theta)
            for key, value in tr.items():
                assert value.shape == shapes[key] and value.dtype == dtype
                assert not jnp.any(value)
        pp = prim.rule("init_pp")(v["x"], y, theta, num_states)
        assert pp.shape == (3, num_states) and pp.dtype == dtype and not jnp.any(pp)
