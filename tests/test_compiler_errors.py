"""Bad input to ``compile_graph``: a clear error each, naming the path."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, I, H = 2, 3, 4


def test_model_without_hidden_state_is_an_error_naming_its_variables():
    class Carry(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.h = nnx.Variable(jnp.zeros((B, H)))  # recurrent, but not a HiddenState

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, self.w[...])
            return self.h[...]

    with pytest.raises(ValueError, match=r"Carry has no braintrace\.HiddenState.*'h'"):
        braintrace.compile_graph(Carry(), jnp.ones((B, I)))


def test_feedforward_model_without_state_is_an_error():
    with pytest.raises(ValueError, match=r"ETPLinear has no braintrace\.HiddenState"):
        braintrace.compile_graph(layers.ETPLinear(I, H, rngs=nnx.Rngs(0)), jnp.ones((B, I)))


def test_model_without_params_is_an_error():
    model = layers.LIF(H)
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"LIF has no nnx\.Param"):
        braintrace.compile_graph(model, jnp.ones((B, H)))


def test_model_without_etp_primitive_is_an_error_naming_the_params():
    class PlainLinear(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(I, H, rngs=rngs)
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + self.dense(x)
            return self.h[...]

    model = PlainLinear(nnx.Rngs(0))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"PlainLinear: no ETP primitive reads a Param.*"
                                         r"'dense\.bias', 'dense\.kernel'.*ETPLinear"):
        braintrace.compile_graph(model, jnp.ones((B, I)))


def test_model_with_an_untraced_param_besides_etp_ones_compiles_and_reports_it():
    class Bias(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.b = nnx.Param(jnp.zeros(H))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, self.w[...]) + self.b[...]
            return self.h[...]

    model = Bias()
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    assert graph.traced_param_paths == ("w",)
    assert "b: no ETP primitive reads it as a trainable input" in graph.report(verbose=True)


def test_param_written_in_the_step_is_an_error_naming_the_path():
    class Writes(nnx.Module):
        def __init__(self):
            self.inner = layers.ETPLinear(I, H, rngs=nnx.Rngs(0))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + self.inner(x)
            self.inner.bias[...] = self.inner.bias[...] + 1.0
            return self.h[...]

    model = Writes()
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"writes the Param 'inner\.bias' inside its step"):
        braintrace.compile_graph(model, jnp.ones((B, I)))


@pytest.mark.parametrize("shape, match", [
    ((5, I), (r"Stateful\(GRUCell\).*input of shape \(5, 3\).*hidden state 'carry'.*"
              r"expected input shape \(2, 3\).*init_states\(model, batch_size=5\)")),
    ((B, I + 1), (r"Stateful\(GRUCell\).*input of shape \(2, 4\) has the wrong feature "
                  r"size; expected input shape \(2, 3\)")),
])
def test_wrong_example_shape_surfaces_the_layer_error(shape, match):
    model = layers.Stateful(layers.GRUCell(I, H, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=match) as info:
        braintrace.compile_graph(model, jnp.ones(shape))
    assert any("hidden states: 'carry' (2, 4)" in n for n in info.value.__notes__)


def test_wrong_example_shape_in_a_stack_names_the_layer_path():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(layers.Stateful(layers.GRUCell(I, H, rngs=rngs)),
                           layers.Stateful(layers.LSTMCell(H, 5, rngs=rngs)))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"Stateful\(GRUCell\) at 'layers\.0'"):
        braintrace.compile_graph(model, jnp.ones((B, H)))


def test_wrong_example_shape_in_a_custom_model_gets_a_note_naming_the_states():
    class Custom(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = 0.5 * self.h[...] + braintrace.matmul(x, self.w[...])
            return self.h[...]

    model = Custom()
    braintrace.init_states(model, B)
    with pytest.raises(Exception) as info:
        braintrace.compile_graph(model, jnp.ones((B, I + 2)))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "tracing one step of Custom on an example input of shape(s) [(2, 5)]" in notes
    assert "hidden states: 'h' (2, 4)" in notes


@pytest.mark.parametrize("write", ["index", "set_value"])
def test_unbatched_hidden_state_is_an_error_naming_the_state(write):
    class Custom(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((I, H)))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            new = 0.5 * self.h[...] + braintrace.matmul(x, self.w[...])
            if write == "index":
                self.h[...] = new  # NNX itself refuses to broadcast (2, 4) into (4,)
            else:
                self.h.set_value(new)
            return new

    with pytest.raises(ValueError) as info:
        braintrace.compile_graph(Custom(), jnp.ones((B, I)))
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    if write == "index":
        assert "hidden states: 'h' (4,)" in message
    else:
        assert ("writes hidden state 'h' with shape (2, 4) and dtype float32, but it holds "
                "shape (4,)") in message
        assert "braintrace.init_states(model, batch_size=2)" in message


def test_pure_step_returning_a_reshaped_state_is_an_error_naming_the_path():
    def step(params, hidden, x):
        h = 0.5 * hidden["h"] + braintrace.matmul(x, params["w"])
        return {"h": h[:1]}, h

    with pytest.raises(ValueError, match=r"step writes hidden state 'h' with shape \(1, 4\)"):
        braintrace.compile_graph(step, jnp.ones((B, I)), params={"w": jnp.ones((I, H))},
                                 hidden={"h": jnp.zeros((B, H))})


def test_pure_step_needs_params_and_hidden():
    def step(params, hidden, x):
        return hidden, x

    with pytest.raises(TypeError, match="needs params= and hidden="):
        braintrace.compile_graph(step, jnp.ones((B, I)))
    with pytest.raises(ValueError, match="`hidden` has no array leaves"):
        braintrace.compile_graph(step, jnp.ones((B, I)), params={"w": jnp.ones(2)}, hidden={})


def test_scope_must_be_known():
    model = layers.Stateful(layers.MinGRUCell(I, H, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match="scope must be 'diagonal', 'coupled' or 'full'"):
        braintrace.compile_graph(model, jnp.ones((B, I)), scope="total")


def test_vmapped_etp_primitive_warns_that_its_weights_drop_out():
    class Vmapped(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((B, I, H)))
            self.v = nnx.Param(jnp.ones((I, H)))
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            per_sample = jax.vmap(braintrace.matmul)(x, self.w[...])
            self.h[...] = 0.5 * self.h[...] + per_sample + braintrace.matmul(x, self.v[...])
            return self.h[...]

    model = Vmapped()
    braintrace.init_states(model, B)
    with pytest.warns(UserWarning, match="decomposed into plain JAX ops"):
        graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    assert graph.traced_param_paths == ("v",)
    assert any("decomposed" in w for w in graph.warnings)
    assert "w: no ETP primitive reads it" in graph.report(verbose=True)
