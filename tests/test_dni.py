"""DNI: synthetic gradients at the window boundaries of windowed mode.

Oracles are independent of the library: ``jax.grad`` of the summed loss of an
unrolled float64 model (BPTT), with zero perturbations added to the hidden
state to read the true future cotangents ``∂L_{≥t}/∂h^t``; the synthesiser's
target is derived by hand for a leaky integrator (``∂h^K/∂h^0 = a^K``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference_models import F64, DenseLeaky, GRUNet, bptt_grads, data, mse
from reference_models import leaves as _leaves

import braintrace

T, K = 6, 2


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


class Oracle(nnx.Module):
    """Returns a fixed table of cotangents: ``table[t // K]`` for the state after ``t`` steps."""

    def __init__(self, path, table):
        self.path = path
        self.table = nnx.Variable(table)

    def __call__(self, hidden, t):
        return {self.path: self.table[...][t // K]}


def future_cotangents(model, xs, ys):
    """``∂L_{≥t}/∂h^t`` for ``t = 0..T-1`` (losses of step ``t`` on), by BPTT in float64."""
    graphdef, params, hidden, other = nnx.split(model, nnx.Param, braintrace.HiddenState, ...)

    def total(eps):
        def body(h, inputs):
            x, y, e = inputs
            m = nnx.merge(graphdef, params, jax.tree.map(jnp.add, h, e), other, copy=True)
            out = m(x)
            return nnx.state(m, braintrace.HiddenState), mse(out, y)

        return jnp.sum(jax.lax.scan(body, hidden, (xs, ys, eps))[1])

    eps = jax.tree.map(lambda h: jnp.zeros((xs.shape[0], *h.shape), h.dtype), hidden)
    return jax.tree.leaves(jax.grad(total)(eps))[0]


def leaves(state):
    """``{'synth/kernel': array, ...}``: the leaves by their path (no trailing ``/value``)."""
    return {k.removesuffix("/value"): v for k, v in _leaves(state).items()}


def _model_grads(state):
    return {k: v for k, v in leaves(state).items() if not k.startswith("synth")}


_PLAIN = {}


def _plain_windowed(xs, ys):
    """Plain windowed D-RTRL on a fresh ``GRUNet`` (computed once)."""
    if "grads" not in _PLAIN:
        _PLAIN["grads"] = _windowed(GRUNet(), braintrace.D_RTRL(), xs, ys)
    return _PLAIN["grads"]


def _windowed(model, algorithm, xs, ys):
    learner = braintrace.compile(model, algorithm, xs[0])
    return leaves(learner.etrace_grad(xs, ys, mse, chunk_size=K, reduction="sum"))


def test_zero_synthesizer_is_plain_windowed_mode_bit_for_bit():
    xs, ys = data(T)
    model = GRUNet()
    model.synth = braintrace.LinearSynthesizer(model)
    want = _plain_windowed(xs, ys)
    got = _windowed(model, braintrace.DNI(model.synth), xs, ys)
    for key, value in want.items():
        if not key.startswith("synth"):
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert np.max(np.abs(got["synth/kernel"])) > 1e-6  # the synthesiser learns from the start


def test_oracle_synthesizer_gives_bptt_on_a_gru():
    xs, ys = data(T)
    model = GRUNet()
    future = future_cotangents(model, xs, ys)
    table = jnp.concatenate([future[::K], jnp.zeros_like(future[:1])])  # t = 0, K, .., T
    model.synth = Oracle("rnn.carry", table)
    want = _model_grads(bptt_grads(GRUNet(), xs, ys))
    got = _model_grads(_windowed(model, braintrace.DNI(model.synth), xs, ys))
    plain = _model_grads(_plain_windowed(xs, ys))
    for key, value in want.items():
        scale = np.max(np.abs(value))
        assert scale > 1e-6, key
        assert np.max(np.abs(got[key] - value)) / scale < 1e-8, key
    worst = max(np.max(np.abs(plain[k] - v)) / np.max(np.abs(v)) for k, v in want.items())
    assert worst > 1e-3  # negative control: windowed mode alone is not BPTT here


def test_synthesizer_gradient_matches_the_hand_derived_target():
    xs, ys = data(4)
    model = DenseLeaky()
    model.synth = braintrace.LinearSynthesizer(model)
    kernel = 0.3 * jax.random.normal(jax.random.key(5), (4, 4), F64)
    model.synth.kernel.set_value(kernel)
    got = leaves(braintrace.compile(model, braintrace.DNI(model.synth), xs[0]).etrace_grad(
        xs, ys, mse, chunk_size=K, reduction="sum"))
    w, b, wo, a = model.w[...], model.b[...], model.wo[...], model.a
    signal = jax.grad(lambda h, y: mse(jnp.tanh(h) @ wo, y))
    h, states, dk, db = jnp.zeros(4, F64), [jnp.zeros(4, F64)], 0.0, 0.0
    for t in range(4):
        h = a * h + xs[t] @ w + b
        states.append(h)
    for start in (0, K):  # g_0 = Σ_k a^k ∂L_k/∂h_k + a^K ŝ(h_K); ∇ = Σ_w h_0 ⊗ (ŝ(h_0) - g_0)
        target = sum(a ** k * signal(states[start + k], ys[start + k - 1]) for k in (1, 2))
        target = target + a ** K * (states[start + K] @ kernel)
        error = states[start] @ kernel - target
        dk, db = dk + jnp.outer(states[start], error), db + error
    np.testing.assert_allclose(got["synth/kernel"], dk, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got["synth/bias"], db, rtol=1e-10, atol=1e-14)


def test_bad_uses_raise_clear_errors():
    xs, ys = data(T)
    model = GRUNet()
    outside = braintrace.LinearSynthesizer(model)
    with pytest.raises(ValueError, match="not part of the model"):
        braintrace.compile(model, braintrace.DNI(outside), xs[0])
    model.synth = outside
    learner = braintrace.compile(model, braintrace.DNI(model.synth), xs[0])
    with pytest.raises(ValueError, match="chunk_size=K"):
        learner.etrace_grad(xs, ys, mse)
    with pytest.raises(TypeError, match="nnx.Module"):
        braintrace.DNI(lambda h, t: h)


def test_trainer_updates_model_and_synthesizer_together():
    xs, ys = data(T)
    model = GRUNet()
    model.synth = braintrace.LinearSynthesizer(model)
    learner = braintrace.compile(model, braintrace.DNI(model.synth), xs[0])
    expected = leaves(learner.etrace_grad(xs, ys, mse, chunk_size=T, reduction="sum"))
    learner.reset()
    before = {k: np.copy(v) for k, v in leaves(nnx.state(model, nnx.Param)).items()}
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=T)
    trainer.step(xs, ys)
    after = leaves(nnx.state(model, nnx.Param))
    for key, grad in expected.items():
        np.testing.assert_allclose(after[key], before[key] - 0.1 * grad / T, rtol=1e-9,
                                   atol=1e-12, err_msg=key)
    assert np.max(np.abs(after["synth/bias"])) > 0  # (the kernel: h_0 = 0 in one window)
