"""The linear recurrent unit: init, forward against complex numbers, exact D-RTRL, optax."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads as bptt
from helpers import mse
from test_gradient_contract import assert_live, relative_errors

import braintrace
from braintrace import layers

F64 = jnp.float64
IN, HID, B, T = 3, 4, 2, 4


def complex_reference(p, h0, xs):
    """The paper's equations on complex arrays: ``h' = λ h + γ (B x)``, ``y = Re(C h') + D x``."""
    lam = jnp.exp(-jnp.exp(p["nu_log"]) + 1j * jnp.exp(p["theta_log"]))
    b = (p["B_re"] + 1j * p["B_im"]) * jnp.exp(p["gamma_log"])[:, None]
    c = p["C_re"] + 1j * p["C_im"]
    h, ys = h0, []
    for x in xs:
        h = lam * h + x @ b.T
        skip = p["D"] * x if p["D"].ndim == 1 else x @ p["D"].T
        ys.append((h @ c.T).real + skip)
    return h, jnp.stack(ys)


def params_of(module):
    return {k: v[...] for k, v in nnx.state(module, nnx.Param).items()}


def test_init_follows_the_paper_ring_and_normalisation():
    lru = layers.LRU(IN, 64, r_min=0.4, r_max=0.9, max_phase=math.pi, rngs=nnx.Rngs(0))
    p = params_of(lru)
    modulus, phase = np.exp(-np.exp(p["nu_log"])), np.exp(p["theta_log"])
    assert np.all((modulus >= 0.4 - 1e-6) & (modulus <= 0.9 + 1e-6))
    assert np.all((phase >= 0) & (phase <= math.pi))
    np.testing.assert_allclose(np.exp(p["gamma_log"]), np.sqrt(1 - modulus ** 2), rtol=1e-5)
    shapes = {k: v.shape for k, v in p.items()}
    assert shapes == {"nu_log": (64,), "theta_log": (64,), "gamma_log": (64,),
                      "B_re": (64, IN), "B_im": (64, IN), "C_re": (IN, 64), "C_im": (IN, 64),
                      "D": (IN,)}
    assert {v.dtype for v in p.values()} == {jnp.dtype(jnp.float32)}
    assert 0.3 < np.std(p["B_re"]) * math.sqrt(2 * IN) < 1.7


def test_lru_and_lru_cell_have_the_same_params_under_the_same_rngs():
    a = layers.LRU(IN, HID, out_features=5, rngs=nnx.Rngs(3))
    b = layers.LRUCell(IN, HID, out_features=5, rngs=nnx.Rngs(3))
    jax.tree.map(np.testing.assert_array_equal, params_of(a), params_of(b))
    assert params_of(a)["D"].shape == (5, IN)


@pytest.mark.parametrize("out_features", [None, 5])
def test_lru_and_cell_forward_equal_the_complex_equations(out_features):
    lru = layers.LRU(IN, HID, out_features=out_features, rngs=nnx.Rngs(1))
    cell = layers.LRUCell(IN, HID, out_features=out_features, rngs=nnx.Rngs(1))
    xs = jax.random.normal(jax.random.key(0), (T, B, IN))
    h0 = jax.random.normal(jax.random.key(1), (B, HID)) + 1j * jax.random.normal(
        jax.random.key(2), (B, HID))
    want_h, want_ys = complex_reference(params_of(lru), h0, xs)
    braintrace.init_states(lru, batch_size=B)
    lru.h_re[...], lru.h_im[...] = h0.real, h0.imag
    ys = jnp.stack([lru(x) for x in xs])
    np.testing.assert_allclose(ys, want_ys, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lru.h, want_h, rtol=1e-4, atol=1e-5)
    rnn_ys = nnx.RNN(cell, time_major=True)(xs, initial_carry=(h0.real, h0.imag))
    np.testing.assert_allclose(rnn_ys, want_ys, rtol=1e-4, atol=1e-5)


class Readout(nnx.Module):
    """LRU -> tanh -> ETPLinear readout (float64)."""

    def __init__(self):
        self.lru = layers.LRU(IN, HID, out_features=5, r_min=0.4, param_dtype=F64,
                              rngs=nnx.Rngs(0))
        self.out = layers.ETPLinear(5, 2, param_dtype=F64, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.out(jnp.tanh(self.lru(x)))


def _built():
    model = Readout()
    braintrace.init_states(model, batch_size=B)
    model.lru.h_re[...] = 0.5 * jax.random.normal(jax.random.key(7), (B, HID), F64)
    model.lru.h_im[...] = 0.5 * jax.random.normal(jax.random.key(8), (B, HID), F64)
    return model


def test_d_rtrl_equals_float64_bptt_for_every_lru_param():
    with jax.enable_x64(True):
        xs = jax.random.normal(jax.random.key(1), (T, B, IN), F64)
        ys = jax.random.normal(jax.random.key(2), (T, B, 2), F64)
        want = bptt(_built(), xs, ys)
        assert_live(want)
        learner = braintrace.compile(_built(), braintrace.D_RTRL(), xs[0], strict=True)
        traced = set(learner.graph.traced_param_paths)
        assert traced == {f"lru.{k}" for k in ("B_re", "B_im", "nu_log", "theta_log",
                                                "gamma_log")}
        (group,) = learner.graph.groups
        assert group.num_states == 2  # (h_re, h_im): one 2x2 rotation-scaling per unit
        errors = relative_errors(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)
        # and step by step: no time block hides a lossy trace carry
        learner = braintrace.compile(_built(), braintrace.D_RTRL(), xs[0], strict=True)
        per_step = relative_errors(learner.etrace_grad(xs, ys, mse, reduction="sum",
                                                       block_size=1), want)
    assert len(errors) == 10 and max(errors.values()) <= 1e-8, errors
    assert max(per_step.values()) <= 1e-8, per_step


def test_an_adam_step_on_an_online_lru_learner_changes_nu_theta_and_gamma():
    model = nnx.Sequential(layers.LRU(IN, HID, r_min=0.5, rngs=nnx.Rngs(0)),
                           layers.ETPLinear(IN, 1, rngs=nnx.Rngs(1)))
    xs = jax.random.normal(jax.random.key(0), (8, B, IN))
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=B, strict=True)
    before = params_of(model.layers[0])
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse)
    losses = trainer.step(xs, jnp.cumsum(xs[..., :1], axis=0) / 4)
    assert losses.shape == (8,) and np.all(np.isfinite(losses))
    after = params_of(learner.model.layers[0])
    for name in ("nu_log", "theta_log", "gamma_log", "B_re", "B_im", "C_re", "C_im", "D"):
        assert after[name].dtype == jnp.float32
        assert np.max(np.abs(after[name] - before[name])) > 1e-4, name


@pytest.mark.parametrize("kwargs,match", [
    ({"r_min": 0.5, "r_max": 0.5}, "r_min < r_max"),
    ({"r_max": 1.5}, "r_max <= 1"),
    ({"max_phase": 0.0}, "max_phase must be positive"),
    ({"out_features": 0}, "out_features must be a positive int"),
])
def test_bad_lru_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layers.LRU(IN, HID, rngs=nnx.Rngs(0), **kwargs)


def test_lru_input_of_the_wrong_shape_names_the_layer_and_expected_shape():
    lru = layers.LRU(IN, HID, rngs=nnx.Rngs(0))
    braintrace.init_states(lru, batch_size=B)
    with pytest.raises(ValueError, match=r"LRU.*expected input shape \(2, 3\)"):
        lru(jnp.ones((B, 5)))
    cell = layers.LRUCell(IN, HID, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"LRUCell.*expected input shape \(4, 3\)"):
        cell(cell.initialize_carry((4, IN)), jnp.ones((2, IN)))
    with pytest.raises(ValueError, match="carry_init needs rngs"):
        cell.initialize_carry((4, IN), carry_init=nnx.initializers.normal())
