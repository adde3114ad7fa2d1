"""OTTT, SLTT and OTPE (float64, against the BPTT oracle).

* On every ETP primitive (dense, LoRA, conv, sparse, einsum, grouped, embedding,
  elementwise) driving a leaky state ``h' = λ h + y``: OTTT with that ``λ`` and OTPE
  equal BPTT to ``1e-8`` and ``strict=True`` accepts them; SLTT equals it where
  ``λ = 0``.
* Where each paper says its rule is exact: OTTT on LIF neurons whose reset passes
  no derivative under a memoryless readout (per step and time-blocked), OTPE on a
  LIF or ALIF layer (reset included, learned time constants) under a leaky readout
  whose leak is its ``λ``. Negative controls: the other ``λ``, the reset's
  derivative, D-RTRL on OTPE's model all differ, and ``strict=True`` refuses them.
* By direction on two feed-forward LIF layers under a leaky readout: OTPE aligns
  with BPTT's first-layer gradient (cosine > 0.9) where OTTT, SLTT and D-RTRL do not,
  and the permuted gradient (the control) fails the same threshold.
* OTPE time-blocked: on the exact cases above and, where it approximates (two LIF
  layers), equal to its per-step form to ``1e-10`` (gradients and traces).
* The drivers: a user's ``nnx.jit`` step that switches ``'es_d_rtrl'`` to each rule
  by one string, the trainer, windowed mode refused where a rule has none.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, mse
from reference_models import assert_live, leaves, rel_errors

import braintrace
from braintrace import layers
from braintrace._loops import Blocked, choose_loop

F64 = jnp.float64
B, T, IN, H, OUT = 2, 3, 4, 4, 2


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _live(make, xs, ys):
    want = bptt_grads(make(), xs, ys)
    assert_live(want)
    return want


def _grads(make, algorithm, xs, ys, **kw):
    learner = braintrace.compile(make(), algorithm, xs[0], strict=kw.pop("strict", False))
    return learner.etrace_grad(xs, ys, mse, reduction="sum", **kw), learner


# -- every primitive, a leaky state of its own ---------------------------------------------------


class Offset(nnx.Module):
    """``x M + tanh(w)``: an elementwise Param (a learnable offset) beside a fixed matrix."""

    def __init__(self):
        self.m = jax.random.normal(jax.random.key(5), (IN, H), F64)
        self.w = layers.ETPElemwise(jnp.linspace(-1.0, 1.0, H), jnp.tanh, param_dtype=F64)

    def __call__(self, x):
        return x @ self.m + self.w()


def _lora():
    layer = layers.ETPLoRALinear(IN, H, lora_rank=2, param_dtype=F64, lora_param_dtype=F64,
                                 rngs=nnx.Rngs(1))
    layer.lora.lora_b.set_value(jax.random.normal(jax.random.key(6), (2, H), F64))
    return layer


KW = {"param_dtype": F64}
DRIVES = {  # (layer, its state's shape, what it reads of the step's input)
    "dense": (lambda: layers.ETPLinear(IN, H, rngs=nnx.Rngs(1), **KW), (H,), lambda x: x),
    "lora": (_lora, (H,), lambda x: x),
    "conv": (lambda: layers.ETPConv(1, 2, (2,), rngs=nnx.Rngs(2), **KW), (IN, 2),
             lambda x: x[..., None]),
    "sparse": (lambda: layers.ETPSparseLinear(
        IN, H, connectivity=np.eye(IN, H, dtype=bool) | np.eye(IN, H, 1, dtype=bool),
        rngs=nnx.Rngs(3), **KW), (H,), lambda x: x),
    "einsum": (lambda: layers.ETPEinsum("bd,dhk->bhk", (IN, 2, 2), (2, 2), rngs=nnx.Rngs(4),
                                        **KW), (2, 2), lambda x: x),
    "grouped": (lambda: layers.ETPGroupedLinear(IN, H, 2, rngs=nnx.Rngs(5), **KW), (H,),
                lambda x: x),
    "elementwise": (Offset, (H,), lambda x: x),
}


class Leaks(nnx.Module):
    """Each of ``names``' layers drives a leaky state of its own, ``h_k' = decay·h_k + y_k``;
    one untraced readout of all ``tanh(h_k)``."""

    def __init__(self, names, decay):
        self.decay, self.names = decay, tuple(names)
        self.drives = nnx.List([DRIVES[n][0]() for n in self.names])
        self.h = nnx.List([braintrace.HiddenState(jnp.zeros(DRIVES[n][1], F64))
                           for n in self.names])
        width = sum(math.prod(DRIVES[n][1]) for n in self.names)
        self.out = layers.ETPLinear(width, OUT, rngs=nnx.Rngs(9), **KW)

    def __call__(self, x):
        features = []
        for name, drive, h in zip(self.names, self.drives, self.h):
            h[...] = self.decay * h[...] + drive(DRIVES[name][2](x))
            features.append(jnp.tanh(h[...]).reshape(*x.shape[:-1], -1))
        return self.out(jnp.concatenate(features, axis=-1))


def _leaks(decay, names=tuple(DRIVES)):
    model = Leaks(names, decay)
    braintrace.init_states(model, B)
    for k, h in enumerate(model.h):
        h.set_value(0.5 * jax.random.normal(jax.random.key(7 + k), h.shape, F64))
    return model


def _data(shape=(IN,), seed=1):
    return (jax.random.normal(jax.random.key(seed), (T, B, *shape), F64),
            jax.random.normal(jax.random.key(seed + 1), (T, B, OUT), F64))


def test_ottt_and_otpe_equal_bptt_on_every_primitive_driving_a_leak_of_their_decay():
    """OTPE per step and in blocks of 2 (a block entered with traces, then a shorter one)."""
    xs, ys = _data()
    make = lambda: _leaks(0.8)
    want = _live(make, xs, ys)
    for algorithm, block_size in ((braintrace.OTTT(0.8), None), (braintrace.OTPE(0.8), 1),
                                  (braintrace.OTPE(0.8), 2)):
        got, learner = _grads(make, algorithm, xs, ys, strict=True, block_size=block_size)
        assert {r.primitive.name.removeprefix("etp_").removesuffix("_batched")
                for r in learner.graph.relations} == {
            "dense", "lora", "conv", "sparse", "einsum", "grouped", "elemwise"}
        errors = rel_errors(got, want)
        assert max(errors.values()) <= 1e-8, (algorithm.name, block_size, errors)


def test_sltt_equals_bptt_where_the_state_has_no_memory_and_only_there():
    xs, ys = _data()
    names = ("dense", "elementwise")
    got, learner = _grads(lambda: _leaks(0.0, names), "sltt", xs, ys, strict=True)
    assert learner.traces == []
    assert max(rel_errors(got, _live(lambda: _leaks(0.0, names), xs, ys)).values()) <= 1e-8
    with pytest.raises(ValueError, match="SLTT"):  # a leak: the temporal path it drops
        braintrace.compile(_leaks(0.8, names), "sltt", xs[0], strict=True)


def test_the_embedding_runs_otpe_exactly_and_ottt_refuses_it():
    class Tokens(nnx.Module):
        def __init__(self):
            self.embed = layers.ETPEmbed(6, H, rngs=nnx.Rngs(1), **KW)
            self.h = braintrace.HiddenState(jnp.zeros((H,), F64))
            self.out = layers.ETPLinear(H, OUT, rngs=nnx.Rngs(2), **KW)

        def __call__(self, x):
            self.h[...] = 0.8 * self.h[...] + self.embed(x)
            return self.out(jnp.tanh(self.h[...]))

    def make():
        model = Tokens()
        braintrace.init_states(model, B)
        return model

    xs = jax.random.randint(jax.random.key(1), (T, B), 0, 6)
    ys = _data()[1]
    got, _ = _grads(make, braintrace.OTPE(0.8), xs, ys, strict=True)
    assert max(rel_errors(got, _live(make, xs, ys)).values()) <= 1e-8
    with pytest.raises(braintrace.MissingRuleError, match="'init_pp' of primitive 'etp_embed"):
        braintrace.compile(make(), "ottt", xs[0])


# -- spiking layers: where each paper says its rule is exact -----------------------------------

TAU, TAU_OUT = 4.0, 3.0
LEAK, LEAK_OUT = math.exp(-1 / TAU), math.exp(-1 / TAU_OUT)


def _spiking(readout, neuron="lif", detach_reset=False, hidden=H, layers_=1, seed=0):
    """``layers_`` feed-forward spiking layers (ETPLinear into LIF or ALIF), then an untraced
    ``ETPLinear`` (``readout='linear'``) or a ``LeakyReadout`` (``'leaky'``)."""
    rngs = nnx.Rngs(seed)
    init = nnx.initializers.normal(1.0)
    stack, width = [], IN
    for _ in range(layers_):
        neuron_kw = {"tau": TAU, "v_th": 0.5, "detach_reset": detach_reset, "param_dtype": F64}
        cell = (layers.LIF(hidden, **neuron_kw) if neuron == "lif" else
                layers.ALIF(hidden, tau_a=6.0, beta=0.5, learn_tau=True, **neuron_kw))
        stack += [layers.ETPLinear(width, hidden, kernel_init=init, rngs=rngs, **KW), cell]
        width = hidden
    stack.append(layers.ETPLinear(hidden, OUT, rngs=rngs, **KW) if readout == "linear" else
                 layers.LeakyReadout(hidden, OUT, tau=TAU_OUT, rngs=rngs, **KW))
    model = nnx.Sequential(*stack)
    braintrace.init_states(model, B)
    return model


def _spikes(steps=6, seed=1):
    return _data(seed=seed) if steps == T else (
        2.0 * jax.random.normal(jax.random.key(seed), (steps, B, IN), F64),
        jax.random.normal(jax.random.key(seed + 1), (steps, B, OUT), F64))


def test_ottt_equals_bptt_on_lif_neurons_whose_reset_passes_no_derivative():
    xs, ys = _spikes()
    make = lambda: _spiking("linear", detach_reset=True)
    want = _live(make, xs, ys)
    for block_size in (1, 4):
        got, learner = _grads(make, braintrace.OTTT(LEAK), xs, ys, strict=True,
                              block_size=block_size)
        assert max(rel_errors(got, want).values()) <= 1e-8
    # the trace is presynaptic: O(B·I) per operation, nothing of the neurons' size
    assert [a.shape for a in jax.tree.leaves(learner.traces)] == [(B, IN), ()]
    # negative controls: another λ, or the reset's derivative, and strict refuses
    for algorithm, reset_make in ((braintrace.OTTT(0.5), make),
                                  (braintrace.OTTT(LEAK), lambda: _spiking("linear"))):
        with pytest.raises(ValueError, match="OTTT"):
            braintrace.compile(reset_make(), algorithm, xs[0], strict=True)
        got, learner = _grads(reset_make, algorithm, xs, ys)
        assert "temporal-path" in learner.report(verbose=True)
        assert max(rel_errors(got, _live(reset_make, xs, ys)).values()) > 1e-3


@pytest.mark.parametrize("neuron", ["lif", "alif"])
def test_otpe_equals_bptt_on_a_spiking_layer_under_a_leaky_readout_of_its_decay(neuron):
    """The reset's derivative included; ALIF: two states, learned time constants. Per step
    and in two blocks of 3 (the second entered with traces)."""
    xs, ys = _spikes()
    make = lambda: _spiking("leaky", neuron=neuron)
    want = _live(make, xs, ys)
    for block_size in (1, 3):
        got, learner = _grads(make, braintrace.OTPE(LEAK_OUT), xs, ys, strict=True,
                              block_size=block_size)
        assert max(rel_errors(got, want).values()) <= 1e-8, block_size
    (reader,), () = learner.rules.readers  # the readout reads the layer's spikes
    assert learner.graph.relations[reader].all_param_paths == ("layers.2.linear.bias",
                                                                "layers.2.linear.kernel")
    assert "approximations: none" in learner.report()
    if neuron == "alif":
        return
    # negative controls: D-RTRL (which drops the readout's memory) and another λ
    for algorithm in (braintrace.DRTRL(), braintrace.OTPE(0.5)):
        with pytest.raises(ValueError, match="strict=True"):
            braintrace.compile(make(), algorithm, xs[0], strict=True)
        got, _ = _grads(make, algorithm, xs, ys)
        assert max(rel_errors(got, want).values()) > 1e-3


class Readers(nnx.Module):
    """One LIF layer whose spikes ``s`` reach the output by every kind of path: a leaky
    readout of ``s``; one operation reading ``2·s`` into two leaky states (one equation, two
    groups); a memoryless ``ETPLinear`` of ``s``; a direct ``0.7·s M``. ``tau``: the second
    reader's time constant; ``bypass``: the output also reads that reader's output ``z``."""

    def __init__(self, tau=TAU_OUT, bypass=False):
        rngs, self.bypass = nnx.Rngs(0), bypass
        self.enc = layers.ETPLinear(IN, H, kernel_init=nnx.initializers.normal(1.0), rngs=rngs,
                                    **KW)
        self.lif = layers.LIF(H, tau=TAU, v_th=0.5, param_dtype=F64)
        self.leaky = layers.LeakyReadout(H, OUT, tau=TAU_OUT, rngs=rngs, **KW)
        self.twice = layers.ETPLinear(H, 2 * OUT, rngs=rngs, **KW)
        self.a = braintrace.HiddenState(jnp.zeros((OUT,), F64))
        self.b = braintrace.HiddenState(jnp.zeros((OUT,), F64))
        self.leak = math.exp(-1 / tau)
        self.memoryless = layers.ETPLinear(H, OUT, rngs=rngs, **KW)
        self.m = jax.random.normal(jax.random.key(3), (H, OUT), F64)

    def __call__(self, x):
        s = self.lif(self.enc(x))
        z = self.twice(2 * s)
        self.a[...] = self.leak * self.a[...] + z[..., :OUT]
        self.b[...] = self.leak * self.b[...] + z[..., OUT:]
        y = self.leaky(s) + self.a[...] - 0.5 * self.b[...] + self.memoryless(s) + 0.7 * s @ self.m
        return y + 0.3 * z[..., :OUT] if self.bypass else y


def _readers(**kw):
    model = Readers(**kw)
    braintrace.init_states(model, B)
    return model


def test_otpe_is_exact_on_a_layer_read_by_several_readers_of_its_leak_and_other_paths():
    """Each reader's input cotangent is taken at its own read: a second reader, a reader of
    ``2·s``, a memoryless readout and a direct path of the same spikes are not counted into
    it (they were: 40-88% off BPTT, accepted by ``strict``). Per step and in blocks of 4."""
    xs, ys = _spikes()
    want = _live(_readers, xs, ys)
    for block_size in (1, 4):
        got, learner = _grads(_readers, braintrace.OTPE(LEAK_OUT), xs, ys, strict=True,
                              block_size=block_size)
        assert max(rel_errors(got, want).values()) <= 1e-8, (block_size, rel_errors(got, want))
    # the layer's readers: the leaky readout's operation and the one of 2·s, once each
    assert sorted(learner.graph.relations[r].all_param_paths[0]
                  for r in learner.rules.readers[-1]) == ["leaky.linear.bias", "twice.bias"]


@pytest.mark.parametrize(("kw", "why"), [
    ({"tau": 2 * TAU_OUT}, (r"hidden state `a` .* reads hidden state `lif.v` .* and leaks by "
                            r"0.846482, not by decay=0.716531")),
    ({"bypass": True}, (r"the step's output reads the output of `twice` \(ETPLinear\) other "
                        r"than through the new hidden state"))])
def test_strict_refuses_otpe_where_a_reader_is_not_the_estimate_and_says_why(kw, why):
    """A reader of another leak, a reader's output read at its own step: not exact (the
    negative controls), refused, and the report says which state or operation."""
    xs, ys = _spikes()
    make = lambda: _readers(**kw)
    with pytest.raises(ValueError, match=why):
        braintrace.compile(make(), braintrace.OTPE(LEAK_OUT), xs[0], strict=True)
    got, learner = _grads(make, braintrace.OTPE(LEAK_OUT), xs, ys, block_size=1)
    assert re.search(why, learner.report())
    assert max(rel_errors(got, _live(make, xs, ys)).values()) > 1e-3


def test_otpe_on_a_bfloat16_layer_fed_float32_data_is_within_bfloat16_rounding_of_bptt():
    """bfloat16 Params and states, float32 data, strict with the readout's leak as bfloat16
    stores it: the traces and ``R̂`` keep the layer's dtype, the gradients stay within
    bfloat16 rounding of BPTT's (0.7% here; over 40 steps, per step and in the default
    blocks, 1.6% and 1.1%, where RTRL's own error is 2.1%). Per step: the blocked form
    equals it (the tests above), and compiles three times slower."""
    bf16 = jnp.bfloat16

    def make():
        rngs = nnx.Rngs(0)
        model = nnx.Sequential(
            layers.ETPLinear(IN, H, kernel_init=nnx.initializers.normal(1.0), rngs=rngs,
                             param_dtype=bf16),
            layers.LIF(H, tau=TAU, v_th=0.5, param_dtype=bf16),
            layers.LeakyReadout(H, OUT, tau=TAU_OUT, rngs=rngs, param_dtype=bf16))
        braintrace.init_states(model, B)
        return model

    xs, ys = jax.tree.map(lambda a: a.astype(jnp.float32), _spikes())
    as_f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
    decay = float(bf16(LEAK_OUT))  # 0.71484375
    got, learner = _grads(make, braintrace.OTPE(decay), xs, ys, strict=True, block_size=1)
    assert max(rel_errors(as_f32(got), as_f32(_live(make, xs, ys))).values()) < 3e-2
    assert {a.dtype for a in jax.tree.leaves(learner.traces)} == {jnp.dtype(bf16)}


class WideLIF(nnx.Module):
    """A LIF membrane computed in float32 and written into a bfloat16 state; its spikes are
    read from the float32 value, not from the state."""

    def __init__(self):
        self.v = braintrace.HiddenState(jnp.zeros((H,), jnp.bfloat16))

    def __call__(self, x):
        v = LEAK * self.v[...].astype(jnp.float32) + x
        self.v[...] = v
        return layers.spike(v - 0.5)


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_strict_refuses_otpe_of_another_leak_where_the_layer_is_stored_narrower():
    """The readout reads the wider value the narrowed state is cast from: strict still sees
    it (a guard for the analyses of the new state)."""
    model = nnx.Sequential(layers.ETPLinear(IN, H, rngs=nnx.Rngs(0)), WideLIF(),
                           layers.LeakyReadout(H, OUT, tau=TAU_OUT, rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"OTPE\(decay=0.5\)"):
        braintrace.compile(model, braintrace.OTPE(0.5), jnp.zeros((B, IN), jnp.float32),
                           strict=True)


def test_in_two_spiking_layers_otpe_aligns_the_first_layer_and_the_others_do_not():
    """Two LIF layers under a leaky readout: the first layer's credit reaches the loss
    through the second layer's and the readout's memory. OTPE's estimate keeps most of it
    (the published ordering OTTT, OSTL < OTPE); the permuted gradient is the control.
    OTPE in blocks of 5, each layer's spikes read by the next operation, gives its per-step
    gradient and traces."""
    xs, ys = _spikes(steps=20, seed=3)
    make = lambda: _spiking("leaky", layers_=2, hidden=6)
    want = leaves(_live(make, xs, ys))["layers/0/kernel/value"].ravel()
    cos = lambda a: float(a @ want / np.linalg.norm(a) / np.linalg.norm(want))
    first = {}
    for algorithm in (braintrace.OTPE(LEAK_OUT), braintrace.OTTT(LEAK), braintrace.SLTT(),
                      braintrace.DRTRL()):
        got, learner = _grads(make, algorithm, xs, ys, block_size=1)
        assert "approximations (" in learner.report()  # all approximate here
        first[algorithm.name] = leaves(got)["layers/0/kernel/value"].ravel()
        if algorithm.name == "otpe":
            per_step, per_step_learner = got, learner
    control = np.random.default_rng(0).permutation(first["otpe"])
    assert cos(first["otpe"]) > 0.9 > max(cos(first[n]) for n in ("ottt", "sltt", "d_rtrl"))
    assert cos(control) < 0.5
    assert per_step_learner.rules.readers == ((1,), (2,), ())
    assert choose_loop(per_step_learner.rules, length=20) == Blocked(32)  # by default
    got, learner = _grads(make, braintrace.OTPE(LEAK_OUT), xs, ys, block_size=5)
    assert max(rel_errors(got, per_step).values()) <= 1e-10
    for a, b in zip(jax.tree.leaves(learner.traces), jax.tree.leaves(per_step_learner.traces),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# -- drivers ------------------------------------------------------------------------------------


def test_a_flax_train_step_switches_from_es_d_rtrl_to_each_rule_by_one_string():
    """The user's own ``nnx.jit`` step, written once: only the algorithm's name changes."""

    def train(algorithm):
        model = _spiking("leaky")
        xs, ys = _spikes(steps=8)
        learner = braintrace.compile(model, algorithm, xs[0], batch_size=B)
        online = braintrace.online_grad(learner, mse)
        optimizer = nnx.Optimizer(model, optax.adam(2e-2), wrt=nnx.Param)
        state = online.init(model)
        expected = learner.etrace_grad(xs, ys, mse)  # the same start: the learner's own shell

        @nnx.jit
        def train_step(model, optimizer, state, xs, ys):
            grads, state, stats = online.grad(model, state, xs, ys)
            optimizer.update(model, grads)
            return grads, stats.losses

        grads, losses = train_step(model, optimizer, state, xs, ys)
        assert max(rel_errors(grads, expected).values()) < 1e-10, algorithm
        for _ in range(5):  # the same sequence from the same start
            _, later = train_step(model, optimizer, state, xs, ys)
        assert float(jnp.mean(later)) < float(jnp.mean(losses)), algorithm

    for algorithm in ("es_d_rtrl", "ottt", "sltt", "otpe"):
        train(algorithm)


@pytest.mark.parametrize(("name", "every"), [("ottt", 2), ("sltt", 3), ("otpe", 3)])
def test_the_trainer_makes_an_optax_update_every_few_steps_as_by_hand(name, every):
    """The trainer's windows run in time blocks (OTTT's, OTPE's), the hand's per step."""
    xs, ys = _spikes()
    tx = optax.sgd(0.1)

    def by_hand():
        model = _spiking("leaky")
        learner = braintrace.compile(model, name, xs[0])
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        for start in range(0, xs.shape[0], every):
            window = slice(start, start + every)
            optimizer.update(model, learner.etrace_grad(xs[window], ys[window], mse,
                                                        block_size=1))
        return nnx.state(model, nnx.Param)

    model = _spiking("leaky")
    trainer = braintrace.OnlineTrainer(braintrace.compile(model, name, xs[0]), tx, loss_fn=mse,
                                       update_every=every)
    trainer.step(xs, ys)
    assert max(rel_errors(nnx.state(model, nnx.Param), by_hand()).values()) < 1e-10


def test_windows_are_refused_where_a_rule_has_none():
    xs, ys = _spikes()
    for name in ("ottt", "sltt", "otpe"):
        learner = braintrace.compile(_spiking("leaky"), name, xs[0])
        with pytest.raises(ValueError, match="single-step rule"):
            learner.etrace_grad(xs, ys, mse, chunk_size=2)
    with pytest.raises(ValueError, match=r"decay must lie in \[0, 1\)"):
        braintrace.OTPE(1.0)
    with pytest.raises(TypeError, match="decay must be a float"):
        braintrace.OTTT("0.9")


def test_fit_trains_a_spiking_classifier_with_the_rules():
    from braintrace.tasks import SpikePatterns

    task = SpikePatterns(num_classes=3, num_inputs=5, seq_len=8, response_steps=2, seed=0)
    batches = [task.sample(jax.random.key(i), B) for i in range(2)]
    ce = lambda y, t: optax.softmax_cross_entropy_with_integer_labels(y, t).mean()
    for name in ("ottt", "otpe"):  # the two new loop paths (SLTT's is the same-step one)
        model = nnx.Sequential(layers.ETPLinear(5, 6, rngs=nnx.Rngs(0)), layers.LIF(6, tau=5.0),
                               layers.LeakyReadout(6, 3, rngs=nnx.Rngs(1)))
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        learner = braintrace.compile(model, name, jnp.zeros((B, 5)), batch_size=B)
        history = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=ce).fit(
            batches, progress=False)
        assert len(history) == 2 and all(np.isfinite(history[k]) for k in range(2)), name
        moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), before,
                             nnx.state(model, nnx.Param))
        assert max(jax.tree.leaves(moved)) > 0, name  # it learnt
