"""Spike rates per spiking layer: measured as stepping the model by hand counts them, flagged
silent below 1% and saturated above 50%, and logged by ``OnlineTrainer.fit``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers

T, B, I = 12, 3, 2


def three_layers():
    """A layer that fires now and then, one that never fires, one that fires at every step."""
    model = nnx.Sequential(layers.ETPLinear(I, 4, rngs=nnx.Rngs(0)), layers.LIF(4, tau=5.0),
                           layers.ETPLinear(4, 3, rngs=nnx.Rngs(1)), layers.LIF(3),
                           layers.ETPLinear(3, 2, rngs=nnx.Rngs(2)), layers.LIF(2))
    first, second, third = model.layers[0], model.layers[2], model.layers[4]
    first.kernel[...] = jnp.full((I, 4), 0.4) * jnp.array([0.5, 1.0, 1.5, 2.0])
    second.kernel[...] = jnp.zeros((4, 3))
    second.bias[...] = jnp.full(3, -1.0)   # far below threshold: silent
    third.kernel[...] = jnp.zeros((3, 2))
    third.bias[...] = jnp.full(2, 5.0)     # far above threshold: a spike at every step
    return model


def inputs():
    return jax.random.bernoulli(jax.random.key(0), 0.5, (T, B, I)).astype(jnp.float32)


@nnx.jit
def _step(model, x):
    model(x)
    return [layer.spikes() for layer in model.layers if isinstance(layer, layers.LIF)]


def by_hand(model, xs):
    """Each LIF's mean spikes, stepping a copy of the model one step at a time."""
    model = nnx.clone(model)
    braintrace.init_states(model, B)
    spikes = [_step(model, x) for x in xs]
    return [float(np.mean([step[i] for step in spikes])) for i in range(len(spikes[0]))]


def test_rates_are_the_mean_spikes_of_each_layer_stepped_by_hand():
    model, xs = three_layers(), inputs()
    rates = braintrace.spike_rates(model, xs, batch_size=B)
    assert list(rates.rates) == ["layers.1", "layers.3", "layers.5"]
    np.testing.assert_allclose(list(rates.rates.values()), by_hand(model, xs), rtol=1e-6)
    assert 0.01 < rates.rates["layers.1"] < 0.5  # the three cases the flags tell apart
    assert rates.rates["layers.3"] == 0.0 and rates.rates["layers.5"] == 1.0


def test_the_flag_fires_on_a_silent_and_a_saturated_layer_and_not_on_a_healthy_one():
    rates = braintrace.spike_rates(three_layers(), inputs(), batch_size=B)
    assert rates.flagged == {"layers.3": "silent", "layers.5": "saturated"}
    line = rates.line()
    assert "layers.1 " in line and "layers.3 0.0% SILENT" in line
    assert "layers.5 100.0% SATURATED" in line and "< 1%" in line and "> 50%" in line
    healthy = braintrace.SpikeRates({"a": 0.011, "b": 0.49})
    assert healthy.flagged == {} and "(" not in healthy.line()  # no warning on healthy layers
    edges = braintrace.SpikeRates({"a": 0.0099, "b": 0.51})
    assert edges.flagged == {"a": "silent", "b": "saturated"}


def test_a_model_without_spiking_layers_has_no_rates():
    model = nnx.Sequential(layers.ETPLinear(I, 3, rngs=nnx.Rngs(0)))
    assert braintrace.spike_rates(model, inputs(), batch_size=B).rates == {}


def test_the_model_is_untouched():
    model = three_layers()
    braintrace.init_states(model, B)
    before = jax.tree.map(np.asarray, nnx.state(model))
    braintrace.spike_rates(model, inputs(), batch_size=B)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray,
                                                                     nnx.state(model)))


def test_a_wrong_batch_size_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size"):
        braintrace.spike_rates(three_layers(), inputs(), batch_size=0)


def test_fit_logs_the_rates_of_its_first_and_last_batch(capsys):
    model = three_layers()
    learner = braintrace.compile(model, "bptt", jnp.zeros((B, I)), batch_size=B)
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.0), loss_fn=mse)
    batches = [(inputs(), jnp.zeros((T, B, 2)))] * 3
    history = trainer.fit(batches, progress=True)
    assert [r["step"] for r in history.spike_rates] == [1, 3]
    assert history.spike_rates[0]["layers.3"] == 0.0
    logged = capsys.readouterr().out  # above the progress bar (on stderr)
    assert logged.count("SILENT") == 2 and logged.count("SATURATED") == 2
    assert "step 1: spike rates: layers.1" in logged
    quiet = trainer.fit(batches, progress=False)
    assert len(quiet.spike_rates) == 2 and "spike rates" not in capsys.readouterr().out
