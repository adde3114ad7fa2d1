"""ES-D-RTRL (pp_prop) and e-prop's random feedback (float64).

* ES-D-RTRL: the rank ↔ decay mapping; its update equals an independent
  implementation of the equations (separate α for the x and f sides, bias
  correction ``c_t = 1 - α_f^t``); a bias learns exactly like a weight row fed
  by a constant 1; trace sizes are ``O(B·(I + O·S))``; on a GRU and a
  recurrent ALIF network its gradient is direction-aligned with BPTT, with
  negative controls showing the threshold can fail.
* EProp(feedback='random'): the signal is e-prop's ``B e`` through the exact
  local derivatives, the readout keeps its exact gradient, it is deterministic
  per seed, and windowed mode rejects it.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_models as S

import braintrace
from braintrace._algorithms import get_algorithm
from braintrace._algorithms._eprop import feedback_equations, random_feedback_operands
from braintrace._algorithms._es_d_rtrl import (
    IOTerm,
    IOTrace,
    decay_from,
    es_input_rule,
    x_free_part,
)
from braintrace._compiler import StepLeaves, programs, split_model


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# -- ES-D-RTRL -----------------------------------------------------------------------------


def test_rank_decay_mapping():
    assert [decay_from(r) for r in (1, 2, 3, 7)] == [0.0, 1 / 3, 0.5, 0.75]
    assert decay_from(0.9) == 0.9 and decay_from(0.0) == 0.0
    alg = braintrace.ES_D_RTRL(3, x_decay_or_rank=0.2)
    assert (alg.f_decay, alg.x_decay) == (0.5, 0.2)
    alg = braintrace.pp_prop(7)
    assert isinstance(alg, braintrace.ES_D_RTRL) and (alg.f_decay, alg.x_decay) == (0.75, 0.75)
    assert type(get_algorithm("pp_prop")) is braintrace.ES_D_RTRL
    assert braintrace.OSTLFeedforward().f_decay == braintrace.OSTLFeedforward().x_decay == 0.0
    for bad, error in [(0, ValueError), (-2, ValueError), (1.0, ValueError), (-0.1, ValueError),
                       (True, TypeError)]:
        with pytest.raises(error):
            decay_from(bad)


def _es_reference(model, xs, ys, a_f, a_x):
    """The ES-D-RTRL equations, written out for ``h' = a ⊙ h + x W + b`` (``D = a``, ``Df = 1``).

    Per step: the exact same-step gradient plus ``∂L_t/∂h^{t-1} = a δ^t`` contracted with
    the previous traces ``ε_x^{t-1} ⊗ ε_f^{t-1} / c_{t-1}``.
    """
    a, w, b, wo = model.a, model.w[...], model.b[...], model.wo[...]
    h = model.h[...]
    eps_x = jnp.zeros_like(xs[0])
    eps_1 = 0.0
    eps_f = jnp.zeros_like(h)
    grads = {"w": jnp.zeros_like(w), "b": jnp.zeros_like(b), "wo": jnp.zeros_like(wo)}
    for t in range(xs.shape[0]):
        h = a * h + xs[t] @ w + b
        step_loss = lambda h, wo, y=ys[t]: S.mse(jnp.tanh(h) @ wo, y)
        delta, d_wo = jax.grad(step_loss, argnums=(0, 1))(h, wo)
        grads["w"] += jnp.einsum("bi,bh->ih", xs[t], delta)
        grads["b"] += jnp.sum(delta, axis=0)
        if t > 0:
            signal = eps_f * (a * delta) / (1.0 - a_f ** t)
            grads["w"] += jnp.einsum("bi,bh->ih", eps_x, signal)
            grads["b"] += eps_1 * jnp.sum(signal, axis=0)
        grads["wo"] += d_wo
        eps_x = a_x * eps_x + xs[t]
        eps_1 = a_x * eps_1 + 1.0
        eps_f = a_f * a * eps_f + (1.0 - a_f)
    return grads


def test_es_d_rtrl_follows_its_equations():
    """Separate α_x, α_f and the bias correction, against a hand-written loop."""
    xs, ys = S.data(6, 2)
    model = S.randomize_hidden(S.DenseLeaky(2, 1))
    want = _es_reference(model, xs, ys, a_f=0.6, a_x=0.3)
    got = S.leaves(S.online_grads(model, braintrace.ES_D_RTRL(0.6, x_decay_or_rank=0.3), xs, ys))
    for key in ("w", "b", "wo"):
        np.testing.assert_allclose(got[f"{key}/value"], want[key], rtol=1e-10, atol=1e-12)
    # the approximation is real here: this is not the BPTT gradient
    bptt = S.leaves(S.bptt_grads(S.randomize_hidden(S.DenseLeaky(2, 1)), xs, ys))
    assert np.max(np.abs(bptt["w/value"] - want["w"])) > 1e-2 * np.max(np.abs(want["w"]))


def _products_of_shape(shape: tuple[int, ...], fn, *args) -> int:
    """Products with a ``shape`` result in the program XLA compiles for ``fn`` (after its
    dead-code elimination)."""
    dims = ",".join(map(str, shape))
    pattern = rf"= f(32|64)\[{dims}\]\{{[0-9,]*\}} dot\("
    return len(re.findall(pattern, jax.jit(fn).lower(*args).compile().as_text()))


def test_the_bias_correction_forms_no_product_with_zeros():
    """ES-D-RTRL's ``finalize`` maps the bias signal ``Σ_t (ε_1 - 1)·d`` through the x-free
    part of a dense layer's ``xy_to_dw``, the bias's ``Σ d``: no kernel product with
    ``x = 0`` is compiled (XLA would compute it, once per update in ``OnlineTrainer``).
    Negative control: the whole rule at ``x = 0`` has that product."""
    from flax import nnx

    from braintrace import layers
    model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
    braintrace.init_states(model, 2)
    graph = braintrace.compile_graph(model, jnp.ones((2, 3)))
    (r,) = graph.input_relations
    theta = programs.operands(graph, jax.tree.leaves(split_model(model)[1]))[r.index]
    xy_to_dw = r.primitive.rule("xy_to_dw")
    d = jax.random.normal(jax.random.key(0), (2, 4))
    part = x_free_part(xy_to_dw, r.x_shape, d, theta, r.params)
    whole = xy_to_dw(jnp.zeros(r.x_shape), d, theta, **r.params)
    assert set(part) == {"bias"} and set(whole) == {"kernel", "bias"}
    np.testing.assert_allclose(part["bias"], whole["bias"], rtol=1e-15)
    np.testing.assert_allclose(part["bias"], d.sum(0), rtol=1e-12)
    kernel = theta["kernel"].shape
    grad = {"kernel": jnp.ones(kernel), "bias": jnp.ones(4)}
    finalize = lambda d: es_input_rule(0.5, 0.5).finalize(r, IOTerm(grad, d), theta)
    np.testing.assert_allclose(finalize(d)["bias"], 1.0 + d.sum(0), rtol=1e-12)
    np.testing.assert_array_equal(finalize(d)["kernel"], grad["kernel"])
    assert _products_of_shape(kernel, finalize, d) == 0
    whole = lambda d: xy_to_dw(jnp.zeros(r.x_shape), d, theta, **r.params)
    assert _products_of_shape(kernel, whole, d) == 1


def test_x_free_part_leaves_out_every_entry_computed_from_x():
    """An entry that reads ``x`` is left out even where it is not zero at ``x = 0``; one
    that does not, and a constant, are kept."""
    rule = lambda x, d, theta: {"bias": d.sum(0), "kernel": x.T @ d, "shifted": (x + 1.0).sum() * d,
                         "constant": jnp.ones(3)}
    part = x_free_part(rule, (2, 3), jnp.ones((2, 3)), {}, {})
    assert set(part) == {"bias", "constant"}
    np.testing.assert_array_equal(part["bias"], [2.0, 2.0, 2.0])


@pytest.mark.parametrize("algorithm", [
    braintrace.ES_D_RTRL(0.7, x_decay_or_rank=0.4), braintrace.pp_prop(3), braintrace.EProp(0.5),
], ids=["es_d_rtrl-0.7-x0.4", "pp_prop-rank3", "eprop-0.5"])
def test_bias_learns_like_a_weight_row_fed_by_one(algorithm):
    """Same model with ``b``, or with ``x`` augmented by a 1 column and ``b`` as the last row."""
    xs, ys = S.data(8, 2)
    with_bias = S.randomize_hidden(S.DenseLeaky(2, 1))
    w_aug = jnp.concatenate([with_bias.w[...], with_bias.b[...][None]], axis=0)
    augmented = S.randomize_hidden(S.DenseLeaky(2, 1, bias=False, w=w_aug, in_features=S.I + 1))
    xs_aug = jnp.concatenate([xs, jnp.ones((*xs.shape[:-1], 1))], axis=-1)
    got = S.leaves(S.online_grads(with_bias, algorithm, xs, ys))
    row = S.leaves(S.online_grads(augmented, algorithm, xs_aug, ys))
    np.testing.assert_allclose(got["b/value"], row["w/value"][-1], rtol=1e-10)
    np.testing.assert_allclose(got["w/value"], row["w/value"][:-1], rtol=1e-10)
    np.testing.assert_allclose(got["wo/value"], row["wo/value"], rtol=1e-10)


@pytest.mark.parametrize("make, num_states", [(S.GRUNet, 1), (S.RecurrentSNN, 2)],
                         ids=["gru", "recurrent-alif"])
def test_es_d_rtrl_trace_sizes_are_linear_in_neurons(make, num_states):
    batch = 3
    model = make()
    braintrace.init_states(model, batch)
    x = jnp.ones((batch, S.I))
    learner = braintrace.compile(model, braintrace.ES_D_RTRL(), x)
    graph = learner.graph
    expected = 0
    for r, state in zip(graph.relations, learner.traces):
        assert graph.groups[r.group].num_states == num_states
        if r.has_input:
            assert isinstance(state, IOTrace)
            (b, i), (b2, o) = r.x_shape, r.y_shape
            assert b == b2 == batch
            assert state.x.shape == (batch, i)
            assert state.ones.shape == ()
            if learner.rules.leader(r.index) is not None:  # ε_f is its leader's
                assert state.f is None and state.f_power is None
                expected += batch * i + 1
                continue
            assert state.f.shape == (batch, o, num_states)
            assert state.f_power.shape == ()
            expected += batch * (i + o * num_states) + 2
        else:  # elementwise (time constant): its trace is shaped like the hidden group
            (leaf,) = jax.tree.leaves(state)
            assert leaf.shape == (*graph.groups[r.group].shape, num_states)
            expected += leaf.size
    es_size = sum(leaf.size for leaf in jax.tree.leaves(learner.traces))
    assert es_size == expected
    d_rtrl = braintrace.compile(make(), braintrace.D_RTRL(), jnp.ones(S.I))  # per sample
    per_sample_d_rtrl = sum(leaf.size for leaf in jax.tree.leaves(d_rtrl.traces))
    assert es_size < batch * per_sample_d_rtrl


def _traced_cosine(a, b):
    """Cosine over the traced Params (the readout ``out`` learns exactly by same-step gradients)."""
    la, lb = S.leaves(a), S.leaves(b)
    keys = sorted(k for k in la if not k.startswith("out/"))
    return S.cosine(np.concatenate([la[k].ravel() for k in keys]),
                    np.concatenate([lb[k].ravel() for k in keys]))


def _batched(make, batch, scale=0.5):
    model = make()
    braintrace.init_states(model, batch)
    return S.randomize_hidden(model, scale=scale)


# measured cosines with BPTT over traced Params (T = 20, B = 3):
#   GRU: ES-D-RTRL 0.958; time-reversed targets 0.775; time-shuffled inputs 0.658
#   recurrent LIF: ES-D-RTRL 0.986; time-reversed targets -0.208; time-shuffled inputs 0.555
#   recurrent ALIF: ES-D-RTRL 0.990; time-reversed targets 0.375; time-shuffled inputs -0.141
@pytest.mark.parametrize("make, input_scale, threshold", [
    (S.GRUNet, 1.0, 0.90),
    (functools.partial(S.RecurrentSNN, neuron="lif"), 2.0, 0.92),
    (S.RecurrentSNN, 2.0, 0.95),
], ids=["gru", "recurrent-lif", "recurrent-alif"])
def test_es_d_rtrl_direction_aligned_with_bptt(make, input_scale, threshold):
    xs, ys = S.data(20, 3, scale=input_scale)
    ys = 3.0 * ys  # targets dominate the error, so a wrong signal points elsewhere
    want = S.bptt_grads(_batched(make, 3), xs, ys)
    S.assert_live(want)
    runner = S.Runner(_batched(make, 3), braintrace.ES_D_RTRL(), xs[0])
    assert _traced_cosine(runner.grads(xs, ys), want) >= threshold
    # negative controls, same algorithm and threshold: a wrong learning signal fails the check
    assert _traced_cosine(runner.grads(xs, ys[::-1]), want) < threshold
    shuffled = xs[jax.random.permutation(jax.random.key(3), xs.shape[0])]
    assert _traced_cosine(runner.grads(shuffled, ys), want) < threshold


# -- e-prop with random feedback -------------------------------------------------------------


def _step_inputs(learner, x):
    _, params, hidden, other = split_model(learner.model)
    return jax.tree.leaves(params), jax.tree.leaves(hidden), jax.tree.leaves(other), [x]


def test_feedback_is_exact_with_real_weights_and_random_otherwise():
    xs, ys = S.data(1, 3)
    model = _batched(S.GRUNet, 3)
    learner = braintrace.compile(model, braintrace.EProp(feedback="random"), xs[0])
    graph = learner.graph
    params, hidden, other, x = _step_inputs(learner, xs[0])

    def step_gradients(feedback):
        def loss(params, hidden):
            out = programs.forward(graph, StepLeaves(params, hidden, other, x), feedback)[0].y
            return S.mse(jax.tree.unflatten(graph.out_treedef, out), ys[0])
        return jax.grad(loss, argnums=(0, 1))(params, hidden)

    exact_params, exact_signal = step_gradients(None)
    # only the readout reads the new hidden state (not dense_i / dense_h, which read x, h^{t-1})
    (readout,) = feedback_equations(graph)
    index = graph.param_paths.index("out.kernel")
    kernel = params[index]
    real_params, real_signal = step_gradients({readout: {1: kernel}})
    np.testing.assert_allclose(real_signal[0], exact_signal[0], rtol=1e-12)
    for got, want in zip(real_params, exact_params):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    operands = random_feedback_operands(graph, seed=0)
    assert set(operands) == {readout} and operands[readout][1].shape == kernel.shape
    random_params, random_signal = step_gradients(operands)
    assert S.cosine(np.ravel(random_signal[0]), np.ravel(exact_signal[0])) < 0.9
    np.testing.assert_allclose(random_params[index], exact_params[index], rtol=1e-12)


def test_random_feedback_is_eprop_learning_signal_on_leaky_model():
    """``L^t = (1 - tanh²h^t) ⊙ (e^t Bᵀ)``, ``e^t = ∂L_t/∂y^t``: the same-step term
    ``L^t ⊗ x^t`` plus ``(a L^t)·ē^{t-1}`` with filtered D-RTRL traces
    ``ē^t = κ ē^{t-1} + ε^t``; exact readout."""
    kappa = 0.4
    xs, ys = S.data(6, 2)
    model = S.randomize_hidden(S.DenseLeaky(2, 1))
    a, w, b, wo, h = model.a, model.w[...], model.b[...], model.wo[...], model.h[...]
    bptt = S.leaves(S.bptt_grads(model, xs, ys))
    learner = braintrace.compile(model, braintrace.EProp(kappa, feedback="random", seed=3),
                                 xs[0])
    (readout,) = feedback_equations(learner.graph)
    fb = random_feedback_operands(learner.graph, seed=3)[readout][1]
    assert fb.shape == wo.shape and not np.allclose(fb, wo)
    got = S.leaves(learner.etrace_grad(xs, ys, S.mse, reduction="sum"))

    eps_w, eps_b = jnp.zeros((2, *w.shape)), jnp.zeros((2, *b.shape))
    bar_w, bar_b = eps_w, eps_b
    want_w, want_b = jnp.zeros_like(w), jnp.zeros_like(b)
    for t in range(xs.shape[0]):
        h = a * h + xs[t] @ w + b
        error = jax.grad(S.mse)(jnp.tanh(h) @ wo, ys[t])
        signal = (1.0 - jnp.tanh(h) ** 2) * (error @ fb.T)
        want_w += jnp.einsum("bi,bh->ih", xs[t], signal)
        want_w += jnp.einsum("bih,bh->ih", a * bar_w, signal)
        want_b += jnp.sum(signal, axis=0) + jnp.sum(a * bar_b * signal, axis=0)
        eps_w = a * eps_w + xs[t][:, :, None]
        eps_b = a * eps_b + 1.0
        bar_w, bar_b = kappa * bar_w + eps_w, kappa * bar_b + eps_b
    np.testing.assert_allclose(got["w/value"], want_w, rtol=1e-10)
    np.testing.assert_allclose(got["b/value"], want_b, rtol=1e-10)
    np.testing.assert_allclose(got["wo/value"], bptt["wo/value"], rtol=1e-10)  # exact readout
    assert np.max(np.abs(got["w/value"] - bptt["w/value"])) > 1e-2 * np.max(np.abs(want_w))


def test_random_feedback_is_deterministic_per_seed():
    xs, ys = S.data(5, 3, scale=2.0)
    runs = []
    for seed in (0, 1):
        runner = S.Runner(_batched(S.RecurrentSNN, 3, 1.5),
                          braintrace.EProp(0.3, feedback="random", seed=seed), xs[0])
        runs.append([S.leaves(runner.grads(xs, ys)) for _ in range(1 + (seed == 0))])
    (first, again), (other,) = runs
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert not np.allclose(first["rec/dense_i/kernel/value"], other["rec/dense_i/kernel/value"])
    np.testing.assert_allclose(first["out/kernel/value"], other["out/kernel/value"], rtol=1e-12)


def test_random_feedback_options_are_checked():
    with pytest.raises(ValueError, match="feedback"):
        braintrace.EProp(feedback="transposed")
    xs, ys = S.data(4, None)
    learner = braintrace.compile(S.DenseLeaky(), braintrace.EProp(feedback="random"), xs[0])
    with pytest.raises(ValueError, match="single-step"):
        learner.etrace_grad(xs, ys, S.mse, chunk_size=2)
