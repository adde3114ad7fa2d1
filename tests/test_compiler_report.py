"""``graph.report()`` / ``str(graph)``, and compiling a pure step function."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._compiler import StepLeaves
from braintrace._compiler import programs
from braintrace._compiler import split_model

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


def test_report_lists_groups_traced_params_same_step_params_and_warnings():
    model = Net(nnx.Rngs(0))
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    text = graph.report()
    assert str(graph) == text
    lines = text.splitlines()
    assert lines[0] == "ETraceGraph (diagonal scope)"
    # Hidden groups, with their states, shape and S.
    assert "  hidden groups (2):" in lines
    assert "    [0] m  shape=(2, 4)  S=1" in lines
    assert "    [1] rnn.neuron.a, rnn.neuron.v  shape=(2, 4)  S=2" in lines
    # Traced Params, and the relations that trace them.
    assert ("  Params learning by eligibility traces (5): rnn.dense_h.kernel, rnn.dense_i.bias, "
            "rnn.dense_i.kernel, rnn.neuron.tau.weight, w") in lines
    assert any(line.startswith("    etp_elemwise (eqn ") and "weight<-rnn.neuron.tau.weight"
               in line and "[rnn.neuron.a, rnn.neuron.v]" in line for line in lines)
    # Same-step Params, each with its reason.
    start = lines.index("  Params with same-step gradients (4):")
    same_step = lines[start + 1:start + 5]
    assert [line.split(":")[0].strip() for line in same_step] == [
        "out.bias", "out.kernel", "pre.bias", "pre.kernel"]
    assert all("readout" in line for line in same_step[:2])
    assert all("only through another trainable ETP operation" in line for line in same_step[2:])
    # Approximations: the rolled state's D.
    assert any(line.startswith("  approximations of the temporal credit") for line in lines)
    assert any("moved-positions" in line and "hidden group ['m']" in line for line in lines)
    # What the normalisation pass did (the spike function is kept opaque).
    assert any("custom_jvp_call" in line and "opaque" in line for line in lines)


def test_report_of_a_clean_model_has_no_warnings_and_no_same_step_params():
    model = layers.Stateful(layers.MinGRUCell(I, H, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, B)
    text = braintrace.compile_graph(model, jnp.ones((B, I))).report()
    assert "  Params with same-step gradients (0): -" in text.splitlines()
    assert "warnings" not in text


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
