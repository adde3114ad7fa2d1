"""The fast learning signal (``signal='fast'``): ``∂L_t/∂h^t`` contracted with the updated traces.

Where the compiler proves it equal to the exact signal it is BPTT's gradient (float64, per step
and time-blocked) and runs by default; elsewhere (a GRU, two recurrent LIF layers) it differs,
``report()`` names it, ``strict=True`` refuses it, every Param still learns, and its direction
stays close to BPTT's (with a negative control). It also runs inside a user's ``nnx.jit`` train
step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference_models import (
    F64,
    DenseLeaky,
    ElemLeaky,
    GRUNet,
    SpikingFF,
    assert_live,
    bptt_grads,
    cosine,
    data,
    flat,
    leaves,
    mse,
    randomize_hidden,
    rel_errors,
)

import braintrace
from braintrace import layers
from braintrace._compiler import fast_signal_obstacles

B, T = 3, 10


def _algorithm(kind: str, signal: str):
    return (braintrace.DRTRL(signal=signal) if kind == "d_rtrl"
            else braintrace.ESDRTRL(0.5, signal=signal))


def _grads(model, algorithm, xs, ys, **kw):
    learner = braintrace.compile(model, algorithm, xs[0])
    return learner.etrace_grad(xs, ys, mse, reduction="sum", **kw), learner


class TwoLayerLIF(nnx.Module):
    """Two recurrent LIF layers (learnable τ) and a leaky readout, float64."""

    def __init__(self, seed=0, hidden=5):
        rngs = nnx.Rngs(seed)
        normal = nnx.initializers.normal
        self.l1 = layers.RecurrentSpiking(
            3, layers.LIF(hidden, tau=5.0, learn_tau=True, param_dtype=F64),
            kernel_init=normal(1.5), recurrent_kernel_init=normal(0.5), param_dtype=F64,
            rngs=rngs)
        self.l2 = layers.RecurrentSpiking(
            hidden, layers.LIF(hidden, tau=5.0, learn_tau=True, param_dtype=F64),
            kernel_init=normal(1.5), recurrent_kernel_init=normal(0.5), param_dtype=F64,
            rngs=rngs)
        self.readout = layers.LeakyReadout(hidden, 2, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.l2(self.l1(x)))


# -- (a) equal where the compiler says so --------------------------------------------------

EXACT_CASES = {
    "dense_leaky-d_rtrl": (lambda: DenseLeaky(batch=B), "d_rtrl", B),
    "lif-d_rtrl": (lambda: SpikingFF("lif"), "d_rtrl", None),
    "alif-d_rtrl": (lambda: SpikingFF("alif"), "d_rtrl", None),
    "elementwise_leaky-es_d_rtrl": (lambda: ElemLeaky(batch=B), "es_d_rtrl", B),
}


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_fast_signal_equals_exact_and_bptt_where_proven(case, block_size):
    make, kind, batch = EXACT_CASES[case]
    with jax.enable_x64(True):
        xs, ys = data(T, batch=batch, scale=2.0)
        model = randomize_hidden(make())
        assert fast_signal_obstacles(braintrace.compile_graph(model, xs[0])) == ()
        oracle = bptt_grads(model, xs, ys)
        assert_live(oracle)
        fast, learner = _grads(randomize_hidden(make()), _algorithm(kind, "fast"), xs, ys,
                               block_size=block_size)
        assert learner.rules.learning_signal.reads_new_state
        assert learner.algorithm.approximations(learner.graph) == ()
        # the exact signal by an independent path: windows of one step (∂L_t/∂h^{t-1}·ε^{t-1})
        exact, _ = _grads(randomize_hidden(make()), _algorithm(kind, "exact"), xs, ys,
                          chunk_size=1)
        for name, err in rel_errors(fast, oracle).items():
            assert err < 1e-10, (name, err)
        for name, err in rel_errors(fast, exact).items():
            assert err < 1e-10, (name, err)


def test_exact_signal_runs_the_fast_form_only_where_proven():
    with jax.enable_x64(True):
        xs, _ = data(T, batch=B)
        proven = braintrace.compile(DenseLeaky(batch=B), braintrace.DRTRL(), xs[0])
        not_proven = braintrace.compile(DenseLeaky(batch=B, num_states=2), braintrace.DRTRL(),
                                        xs[0])
    assert proven.rules.learning_signal.reads_new_state
    assert not not_proven.rules.learning_signal.reads_new_state
    kinds = [o.kind for o in fast_signal_obstacles(not_proven.graph)]
    assert kinds == ["new-from-new"]  # c' = 0.5 c + tanh(h') reads the new h'


def test_compiler_names_a_readout_of_the_previous_state():
    class PreviousReadout(nnx.Module):
        def __init__(self):
            self.inp = layers.ETPLinear(3, 4, rngs=nnx.Rngs(0))
            self.h = braintrace.HiddenState(jnp.zeros((4,)))

        def __call__(self, x):
            before = self.h[...]
            self.h[...] = 0.9 * before + self.inp(x)
            return jnp.tanh(before) + self.h[...]

    graph = braintrace.compile_graph(PreviousReadout(), jnp.ones((3,)))
    assert graph.approximations == ()
    obstacles = fast_signal_obstacles(graph)
    assert [o.kind for o in obstacles] == ["reads-before-update"]
    assert "'h' before the update" in obstacles[0].detail


# -- (b) an approximation elsewhere -----------------------------------------------------------

APPROX_CASES = {"gru": (GRUNet, 1.0), "two_layer_lif": (TwoLayerLIF, 2.0)}


@pytest.mark.parametrize("kind", ["d_rtrl", "es_d_rtrl"])
@pytest.mark.parametrize("case", sorted(APPROX_CASES))
def test_fast_signal_approximates_by_direction(case, kind):
    make, scale = APPROX_CASES[case]
    with jax.enable_x64(True):
        xs, ys = data(30, scale=scale)
        oracle = bptt_grads(make(), xs, ys)
        assert_live(oracle)
        fast, learner = _grads(make(), _algorithm(kind, "fast"), xs, ys)
        exact, _ = _grads(make(), _algorithm(kind, "exact"), xs, ys)
    assert learner.rules.learning_signal.reads_new_state
    assert max(rel_errors(fast, exact).values()) > 1e-3  # it is not the exact signal
    for name, value in leaves(fast).items():  # every Param learns (the GRU's Wr included)
        assert np.max(np.abs(value)) > 1e-8, name
    c_fast = cosine(fast, oracle)
    control = np.random.default_rng(0).permutation(flat(fast))
    c_control = cosine(control, flat(oracle))
    assert c_fast > 0.85, c_fast
    assert c_control < 0.5 < c_fast, (c_control, c_fast)


def test_gru_reset_gate_kernel_learns_under_the_fast_signal():
    with jax.enable_x64(True):
        xs, ys = data(20)
        fast, _ = _grads(GRUNet(), braintrace.ESDRTRL(signal="fast"), xs, ys)
    hidden = fast["rnn"]["cell"]["dense_h"]["kernel"][...]
    reset, update, candidate = np.split(np.asarray(hidden), 3, axis=-1)
    for gate in (reset, update, candidate):
        assert np.max(np.abs(gate)) > 1e-8


@pytest.mark.parametrize("kind", ["d_rtrl", "es_d_rtrl"])
def test_report_names_the_fast_signal_and_strict_refuses_it(kind):
    with jax.enable_x64(True):
        xs, _ = data(T, batch=B)
        learner = braintrace.compile(GRUNet(), _algorithm(kind, "fast"), xs[0, 0])
        assert "signal='fast'" in learner.report()
        assert "fast-signal" in [a.kind for a in learner.algorithm.approximations(learner.graph)]
        # a model the exact signal is strict-exact on: only the fast signal is refused
        model = DenseLeaky(batch=B, num_states=2)
        braintrace.compile(model, braintrace.DRTRL(), xs[0], strict=True)
        with pytest.raises(ValueError, match=r"signal='fast'.*new value of 'c'"):
            braintrace.compile(DenseLeaky(batch=B, num_states=2), braintrace.DRTRL(signal="fast"),
                               xs[0], strict=True)


def test_fast_signal_is_single_step_and_checks_its_argument():
    with jax.enable_x64(True):
        xs, ys = data(4)
        learner = braintrace.compile(GRUNet(), braintrace.DRTRL(signal="fast"), xs[0])
        with pytest.raises(ValueError, match="signal='fast'"):
            learner.etrace_grad(xs, ys, mse, chunk_size=2)
    with pytest.raises(ValueError, match="signal must be 'exact'"):
        braintrace.ESDRTRL(signal="approximate")


# -- (c) inside a user's train step -----------------------------------------------------------


def test_fast_signal_inside_an_nnx_jit_optax_train_step():
    model = nnx.Sequential(layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0))),
                           layers.ETPLinear(8, 2, rngs=nnx.Rngs(1)))
    xs = jax.random.normal(jax.random.key(0), (20, 4, 3))
    ys = jnp.sin(jnp.cumsum(xs[..., :2], axis=0))
    learner = braintrace.compile(model, braintrace.ESDRTRL(signal="fast"), xs[0], batch_size=4)
    online = braintrace.online_grad(learner, mse)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    state = online.init(model)
    expected = learner.etrace_grad(xs, ys, mse)  # the same start: the learner's own shell

    @nnx.jit
    def train_step(model, optimizer, state, xs, ys):
        grads, state, stats = online.grad(model, state, xs, ys)
        optimizer.update(model, grads)
        return grads, state, stats.losses

    grads, state, losses = train_step(model, optimizer, state, xs, ys)
    for name, err in rel_errors(grads, expected).items():
        assert err < 1e-5, (name, err)
    first = float(jnp.mean(losses))
    for _ in range(30):
        _, state, losses = train_step(model, optimizer, online.init(model), xs, ys)
    assert float(jnp.mean(losses)) < 0.9 * first
