"""``layers.ETPConv`` is a drop-in for ``nnx.Conv``; ``layers.ConvLIF`` is LIF on a conv grid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import primitive_names

import braintrace
from braintrace import layers


def _case(in_features: int, out_features: int, kernel_size, **kwargs) -> dict:
    return {"in_features": in_features, "out_features": out_features,
            "kernel_size": kernel_size, **kwargs}


PARITY = {
    "1d-valid": _case(2, 3, 3, padding="VALID"),
    "1d-strided-same-grouped-nobias": _case(4, 6, (2,), strides=2, feature_group_count=2,
                                            use_bias=False),
    "1d-causal-dilated": _case(2, 3, 3, padding="CAUSAL", kernel_dilation=2),
    "2d-same-strided": _case(3, 4, (3, 3), strides=2),
    "2d-valid-grouped": _case(4, 2, (2, 3), strides=(1, 2), padding="VALID",
                              feature_group_count=2),
    "2d-explicit-dilated": _case(2, 3, (2, 2), padding=((1, 0), (2, 1)), kernel_dilation=(2, 1)),
    "2d-input-dilation": _case(2, 3, (3, 3), padding=1, input_dilation=(2, 1)),
    "2d-circular": _case(2, 3, (3, 2), padding="CIRCULAR"),
    "3d-same": _case(2, 2, (2, 2, 2), strides=(1, 2, 1)),
}
SPATIAL = {1: (7,), 2: (6, 5), 3: (3, 4, 3)}


def _spatial(kwargs) -> tuple[int, ...]:
    size = kwargs["kernel_size"]
    return SPATIAL[1 if isinstance(size, int) else len(size)]


def _flat_params(model):
    return {".".join(map(str, path)): var for path, var in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", sorted(PARITY))
def test_etp_conv_has_the_params_and_outputs_of_nnx_conv(name):
    kwargs = PARITY[name]
    ours, theirs = layers.ETPConv(**kwargs, rngs=nnx.Rngs(3)), nnx.Conv(**kwargs, rngs=nnx.Rngs(3))
    mine, flax_params = _flat_params(ours), _flat_params(theirs)
    assert mine.keys() == flax_params.keys() == ({"kernel", "bias"} if kwargs.get(
        "use_bias", True) else {"kernel"})
    for key, var in mine.items():
        assert type(var) is type(flax_params[key])
        assert var.shape == flax_params[key].shape and var.dtype == flax_params[key].dtype
        np.testing.assert_array_equal(var[...], flax_params[key][...])
    for batch in [(), (2, 3)] if name in ("1d-valid", "2d-same-strided") else [(2,)]:
        x = jax.random.normal(jax.random.key(0), (*batch, *_spatial(kwargs),
                                                  kwargs["in_features"]))
        got, want = jax.jit(lambda x: (ours(x), theirs(x)))(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["2d-valid-grouped", "1d-strided-same-grouped-nobias"])
def test_etp_conv_loads_flax_weights_and_runs_the_etp_primitive(name):
    kwargs = PARITY[name]
    theirs = nnx.Conv(**kwargs, rngs=nnx.Rngs(5))
    ours = layers.ETPConv(**kwargs, rngs=nnx.Rngs(0))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    x = jax.random.normal(jax.random.key(1), (2, *_spatial(kwargs), kwargs["in_features"]))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    graphdef, state = nnx.split(ours)
    names = primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    assert "etp_conv_batched" in names and "conv_general_dilated" not in names


def test_etp_conv_applies_a_mask_as_nnx_conv_does():
    mask = jnp.tril(jnp.ones((3, 2, 4)))
    kwargs = _case(2, 4, 3, mask=mask, padding="VALID")
    ours, theirs = layers.ETPConv(**kwargs, rngs=nnx.Rngs(0)), nnx.Conv(**kwargs, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 6, 2))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"in_features": 3, "out_features": 4, "kernel_size": 3, "feature_group_count": 2},
     "feature_group_count=2 must be a positive int dividing in_features=3"),
    ({"in_features": 2, "out_features": 4, "kernel_size": 3, "mask": jnp.ones((3, 3))},
     r"mask of shape \(3, 3\) must have the kernel's shape \(3, 2, 4\)"),
    ({"in_features": 2, "out_features": 4, "kernel_size": 3, "preferred_element_type": jnp.float32},
     "preferred_element_type is not supported"),
    ({"in_features": 2, "out_features": 4, "kernel_size": 3,
          "conv_general_dilated": lambda *a, **k: None}, "custom conv_general_dilated"),
])
def test_etp_conv_refuses_what_it_does_not_support(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layers.ETPConv(**kwargs, rngs=nnx.Rngs(0))


def test_etp_conv_names_the_expected_input_shape():
    layer = layers.ETPConv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\(\*batch, spatial, spatial, 3\)"):
        layer(jnp.ones((2, 8, 8, 2)))
    with pytest.raises(ValueError, match="CAUSAL.*1-D"):
        layers.ETPConv(3, 4, (3, 3), padding="CAUSAL", rngs=nnx.Rngs(0))(jnp.ones((8, 8, 3)))


def test_conv_lif_is_lif_at_every_position_and_channel():
    layer = layers.ConvLIF(1, 2, (3, 3), input_size=(5, 5), strides=2, tau=10.0,
                           rngs=nnx.Rngs(0))
    assert layer.output_shape == layer.neuron.v.shape == (3, 3, 2)
    flat = nnx.to_flat_state(nnx.state(layer, braintrace.HiddenState))
    assert [".".join(map(str, path)) for path, _ in flat] == ["neuron.v"]
    braintrace.init_states(layer, batch_size=2)
    xs = jax.random.uniform(jax.random.key(0), (6, 2, 5, 5, 1), minval=0.0, maxval=2.0)
    lif = layers.LIF(2, tau=10.0)
    lif.v = braintrace.HiddenState(jnp.zeros((2, 3, 3, 2)))

    @nnx.jit
    def run(layer, lif, xs):
        return jnp.stack([layer(x) for x in xs]), jnp.stack([lif(layer.conv(x)) for x in xs])

    spikes, want = run(layer, lif, xs)
    np.testing.assert_array_equal(spikes, want)
    np.testing.assert_allclose(layer.neuron.v[...], lif.v[...], rtol=1e-6)
    assert 0 < float(jnp.mean(spikes)) < 1


def test_conv_lif_checks_its_frame_shape_and_input_size():
    layer = layers.ConvLIF(2, 3, 3, input_size=(8,), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"does not end with the frame shape \(8, 2\)"):
        layer(jnp.ones((7, 2)))
    with pytest.raises(ValueError, match="one entry per spatial axis"):
        layers.ConvLIF(2, 3, (3, 3), input_size=(8,), rngs=nnx.Rngs(0))


def test_conv_lif_with_refractoriness_and_learnable_tau_keeps_per_position_states():
    layer = layers.ConvLIF(1, 2, 3, input_size=(6,), refractory_steps=2, learn_tau=True,
                           rngs=nnx.Rngs(0))
    assert layer.neuron.ref_steps.shape == layer.neuron.v.shape == (6, 2)
    assert layer.neuron.tau.weight.shape == (2,)
    braintrace.init_states(layer, batch_size=3)
    assert layer(jnp.ones((3, 6, 1))).shape == (3, 6, 2)
