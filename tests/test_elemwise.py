"""The elementwise ETP primitive: y = fn(w), no input x, traces shaped like the hidden group."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import element_wise, etp_elemwise_p


def decay(tau):
    """A learnable time constant's per-step decay factor."""
    return jnp.exp(-1.0 / tau)


FNS = {"identity": None, "decay": decay, "sigmoid": jax.nn.sigmoid, "square": jnp.square}


def _apply(fn, w):
    return w if fn is None else fn(w)


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _tau(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).uniform(1.5, 6.0, shape), dtype)


def _close(a, b, dtype=jnp.float32):
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _compiled(fn):
    """Evaluates ``fn()`` under jit: one compilation instead of one per eager op."""
    return jax.jit(fn)()


# -- forward, layout, derivatives ------------------------------------------------------------


@pytest.mark.parametrize("shape, fname", [((), "identity"), ((4,), "decay"),
                                          ((1, 4), "sigmoid"), ((4,), "square")],
                         ids=["scalar", "neuron", "row", "square"])
def test_forward_matches_fn(shape, fname):
    w = _tau(0, shape)
    y = element_wise(w, FNS[fname])
    assert y.shape == shape and y.dtype == w.dtype
    _close(y, _apply(FNS[fname], w))
    _close(jax.jit(lambda w: element_wise(w, FNS[fname]))(w), _apply(FNS[fname], w))


def test_jaxpr_and_layout():
    w = _tau(0, (3,))
    jaxpr = jax.make_jaxpr(lambda w, h: element_wise(w, decay) * h)(w, jnp.ones((2, 3)))
    eqn = jaxpr.jaxpr.eqns[0]
    assert eqn.primitive is etp_elemwise_p and eqn.params["fn"] is decay
    assert etp_elemwise_p.gradient_enabled
    assert etp_elemwise_p.x_invar_index is None
    assert etp_elemwise_p.trainable_invars(eqn.params) == {"weight": 0}
    assert braintrace.etp_primitives()["etp_elemwise"] is etp_elemwise_p
    for rule in ("dt_to_t", "xy_to_dw", "init_drtrl", "init_pp"):
        assert etp_elemwise_p.has_rule(rule)


@pytest.mark.parametrize("fname", ["decay", "sigmoid", "square"])
def test_grad_and_jvp_match_fn(fname):
    fn = FNS[fname]
    w = _tau(1, (3,))
    h = _normal(2, (2, 3))

    def loss(g):
        return lambda w: jnp.sum(jnp.tanh(g(w) * h) ** 2)

    want = jax.jit(jax.grad(loss(fn)))(w)
    _close(jax.grad(loss(lambda w: element_wise(w, fn)))(w), want)
    _close(jax.jit(jax.grad(loss(lambda w: element_wise(w, fn))))(w), want)
    tw = jnp.array([1.0, -2.0, 0.5])
    _close(jax.jvp(lambda w: element_wise(w, fn), (w,), (tw,))[1], jax.jvp(fn, (w,), (tw,))[1])
    assert float(jnp.abs(want).sum()) > 0


def test_vmap_with_shared_weight_keeps_the_primitive():
    w = _tau(3, (3,))
    f = jax.vmap(lambda h: element_wise(w, decay) * h)
    hs = _normal(4, (5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(f)(hs)
        out = f(hs)
    assert "etp_elemwise" in [e.primitive.name for e in jaxpr.jaxpr.eqns]
    _close(out, decay(w) * hs)


def test_vmap_over_the_weight_warns_and_is_correct():
    ws = _tau(5, (4, 3))
    with pytest.warns(UserWarning, match=re.escape("'etp_elemwise'")):
        out = jax.vmap(lambda w: element_wise(w, decay))(ws)
    _close(out, decay(ws))


def test_float64():
    with jax.enable_x64(True):
        w = _tau(6, (3,), jnp.float64)
        y = element_wise(w, decay)
        assert y.dtype == jnp.float64
        _close(y, decay(w), jnp.float64)
        g = jax.grad(lambda w: jnp.sum(element_wise(w, decay) ** 2))(w)
        _close(g, jax.grad(lambda w: jnp.sum(decay(w) ** 2))(w), jnp.float64)


# -- ETP rules -----------------------------------------------------------------------------------


XY_CASES = [
    ((), (), "identity"), ((4,), (4,), "decay"),    # d shaped like y
    ((), (2, 4), "decay"),                           # scalar weight broadcast into (B, H)
    ((4,), (2, 4), "sigmoid"),                       # per-neuron weight, batch axis summed
    ((1, 4), (3, 4), "decay"),                       # singleton axis summed with keepdims
    ((4,), (2, 3, 4), "identity"),                   # several leading axes
]


@pytest.mark.parametrize("w_shape, d_shape, fname", XY_CASES,
                         ids=["scalar", "neuron", "scalar-BH", "neuron-BH", "row-BH",
                              "neuron-BTH"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_xy_to_dw_is_the_pullback_of_the_broadcast(w_shape, d_shape, dtype, fname):
    with jax.enable_x64(dtype == jnp.float64):
        fn = FNS[fname] or (lambda w: w)
        w = _tau(7, w_shape, dtype)
        d = _normal(8, d_shape, dtype)

        def compute():
            got = etp_elemwise_p.rule("xy_to_dw")(None, d, {"weight": w}, fn=fn)
            bcast = lambda theta: jnp.broadcast_to(fn(theta["weight"]), d_shape)
            (want,) = jax.vjp(bcast, {"weight": w})[1](d)
            return got, want

        got, want = _compiled(compute)
        assert set(got) == {"weight"}
        assert got["weight"].shape == w_shape and got["weight"].dtype == dtype
        _close(got["weight"], want["weight"], dtype)


@pytest.mark.parametrize("w_shape", [(), (4,)], ids=["scalar", "neuron"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dt_to_t_scales_elementwise(w_shape, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        w = _tau(9, w_shape, dtype)
        c, d = _normal(10, (2, 4), dtype), _normal(11, (2, 4), dtype)
        rule = etp_elemwise_p.rule

        def compute():
            scaled = rule("dt_to_t")(d, {"weight": c}, fn=decay)
            via_trace = rule("xy_to_dw")(None, scaled["weight"], {"weight": w}, fn=decay)
            direct = rule("xy_to_dw")(None, c * d, {"weight": w}, fn=decay)
            return scaled, via_trace, direct

        scaled, via_trace, direct = _compiled(compute)
        _close(scaled["weight"], c * d, dtype)
        assert scaled["weight"].dtype == dtype
        _close(via_trace["weight"], direct["weight"], dtype)


@pytest.mark.parametrize("w_shape", [(), (3,), (1, 3)], ids=["scalar", "neuron", "row"])
@pytest.mark.parametrize("num_states", [1, 2])
def test_drtrl_learnable_decay_matches_grad(w_shape, num_states):
    """h_t = fn(w) ⊙ h_{t-1} + x_t over a (B, H) group; L = Σ_t ⟨c_t, h_t⟩.

    The trace is shaped like the hidden group: ε_t = dt_to_t(fn(w), ε_{t-1}) + h_{t-1}
    (∂h_t/∂y = h_{t-1}), and the gradient is xy_to_dw of Σ_t c_t ⊙ ε_t. With S states
    the same trace is carried S times and the solve averages over them with weights.
    """
    steps, batch, hidden = 5, 2, 3
    with jax.enable_x64(True):
        w = _tau(12, w_shape, jnp.float64)
        xs = _normal(13, (steps, batch, hidden), jnp.float64)
        cs = _normal(14, (steps, batch, hidden), jnp.float64)
        state_w = jnp.arange(1.0, num_states + 1.0) / (num_states * (num_states + 1) / 2)
        rule = etp_elemwise_p.rule

        def unrolled(w):
            h, loss = jnp.zeros((batch, hidden)), 0.0
            for t in range(steps):
                h = element_wise(w, decay) * h + xs[t]
                loss = loss + jnp.sum(cs[t] * h)
            return loss

        def per_sample(y, x_seq, c_seq):
            eps = rule("init_drtrl")(None, y, {"weight": w}, num_states)["weight"]
            h, acc = jnp.zeros(hidden), jnp.zeros(hidden)
            for t in range(steps):
                eps = jax.vmap(lambda e: rule("dt_to_t")(y, {"weight": e}, fn=decay)["weight"],
                               in_axes=-1, out_axes=-1)(eps) + h[:, None]
                h = y * h + x_seq[t]
                acc = acc + (c_seq[t][:, None] * eps) @ state_w
            return acc

        def compute():
            y = jnp.broadcast_to(decay(w), (batch, hidden))  # y as seen by the hidden group
            acc = jax.vmap(per_sample, in_axes=(0, 1, 1))(y, xs, cs)  # (B, H): batch solve
            got = rule("xy_to_dw")(None, acc, {"weight": w}, fn=decay)["weight"]
            return got, jax.grad(unrolled)(w)

        got, want = _compiled(compute)
        assert float(jnp.abs(want).sum()) > 0
        assert got.shape == w_shape
        _close(got, want, jnp.float64)


@pytest.mark.parametrize("y_shape", [(4,), (2, 4)])
@pytest.mark.parametrize("num_states", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_init_rules(y_shape, num_states, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        w = _tau(15, (), dtype)
        y = jnp.broadcast_to(decay(w), y_shape)
        tr = etp_elemwise_p.rule("init_drtrl")(None, y, {"weight": w}, num_states)
        assert set(tr) == {"weight"}
        assert tr["weight"].shape == (*y_shape, num_states) and tr["weight"].dtype == dtype
        assert not jnp.any(tr["weight"])
        pp = etp_elemwise_p.rule("init_pp")(None, y, {"weight": w}, num_states)
        assert pp.shape == (*y_shape, num_states) and pp.dtype == dtype and not jnp.any(pp)
