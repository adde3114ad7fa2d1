"""Pinned relation profiles: which Params the compiler traces, into which hidden groups.

A profile is ``(groups, relations, exclusions)``: the hidden groups (state
paths), every traced relation as ``(Param paths, group paths, colours)`` and
every excluded site as ``(Param paths, reason keyword)``.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, I, H = 2, 3, 4


def profile(graph):
    groups = [g.paths for g in graph.groups]
    relations = sorted(
        (tuple(sorted(p for ps in r.param_paths.values() for p in ps)),
         graph.groups[r.group].paths, r.num_colours)
        for r in graph.relations)
    exclusions = sorted((x.param_paths, x.reason) for x in graph.exclusions)
    return groups, relations, exclusions


def compiled(model, x_features=I):
    braintrace.init_states(model, B)
    return braintrace.compile_graph(model, jnp.ones((B, x_features)))


class LoRALeaky(nnx.Module):
    """A leaky integrator driven by an ETPLoRA adapter and an ETPLoRALinear."""

    def __init__(self, rngs):
        self.lora = layers.ETPLoRA(I, 2, H, rngs=rngs)
        self.lin = layers.ETPLoRALinear(I, H, lora_rank=2, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        self.h[...] = 0.9 * self.h[...] + self.lora(x) + self.lin(x)
        return self.h[...]


class ElemwiseLeaky(nnx.Module):
    """A leaky integrator with a learnable decay ``sigmoid(alpha)`` (ETPElemwise)."""

    def __init__(self, rngs):
        self.alpha = layers.ETPElemwise(jnp.zeros(H), jax.nn.sigmoid)
        self.inp = layers.ETPLinear(I, H, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        self.h[...] = self.alpha() * self.h[...] + self.inp(x)
        return self.h[...]


class Tied(nnx.Module):
    """One Param ``w`` used at two sites, each feeding its own state."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (I, H)))
        self.h1 = braintrace.HiddenState(jnp.zeros(H))
        self.h2 = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        self.h1[...] = 0.5 * self.h1[...] + braintrace.matmul(x, self.w[...])
        self.h2[...] = 0.7 * self.h2[...] + braintrace.matmul(2.0 * x, self.w[...])
        return self.h1[...] + self.h2[...]


class Chain(nnx.Module):
    """``w1`` reaches ``h`` only through the trainable ``w2``; ``wo`` is a readout."""

    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (I, H)))
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (H, H)))
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (H, 2)))
        self.h = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        u = jnp.tanh(braintrace.matmul(x, self.w1[...]))
        self.h[...] = 0.5 * self.h[...] + braintrace.matmul(u, self.w2[...])
        return braintrace.matmul(self.h[...], self.wo[...])


class WithReadout(nnx.Module):
    """A GRU layer and an ETPLinear readout of its output."""

    def __init__(self, rngs):
        self.rnn = layers.Stateful(layers.GRUCell(I, H, rngs=rngs))
        self.out = layers.ETPLinear(H, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rnn(x))


DENSE = ("dense_i.bias", "dense_i.kernel")

CASES = {
    "simple": (
        lambda r: layers.Stateful(layers.SimpleCell(I, H, rngs=r)),
        [("carry",)],
        [(("cell.dense_h.kernel",), ("carry",), 1),
         (tuple(f"cell.{p}" for p in DENSE), ("carry",), 1)]),
    "gru_fused_kernel": (
        lambda r: layers.Stateful(layers.GRUCell(I, H, rngs=r)),
        [("carry",)],
        [(("cell.dense_h.kernel",), ("carry",), 3),
         (tuple(f"cell.{p}" for p in DENSE), ("carry",), 3)]),
    "lstm": (
        lambda r: layers.Stateful(layers.LSTMCell(I, H, rngs=r)),
        [("carry.0", "carry.1")],
        sorted([((f"cell.{n}.kernel",), ("carry.0", "carry.1"), 1)
                for n in ("ii", "if_", "ig", "io")]
               + [((f"cell.{n}.bias", f"cell.{n}.kernel"), ("carry.0", "carry.1"), 1)
                  for n in ("hi", "hf", "hg", "ho")])),
    "mingru": (
        lambda r: layers.Stateful(layers.MinGRUCell(I, H, rngs=r)),
        [("carry",)],
        [(("cell.dense_n.bias", "cell.dense_n.kernel"), ("carry",), 1),
         (("cell.dense_z.bias", "cell.dense_z.kernel"), ("carry",), 1)]),
    "lif_learn_tau": (
        lambda r: layers.LIF(I, learn_tau=True),
        [("v",)],
        [(("tau.weight",), ("v",), 1)]),
    "alif_two_states": (
        lambda r: layers.ALIF(I, learn_tau=True, learn_tau_a=True),
        [("a", "v")],
        [(("tau.weight",), ("a", "v"), 1), (("tau_a.weight",), ("a", "v"), 1)]),
    "recurrent_spiking_alif": (
        lambda r: layers.RecurrentSpiking(I, layers.ALIF(H), rngs=r),
        [("neuron.a", "neuron.v")],
        [(("dense_h.kernel",), ("neuron.a", "neuron.v"), 1),
         (DENSE, ("neuron.a", "neuron.v"), 1)]),
    "recurrent_spiking_lif_refractory": (
        lambda r: layers.RecurrentSpiking(
            I, layers.LIF(H, refractory_steps=2, learn_tau=True), rngs=r),
        [("neuron.ref_steps", "neuron.v")],
        [(("dense_h.kernel",), ("neuron.ref_steps", "neuron.v"), 1),
         (DENSE, ("neuron.ref_steps", "neuron.v"), 1),
         (("neuron.tau.weight",), ("neuron.ref_steps", "neuron.v"), 1)]),
    "exp_synapse": (
        lambda r: layers.ExpSynapse(I, learn_tau=True),
        [("g",)],
        [(("tau.weight",), ("g",), 1)]),
    "leaky_readout": (
        lambda r: layers.LeakyReadout(I, 2, learn_tau=True, rngs=r),
        [("y",)],
        [(("linear.bias", "linear.kernel"), ("y",), 1), (("tau.weight",), ("y",), 1)]),
    "lora_leaky": (
        LoRALeaky,
        [("h",)],
        [(("lin.bias", "lin.kernel"), ("h",), 1),
         (("lin.lora.lora_a", "lin.lora.lora_b"), ("h",), 1),
         (("lora.lora_a", "lora.lora_b"), ("h",), 1)]),
    "elemwise_time_constant": (
        ElemwiseLeaky,
        [("h",)],
        [(("alpha.weight",), ("h",), 1), (("inp.bias", "inp.kernel"), ("h",), 1)]),
    "tied_weights": (
        Tied,
        [("h1",), ("h2",)],
        [(("w",), ("h1",), 1), (("w",), ("h2",), 1)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_relation_profile_of_layer(name):
    make, groups, relations = CASES[name]
    graph = compiled(make(nnx.Rngs(0)))
    got_groups, got_relations, got_exclusions = profile(graph)
    assert got_groups == groups
    assert got_relations == relations
    assert got_exclusions == []


def test_relation_profile_of_two_layer_stack():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(layers.Stateful(layers.GRUCell(I, H, rngs=rngs)),
                           layers.Stateful(layers.LSTMCell(H, 5, rngs=rngs)))
    groups, relations, exclusions = profile(compiled(model))
    assert groups == [("layers.0.carry",), ("layers.1.carry.0", "layers.1.carry.1")]
    by_group = {}
    for params, group, colours in relations:
        by_group.setdefault(group, []).append((params, colours))
    # Layer 0's weights feed only layer 0's state (layer 1 reads it through its own ETP ops).
    assert sorted(by_group[("layers.0.carry",)]) == [
        (("layers.0.cell.dense_h.kernel",), 3),
        (("layers.0.cell.dense_i.bias", "layers.0.cell.dense_i.kernel"), 3)]
    assert len(by_group[("layers.1.carry.0", "layers.1.carry.1")]) == 8
    assert all(p[0].startswith("layers.1.") for p, _ in
               by_group[("layers.1.carry.0", "layers.1.carry.1")])
    assert exclusions == []


def test_tied_weight_gives_one_relation_per_site_on_the_same_param():
    graph = compiled(Tied(nnx.Rngs(0)))
    assert len(graph.relations) == 2
    assert {r.eqn_index for r in graph.relations} == graph.traced_eqns
    assert len(graph.traced_eqns) == 2
    assert graph.traced_param_paths == ("w",)


def test_weight_chain_and_readout_are_excluded_with_reasons():
    graph = compiled(Chain(nnx.Rngs(0)))
    groups, relations, exclusions = profile(graph)
    assert groups == [("h",)]
    assert relations == [(("w2",), ("h",), 1)]
    assert [params for params, _ in exclusions] == [("w1",), ("wo",)]
    assert "only through another trainable ETP operation" in exclusions[0][1]
    assert "readout" in exclusions[1][1]
    assert graph.traced_param_paths == ("w2",)


def test_readout_layer_is_excluded_and_the_recurrent_layer_traced():
    groups, relations, exclusions = profile(compiled(WithReadout(nnx.Rngs(0))))
    assert groups == [("rnn.carry",)]
    assert [r[0] for r in relations] == [("rnn.cell.dense_h.kernel",),
                                         ("rnn.cell.dense_i.bias", "rnn.cell.dense_i.kernel")]
    assert len(exclusions) == 1
    assert exclusions[0][0] == ("out.bias", "out.kernel")
    assert "readout" in exclusions[0][1]


def test_output_feeding_several_hidden_units_is_excluded():
    class Broadcast(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, 1)))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, self.w[...])
            return self.h[...]

    _, relations, exclusions = profile(compiled(Broadcast()))
    assert relations == []
    assert exclusions[0][0] == ("w",)
    assert "feeds several hidden units" in exclusions[0][1]


def test_operand_computed_from_hidden_state_is_excluded_naming_the_state():
    class StateWeight(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            w = self.w[...] * jnp.mean(self.h[...])
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, w)
            return self.h[...]

    _, relations, exclusions = profile(compiled(StateWeight()))
    assert relations == []
    assert exclusions[0][0] == ("w",)
    assert "hidden state 'h'" in exclusions[0][1]


def test_masked_and_transformed_weight_traces_back_to_its_param():
    class Masked(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.scale = nnx.Param(jnp.ones(()))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            w = jnp.tril(self.w[...]) * jax.nn.softplus(self.scale[...])
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, w)
            return self.h[...]

    _, relations, _ = profile(compiled(Masked()))
    assert relations == [(("scale", "w"), ("h",), 1)]
