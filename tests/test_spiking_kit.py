"""The spiking modeller's kit against NumPy references and the float64 BPTT oracle.

* IF and CuBaLIF (and their recurrent variants) step as plain NumPy references do; the
  report of a CuBaLIF layer shows its two states per neuron in one group.
* Surrogates given as functions: a derivative, a user's ``custom_jvp`` spike, spyx's
  ``jit(custom_gradient)`` activations; a plain function that is a spike function is refused.
* Readouts over time: the per-step loss at each sample's last step (``last_step_mask``)
  of a ``SumOverTime`` / ``MaxOverTime`` is the sequence loss (spike-count and
  max-membrane cross-entropy computed directly from the unrolled outputs), and D-RTRL
  (``strict=True``) equals its gradient.
* Activity regularisers: the penalties against their formulas; a regularised loss whose
  penalty reads the hidden spikes at every step, or their counts at the last step, is
  learned by D-RTRL exactly as BPTT learns it (and the penalty's share is live).
* ``cross_entropy``, ``last_step_mask`` and ``accuracy`` with a per-sample mask against
  NumPy; the encoders against NumPy loops (latency, delta) and binomial bounds (rate,
  Poisson), under ``jit``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads
from reference_models import assert_live, rel_errors

import braintrace
from braintrace import layers, tasks

F64 = jnp.float64


def _run(layer, xs):
    return np.stack([np.asarray(layer(x)) for x in xs])


# -- neurons ---------------------------------------------------------------------------------


def _lif_reference(xs, alpha, alpha_syn, v_th, v_reset, reset, w_h=None):
    """Plain-NumPy LIF family, one row of neurons: ``I = α_s I + x (+ z W_h)`` (``α_s = 0``:
    no synapse), ``v = α (v - reset) + I``, ``z = H(v - v_th)``."""
    n = xs.shape[1]
    v, i, z = np.zeros(n), np.zeros(n), np.zeros(n)
    zs = []
    for x in xs:
        i = alpha_syn * i + x + (0 if w_h is None else z @ w_h)
        v = v - z * (v_th - v_reset) if reset == "soft" else v + z * (v_reset - v)
        v = alpha * v + i
        z = (v - v_th > 0).astype(float)
        zs.append(z)
    return np.array(zs), v, i


@pytest.mark.parametrize("reset", ["soft", "hard"])
def test_if_and_cuba_lif_step_as_plain_references(reset):
    xs = np.random.default_rng(0).uniform(-0.2, 0.7, (12, 3))
    kw = {"v_th": 1.0, "v_reset": 0.1, "reset": reset}
    neuron = layers.IF(3, **kw)
    z_ref, v_ref, _ = _lif_reference(xs, 1.0, 0.0, **kw)
    np.testing.assert_array_equal(_run(neuron, jnp.asarray(xs)), z_ref)
    np.testing.assert_allclose(neuron.v[...], v_ref, rtol=1e-5)
    cuba = layers.CuBaLIF(3, tau=8.0, tau_syn=3.0, **kw)
    z_ref, v_ref, i_ref = _lif_reference(xs, math.exp(-1 / 8), math.exp(-1 / 3), **kw)
    z = _run(cuba, jnp.asarray(xs))
    np.testing.assert_array_equal(z, z_ref)
    np.testing.assert_allclose(cuba.v[...], v_ref, rtol=1e-5)
    np.testing.assert_allclose(cuba.i[...], i_ref, rtol=1e-5)
    assert 0 < z.sum() < z.size  # the reference is not trivially silent or saturated


@pytest.mark.parametrize("neuron", ["if", "cuba"])
def test_recurrent_if_and_cuba_lif_feed_their_spikes_into_the_current(neuron):
    alpha, alpha_syn = (1.0, 0.0) if neuron == "if" else (math.exp(-1 / 8), math.exp(-1 / 3))
    cell = layers.IF(3) if neuron == "if" else layers.CuBaLIF(3, tau=8.0, tau_syn=3.0)
    layer = layers.RecurrentSpiking(2, cell, use_bias=False, rngs=nnx.Rngs(0))
    w_i = np.array([[0.9, 0.5, 0.3], [0.2, 0.6, 0.8]], np.float32)
    w_h = np.array([[0.0, -0.5, 0.7], [0.6, 0.0, -0.4], [-0.3, 0.5, 0.0]], np.float32)
    layer.dense_i.kernel[...] = w_i
    layer.dense_h.kernel[...] = w_h
    xs = np.random.default_rng(1).uniform(0.0, 1.0, (10, 2))
    z_ref, _, _ = _lif_reference(xs @ w_i, alpha, alpha_syn, 1.0, 0.0, "soft", w_h)
    np.testing.assert_allclose(_run(layer, jnp.asarray(xs)), z_ref)
    assert 0 < z_ref.sum() < z_ref.size


def test_a_cuba_lif_layer_is_one_group_of_two_states_per_neuron_and_its_count_a_third():
    def graph(readout):
        neuron = layers.CuBaLIF(4, learn_tau_syn=True)
        net = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), neuron, *readout)
        return braintrace.compile_graph(net, jnp.ones(3))

    report = graph(()).report()
    assert "hidden groups (1): `layers.1` (CuBaLIF): i and v (4,)" in report
    assert "approximations: none" in report and "layers.1.tau_syn.weight" in report
    assert "layers.1.i, layers.1.v  shape=(4,)  S=2  of `layers.1` (CuBaLIF)" in graph(
        ()).report(verbose=True)
    counted = graph((layers.SumOverTime(4),))
    assert "layers.1.i, layers.1.v, layers.2.c  shape=(4,)  S=3" in counted.report(verbose=True)
    assert ("hidden groups (1): `layers.1` (CuBaLIF): i and v, with `layers.2` (SumOverTime): "
            "c (4,)") in counted.report()  # each state under its own module
    # OTPE's signal on the new state holds the current's path into the membrane, as its traces
    # do: strict refuses it, naming the path (test_gradient_contract: it really differs)
    [otpe] = braintrace.OTPE(0.5).approximations(graph(()))
    assert ("hidden state `layers.1.v` of `layers.1` (CuBaLIF) is computed from that of hidden "
            "state `layers.1.i`") in otpe.detail


@pytest.mark.parametrize("neuron", [layers.IF, layers.CuBaLIF])
def test_nir_export_refuses_a_recurrent_layer_of_if_or_cuba_lif_neurons(neuron):
    from braintrace.nir import to_nir

    model = nnx.Sequential(layers.RecurrentSpiking(3, neuron(4, reset="hard"), rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=rf"'layers.0.neuron' is {neuron.__name__}, which has no"):
        to_nir(model, (3,), dt=1.0)  # not a NIR LIF: no leak, or a synaptic current


# -- surrogates given as functions -----------------------------------------------------------


def gaussian(x):
    return jnp.exp(-x ** 2)


@jax.custom_jvp
def own_spike(x):
    return (x > 0).astype(x.dtype)


own_spike.defjvp(lambda p, t: (own_spike(p[0]), t[0] * 3.0 / (1.0 + jnp.abs(p[0]))))


@jax.custom_gradient
def spyx_like(x):  # spyx.axn.custom(bwd, fwd): a custom_vjp, which spyx wraps in jax.jit
    return (x > 0).astype(x.dtype), lambda g: g * 0.5


POINTS = jnp.array([-1.5, -0.2, 0.0, 0.3, 2.0])


@pytest.mark.parametrize(("surrogate", "derivative"), [
    (gaussian, lambda x: np.exp(-x ** 2)),
    (own_spike, lambda x: 3.0 / (1.0 + np.abs(x))),
    (jax.jit(spyx_like), lambda x: np.full_like(x, 0.5)),
], ids=["derivative", "custom_jvp-spike", "spyx-activation"])
def test_a_surrogate_given_as_a_function_keeps_the_step_and_gives_its_derivative(surrogate,
                                                                                 derivative):
    np.testing.assert_array_equal(layers.spike(POINTS, surrogate), [0, 0, 0, 1, 1])
    grads = jax.vmap(jax.grad(lambda x: layers.spike(x, surrogate)))(POINTS)
    np.testing.assert_allclose(grads, derivative(np.asarray(POINTS)), rtol=1e-6)
    graphdef, state = nnx.split(layers.LIF(5, v_th=0.5, surrogate=surrogate))  # a neuron too
    dv = jax.grad(lambda x: nnx.merge(graphdef, state, copy=True)(x).sum())(POINTS + 0.5)
    np.testing.assert_allclose(dv, derivative(np.asarray(POINTS)), rtol=1e-6)


def test_a_plain_spike_function_or_a_sharpness_for_a_function_is_refused():
    with pytest.raises(ValueError, match="as a spike function does.*jax.custom_jvp"):
        layers.CuBaLIF(3, surrogate=lambda x: (x > 0).astype(x.dtype))
    with pytest.raises(ValueError, match="alpha=2.0 sets the sharpness of a named surrogate"):
        layers.spike(POINTS, gaussian, 2.0)
    with pytest.raises(TypeError, match="surrogate must be a name"):
        layers.IF(3, surrogate=3)
    with pytest.raises(ValueError, match="unknown surrogate 'gauss'.*'tanh', 'boxcar'"):
        layers.IF(3, surrogate="gauss")


# -- readouts over time, losses and metrics ----------------------------------------------------

B, I, H, O, T = 3, 3, 4, 3, 7
LENGTHS = jnp.array([7, 4, 6])
LABELS = jnp.array([2, 0, 1])


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _data(scale=2.0):
    return scale * jax.random.uniform(jax.random.key(3), (T, B, I), F64)


def _sequence_loss_grads(model, readout, xs, reduce):
    """``∇ (1/B) Σ_b CE(reduce_{t < len_b} readout_t)``, straight from the unrolled outputs
    (a per-sample mask's ``'sum'`` is over time; over the batch, a mean)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        def body(rest, x):
            m = nnx.merge(graphdef, params, rest, copy=True)
            out = readout(m, x)
            return nnx.split(m, nnx.Param, ...)[2], out

        outs = jax.lax.scan(body, rest, xs)[1]                      # (T, B, O)
        valid = (jnp.arange(T)[:, None] < LENGTHS[None, :])[..., None]
        logits = reduce(jnp.where(valid, outs, reduce.fill), axis=0)
        return tasks.cross_entropy(logits, LABELS)

    return jax.grad(loss)(params)


def _count_model():
    return nnx.Sequential(
        layers.ETPLinear(I, O, param_dtype=F64, rngs=nnx.Rngs(1)),
        layers.CuBaLIF(O, tau=4.0, tau_syn=2.0, v_th=0.4, learn_tau=True, param_dtype=F64),
        layers.SumOverTime(O, param_dtype=F64))


def _max_model():
    return nnx.Sequential(
        layers.LeakyReadout(I, O, tau=3.0, learn_tau=True, param_dtype=F64, rngs=nnx.Rngs(2)),
        layers.MaxOverTime(O, param_dtype=F64))


SUM = functools.partial(jnp.sum)
SUM.fill = 0.0
MAX = functools.partial(jnp.max)
MAX.fill = -jnp.inf


@pytest.mark.parametrize(("make", "reduce"), [(_count_model, SUM), (_max_model, MAX)],
                         ids=["spike-count", "max-membrane"])
def test_a_readout_scored_at_each_samples_last_step_is_the_sequence_loss_learned_exactly(
        x64, make, reduce):
    xs = _data()
    model = make()
    braintrace.init_states(model, B)
    # the oracle: the sequence loss of the outputs before the accumulator (spikes, membrane)
    want = _sequence_loss_grads(model, lambda m, x: m.layers[1](m.layers[0](x)), xs, reduce)
    assert_live(want)
    learner = braintrace.compile(model, braintrace.DRTRL(), xs[0], strict=True)
    ys = jnp.broadcast_to(LABELS, (T, B))
    got = learner.etrace_grad(xs, ys, tasks.cross_entropy, mask=tasks.last_step_mask(LENGTHS, T),
                              reduction="sum")
    assert max(rel_errors(got, want).values()) <= 1e-10


def test_cross_entropy_and_the_last_step_mask_against_numpy():
    logits = np.random.default_rng(2).normal(size=(4, 3))
    labels = np.array([0, 2, 1, 2])
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for eps in (0.0, 0.3):
        q = (1 - eps) * np.eye(3)[labels] + eps / 3
        np.testing.assert_allclose(
            tasks.cross_entropy(jnp.asarray(logits), jnp.asarray(labels), label_smoothing=eps),
            -(q * log_p).sum(-1).mean(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"labels of shape \(4, 1\) do not fit"):
        tasks.cross_entropy(jnp.asarray(logits), jnp.asarray(labels)[:, None])
    mask = np.zeros((T, B))
    mask[np.asarray(LENGTHS) - 1, np.arange(B)] = 1
    np.testing.assert_array_equal(tasks.last_step_mask(LENGTHS, T), mask)


def test_accuracy_reads_each_sample_at_its_own_scored_steps():
    rng = np.random.default_rng(4)
    outputs = rng.normal(size=(T, 5, O))
    labels = rng.integers(0, O, size=(T, 5))
    mask = (rng.uniform(size=(T, 5)) < 0.4).astype(np.float32)
    mask[:, 4] = 0  # a sample never scored
    outputs[mask == 0] = np.nan  # never read
    counted = [b for b in range(5) if mask[:, b].any()]
    right = [np.argmax(np.nansum(mask[:, b, None] * np.nan_to_num(outputs[:, b]), axis=0))
             == labels[np.flatnonzero(mask[:, b])[-1], b] for b in counted]
    batch = tasks.Batch(jnp.zeros((T, 5, 1)), jnp.asarray(labels), jnp.asarray(mask))
    assert float(tasks.accuracy(jnp.asarray(outputs), batch)) == pytest.approx(np.mean(right))


# -- activity regularisers ---------------------------------------------------------------------


def test_the_penalties_are_their_formulas():
    a = np.random.default_rng(5).uniform(0, 1, (6, 5))
    mean = a.mean(-1)
    np.testing.assert_allclose(tasks.firing_rate_penalty(jnp.asarray(a), 0.3),
                               np.mean((mean - 0.3) ** 2), rtol=1e-6)
    np.testing.assert_allclose(tasks.silent_neuron_penalty(jnp.asarray(a), 0.4),
                               np.mean(np.maximum(0, 0.4 - a) ** 2), rtol=1e-6)
    np.testing.assert_allclose(tasks.overactivity_penalty(jnp.asarray(a), 0.45),
                               np.mean(np.maximum(0, mean - 0.45) ** 2), rtol=1e-6)
    assert float(tasks.overactivity_penalty(jnp.asarray(a), 0.45)) > 0  # both branches met
    with pytest.raises(ValueError, match="activity must be a floating array"):
        tasks.silent_neuron_penalty(jnp.ones((2, 3), jnp.int32), 1.0)


class Regularised(nnx.Module):
    """A CuBaLIF hidden layer and a memoryless readout; returns the logits, the hidden
    spikes and their counts so far."""

    def __init__(self):
        self.inp = layers.ETPLinear(I, H, param_dtype=F64, rngs=nnx.Rngs(5))
        self.hidden = layers.CuBaLIF(H, tau=4.0, tau_syn=2.0, v_th=0.4, param_dtype=F64)
        self.count = layers.SumOverTime(H, param_dtype=F64)
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=nnx.Rngs(6))

    def __call__(self, x):
        z = self.hidden(self.inp(x))
        return self.out(z), z, self.count(z)


def _every_step(y, label, strength):
    return (tasks.cross_entropy(y[0], label)
            + strength * tasks.firing_rate_penalty(y[1], 0.3))


def _at_the_end(y, label, strength):
    rates = y[2] / T
    return (tasks.cross_entropy(y[0], label) + strength * (
        tasks.silent_neuron_penalty(rates, 0.4) + tasks.overactivity_penalty(rates, 0.1)))


@pytest.mark.parametrize(("penalised", "scored"), [
    (_every_step, np.ones(T)), (_at_the_end, np.arange(T) == T - 1)],
    ids=["per-step-spikes", "counts-at-the-last-step"])
def test_d_rtrl_learns_a_regularised_loss_as_bptt_does(x64, penalised, scored):
    xs, ys, weights = _data(), jnp.broadcast_to(LABELS, (T, B)), jnp.asarray(scored, F64)
    model = Regularised()
    braintrace.init_states(model, B)
    learner = braintrace.compile(model, braintrace.DRTRL(), xs[0], strict=True)
    grads = {}
    for strength in (0.0, 5.0):
        loss = functools.partial(penalised, strength=strength)
        learner.reset()  # the hidden state from the start (the last call advanced it)
        want = bptt_grads(model, xs, ys, weights, loss_fn=loss)
        grads[strength] = learner.etrace_grad(xs, ys, loss, mask=weights, reduction="sum")
        assert max(rel_errors(grads[strength], want).values()) <= 1e-8
    assert_live(grads[5.0])
    share = rel_errors(grads[0.0], grads[5.0])  # the penalty reaches the hidden layer
    assert share["inp/kernel/value"] > 1e-3


# -- encoders ----------------------------------------------------------------------------------


def _within_binomial(spikes, p, steps):
    """Each input's spike frequency within 5 binomial standard deviations of ``p``."""
    sigma = np.sqrt(np.maximum(p * (1 - p), 1e-12) / steps)
    assert np.all(np.abs(np.asarray(spikes).mean(0) - p) <= 5 * sigma + 1e-12)


def test_rate_and_poisson_encoders_fire_at_their_probabilities():
    x = jnp.array([[-0.5, 0.0, 0.1], [0.35, 0.9, 2.0]])
    steps = 3000
    rate = jax.jit(tasks.rate_encode, static_argnums=2, static_argnames="gain")
    spikes = rate(jax.random.key(0), x, steps, gain=1.5)
    assert spikes.shape == (steps, 2, 3) and spikes.dtype == jnp.float32
    assert set(np.unique(spikes)) <= {0.0, 1.0}
    _within_binomial(spikes, np.clip(1.5 * np.asarray(x), 0, 1), steps)
    np.testing.assert_array_equal(rate(jax.random.key(0), x, steps, gain=1.5), spikes)
    assert not np.array_equal(rate(jax.random.key(1), x, steps, gain=1.5), spikes)
    rates = jnp.array([0.0, 20.0, 300.0])
    poisson = tasks.poisson_encode(jax.random.key(2), rates, steps, dt=1e-3)
    _within_binomial(poisson, 1 - np.exp(-np.asarray(rates) * 1e-3), steps)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        tasks.rate_encode(jax.random.key(0), x, 0)


def _latency_reference(x, steps, method, tau, threshold):
    out = np.zeros((steps, *x.shape), np.float32)
    for idx, v in np.ndenumerate(x):
        if v <= threshold:
            continue
        t = (round((1 - min(max(v, 0), 1)) * (steps - 1)) if method == "linear"
             else round(tau * math.log(v / (v - threshold))))
        if t < steps:
            out[(t, *idx)] = 1
    return out


@pytest.mark.parametrize(("method", "tau", "threshold"),
                         [("linear", 1.0, 0.0), ("linear", 1.0, 0.3), ("log", 4.0, 0.2)])
def test_latency_encoder_against_numpy(method, tau, threshold):
    x = np.random.default_rng(6).uniform(-0.1, 1.1, (5, 4)).astype(np.float32)
    got = tasks.latency_encode(jnp.asarray(x), 9, method=method, tau=tau, threshold=threshold)
    np.testing.assert_array_equal(got, _latency_reference(x, 9, method, tau, threshold))
    assert 0 < got.sum() < x.size  # some fire, some never do
    with pytest.raises(ValueError, match="method must be 'linear' or 'log'"):
        tasks.latency_encode(jnp.asarray(x), 9, method="exp")


def test_delta_encoder_against_numpy_and_its_reconstruction():
    rng = np.random.default_rng(7)
    x = np.cumsum(rng.normal(0, 0.3, (40, 3)), axis=0).astype(np.float32)
    theta = 0.4
    reference, want = np.zeros(3, np.float32), []
    for x_t in x:
        s = (x_t - reference >= theta).astype(np.float32) - (x_t - reference <= -theta)
        reference = reference + np.float32(theta) * s
        want.append(s)
    events = jax.jit(tasks.delta_encode, static_argnums=1)(jnp.asarray(x), theta)
    np.testing.assert_array_equal(events, np.array(want))
    split = tasks.delta_encode(jnp.asarray(x), theta, two_channels=True)
    np.testing.assert_array_equal(split[..., :3] - split[..., 3:], events)
    slow = np.sin(np.linspace(0, 6, 200))[:, None].astype(np.float32)  # moves < θ per step
    rebuilt = 0.1 * np.cumsum(tasks.delta_encode(jnp.asarray(slow), 0.1), axis=0)
    assert np.max(np.abs(rebuilt - slow)) < 0.1 + 1e-6
