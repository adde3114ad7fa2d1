"""The dense ETP primitive: forward, derivatives, and every ETP rule against jax oracles."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import etp_dense_batched_p, etp_dense_p, matmul

MASK = np.array([[1.0, 0.0, 1.0, 1.0, 0.0],
                 [0.0, 1.0, 1.0, 0.0, 1.0],
                 [1.0, 1.0, 0.0, 1.0, 1.0]], np.float32)


def apply_mask(k):
    """A fixed connectivity mask (shapes (3, 5) only)."""
    return k * MASK


TRANSFORMS = {"none": None, "abs": jnp.abs, "mask": apply_mask, "softplus": jax.nn.softplus}


def _plain(x, k, b=None, transform=None):
    kk = k if transform is None else transform(k)
    y = jnp.matmul(x.astype(kk.dtype), kk)
    return y if b is None else y + b


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _data(i=3, o=5, lead=(), dtype=jnp.float32, seed=0):
    """x, kernel, bias; the kernel's first row and column are negative (abs has a kink)."""
    rng = np.random.default_rng(seed)
    x, k, b = (rng.standard_normal(s) for s in ((*lead, i), (i, o), (o,)))
    k[0], k[:, 0] = -np.abs(k[0]), -np.abs(k[:, 0])
    return tuple(jnp.asarray(a, dtype) for a in (x, k, b))


def _compiled(fn):
    """Evaluates ``fn()`` under jit: one compilation instead of one per eager op."""
    return jax.jit(fn)()


def _close(a, b, dtype=jnp.float32):
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _prims(jaxpr):
    return [e.primitive.name for e in jaxpr.jaxpr.eqns]


# -- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (4,), (2, 3, 4)], ids=["sample", "batch", "3lead"])
@pytest.mark.parametrize("bias, tname", [(False, "none"), (True, "abs"), (True, "mask")])
def test_forward_matches_plain(lead, bias, tname):
    x, k, b = _data(lead=lead)
    b = b if bias else None
    t = TRANSFORMS[tname]
    y = matmul(x, k, b, kernel_transform=t)
    assert y.shape == (*lead, 5)
    _close(y, _plain(x, k, b, t))
    if len(lead) == 3:
        jitted = jax.jit(lambda x, k: matmul(x, k, b, kernel_transform=t))
        _close(jitted(x, k), _plain(x, k, b, t))


@pytest.mark.parametrize("lead, prim", [((), "etp_dense"), ((4,), "etp_dense_batched"),
                                        ((2, 3, 4), "etp_dense_batched")])
def test_jaxpr_binds_the_right_primitive(lead, prim):
    x, k, b = _data(lead=lead)
    jaxpr = jax.make_jaxpr(lambda x, k, b: matmul(x, k, b))(x, k, b)
    names = _prims(jaxpr)
    assert names.count(prim) == 1 and "dot_general" not in names
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == prim)
    expected_x = (3,) if not lead else (int(np.prod(lead)), 3)
    assert eqn.invars[0].aval.shape == expected_x
    assert eqn.params["has_bias"] is True
    assert eqn.primitive.trainable_invars(eqn.params) == {"kernel": 1, "bias": 2}
    assert etp_dense_p.trainable_invars({"has_bias": False}) == {"kernel": 1}
    assert etp_dense_batched_p.batched and not etp_dense_p.batched
    assert etp_dense_p.batched_counterpart is etp_dense_batched_p


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="does not match kernel"):
        matmul(jnp.ones(4), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="does not match kernel"):
        matmul(jnp.ones(3), jnp.ones(3))


# -- derivatives -------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (2, 3, 2)], ids=["sample", "3lead"])
@pytest.mark.parametrize("tname", ["none", "abs", "mask"])
def test_grad_matches_plain(lead, tname):
    x, k, b = _data(lead=lead)
    t = TRANSFORMS[tname]

    def loss(f):
        return lambda x, k, b: jnp.sum(jnp.tanh(f(x, k, b, t)) * jnp.arange(5.0))

    mm = lambda x, k, b, t: matmul(x, k, b, kernel_transform=t)
    got = jax.jit(jax.grad(loss(mm), argnums=(0, 1, 2)))(x, k, b)
    want = jax.jit(jax.grad(loss(_plain), argnums=(0, 1, 2)))(x, k, b)
    for g, e in zip(got, want, strict=True):
        _close(g, e)
    assert float(jnp.abs(want[1]).sum()) > 0


def test_vmap_of_per_sample_matmul_uses_batched_primitive():
    x, k, b = _data(lead=(6,))
    f = jax.vmap(lambda x: matmul(x, k, b), in_axes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(f)(x.T)
        y = f(x.T)
        g = jax.jit(jax.grad(lambda k: jnp.sum(jax.vmap(lambda x: matmul(x, k, b))(x) ** 2)))(k)
    assert "etp_dense_batched" in _prims(jaxpr) and "etp_dense" not in _prims(jaxpr)
    _close(y, _plain(x, k, b))
    _close(g, jax.grad(lambda k: jnp.sum(_plain(x, k, b) ** 2))(k))


def test_integer_inputs():
    counts = jnp.array([[0, 1, 3], [2, 0, 0]], jnp.int32)
    _, k, b = _data()
    _close(matmul(counts, k, b), _plain(counts, k, b))
    _close(matmul(counts[0], k), _plain(counts[0], k))
    g = jax.jit(jax.grad(lambda k, b: jnp.sum(matmul(counts, k, b) ** 2), argnums=(0, 1)))(k, b)
    e = jax.jit(jax.grad(lambda k, b: jnp.sum(_plain(counts, k, b) ** 2), argnums=(0, 1)))(k, b)
    for gi, ei in zip(g, e, strict=True):
        _close(gi, ei)
    theta = {"kernel": k, "bias": b}
    d = jnp.ones((2, 5))
    dw = etp_dense_batched_p.rule("xy_to_dw")(counts, d, theta, has_bias=True,
                                               kernel_transform=None, precision=None)
    _close(dw["kernel"], jnp.outer(counts.sum(0), jnp.ones(5)))
    assert dw["kernel"].dtype == k.dtype


def test_float64_forward_and_grad():
    with jax.enable_x64(True):
        x, k, b = _data(lead=(2, 3), dtype=jnp.float64)
        y = matmul(x, k, b)
        assert y.dtype == jnp.float64
        _close(y, _plain(x, k, b), jnp.float64)
        g = jax.grad(lambda k: jnp.sum(jnp.sin(matmul(x, k, b))))(k)
        want = jax.jit(jax.grad(lambda k: jnp.sum(jnp.sin(_plain(x, k, b)))))(k)
        _close(g, want, jnp.float64)


# -- ETP rules against jax.vjp / jax.jacobian of the impl -------------------------------------


def _params(bias, t):
    return {"has_bias": bias, "kernel_transform": t, "precision": None}


def _theta(k, b, bias):
    return {"kernel": k, "bias": b} if bias else {"kernel": k}


def _impl_of(prim, x, theta, params):
    """The primitive's impl as a function of θ."""
    def f(theta):
        ops = [x, theta["kernel"]] + ([theta["bias"]] if "bias" in theta else [])
        return prim.impl_fn(*ops, **params)
    return f


def _rule_cases():
    """Every shape × batched × dtype; bias and transform cycle so that each appears."""
    cases = []
    combos = [(i, o, batched, dtype) for dtype in (jnp.float32, jnp.float64)
              for (i, o) in [(3, 5), (4, 2)] for batched in (False, True)]
    cycle = [(True, "none"), (False, "abs"), (True, "softplus"), (True, "abs")]
    for n, (i, o, batched, dtype) in enumerate(combos):
        bias, tname = cycle[n % len(cycle)]
        if (i, o) == (3, 5) and n % 2:
            tname = "mask"
        name = (f"{i}x{o}-{'B' if batched else 'S'}-{jnp.dtype(dtype).name}-"
                f"{'bias' if bias else 'nobias'}-{tname}")
        cases.append(pytest.param(i, o, batched, dtype, bias, tname, id=name))
    return cases


RULE_CASES = _rule_cases()


@pytest.mark.parametrize("i, o, batched, dtype, bias, tname", RULE_CASES)
def test_xy_to_dw_is_the_pullback(i, o, batched, dtype, bias, tname):
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_dense_batched_p if batched else etp_dense_p
        x, k, b = _data(i, o, lead=(4,) if batched else (), dtype=dtype, seed=1)
        d = _normal(7, (*x.shape[:-1], o), dtype)
        params = _params(bias, TRANSFORMS[tname])
        theta = _theta(k, b, bias)

        def compute():
            got = prim.rule("xy_to_dw")(x, d, theta, **params)
            (want,) = jax.vjp(_impl_of(prim, x, theta, params), theta)[1](d)
            per = None
            if batched:  # the whole-batch pullback is the sum of per-sample ones
                per = jax.vmap(lambda x, d: etp_dense_p.rule("xy_to_dw")(x, d, theta, **params))
                per = jax.tree.map(lambda g: g.sum(0), per(x, d))
            return got, want, per

        got, want, per = _compiled(compute)
        assert set(got) == set(theta)
        for key in theta:
            assert got[key].shape == theta[key].shape and got[key].dtype == dtype
            _close(got[key], want[key], dtype)
            if batched:
                _close(got[key], per[key], dtype)


@pytest.mark.parametrize("i, o, batched, dtype, bias, tname",
                         [c for c in RULE_CASES if c.values[3] == jnp.float64])
def test_dt_to_t_scales_the_output_axis(i, o, batched, dtype, bias, tname):
    """Per sample: dt_to_t(d, ∂y/∂θ) = ∂(d ⊙ y)/∂θ, restricted to the y↔θ diagonal."""
    with jax.enable_x64(True):
        prim = etp_dense_batched_p if batched else etp_dense_p
        x, k, b = _data(i, o, dtype=dtype, seed=2)
        c = _normal(3, (o,), dtype)
        d = _normal(4, (o,), dtype)
        params = _params(bias, TRANSFORMS[tname])
        theta = _theta(k, b, bias)
        dt_to_t = prim.rule("dt_to_t")
        xy_to_dw = prim.rule("xy_to_dw")

        def compute():
            # Scaling a trace by d is scaling its cotangent by d.
            scaled = dt_to_t(d, xy_to_dw(x, c, theta, **params), **params)
            direct = xy_to_dw(x, c * d, theta, **params)
            # The Jacobian's y↔θ diagonal: ε[i, o] = ∂y_o/∂K_io, and d·ε = ∂(d ⊙ y)_o/∂K_io.
            f = _impl_of(etp_dense_p, x, theta, params)
            jac = jax.jacobian(f)(theta)
            jac_d = jax.jacobian(lambda th: d * f(th))(theta)
            eps = {"kernel": jnp.einsum("oio->io", jac["kernel"])}
            want = {"kernel": jnp.einsum("oio->io", jac_d["kernel"])}
            if bias:
                eps["bias"] = jnp.diagonal(jac["bias"])
                want["bias"] = jnp.diagonal(jac_d["bias"])
            return scaled, direct, dt_to_t(d, eps, **params), want

        scaled, direct, got, want = _compiled(compute)
        for key in theta:
            _close(scaled[key], direct[key], dtype)
            _close(got[key], want[key], dtype)


@pytest.mark.parametrize("num_states, batched, dtype", [(1, False, jnp.float32),
                                                        (3, True, jnp.float64)])
def test_dt_to_t_over_a_state_axis(num_states, batched, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_dense_batched_p if batched else etp_dense_p
        trace = {"kernel": _normal(0, (3, 5, num_states), dtype),
                 "bias": _normal(1, (5, num_states), dtype)}
        d = jnp.arange(1.0, 6.0, dtype=dtype)
        rule = jax.vmap(lambda t: prim.rule("dt_to_t")(d, t, **_params(True, None)),
                        in_axes=-1, out_axes=-1)
        got = rule(trace)
        _close(got["kernel"], trace["kernel"] * d[None, :, None], dtype)
        _close(got["bias"], trace["bias"] * d[:, None], dtype)
        assert got["kernel"].dtype == dtype


@pytest.mark.parametrize("num_states, batched, bias, dtype", [
    (1, False, True, jnp.float32), (3, True, False, jnp.float32),
    (3, False, False, jnp.float64), (1, True, True, jnp.float64)])
def test_init_rules(num_states, batched, bias, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        prim = etp_dense_batched_p if batched else etp_dense_p
        x, k, b = _data(4, 2, dtype=dtype)
        theta = _theta(k, b, bias)
        y = _plain(x, k, b if bias else None)
        tr = prim.rule("init_drtrl")(x, y, theta, num_states)
        assert set(tr) == set(theta)
        for key in theta:
            assert tr[key].shape == (*theta[key].shape, num_states)
            assert tr[key].dtype == dtype
            assert not jnp.any(tr[key])
        pp = prim.rule("init_pp")(x, y, theta, num_states)
        assert pp.shape == (2, num_states) and pp.dtype == dtype and not jnp.any(pp)


def test_registered_in_registry():
    prims = braintrace.etp_primitives()
    assert prims["etp_dense"] is etp_dense_p
    assert prims["etp_dense_batched"] is etp_dense_batched_p
