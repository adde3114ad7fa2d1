"""BPTT through every layer: ``jax.grad`` of a ``lax.scan`` over a pure step (split/merge)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads as oracle

import braintrace
from braintrace import layers

T, B = 6, 2


class Leaky(nnx.Module):
    """A leaky integrator driven by a stateless layer, so the layer feeds a hidden state."""

    def __init__(self, layer: nnx.Module, features: int):
        self.layer = layer
        self.h = braintrace.HiddenState(jnp.zeros(features))

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.layer(x)
        return self.h[...]


class Gain(nnx.Module):
    """A learnable sigmoid gain on the input, read through ``ETPElemwise``."""

    def __init__(self, features: int):
        self.gain = layers.ETPElemwise(jnp.linspace(-1.0, 1.0, features), jax.nn.sigmoid)

    def __call__(self, x):
        return self.gain() * x


def _lora_linear(rngs):
    layer = layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=rngs)
    layer.lora.lora_b[...] = jax.random.normal(jax.random.key(9), (2, 4))
    return layer


def _lora(rngs):
    layer = layers.ETPLoRA(3, 2, 4, base_module=layers.ETPLinear(3, 4, rngs=rngs), rngs=rngs)
    layer.lora_b[...] = jax.random.normal(jax.random.key(9), (2, 4))
    return layer


def _spiking(neuron):
    def make(rngs):
        return nnx.Sequential(layers.ETPLinear(3, 4, kernel_init=nnx.initializers.normal(2.0),
                                               rngs=rngs),
                              neuron(), layers.ExpSynapse(4, learn_tau=True),
                              layers.LeakyReadout(4, 2, learn_tau=True, rngs=rngs))
    return make


MODELS = {
    "ETPLinear": lambda rngs: Leaky(layers.ETPLinear(3, 4, rngs=rngs), 4),
    "ETPLoRA": lambda rngs: Leaky(_lora(rngs), 4),
    "ETPLoRALinear": lambda rngs: Leaky(_lora_linear(rngs), 4),
    "ETPElemwise": lambda rngs: Leaky(Gain(3), 3),
    "SimpleCell": lambda rngs: layers.Stateful(layers.SimpleCell(3, 4, rngs=rngs)),
    "GRUCell": lambda rngs: layers.Stateful(layers.GRUCell(3, 4, rngs=rngs)),
    "LSTMCell": lambda rngs: layers.Stateful(layers.LSTMCell(3, 4, rngs=rngs)),
    "MinGRUCell": lambda rngs: layers.Stateful(layers.MinGRUCell(3, 4, rngs=rngs)),
    "LIF": _spiking(lambda: layers.LIF(4, tau=5.0, learn_tau=True, reset="hard")),
    "ALIF": _spiking(lambda: layers.ALIF(4, tau=5.0, learn_tau=True, learn_tau_a=True,
                                         refractory_steps=1)),
    "RecurrentSpiking": lambda rngs: nnx.Sequential(
        layers.RecurrentSpiking(3, layers.ALIF(4, learn_tau=True), rngs=rngs,
                                kernel_init=nnx.initializers.normal(2.0),
                                recurrent_kernel_init=nnx.initializers.normal(1.0)),
        layers.LeakyReadout(4, 2, rngs=rngs)),
}


def sum_of_squares(y, t):
    del t  # no targets
    return jnp.sum(y ** 2)


def bptt_grads(model, xs):
    """Gradient of ``Σ_t |y_t|²`` w.r.t. every Param (the oracle of ``tests/helpers.py``)."""
    ys = jnp.zeros(xs.shape[0], xs.dtype)
    return oracle(model, xs, ys, loss_fn=sum_of_squares)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bptt_through_scan_gives_a_nonzero_gradient_for_every_param(name):
    model = MODELS[name](nnx.Rngs(0))
    braintrace.init_states(model, batch_size=B)
    xs = jax.random.uniform(jax.random.key(1), (T, B, 3), minval=0.0, maxval=1.5)
    grads = nnx.to_flat_state(bptt_grads(model, xs))
    assert len(grads) == len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, grad in grads:
        value = np.asarray(grad[...])
        assert np.all(np.isfinite(value)), path
        assert np.any(value != 0), f"zero BPTT gradient for {name} Param {path}"


def test_bptt_gradient_matches_finite_differences_for_a_learnable_time_constant():
    model = nnx.Sequential(layers.ExpSynapse(3, tau=4.0, learn_tau=True),
                           layers.LeakyReadout(3, 1, rngs=nnx.Rngs(0)))
    xs = jax.random.normal(jax.random.key(2), (T, 3))
    grad = bptt_grads(model, xs)["layers"][0]["tau"]["weight"][...]

    def loss_at(tau):
        m = nnx.clone(model)
        m.layers[0].tau.weight[...] = tau
        return float(sum(jnp.sum(m(x) ** 2) for x in xs))

    tau, eps = np.full(3, 4.0, np.float32), 1e-2
    numeric = [(loss_at(tau + eps * e) - loss_at(tau - eps * e)) / (2 * eps) for e in np.eye(3)]
    np.testing.assert_allclose(grad, numeric, rtol=2e-2)


@pytest.mark.parametrize("cell", ["layers.GRUCell", "nnx.GRUCell"])
def test_bptt_is_exact_on_a_gru_strict_accepts_it_and_reports_no_approximation(cell):
    """BPTT keeps no traces, so the traces' approximations (a GRU's recurrent kernel couples
    units) are not its: ``strict=True`` accepts the GRU (a plain Flax one too, which no ETP
    primitive reads) and its gradient is the float64 oracle's. D-RTRL is refused (the
    negative control: the approximation, or nothing to trace, is there)."""
    with jax.enable_x64(True):
        def make():
            if cell == "nnx.GRUCell":
                model = layers.Stateful(nnx.GRUCell(3, 4, param_dtype=jnp.float64,
                                                    rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
            else:
                model = layers.Stateful(layers.GRUCell(3, 4, param_dtype=jnp.float64,
                                                       rngs=nnx.Rngs(0)))
            braintrace.init_states(model, batch_size=B)
            return model

        xs = jax.random.normal(jax.random.key(1), (T, B, 3), jnp.float64)
        learner = braintrace.compile(make(), "bptt", xs[0], strict=True)
        assert "approximations: none ('bptt' equals BPTT on this model)" in learner.report()
        got = learner.etrace_grad(xs, jnp.zeros(T), sum_of_squares, reduction="sum")
        for (path, g), (_, w) in zip(nnx.to_flat_state(got),
                                     nnx.to_flat_state(bptt_grads(make(), xs)), strict=True):
            w = np.asarray(w[...])
            assert np.max(np.abs(w)) > 0, path
            assert np.max(np.abs(np.asarray(g[...]) - w)) <= 1e-10 * np.max(np.abs(w)), path
        refused = "no ETP primitive reads a Param" if cell == "nnx.GRUCell" else "strict=True, but"
        with pytest.raises(ValueError, match=refused):
            braintrace.compile(make(), "d_rtrl", xs[0], strict=True)
