"""Spike function, LIF/ALIF/IF/CuBaLIF dynamics, synapse, readouts and the recurrent spiking layer."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import primitive_names

import braintrace
from braintrace import layers

SURROGATE_DERIVATIVES = {
    "sigmoid": lambda x, a: a * jax.nn.sigmoid(a * x) * (1 - jax.nn.sigmoid(a * x)),
    "fast_sigmoid": lambda x, a: 1 / (1 + a * np.abs(x)) ** 2,
    "superspike": lambda x, a: 1 / (1 + a * np.abs(x)) ** 2,
    "triangle": lambda x, a: a * np.maximum(0, 1 - a * np.abs(x)),
    "arctan": lambda x, a: a / 2 / (1 + (np.pi / 2 * a * x) ** 2),
    "tanh": lambda x, a: a / 2 / np.cosh(a * x) ** 2,
    "boxcar": lambda x, a: np.where(np.abs(x) < 1 / a, a / 2, 0.0),
    "rectangular": lambda x, a: np.where(np.abs(x) < 1 / a, a / 2, 0.0),
}


@pytest.mark.parametrize("name", sorted(SURROGATE_DERIVATIVES))
def test_spike_is_heaviside_forward_and_the_named_surrogate_backward(name):
    assert set(layers.SURROGATES) == set(SURROGATE_DERIVATIVES)
    x = jnp.array([-1.0, -0.3, -0.05, 0.0, 0.05, 0.3, 1.0])
    np.testing.assert_array_equal(layers.spike(x, name), [0, 0, 0, 0, 1, 1, 1])
    for alpha in (0.7, 3.0):
        grad = jax.vmap(jax.grad(layers.spike), in_axes=(0, None, None))(x, name, alpha)
        np.testing.assert_allclose(grad, SURROGATE_DERIVATIVES[name](np.asarray(x), alpha),
                                   rtol=1e-5, atol=1e-7)


def test_spike_rejects_an_unknown_surrogate():
    with pytest.raises(ValueError, match="unknown surrogate 'gauss'"):
        layers.spike(jnp.ones(2), "gauss")
    with pytest.raises(ValueError, match="unknown surrogate"):
        layers.LIF(3, surrogate="gauss")


def _run(layer, xs):
    return np.stack([np.asarray(layer(x)) for x in xs])


def test_lif_soft_reset_subtracts_and_hard_reset_sets_the_reset_potential():
    alpha = math.exp(-1 / 10)
    xs = jnp.full((4, 1), 0.7)
    soft = layers.LIF(1, tau=10.0, v_reset=-0.2, reset="soft")
    hard = layers.LIF(1, tau=10.0, v_reset=-0.2, reset="hard")
    z_soft, z_hard = _run(soft, xs), _run(hard, xs)
    v1 = 0.7
    v2 = alpha * v1 + 0.7                                # > 1: spikes
    np.testing.assert_array_equal(z_soft[:2, 0], [0, 1])
    v3_soft = alpha * (v2 - 1.2) + 0.7
    v3_hard = alpha * -0.2 + 0.7
    v4_soft, v4_hard = alpha * v3_soft + 0.7, alpha * v3_hard + 0.7
    np.testing.assert_allclose(soft.v[...], [v4_soft], rtol=1e-6)
    np.testing.assert_allclose(hard.v[...], [v4_hard], rtol=1e-6)
    np.testing.assert_array_equal(z_hard[:, 0], [0, 1, 0, float(v4_hard > 1)])


def test_lif_refractory_neuron_holds_and_stays_silent():
    lif = layers.LIF(1, tau=1e6, reset="hard", refractory_steps=2)
    z = _run(lif, jnp.full((8, 1), 0.6))[:, 0]
    # v: .6, 1.2 (spike), hold 0, hold 0, .6, 1.2 (spike), hold, hold
    np.testing.assert_array_equal(z, [0, 1, 0, 0, 0, 1, 0, 0])
    assert lif.ref_steps.shape == lif.v.shape == (1,)


def _alif_reference(xs, tau, tau_a, beta, v_th, v_reset, reset):
    """Plain-numpy ALIF (Bellec et al.): returns spikes and the final (v, a)."""
    alpha, rho = math.exp(-1 / tau), math.exp(-1 / tau_a)
    v = a = z = 0.0
    zs = []
    for x in xs:
        a_new = rho * a + (1 - rho) * z
        v = v - z * (v_th - v_reset) if reset == "soft" else v + z * (v_reset - v)
        v, a = alpha * v + x, a_new
        z = float(v - v_th - beta * a > 0)
        zs.append(z)
    return np.array(zs), v, a


@pytest.mark.parametrize(("reset", "refractory"), [("soft", 0), ("hard", 0), ("soft", 2)])
def test_a_detached_reset_leaves_the_membrane_jacobian_the_docstring_states(reset, refractory):
    """``∂v_t/∂v_{t-1}`` by ``jax.jacobian``: ``α`` (soft), ``α (1 - z_{t-1})`` (hard: 0 after
    a spike), ``∂ṽ/∂v_{t-1} = 1`` where a refractory neuron holds; the reset's derivative
    (not detached) is the control."""
    v0 = jnp.array([0.2, 0.9, -0.4, 1.3])  # neurons 1 and 3 spiked at t-1 (v_th 0.5)
    z = np.array([0.0, 1.0, 0.0, 1.0])
    alpha = math.exp(-1 / 4.0)
    want = {"soft": alpha * np.ones(4), "hard": alpha * (1 - z)}[reset]
    if refractory:
        want = np.where(z > 0, 1.0, alpha)

    def jacobian(detach_reset):
        lif = layers.LIF(4, tau=4.0, v_th=0.5, reset=reset, refractory_steps=refractory,
                         detach_reset=detach_reset)
        graphdef, state = nnx.split(lif)

        def step(v):
            cell = nnx.merge(graphdef, state, copy=True)
            cell.v.set_value(v)
            cell(jnp.full(4, 0.1))
            return cell.v[...]

        return np.asarray(jax.jacobian(step)(v0))

    np.testing.assert_allclose(jacobian(True), np.diag(want), rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(jacobian(False) - np.diag(want))) > 1e-2


@pytest.mark.parametrize("reset", ["soft", "hard"])
def test_alif_matches_a_plain_reference_and_adapts_its_threshold(reset):
    xs = np.concatenate([np.full(12, 0.45), np.zeros(3), np.full(10, 0.6)])
    kwargs = {"tau": 15.0, "tau_a": 10.0, "beta": 2.0, "v_th": 1.0, "v_reset": 0.1,
              "reset": reset}
    alif = layers.ALIF(1, **kwargs)
    z = _run(alif, jnp.asarray(xs)[:, None])[:, 0]
    z_ref, v_ref, a_ref = _alif_reference(xs, **kwargs)
    np.testing.assert_array_equal(z, z_ref)
    np.testing.assert_allclose(alif.v[...], [v_ref], rtol=1e-5)
    np.testing.assert_allclose(alif.a[...], [a_ref], rtol=1e-5)
    assert 0 < z.sum() < _run(layers.LIF(1, tau=15.0, v_reset=0.1, reset=reset),
                              jnp.asarray(xs)[:, None]).sum()


@pytest.mark.parametrize("make,states", [
    (lambda: layers.LIF(4), {"v"}),
    (lambda: layers.LIF(4, refractory_steps=3), {"v", "ref_steps"}),
    (lambda: layers.ALIF(4), {"v", "a"}),
    (lambda: layers.ExpSynapse(4), {"g"}),
    (lambda: layers.LeakyReadout(3, 4, rngs=nnx.Rngs(0)), {"y"}),
    (lambda: layers.RecurrentSpiking(3, layers.ALIF(4), rngs=nnx.Rngs(0)),
     {"neuron.v", "neuron.a"}),
    (lambda: layers.IF(4), {"v"}),
    (lambda: layers.CuBaLIF(4), {"v", "i"}),
    (lambda: layers.RecurrentSpiking(3, layers.CuBaLIF(4), rngs=nnx.Rngs(0)),
     {"neuron.v", "neuron.i"}),
    (lambda: layers.SumOverTime(4), {"c"}),
    (lambda: layers.MaxOverTime(4), {"m"}),
], ids=["LIF", "LIF-refractory", "ALIF", "ExpSynapse", "LeakyReadout", "RecurrentSpiking", "IF",
        "CuBaLIF", "RecurrentCuBaLIF", "SumOverTime", "MaxOverTime"])
def test_hidden_states_of_one_layer_share_the_per_sample_shape(make, states):
    layer = make()
    flat = nnx.to_flat_state(nnx.state(layer, braintrace.HiddenState))
    assert {".".join(map(str, path)) for path, _ in flat} == states
    assert {var.shape for _, var in flat} == {(4,)}


def test_exp_synapse_decays_with_its_time_constant():
    syn = layers.ExpSynapse(2, tau=4.0)
    syn(jnp.ones(2))
    np.testing.assert_allclose(syn(jnp.zeros(2)), np.full(2, math.exp(-0.25)), rtol=1e-6)


def test_leaky_readout_integrates_the_linear_map():
    readout = layers.LeakyReadout(3, 2, tau=5.0, rngs=nnx.Rngs(0))
    z = jnp.array([1.0, 0.0, 1.0])
    y1 = readout(z)
    np.testing.assert_allclose(y1, readout.linear(z), rtol=1e-6)
    np.testing.assert_allclose(readout(z), math.exp(-0.2) * y1 + readout.linear(z), rtol=1e-6)


@pytest.mark.parametrize("make,attr", [
    (lambda: layers.LIF(3, learn_tau=True), "tau"),
    (lambda: layers.ALIF(3, learn_tau_a=True), "tau_a"),
    (lambda: layers.ExpSynapse(3, learn_tau=True), "tau"),
    (lambda: layers.LeakyReadout(3, 3, learn_tau=True, rngs=nnx.Rngs(0)), "tau"),
    (lambda: layers.CuBaLIF(3, learn_tau_syn=True), "tau_syn"),
])
def test_learnable_time_constant_is_a_param_read_through_the_elementwise_primitive(make, attr):
    layer = make()
    tau = getattr(layer, attr)
    assert isinstance(tau, layers.ETPElemwise) and isinstance(tau.weight, nnx.Param)
    assert tau.weight.shape == (3,)
    graphdef, state = nnx.split(layer)
    assert "etp_elemwise" in primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state,
                                         jnp.ones(3))


def test_fixed_time_constants_are_not_params():
    assert len(nnx.state(layers.ALIF(3), nnx.Param)) == 0


def test_recurrent_spiking_feeds_back_the_previous_spikes():
    layer = layers.RecurrentSpiking(2, layers.LIF(3, tau=1e6, reset="hard"), use_bias=False,
                                    rngs=nnx.Rngs(0))
    layer.dense_i.kernel[...] = jnp.full((2, 3), 1.0)
    layer.dense_h.kernel[...] = jnp.eye(3) * 5.0
    x = jnp.array([0.6, 0.0])
    np.testing.assert_array_equal(layer(x), [0, 0, 0])        # v = .6
    np.testing.assert_array_equal(layer(x), [1, 1, 1])        # v = 1.2
    np.testing.assert_array_equal(layer(jnp.zeros(2)), [1, 1, 1])  # reset to 0, then + 5
    graphdef, state = nnx.split(layer)
    names = primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    assert "etp_dense" in names and "custom_jvp_call" in names and "dot_general" not in names


@pytest.mark.parametrize("make", [
    lambda: layers.LIF(3), lambda: layers.ALIF(3), lambda: layers.ExpSynapse(3),
    lambda: layers.IF(3), lambda: layers.CuBaLIF(3), lambda: layers.SumOverTime(3),
    lambda: layers.MaxOverTime(3),
    lambda: layers.LeakyReadout(5, 3, rngs=nnx.Rngs(0)),
    lambda: layers.RecurrentSpiking(5, layers.LIF(3), rngs=nnx.Rngs(0)),
])
def test_spiking_layers_run_under_nnx_jit_with_a_batch(make):
    layer = make()
    braintrace.init_states(layer, batch_size=2)
    features = 5 if isinstance(layer, (layers.LeakyReadout, layers.RecurrentSpiking)) else 3
    x = jnp.ones((2, features))
    eager = make()
    braintrace.init_states(eager, batch_size=2)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), eager(x), rtol=1e-6)
