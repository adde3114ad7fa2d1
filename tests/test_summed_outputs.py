"""Operations whose outputs are added before anything reads them share ``Df``; ES-D-RTRL keeps
their output-side trace ``ε_f`` once (``_compiler/_summed_outputs.py``, ``GraphRules.leaders``).

* which relations the compiler pairs, and which it must not (an output read twice, scaled
  before the sum, feeding another group);
* sharing changes nothing: gradients equal the unshared rules' (float64) in every loop, with
  both learning signals and in the trainer; and the follower stores no ``ε_f`` and stacks no
  output factor;
* negative control: tying two relations whose ``Df`` differ changes the gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._compiler import summed_outputs
from braintrace._loops._blocked import stacked_bytes_per_step

B, I, H, T = 3, 3, 5, 10
F64 = jnp.float64


def linear(i, o, seed):
    return layers.ETPLinear(i, o, rngs=nnx.Rngs(seed), param_dtype=F64)


class Summed(nnx.Module):
    """``z = ALIF(W_in x + W_rec z)`` read out: the two inputs meet in one add."""

    def __init__(self, neuron=layers.ALIF, scale=1.0):
        self.inp, self.rec, self.out = linear(I, H, 0), linear(H, H, 1), linear(H, 2, 2)
        self.neuron = neuron(H, param_dtype=F64)
        self.scale = scale

    def __call__(self, x):
        drive = self.inp(x)
        if self.scale != 1.0:
            drive = self.scale * drive
        return self.out(self.neuron(drive + self.rec(self.neuron.spikes())))


class ReadTwice(Summed):
    """The input layer's output is added and also read out directly."""

    def __call__(self, x):
        drive = self.inp(x)
        z = self.neuron(drive + self.rec(self.neuron.spikes()))
        return self.out(z) + jnp.sum(drive, axis=-1, keepdims=True)


class TwoLayers(nnx.Module):
    """Two LIF layers, each fed by one operation: nothing added."""

    def __init__(self):
        self.a, self.b, self.out = linear(I, H, 0), linear(H, H, 1), linear(H, 2, 2)
        self.lif_a, self.lif_b = layers.LIF(H, param_dtype=F64), layers.LIF(H, param_dtype=F64)

    def __call__(self, x):
        return self.out(self.lif_b(self.b(self.lif_a(self.a(x)))))


class ThreeInputs(nnx.Module):
    """``a + b + c`` into one group: the first two pair."""

    def __init__(self):
        self.a, self.b, self.c, self.out = (linear(I, H, 0), linear(I, H, 1), linear(H, H, 2),
                                            linear(H, 2, 3))
        self.lif = layers.LIF(H, param_dtype=F64)

    def __call__(self, x):
        return self.out(self.lif(self.a(x) + self.b(x) + self.c(self.lif.spikes())))


def graph_of(model):
    braintrace.init_states(model, B)
    return braintrace.compile_graph(model, jnp.ones((B, I), F64))


def test_the_compiler_pairs_outputs_added_once_and_nothing_else():
    with jax.enable_x64(True):
        assert summed_outputs(graph_of(Summed())) == (None, 0)
        assert summed_outputs(graph_of(ThreeInputs())) == (None, 0, None)
        assert summed_outputs(graph_of(Summed(scale=2.0))) == (None, None)  # scaled first
        assert summed_outputs(graph_of(ReadTwice())) == (None, None)  # read elsewhere too
        assert set(summed_outputs(graph_of(TwoLayers()))) == {None}  # different groups


class Unshared(braintrace.ESDRTRL):
    """ES-D-RTRL keeping every relation's ``ε_f`` (the reference)."""

    def rules(self, graph):
        return dataclasses.replace(super().rules(graph), leaders=())


class ForcedTie(braintrace.ESDRTRL):
    """ES-D-RTRL tying relation 1 to relation 0 whatever the graph (the negative control)."""

    def rules(self, graph):
        return dataclasses.replace(super().rules(graph), leaders=(None, 0))


def data():
    xs = 3 * jax.random.normal(jax.random.key(0), (T, B, I), F64)
    return xs, jax.random.normal(jax.random.key(1), (T, B, 2), F64)


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def grads(model, algorithm, **kwargs):
    xs, ys = data()
    braintrace.init_states(model, B)
    learner = braintrace.compile(model, algorithm, xs[0], batch_size=B)
    first = jax.tree.leaves(learner.etrace_grad(xs, ys, mse, **kwargs))
    second = jax.tree.leaves(learner.etrace_grad(xs, ys, mse, **kwargs))  # traces carried on
    return first + second, learner


LOOPS = [{}, {"block_size": 1}, {"block_size": 4}]


@pytest.mark.parametrize(("signal", "loop"), [("exact", loop) for loop in LOOPS]
                         + [("exact", {"chunk_size": 5})]  # the fast signal has no chunks
                         + [("fast", loop) for loop in LOOPS])
def test_sharing_the_output_trace_changes_no_gradient(signal, loop):
    with jax.enable_x64(True):
        got, learner = grads(Summed(), braintrace.ESDRTRL(signal=signal), **loop)
        want, reference = grads(Summed(), Unshared(signal=signal), **loop)
        assert learner.rules.leaders == (None, 0) and reference.rules.leaders == ()
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
        assert all(np.any(g != 0) for g in got)


def test_the_trainer_with_a_shared_output_trace_equals_the_unshared_one():
    with jax.enable_x64(True):
        xs, ys = data()
        params = []
        for algorithm in (braintrace.ESDRTRL(), Unshared()):
            model = Summed()
            braintrace.init_states(model, B)
            learner = braintrace.compile(model, algorithm, xs[0], batch_size=B)
            trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse,
                                               update_every=2)
            trainer.step(xs, ys)
            params.append(jax.tree.leaves(nnx.state(model, nnx.Param)))
        for g, w in zip(*params, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("signal", "stacked"), [("exact", 2), ("fast", 1)])
def test_the_follower_stores_no_output_trace_and_stacks_nothing_of_its_output(signal, stacked):
    """Per step the follower stacks neither its output factor nor (exact signal) its ``dy``."""
    with jax.enable_x64(True):
        _, shared = grads(Summed(), braintrace.ESDRTRL(signal=signal))
        _, unshared = grads(Summed(), Unshared(signal=signal))
        leader, follower = shared.traces[:2]
        assert follower.f is None and follower.f_power is None
        assert leader.f.shape == unshared.traces[1].f.shape == (B, H, 2)  # ALIF: two states
        np.testing.assert_array_equal(leader.f, unshared.traces[1].f)  # what it stands for
        y_bytes = B * H * 8  # one float64 y-shaped value per step
        assert (stacked_bytes_per_step(unshared.rules) - stacked_bytes_per_step(shared.rules)
                == stacked * y_bytes)


def test_tying_relations_whose_df_differ_changes_the_gradient():
    """The negative control: with the input scaled by 2 before the sum, ``Df_in = 2 Df_rec``;
    tying them anyway gives a different gradient, so the compiler's check is needed."""
    with jax.enable_x64(True):
        wrong, _ = grads(Summed(scale=2.0), ForcedTie())
        right, learner = grads(Summed(scale=2.0), braintrace.ESDRTRL())
        assert learner.rules.leaders == ()
        assert max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                   for a, b in zip(wrong, right)) > 1e-3


def test_rules_that_cannot_share_refuse_a_leader():
    """D-RTRL's rules define no ``own``/``tie``: a leader given to them is an error naming the
    relation's Params (never a silently wrong trace)."""
    with jax.enable_x64(True):
        _, learner = grads(Summed(), braintrace.D_RTRL())
        with pytest.raises(ValueError, match=r"Relation 1 \(trains .*'rec.kernel'.*own and tie"):
            dataclasses.replace(learner.rules, leaders=(None, 0))
        with pytest.raises(ValueError, match="2 entries for 3"):
            dataclasses.replace(grads(ThreeInputs(), braintrace.ESDRTRL())[1].rules,
                                leaders=(None, 0))
