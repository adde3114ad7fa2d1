"""ThreeFactor: D-RTRL traces gated by a modulator (``∇θ = Σ_t w_t M^t·ε^t``).

The oracle of (a) is independent of the library: the hidden trajectory of an
unrolled float64 model and ``jax.grad`` of each step's loss with respect to
``h^t`` give the true learning signal ``∂L_t/∂h^t``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference_models import F64, DenseLeaky, H, data, leaves, mse

import braintrace

T = 6
B = 2


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _true_signal(model, xs, ys):
    """``∂L_t/∂h^t`` per step, from an unrolled float64 run of ``DenseLeaky`` (batched)."""
    w, b, wo, a = model.w[...], model.b[...], model.wo[...], model.a
    h = jnp.zeros((B, H), F64)
    traj = []
    for t in range(T):
        h = a * h + xs[t] @ w + b
        traj.append(h)
    step_loss = lambda h, y: mse(jnp.tanh(h) @ wo, y)
    return jax.vmap(jax.grad(step_loss))(jnp.stack(traj), ys)


def _learner(algorithm):
    model = DenseLeaky(batch=B)
    return model, braintrace.compile(model, algorithm, jnp.ones((B, 3), F64))


_COMPILED = {}


def _grads(name, xs, ys, loss_fn=mse, **kw):
    """``etrace_grad`` (sum) from zero state, by one learner compiled per algorithm name."""
    if name not in _COMPILED:
        model, learner = _learner(name)
        _COMPILED[name] = (model, learner, learner.traces)
    model, learner, traces = _COMPILED[name]
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, braintrace.HiddenState)))
    learner.traces = traces
    return _named(learner.etrace_grad(xs, ys, loss_fn, reduction="sum", **kw))


def _named(state):
    """``{'w': array, ...}``: the gradient leaves by their Param's name."""
    return {key.split("/")[0]: value for key, value in leaves(state).items()}


def test_true_signal_reproduces_d_rtrl():
    xs, ys = data(T, batch=B)
    signal = _true_signal(DenseLeaky(batch=B), xs, ys)
    assert float(jnp.max(jnp.abs(signal))) > 1e-3
    ref = _grads("d_rtrl", xs, ys)
    got = _grads("three_factor", xs, ys, modulators={"h": signal})
    for key in ("w", "b", "wo"):  # traced (w, b) by M·ε; the readout by its same-step gradient
        err = np.max(np.abs(got[key] - ref[key])) / np.max(np.abs(ref[key]))
        assert err < 1e-10, (key, err)


def test_linear_in_the_modulator_and_zero_gives_zero():
    xs, ys = data(T, batch=B)
    m1 = jax.random.normal(jax.random.key(1), (T, B, H), F64)
    m2 = jax.random.normal(jax.random.key(2), (T, B, H), F64)
    alg = "three_factor"
    g1, g2 = (_grads(alg, xs, ys, modulators={"h": m}) for m in (m1, m2))
    mix = _grads(alg, xs, ys, modulators={"h": 2.0 * m1 - 0.5 * m2})
    for key in ("w", "b"):
        assert np.max(np.abs(g1[key])) > 1e-3
        np.testing.assert_allclose(mix[key], 2.0 * g1[key] - 0.5 * g2[key], rtol=1e-10,
                                   atol=1e-12)
    zero = _grads(alg, xs, ys, modulators={"h": jnp.zeros((T, B, H), F64)})
    assert not np.any(zero["w"]) and not np.any(zero["b"])
    np.testing.assert_allclose(zero["wo"], g1["wo"], rtol=1e-12)  # the readout keeps its loss


def test_untraced_params_get_zero_with_a_zero_loss_and_mask_weights_the_modulator():
    xs, ys = data(T, batch=B)
    m = jax.random.normal(jax.random.key(3), (T, B, H), F64)
    alg = "three_factor"
    g = _grads(alg, xs, ys, lambda y, t: 0.0 * jnp.sum(y), modulators={"h": m})
    assert not np.any(g["wo"])
    full = _grads(alg, xs, ys, modulators={"h": m})
    mask = (jnp.arange(T) < 3).astype(F64)
    masked = _grads(alg, xs, ys, modulators={"h": m}, mask=mask)
    cut = _grads(alg, xs, ys, modulators={"h": m * mask[:, None, None]})
    np.testing.assert_allclose(masked["w"], cut["w"], rtol=1e-12)
    assert np.max(np.abs(masked["w"] - full["w"])) > 1e-6


@pytest.mark.parametrize("modulators, match", [
    (None, "needs modulators"),
    ([jnp.zeros((T, B, H))], "must be a dict"),
    ({}, r"missing \['h'\]"),
    ({"h": jnp.zeros((T, B, H)), "c": jnp.zeros((T, B, H))}, r"unknown \['c'\]"),
    ({"h": jnp.zeros((T + 1, B, H))}, r"modulators\['h'\] has shape \(7, 2, 4\).*\(6, 2, 4\)"),
    ({"h": jnp.zeros((T, H))}, r"modulators\['h'\] has shape"),
    ({"h": jnp.full((T, B, H), jnp.nan)}, "not finite"),
])
def test_bad_modulators_raise_clear_errors(modulators, match):
    xs, ys = data(T, batch=B)
    _grads("three_factor", xs, ys, modulators={"h": jnp.zeros((T, B, H))})
    learner = _COMPILED["three_factor"][1]
    with pytest.raises((ValueError, TypeError), match=match):
        learner.etrace_grad(xs, ys, mse, modulators=modulators)


def test_modulators_only_for_three_factor_and_not_windowed():
    xs, ys = data(T, batch=B)
    _grads("d_rtrl", xs, ys)
    with pytest.raises(ValueError, match=r"reads no per-step input; got \[.modulators.\]"):
        _COMPILED["d_rtrl"][1].etrace_grad(xs, ys, mse, modulators={"h": jnp.zeros((T, B, H))})
    _grads("three_factor", xs, ys, modulators={"h": jnp.zeros((T, B, H))})
    learner = _COMPILED["three_factor"][1]
    with pytest.raises(ValueError, match="without chunk_size"):
        learner.etrace_grad(xs, ys, mse, chunk_size=2, modulators={"h": jnp.zeros((T, B, H))})


def test_trainer_applies_the_three_factor_gradient():
    xs, ys = data(T, batch=B)
    m = jax.random.normal(jax.random.key(4), (T, B, H), F64)
    model, learner = _learner(braintrace.ThreeFactor())
    w0 = np.asarray(model.w[...])
    expected = _grads("three_factor", xs, ys, modulators={"h": m})["w"]
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=T)
    trainer.step(xs, ys, modulators={"h": m})
    np.testing.assert_allclose(np.asarray(model.w[...]), w0 - 0.1 * expected / T, rtol=1e-10)
    with pytest.raises(ValueError, match="needs modulators"):
        trainer.step(xs, ys)
    assert isinstance(nnx.state(model, nnx.Param), nnx.State)
