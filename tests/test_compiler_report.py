"""``graph.report()`` / ``str(graph)``, and compiling a pure step function."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import BATCH, IN, MODELS
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._compiler import StepLeaves, programs, split_model

B, I, H = 2, 3, 4


class Net(nnx.Module):
    """ALIF recurrent layer, a W->W chain into it, a readout and a rolled state."""

    def __init__(self, rngs):
        self.pre = layers.ETPLinear(I, I, rngs=rngs)
        self.rnn = layers.RecurrentSpiking(I, layers.ALIF(H, learn_tau=True), rngs=rngs)
        self.out = layers.ETPLinear(H, 2, rngs=rngs)
        self.w = nnx.Param(jnp.ones((H, H)))
        self.m = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        z = self.rnn(self.pre(x))
        self.m[...] = jnp.roll(self.m[...], 1, axis=-1) * 0.5 + braintrace.matmul(z, self.w[...])
        return self.out(z)


def test_report_gives_a_summary_in_module_terms_then_the_details():
    model = Net(nnx.Rngs(0))
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    text = graph.report(verbose=True)
    lines = text.splitlines()
    assert lines[0] == "ETraceGraph (diagonal scope)"
    # The summary first: one plain sentence per approximation, in module terms.
    assert lines[1] == "approximations (5; strict=True refuses them):"
    details = lines.index("details:")
    summary = "\n".join(lines[2:details])
    assert ("`rnn.dense_h` (ETPLinear) couples different units of hidden states `rnn.neuron.a` "
            "and `rnn.neuron.v` of `rnn.neuron` (ALIF) from one step to the next") in summary
    assert ("the model (Net) carries hidden states `rnn.neuron.a` and `rnn.neuron.v` of "
            "`rnn.neuron` (ALIF) into hidden state `m` of the model (Net)") in summary
    assert "hidden state `m` of the model (Net) between positions" in summary
    assert ("`pre.bias` and `pre.kernel` of `pre` (ETPLinear) are not traced: the operation's "
            "output reaches hidden state only through another trainable ETP operation "
            "(`rnn.dense_i` (ETPLinear))") in summary
    assert "Exact on this model (strict=True accepts them): RTRL()" in summary
    assert "eqn" not in summary  # equation numbers are details
    # Hidden groups, with their states, shape, S and module.
    assert "  hidden groups (2):" in lines
    assert "    [0] m  shape=(2, 4)  S=1  of the model (Net)" in lines
    assert "    [1] rnn.neuron.a, rnn.neuron.v  shape=(2, 4)  S=2  of `rnn.neuron` (ALIF)" in lines
    # Traced Params, and the operations that trace them.
    assert ("  Params learning by eligibility traces (5): rnn.dense_h.kernel, rnn.dense_i.bias, "
            "rnn.dense_i.kernel, rnn.neuron.tau.weight, w") in lines
    assert any(line.startswith("    `rnn.neuron.tau` (ETPElemwise): weight<-rnn.neuron.tau.weight"
                               " -> group 1 [rnn.neuron.a, rnn.neuron.v]  (etp_elemwise, eqn ")
               for line in lines)
    # Same-step Params, each with its module and reason.
    start = lines.index("  Params with same-step gradients (4):")
    same_step = lines[start + 1:start + 5]
    assert [line.split(":")[0].strip() for line in same_step] == [
        "out.bias", "out.kernel", "pre.bias", "pre.kernel"]
    assert all("in `out` (ETPLinear): reaches no hidden state (a readout)" in line
               for line in same_step[:2])
    assert all("in `pre` (ETPLinear): reaches hidden state only through another trainable ETP "
               "operation" in line for line in same_step[2:])
    # The details of the approximations keep the equations.
    assert any("moved-positions" in line and "hidden group ['m']" in line for line in lines)
    # What the normalisation pass did, located by module (the spike function is opaque; the
    # recurrent layer reads its neuron's spikes once, in its own step).
    assert any("custom_jvp_call at eqn" in line and "in `rnn` (RecurrentSpiking) kept opaque" in line
               for line in lines)


def test_short_report_gives_groups_params_and_each_approximation_in_a_few_lines():
    model = Net(nnx.Rngs(0))
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    text = graph.report()
    assert str(graph) == text
    lines = text.splitlines()
    assert lines[:2] == ["ETraceGraph (diagonal scope)",
                         "approximations (5; strict=True refuses them):"]
    # one sentence per approximation (two share one), the exact alternatives once, groups,
    # Params (traced, same-step) and where the details are
    assert len(lines) == 2 + 4 + 5
    sentences = lines[2:6]
    assert sentences[0].startswith("  - `rnn.dense_h` (ETPLinear) couples different units of "
                                   "hidden states `rnn.neuron.a` and `rnn.neuron.v`")
    assert sentences[0].endswith("drop the recurrent weights if the task allows (a spiking "
                                 "layer fed only forward, ETPLinear into LIF or ALIF, has exact "
                                 "DRTRL() traces).")
    assert not any(re.search(r"(?<![A-Z_])RTRL\(\)|windowed mode", s) for s in sentences)
    assert lines[6].startswith("  Exact on this model (strict=True accepts them): RTRL() (for "
                               "small models")
    assert lines[6].endswith(" Or windowed mode (chunk_size=K in etrace_grad or online_grad) is "
                             "exact within K steps.")
    assert lines[7:] == [
        "hidden groups (2): the model (Net): m (2, 4); `rnn.neuron` (ALIF): a and v (2, 4)",
        ("Params learning by eligibility traces (5): into `rnn.neuron` (ALIF): rnn.dense_i.bias, "
         "rnn.dense_i.kernel, rnn.dense_h.kernel and rnn.neuron.tau.weight; into the model "
         "(Net): w"),
        ("Params with same-step gradients only (4): `out` (ETPLinear): bias and kernel (reaches "
         "no hidden state (a readout)); `pre` (ETPLinear): bias and kernel (reaches hidden state "
         "only through another trainable ETP operation)"),
        "report(verbose=True) adds every Param, the traced operations and the equations"]
    assert "eqn" not in text and "details:" not in text


def test_report_names_a_normalisation_and_an_lru_readout_by_module():
    with jax.enable_x64(True):
        norm = braintrace.compile_graph(MODELS["layernorm"].build(),
                                        jnp.zeros((BATCH, IN), jnp.float64))
        stack = braintrace.compile_graph(MODELS["lru-2-layers"].build(),
                                         jnp.zeros((BATCH, IN), jnp.float64))
    mixing = next(a for a in norm.approximations if a.kind == "output-mixing")
    assert mixing.summary.startswith(
        "Between `drive.lin` (ETPLinear) and hidden state `h` of the model (Leaky), "
        "`drive.norm` (nnx.LayerNorm) mixes units")
    assert "reduce_sum" in mixing.detail and "reduce_sum" not in mixing.summary
    readout = next(a for a in stack.approximations if a.param_paths == ("modules.0.C_im",))
    assert readout.summary.startswith(
        "`modules.0.C_im`, `modules.0.C_re` and `modules.0.D` of `modules.0` (LRU) are not "
        "traced: the operation's output reaches hidden state only through another trainable "
        "ETP operation (`modules.1` (LRU))")
    # excluded alike in one module: one sentence for the three operations
    assert {a.summary for a in stack.approximations
            if a.param_paths[0] in ("modules.0.C_re", "modules.0.D")} == {readout.summary}
    assert "RTRL() follows it exactly" in readout.summary
    coupling = next(a for a in stack.approximations if a.kind == "hidden-coupling")
    assert ("`modules.0` (LRU) carries hidden states `modules.0.h_im` and `modules.0.h_re` of "
            "`modules.0` (LRU) into hidden states `modules.1.h_im` and `modules.1.h_re` of "
            "`modules.1` (LRU)") in coupling.summary


def test_learner_report_and_strict_speak_for_the_algorithm():
    with jax.enable_x64(True):
        x = jnp.zeros((BATCH, IN), jnp.float64)
        learner = braintrace.compile(MODELS["lif"].build(), braintrace.UORO(), x)
        text = learner.report()
        with pytest.raises(ValueError, match="strict=True") as error:
            braintrace.compile(MODELS["lif"].build(), braintrace.UORO(), x, strict=True)
    lines = text.splitlines()
    assert lines[:3] == ["algorithm: uoro (UORO)", "ETraceGraph (full scope)",
                         "approximations (1; strict=True refuses them):"]
    assert lines[3].startswith("  - UORO (seed 0) keeps a random rank-one estimate of RTRL's "
                               "influence")
    assert "`modules.0.bias` and `modules.0.kernel`" in lines[3]
    assert lines[4].startswith("  Exact on this model (strict=True accepts them): DRTRL(), "
                               "RTRL()")
    message = str(error.value)
    assert "the gradient of algorithm 'uoro' (UORO) on this model is approximate" in message
    assert "random-estimate" in message  # the details follow the sentences


def test_pure_step_function_report_names_operations_without_modules():
    def step(params, hidden, x):
        h = 0.5 * hidden["h"] @ params["u"] + braintrace.matmul(x, params["w"])
        return {"h": h}, h

    graph = braintrace.compile_graph(
        step, jnp.ones((B, I)), params={"u": jnp.ones((H, H)), "w": jnp.ones((I, H))},
        hidden={"h": jnp.zeros((B, H))})
    coupling = next(a for a in graph.approximations if a.kind == "hidden-coupling")
    assert coupling.summary.startswith("operations 'dot_general' couple different units of "
                                       "hidden state `h`")
    untraced = next(a for a in graph.approximations if a.kind == "untraced-path")
    assert untraced.summary.startswith("`u` reaches hidden state through operations "
                                       "'dot_general'")
    assert "    <an operation>" not in graph.report()


def test_report_of_a_clean_model_has_no_warnings_and_no_same_step_params():
    model = layers.Stateful(layers.MinGRUCell(I, H, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    assert "  Params with same-step gradients (0): -" in graph.report(verbose=True).splitlines()
    text = graph.report()
    assert "same-step" not in text and "warnings" not in text


def test_report_names_the_coupled_scope():
    model = layers.Stateful(layers.SimpleCell(I, H, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)), scope="coupled")
    assert graph.report().splitlines()[0] == "ETraceGraph (coupled scope)"


class Leaky(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (I, H)))
        self.tau = nnx.Param(jnp.linspace(0.5, 2.0, H))
        self.h = braintrace.HiddenState(jnp.zeros(H))

    def __call__(self, x):
        self.h[...] = (braintrace.element_wise(self.tau[...], jax.nn.sigmoid) * self.h[...]
                       + braintrace.matmul(x, self.w[...]))
        return jnp.tanh(self.h[...])


def pure_step(params, hidden, x):
    h = (braintrace.element_wise(params["tau"], jax.nn.sigmoid) * hidden["h"]
         + braintrace.matmul(x, params["w"]))
    return {"h": h}, jnp.tanh(h)


def test_pure_step_function_compiles_to_the_same_graph_as_the_module():
    model = Leaky()
    braintrace.init_states(model, B)
    model.h[...] = jax.random.normal(jax.random.key(1), (B, H))
    x = jax.random.normal(jax.random.key(2), (B, I))
    params = {"w": model.w[...], "tau": model.tau[...]}
    hidden = {"h": model.h[...]}
    g_fn = braintrace.compile_graph(pure_step, x, params=params, hidden=hidden)
    g_mod = braintrace.compile_graph(model, x)
    assert g_fn.param_paths == g_mod.param_paths == ("tau", "w")
    assert g_fn.hidden_paths == ("h",) and g_fn.other_paths == ()
    assert g_fn.traced_param_paths == ("tau", "w")
    assert [g.paths for g in g_fn.groups] == [("h",)]
    _, p, h, o = split_model(model)
    P, Hs, O = jax.tree.leaves(p), jax.tree.leaves(h), jax.tree.leaves(o)
    d_fn, df_fn = programs.jacobians(
        g_fn, StepLeaves(jax.tree.leaves(params), jax.tree.leaves(hidden), [], [x]))
    d_mod, df_mod = programs.jacobians(g_mod, StepLeaves(P, Hs, O, [x]))
    for a, b in zip([*d_fn, *df_fn], [*d_mod, *df_mod]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    (y, h_out, other_out), _ = programs.forward(
        g_fn, StepLeaves(jax.tree.leaves(params), jax.tree.leaves(hidden), [], [x]))
    want_h, want_y = pure_step(params, hidden, x)
    np.testing.assert_allclose(y[0], want_y, rtol=1e-6)
    np.testing.assert_allclose(h_out[0], want_h["h"], rtol=1e-6)
    assert other_out == []


def test_pure_step_function_with_bare_array_state_and_pytree_output():
    def step(w, h, x):
        new = 0.9 * h + braintrace.matmul(x, w)
        return new, {"y": new, "norm": jnp.sum(new ** 2)}

    graph = braintrace.compile_graph(step, jnp.ones((B, I)), params=jnp.ones((I, H)),
                                     hidden=jnp.zeros((B, H)))
    assert graph.param_paths == ("params",) and graph.hidden_paths == ("hidden",)
    assert graph.traced_param_paths == ("params",)
    assert graph.num_outputs == 2
    assert jax.tree.structure(graph.out_treedef.unflatten([0, 0])) == jax.tree.structure(
        {"y": 0, "norm": 0})


def test_naming_modules_leaves_the_model_and_its_classes_as_they_were():
    model = Net(nnx.Rngs(0))
    braintrace.init_states(model, B)
    classes = [type(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    assert [type(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)] == classes
    assert graph.modules.classes["rnn.neuron"] == "ALIF"
    assert graph.modules.eqn_module(graph.relations[0].eqn_index) == "rnn.dense_i"
