"""What BPTT keeps for its backward pass: the state and the products of each step, no more.

A step of the LIF network ``ETPLinear → LIF → LeakyReadout`` needs, for its backward
pass, the surrogate derivative at the membrane before and after the step and the
spikes the readout read. ``jax.grad`` through a plain ``lax.scan`` keeps those three
neuron-sized arrays a step; ``braintrace.compile(model, 'bptt')`` keeps the membrane
the step starts from and the input current (the matrix product's output) and
recomputes the rest (``_loops/_windowed.py``). The gradients are the same (the
exactness tests against the float64 oracle run through the same loop).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import mse, sequence_loss

import braintrace
from braintrace import layers

T, B, INPUTS, HIDDEN, OUTPUTS = 32, 8, 16, 64, 4
PER_STEP = T * B * HIDDEN * 4
"""Bytes of one float32 neuron-sized array kept for every step."""


def _network() -> nnx.Module:
    model = nnx.Sequential(
        layers.ETPLinear(INPUTS, HIDDEN, kernel_init=nnx.initializers.normal(1.0),
                         rngs=nnx.Rngs(0)),
        layers.LIF(HIDDEN), layers.LeakyReadout(HIDDEN, OUTPUTS, rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    return model


def _data():
    kx, ky = jax.random.split(jax.random.key(0))
    return (jax.random.normal(kx, (T, B, INPUTS)), jax.random.normal(ky, (T, B, OUTPUTS)))


def test_compiled_bptt_keeps_two_neuron_arrays_a_step_where_a_plain_scan_keeps_three():
    model, (xs, ys) = _network(), _data()
    online = braintrace.online_grad(braintrace.compile(model, "bptt", xs[0], batch_size=B), mse)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def bptt(params, state, xs, ys):
        return online.grad(nnx.merge(graphdef, params, rest), state, xs, ys)[0]

    total, _ = sequence_loss(model, xs, ys)
    weights = jnp.ones(T) / T  # online_grad's 'mean' reduction
    kept = jax.jit(bptt).lower(params, online.init(model), xs, ys).compile()
    plain = jax.jit(jax.grad(total)).lower(params, weights).compile()
    kept_bytes = kept.memory_analysis().temp_size_in_bytes
    plain_bytes = plain.memory_analysis().temp_size_in_bytes
    assert 2 * PER_STEP <= kept_bytes < 2.5 * PER_STEP, kept_bytes / PER_STEP
    assert plain_bytes >= 3 * PER_STEP, plain_bytes / PER_STEP  # the control the policy beats
    grads, expected = kept(params, online.init(model), xs, ys), plain(params, weights)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    assert float(jnp.abs(grads["layers"][0]["kernel"][...]).max()) > 0


def test_a_recurrent_spiking_step_computes_the_previous_spikes_once():
    """``z_{t-1}`` feeds the recurrent kernel and the reset: one spike function for both, so
    one surrogate derivative is kept for them (and one for ``z_t``)."""
    layer = layers.RecurrentSpiking(3, layers.LIF(5), rngs=nnx.Rngs(0))
    braintrace.init_states(layer, 2)
    graphdef, state = nnx.split(layer)

    def step(state, x):
        return nnx.merge(graphdef, state, copy=True)(x)

    eqns = jax.make_jaxpr(step)(state, jnp.ones((2, 3))).eqns
    assert [e.primitive.name for e in eqns].count("custom_jvp_call") == 2
