"""Hidden states: (re)initialisation for a batch size, shape errors, optimisers skip them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers


def _snn(rngs):
    return nnx.Sequential(layers.ETPLinear(3, 4, rngs=rngs), layers.LIF(4),
                          layers.LeakyReadout(4, 2, rngs=rngs))


def test_init_states_batches_resets_and_unbatches_every_hidden_state():
    model = _snn(nnx.Rngs(0))
    assert model.layers[1].v.shape == (4,) and model.layers[2].y.shape == (2,)
    braintrace.init_states(model, batch_size=5)
    assert model.layers[1].v.shape == (5, 4) and model.layers[2].y.shape == (5, 2)
    model(jnp.ones((5, 3)))
    assert np.any(np.asarray(model.layers[2].y[...]))
    braintrace.init_states(model, batch_size=3)
    assert model.layers[2].y.shape == (3, 2) and not np.any(np.asarray(model.layers[2].y[...]))
    assert model(jnp.ones((3, 3))).shape == (3, 2)
    braintrace.init_states(model)
    assert model(jnp.ones(3)).shape == (2,)


def test_init_states_restores_a_non_uniform_initial_value_in_its_dtype():
    class Model(nnx.Module):
        def __init__(self):
            self.h = braintrace.HiddenState(jnp.arange(3.0))
            self.c = braintrace.HiddenState(jnp.full(2, -65.0, jnp.bfloat16))

    model = Model()
    braintrace.init_states(model, batch_size=2)
    np.testing.assert_array_equal(model.h[...], [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(model.c[...], np.full((2, 2), -65.0))
    assert model.c[...].dtype == jnp.bfloat16
    assert not model.h[...].weak_type and not model.c[...].weak_type


def test_explicit_init_overrides_the_construction_value():
    state = braintrace.HiddenState(jnp.zeros(2), init=0.5)
    np.testing.assert_array_equal(state.initial_value(3), np.full((3, 2), 0.5))


def test_repeated_init_states_keeps_the_graph_definition():
    model = _snn(nnx.Rngs(0))
    braintrace.init_states(model, batch_size=2)
    first = nnx.graphdef(model)
    braintrace.init_states(model, batch_size=2)
    assert nnx.graphdef(model) == first


def test_init_states_rejects_a_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        braintrace.init_states(layers.LIF(2), batch_size=0)


def test_mismatched_batch_names_the_layer_its_path_and_the_expected_shape():
    model = _snn(nnx.Rngs(0))
    braintrace.init_states(model, batch_size=8)
    with pytest.raises(ValueError) as info:
        model(jnp.ones((4, 3)))
    message = str(info.value)
    assert "LIF at 'layers.1'" in message and "'layers.1.v'" in message
    assert "expected input shape (8, 4)" in message
    assert "braintrace.init_states(model, batch_size=4)" in message


def test_unbatched_state_with_batched_input_says_to_init_states():
    lif = layers.LIF(4)
    with pytest.raises(ValueError, match=r"LIF.*expected input shape \(4,\).*batch_size=2"):
        lif(jnp.ones((2, 4)))


@pytest.mark.parametrize("make,features", [
    (lambda: layers.LIF(4), 4), (lambda: layers.ALIF(4), 4), (lambda: layers.ExpSynapse(4), 4),
    (lambda: layers.LeakyReadout(3, 4, rngs=nnx.Rngs(0)), 3),
    (lambda: layers.RecurrentSpiking(3, layers.LIF(4), rngs=nnx.Rngs(0)), 3),
    (lambda: layers.Stateful(layers.GRUCell(3, 4, rngs=nnx.Rngs(0))), 3),
], ids=["LIF", "ALIF", "ExpSynapse", "LeakyReadout", "RecurrentSpiking", "Stateful"])
def test_mismatched_features_name_the_layer_and_the_expected_shape(make, features):
    layer = make()
    braintrace.init_states(layer, batch_size=2)
    name = type(layer).__name__
    with pytest.raises(ValueError, match=rf"{name}.*wrong feature size; expected input shape "
                                         rf"\(2, {features}\)"):
        layer(jnp.ones((2, features + 1)))
    with pytest.raises(ValueError, match=rf"{name}.*expected input shape \(2, {features}\)"):
        layer(jnp.ones((3, features)))


def test_stateful_error_names_the_wrapped_cell_and_its_path():
    model = layers.Stateful(layers.LSTMCell(3, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"Stateful\(LSTMCell\).*expected input shape \(3,\)"):
        model(jnp.ones(5))
    stack = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), model)
    braintrace.init_states(stack, batch_size=2)
    with pytest.raises(ValueError, match=r"Stateful\(LSTMCell\) at 'layers.1'.*'layers.1.carry.0'"):
        stack(jnp.ones((3, 2)))


def test_recurrent_spiking_error_names_its_own_path():
    stack = nnx.Sequential(layers.RecurrentSpiking(3, layers.LIF(4), rngs=nnx.Rngs(0)))
    braintrace.init_states(stack, batch_size=2)
    with pytest.raises(ValueError, match=r"RecurrentSpiking at 'layers.0'.*batch_size=5"):
        stack(jnp.ones((5, 3)))


def test_errors_are_raised_while_tracing_under_nnx_jit():
    lif = layers.LIF(4)
    braintrace.init_states(lif, batch_size=2)
    with pytest.raises(ValueError, match=r"LIF.*\(2, 4\)"):
        nnx.jit(lambda m, x: m(x))(lif, jnp.ones((3, 4)))


def test_optimizer_over_params_trains_every_layer_and_skips_hidden_states():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=rngs),
                           layers.Stateful(layers.MinGRUCell(4, 4, rngs=rngs)),
                           layers.ALIF(4, learn_tau=True), layers.LeakyReadout(4, 2, rngs=rngs))
    braintrace.init_states(model, batch_size=2)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    xs = jax.random.normal(jax.random.key(0), (3, 2, 3))

    def loss_fn(model):
        return sum(jnp.sum(model(x) ** 2) for x in xs)

    @nnx.jit
    def train_step(model, optimizer):
        grads = nnx.grad(loss_fn)(model)
        hidden = nnx.state(model, braintrace.HiddenState)
        optimizer.update(model, grads)
        return hidden

    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    hidden = train_step(model, optimizer)
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    still = [path for path, value in nnx.to_flat_state(before)
             if np.array_equal(value[...], after[path][...])]
    assert len(after) == 11  # LoRALinear 4, MinGRU 4, ALIF tau 1, readout 2
    # lora_b starts at zero, so lora_a's first gradient is zero; every other Param moves
    assert still == [("layers", 0, "lora", "lora_a")]
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, braintrace.HiddenState), hidden)
