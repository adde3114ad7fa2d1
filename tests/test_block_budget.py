"""The default block size (``block_size=None``) by a memory budget.

``K = clamp(⌊BLOCK_MEMORY_BUDGET / stacked bytes per step⌋, 2, 32)``
(``braintrace/_loops/_spec.py::default_block_size``): a small model keeps blocks
of 32 steps, a large network gets fewer, and whatever ``K`` it picks, the
gradients are the per-step form's (float64). Where the programs are a TPU's
(here ``formulation('pallas')``), a network without sparse relations also keeps
its blocks within ``BLOCK_SPEED_BUDGET`` (a power of two steps) where its traces
are small; one with a sparse relation, or large traces, keeps the memory budget
alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import ALGORITHMS, BATCH, IN, MODELS
from flax import nnx
from test_blocked import assert_same, data, mse

import braintrace
from braintrace import layers
from braintrace._loops import (
    BLOCK_MEMORY_BUDGET,
    BLOCK_SPEED_BUDGET,
    DEFAULT_BLOCK_SIZE,
    TRACE_BOUND_BLOCK_SIZE,
    TRACE_BOUND_RATIO,
    Blocked,
    PerStep,
    _spec,
    choose_loop,
    default_block_size,
)
from braintrace._loops._blocked import stacked_bytes_per_step
from braintrace._platform import formulation


@pytest.fixture
def x64():
    """The contract models are float64."""
    with jax.enable_x64(True):
        yield


def wide_network(neurons: int, algorithm: str, batch: int = 32, inputs: int = 8):
    """``ETPLinear(inputs -> neurons)`` into ``LIF(neurons)``, float32, ``batch`` samples."""
    model = nnx.Sequential(layers.ETPLinear(inputs, neurons, rngs=nnx.Rngs(0)),
                           layers.LIF(neurons))
    return braintrace.compile(model, algorithm, jnp.zeros((batch, inputs)), batch_size=batch)


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
@pytest.mark.parametrize("name", ["dense", "gru", "recurrent-lif-2-layers"])
def test_a_small_model_keeps_blocks_of_32(name, algorithm, x64):
    learner = braintrace.compile(MODELS[name].build(), ALGORITHMS[algorithm](),
                                 jnp.zeros((BATCH, IN)))
    assert default_block_size(learner.rules) == DEFAULT_BLOCK_SIZE == 32
    assert choose_loop(learner.rules, length=100) == Blocked(32)
    assert choose_loop(learner.rules, length=100, block_size=5) == Blocked(5)


def test_rules_without_a_blocked_form_stay_per_step(x64):
    learner = braintrace.compile(MODELS["dense"].build(), braintrace.EProp(feedback="random"),
                                 jnp.zeros((BATCH, IN)))
    assert choose_loop(learner.rules, length=100) == PerStep()


def test_a_large_network_gets_fewer_steps_per_block():
    """65,536 LIF neurons, batch 32, float32: every ``(B, N)`` value is 8 MiB."""
    n, b, i = 65536, 32, 8
    per_value = b * n * 4
    # ES-D-RTRL stacks x (B, 8), dy and the output factor d (B, N) per relation and step
    es = wide_network(n, "es_d_rtrl", b, i)
    assert stacked_bytes_per_step(es.rules) == b * i * 4 + 2 * per_value
    assert default_block_size(es.rules) == BLOCK_MEMORY_BUDGET // (b * i * 4 + 2 * per_value)
    assert default_block_size(es.rules) == 15
    assert choose_loop(es.rules, length=300) == Blocked(15)
    # with the fast signal the relations' share is in their traces: no dy stacked
    fast = wide_network(n, braintrace.ESDRTRL(signal="fast"), b, i)
    assert stacked_bytes_per_step(fast.rules) == b * i * 4 + per_value
    assert default_block_size(fast.rules) == 31
    # D-RTRL stacks x and Df (one state) per relation, the signal and D per group; no dy:
    # here the compiler proves the fast signal exact, and D-RTRL takes it
    d = wide_network(n, "d_rtrl", b, i)
    assert d.rules.learning_signal.reads_new_state
    assert stacked_bytes_per_step(d.rules) == b * i * 4 + 3 * per_value
    assert default_block_size(d.rules) == 10
    # a budget below one step's stacks still gives blocks of 2, never the per-step form
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_spec, "BLOCK_MEMORY_BUDGET", per_value)
        assert default_block_size(d.rules) == 2
        assert choose_loop(d.rules, length=300) == Blocked(2)


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
@pytest.mark.parametrize("name", ["alif-learned-taus", "gru"])
def test_the_chosen_block_size_is_exact(name, algorithm, monkeypatch, x64):
    """With the budget set to three steps' stacks the default is ``K = 3`` (two blocks of 3
    and one of 1 over T = 7), and its gradients, losses, traces and hidden state are the
    per-step form's."""
    case = MODELS[name]

    def run(block_size):
        learner = braintrace.compile(case.build(), ALGORITHMS[algorithm](),
                                     jnp.zeros((BATCH, IN)))
        monkeypatch.setattr(_spec, "BLOCK_MEMORY_BUDGET",
                            3 * stacked_bytes_per_step(learner.rules))
        assert default_block_size(learner.rules) == 3
        xs, ys = data(case.input_scale)
        grads, losses = learner.etrace_grad(xs, ys, mse, block_size=block_size,
                                            return_losses=True)
        out = jax.tree.leaves((grads, losses, learner.traces, learner.leaves()[1]))
        return [np.asarray(a) for a in out]

    per_step = run(1)
    assert any(np.max(np.abs(a)) > 0 for a in per_step)  # the comparison sees values
    assert_same(run(None), per_step)


def test_the_trainers_windows_keep_to_the_budget():
    """Between two updates the trainer runs blocks of up to 64 steps, fewer where 64 stacked
    steps would exceed the budget: 16,384 LIF neurons (2 MiB per ``(B, N)`` value) give ES-D-RTRL
    blocks of 63 steps at most, so a window of 64 steps runs as two blocks of 32."""
    from braintrace._drivers._functional import MAX_BLOCK_SIZE, window_loop

    small = wide_network(64, "es_d_rtrl", 4, 8)
    assert window_loop(small._entry(), 64, None) == Blocked(MAX_BLOCK_SIZE) == Blocked(64)
    assert window_loop(small._entry(), 100, None) == Blocked(50)
    wide = wide_network(16384, "es_d_rtrl", 32, 8)
    fits = BLOCK_MEMORY_BUDGET // stacked_bytes_per_step(wide.rules)
    assert fits == 63
    assert window_loop(wide._entry(), 64, None) == Blocked(32)
    assert window_loop(wide._entry(), 64, 64) == Blocked(64)  # a block size the caller chose
    assert window_loop(wide._entry(), 1, None) == PerStep()  # an update every step


def sparse_network(neurons: int, batch: int = 32, inputs: int = 8):
    """``ETPLinear(inputs -> neurons)`` plus a sparse recurrent sum (2 synapses per neuron)
    into ``LIF(neurons)``, float32, ``batch`` samples."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            post = np.repeat(np.arange(neurons), 2)
            pre = np.random.default_rng(0).integers(0, neurons, post.size)
            self.inp = layers.ETPLinear(inputs, neurons, rngs=rngs)
            self.rec = layers.ETPSparseLinear(neurons, neurons, connectivity=(pre, post),
                                              use_bias=False, rngs=rngs)
            self.lif = layers.LIF(neurons)

        def __call__(self, x):
            return self.lif(self.inp(x) + self.rec(self.lif.spikes()))

    return braintrace.compile(Net(nnx.Rngs(0)), "es_d_rtrl", jnp.zeros((batch, inputs)),
                              batch_size=batch)


def test_on_a_tpu_a_dense_network_keeps_its_blocks_within_the_speed_budget():
    """8,192 LIF neurons, batch 32: ES-D-RTRL stacks 2 MiB and 1 KiB per step. The memory
    budget alone gives 32 steps (the CPU's); a TPU's programs take the largest power of two
    whose blocks fit 32 MiB: 15 steps would, 8 is taken. 512 neurons (128 KiB per step) keep
    32 steps there too."""
    es = wide_network(8192, "es_d_rtrl")
    per_step = stacked_bytes_per_step(es.rules)
    assert per_step == 32 * 8 * 4 + 2 * 32 * 8192 * 4
    assert BLOCK_SPEED_BUDGET // per_step == 15
    assert default_block_size(es.rules) == 32
    with formulation("pallas"):
        assert default_block_size(es.rules) == 8
        assert choose_loop(es.rules, length=100) == Blocked(8)
        assert default_block_size(es.rules, most=64) == 8  # the trainer's windows too
        assert default_block_size(wide_network(512, "es_d_rtrl").rules) == 32
        # a block smaller than two steps' stacks is still 2 steps, not the per-step form
        assert default_block_size(wide_network(131072, "es_d_rtrl").rules) == 2


def test_on_a_tpu_a_network_with_a_sparse_relation_keeps_the_memory_budget_alone():
    """The same neurons with a sparse recurrent sum: 32 steps on a TPU as on the CPU (its
    blocks also merge the gathered rows' sums); the dense one beside it gets 8."""
    sparse = sparse_network(8192)
    assert stacked_bytes_per_step(sparse.rules) > 2 * 32 * 8192 * 4
    with formulation("pallas"):
        assert default_block_size(sparse.rules) == 32
        assert default_block_size(wide_network(8192, "es_d_rtrl").rules) == 8


def test_on_a_tpu_large_traces_keep_long_blocks():
    """D-RTRL on ``ETPLinear(64 -> 8,192)``, batch 32: its traces (B·|θ|, 65 MiB) would be read
    and written 4 times as often in blocks of 8 as in blocks of 32, more bytes per step than a
    step stacks (3 MiB): it keeps 32 steps on a TPU, where ES-D-RTRL on the same layer (traces
    of B·(I + O) values) takes 8."""
    d = wide_network(8192, "d_rtrl", inputs=64)
    per_step = stacked_bytes_per_step(d.rules)
    trace = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(d.traces))
    assert d.rules.trace_bytes == trace == 32 * (64 * 8192 + 8192) * 4
    assert 2 * trace > 8 * per_step and BLOCK_SPEED_BUDGET // per_step >= 8
    es = wide_network(8192, "es_d_rtrl", inputs=64)
    assert 2 * es.rules.trace_bytes <= 8 * stacked_bytes_per_step(es.rules)
    with formulation("pallas"):
        assert default_block_size(d.rules) == 32
        assert default_block_size(es.rules) == 8


def test_trace_bytes_count_the_stored_dtype():
    """``GraphRules.trace_bytes`` counts the traces as stored: half in bfloat16."""
    wide = braintrace.compile(nnx.Sequential(layers.ETPLinear(8, 256, rngs=nnx.Rngs(0)),
                                             layers.LIF(256)),
                              "d_rtrl", jnp.zeros((4, 8)), batch_size=4)
    narrow = braintrace.compile(nnx.Sequential(layers.ETPLinear(8, 256, rngs=nnx.Rngs(0)),
                                               layers.LIF(256)),
                                "d_rtrl", jnp.zeros((4, 8)), batch_size=4,
                                trace_dtype=jnp.bfloat16)
    for learner in (wide, narrow):
        assert learner.rules.trace_bytes == sum(a.size * a.dtype.itemsize
                                                for a in jax.tree.leaves(learner.traces))
    assert 2 * narrow.rules.trace_bytes == wide.rules.trace_bytes


def test_on_a_tpu_traces_that_bound_the_step_get_longer_blocks_evened_out():
    """D-RTRL on ``ETPLinear(512 -> 1,024)``, batch 32: in blocks of 32 its 64 MiB of traces
    would cost 9 times the bytes per step that a step stacks (448 KiB; 3 times suffice:
    ``ETPLinear(192 -> 1,024)``, 3.8 times, does too). Given the sequence's
    length, a TPU's programs take blocks of up to 64 steps, evened out: T = 100 in two blocks
    of 50, T = 1000 in 16 passes (15 blocks of 63 and one of 55), a sequence of 33 to 64 steps
    in one block. Without the length (the trainer's windows choose their own), on the CPU,
    for traces less dominant (``ETPLinear(64 -> 8,192)``: 1.4 times) and for ES-D-RTRL's small
    traces nothing changes."""
    d = wide_network(1024, "d_rtrl", inputs=512)
    per_step = stacked_bytes_per_step(d.rules)
    assert per_step == 32 * 512 * 4 + 3 * 32 * 1024 * 4
    ratio = 2 * d.rules.trace_bytes / (DEFAULT_BLOCK_SIZE * per_step)
    assert TRACE_BOUND_RATIO == 3 and 9 < ratio < 9.2
    near = wide_network(1024, "d_rtrl", inputs=192)
    assert 3.7 < 2 * near.rules.trace_bytes / (DEFAULT_BLOCK_SIZE
                                               * stacked_bytes_per_step(near.rules)) < 3.9
    assert BLOCK_MEMORY_BUDGET // per_step > TRACE_BOUND_BLOCK_SIZE == 64
    less = wide_network(8192, "d_rtrl", inputs=64)
    assert 1 < 2 * less.rules.trace_bytes / (DEFAULT_BLOCK_SIZE
                                             * stacked_bytes_per_step(less.rules)) < 2
    es = wide_network(1024, "es_d_rtrl", inputs=512)
    assert choose_loop(d.rules, length=100) == Blocked(32)  # the CPU
    with formulation("pallas"):
        assert choose_loop(d.rules, length=100) == Blocked(50)
        assert choose_loop(d.rules, length=1000) == Blocked(63)
        assert choose_loop(d.rules, length=40) == Blocked(40)
        # up to 32 steps, as before: blocks of 32, which run a shorter sequence as one
        assert choose_loop(d.rules, length=30) == Blocked(32)
        assert default_block_size(d.rules) == 32  # no length: as before
        assert choose_loop(d.rules, length=100, block_size=32) == Blocked(32)  # chosen
        assert choose_loop(near.rules, length=100) == Blocked(50)
        assert choose_loop(near.rules, length=1000) == Blocked(63)
        assert choose_loop(less.rules, length=100) == Blocked(32)
        assert choose_loop(es.rules, length=100) == Blocked(32)
        # a memory budget below 32 steps' stacks keeps to it
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_spec, "BLOCK_MEMORY_BUDGET", 20 * per_step)
            assert choose_loop(d.rules, length=100) == Blocked(20)
        # traces stored in bfloat16 count half: ETPLinear(1024 -> 1024)'s, 8 times, still do
        model = nnx.Sequential(layers.ETPLinear(1024, 1024, rngs=nnx.Rngs(0)),
                               layers.LIF(1024))
        narrow = braintrace.compile(model, "d_rtrl", jnp.zeros((32, 1024)), batch_size=32,
                                    trace_dtype=jnp.bfloat16)
        assert 7.9 < 2 * narrow.rules.trace_bytes / (
            DEFAULT_BLOCK_SIZE * stacked_bytes_per_step(narrow.rules)) < 8.1
        assert choose_loop(narrow.rules, length=100) == Blocked(50)
        # the ratio is what decides: at 10 times, these traces keep 32 steps; at 4, the
        # 3.8 times' do
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_spec, "TRACE_BOUND_RATIO", 10)
            assert choose_loop(d.rules, length=100) == Blocked(32)
            patch.setattr(_spec, "TRACE_BOUND_RATIO", 4)
            assert choose_loop(near.rules, length=100) == Blocked(32)
            assert choose_loop(d.rules, length=100) == Blocked(50)


@pytest.mark.parametrize("length", [45, 50])
def test_evened_out_trace_bound_blocks_are_exact(length, monkeypatch, x64):
    """Under a TPU's programs, with the trace-bound limit set to 40 steps, D-RTRL on
    ``ETPLinear(1024 -> 256)`` into ``LIF(256)`` (traces that bound the step) runs T = 50 as
    two blocks of 25 and T = 45 as blocks of 23 and 22 (not 40 and a tail); its gradients,
    losses, traces and hidden state are the per-step form's (float64)."""
    inputs, batch, units = 1024, 2, 256
    monkeypatch.setattr(_spec, "TRACE_BOUND_BLOCK_SIZE", 40)
    xs = 3.0 * jax.random.normal(jax.random.key(1), (length, batch, inputs))
    ys = jax.random.normal(jax.random.key(2), (length, batch, units))

    def run(block_size):
        model = nnx.Sequential(layers.ETPLinear(inputs, units, param_dtype=jnp.float64,
                                                rngs=nnx.Rngs(0)),
                               layers.LIF(units, param_dtype=jnp.float64))
        learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=batch)
        grads, losses = learner.etrace_grad(xs, ys, mse, block_size=block_size,
                                            return_losses=True)
        out = jax.tree.leaves((grads, losses, learner.traces, learner.leaves()[1]))
        return learner, [np.asarray(a) for a in out]

    with formulation("pallas"):
        learner, chosen = run(None)
        rules = learner.rules
        assert (2 * rules.trace_bytes
                >= TRACE_BOUND_RATIO * DEFAULT_BLOCK_SIZE * stacked_bytes_per_step(rules))
        assert choose_loop(rules, length=length) == Blocked({50: 25, 45: 23}[length])
        _, per_step = run(1)
    assert xs.dtype == jnp.float64
    assert any(np.max(np.abs(a)) > 0 for a in per_step)
    assert_same(chosen, per_step)
