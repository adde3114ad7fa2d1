"""ETPLinear, ETPLoRA, ETPLoRALinear, ETPElemwise: Flax parity and ETP primitives in the jaxpr."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import primitive_names

from braintrace import layers

SHAPES = [(3,), (4, 3), (2, 5, 3)]


def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)




def _randomise(module, seed):
    """Fills every Param of ``module`` with random values (LoRA's ``lora_b`` starts at zero)."""
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(module, jax.tree.unflatten(
        treedef, [jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]))


def _param_tree(module):
    return jax.tree.map(lambda v: (type(v).__name__, v.shape), nnx.state(module, nnx.Param),
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_bias", [True, False])
def test_etp_linear_matches_nnx_linear_after_loading_its_state(shape, use_bias):
    theirs = nnx.Linear(3, 4, use_bias=use_bias, rngs=nnx.Rngs(1))
    ours = layers.ETPLinear(3, 4, use_bias=use_bias, rngs=nnx.Rngs(2))
    assert _param_tree(ours) == _param_tree(theirs)
    nnx.update(ours, nnx.state(theirs))
    x = _x(shape)
    np.testing.assert_array_equal(ours(x), theirs(x))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(ours, x), theirs(x))


def test_etp_linear_initialises_like_nnx_linear_from_the_same_seed():
    theirs = nnx.Linear(3, 4, bias_init=nnx.initializers.normal(), rngs=nnx.Rngs(7))
    ours = layers.ETPLinear(3, 4, bias_init=nnx.initializers.normal(), rngs=nnx.Rngs(7))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(ours), nnx.state(theirs))


def test_etp_linear_promotes_integer_spikes_and_honours_dtype():
    layer = layers.ETPLinear(3, 2, rngs=nnx.Rngs(0))
    assert layer(jnp.array([1, 0, 1], jnp.int32)).dtype == jnp.float32
    half = layers.ETPLinear(3, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert half(jnp.ones(3)).dtype == jnp.bfloat16


@pytest.mark.parametrize("shape,primitive", [((3,), "etp_dense"), ((4, 3), "etp_dense_batched"),
                                             ((2, 5, 3), "etp_dense_batched")])
def test_etp_linear_step_binds_the_dense_primitive(shape, primitive):
    graphdef, state = nnx.split(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)))
    names = primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state, _x(shape))
    assert primitive in names
    assert "dot_general" not in names


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_base", [False, True])
def test_etp_lora_matches_nnx_lora_after_loading_its_state(shape, with_base):
    rngs_t, rngs_o = nnx.Rngs(1), nnx.Rngs(2)
    theirs = nnx.LoRA(3, 2, 4, base_module=nnx.Linear(3, 4, rngs=rngs_t) if with_base else None,
                      rngs=rngs_t)
    ours = layers.ETPLoRA(3, 2, 4, base_module=(layers.ETPLinear(3, 4, rngs=rngs_o)
                                                if with_base else None), rngs=rngs_o)
    assert _param_tree(ours) == _param_tree(theirs)
    _randomise(theirs, 3)
    nnx.update(ours, nnx.state(theirs))
    x = _x(shape)
    np.testing.assert_array_equal(ours(x), theirs(x))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(ours, x), theirs(x))
    graphdef, state = nnx.split(ours)
    names = primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    assert ("etp_lora" if len(shape) == 1 else "etp_lora_batched") in names
    assert with_base == bool(names & {"etp_dense", "etp_dense_batched"})


def test_etp_lora_initialises_like_nnx_lora_with_zero_lora_b():
    theirs = nnx.LoRA(3, 2, 4, rngs=nnx.Rngs(5))
    ours = layers.ETPLoRA(3, 2, 4, rngs=nnx.Rngs(5))
    assert isinstance(ours.lora_a, nnx.LoRAParam) and isinstance(ours.lora_b, nnx.LoRAParam)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(ours), nnx.state(theirs))
    assert not np.any(np.asarray(ours.lora_b[...]))


@pytest.mark.parametrize("shape", SHAPES)
def test_etp_lora_linear_matches_nnx_lora_linear_after_loading_its_state(shape):
    theirs = nnx.LoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(1))
    ours = layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(2))
    assert _param_tree(ours) == _param_tree(theirs)
    _randomise(theirs, 4)
    nnx.update(ours, nnx.state(theirs))
    x = _x(shape)
    np.testing.assert_array_equal(ours(x), theirs(x))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(ours, x), theirs(x))
    graphdef, state = nnx.split(ours)
    names = primitive_names(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    batched = "_batched" if len(shape) > 1 else ""
    assert {f"etp_dense{batched}", f"etp_lora{batched}"} <= names


def test_etp_lora_linear_only_lora_params_are_lora_params():
    layer = layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(0))
    lora_paths = {path for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.LoRAParam))}
    assert lora_paths == {("lora", "lora_a"), ("lora", "lora_b")}
    assert len(nnx.state(layer, nnx.Param)) == 3  # kernel, bias, lora (Param matches LoRAParam)


def test_etp_elemwise_applies_its_transform_through_the_elementwise_primitive():
    gate = layers.ETPElemwise(jnp.array([0.0, 1.0]), jax.nn.sigmoid)
    np.testing.assert_allclose(gate(), jax.nn.sigmoid(jnp.array([0.0, 1.0])))
    graphdef, state = nnx.split(gate)
    assert "etp_elemwise" in primitive_names(lambda s: nnx.merge(graphdef, s)(), state)
    grad = nnx.grad(lambda m: jnp.sum(m()))(gate)
    np.testing.assert_allclose(grad["weight"][...], jax.nn.sigmoid(jnp.array([0.0, 1.0]))
                               * (1 - jax.nn.sigmoid(jnp.array([0.0, 1.0]))), rtol=1e-6)


def test_exp_decay_is_hashable_and_equal_by_step_size():
    assert layers.ExpDecay(0.5) == layers.ExpDecay(0.5)
    assert hash(layers.ExpDecay(0.5)) == hash(layers.ExpDecay(0.5))
    np.testing.assert_allclose(layers.ExpDecay(0.5)(jnp.array(2.0)), np.exp(-0.25), rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)),
    lambda: layers.ETPLoRA(3, 2, 4, rngs=nnx.Rngs(0)),
    lambda: layers.ETPLoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(0)),
], ids=["ETPLinear", "ETPLoRA", "ETPLoRALinear"])
def test_wrong_feature_size_names_the_layer_and_the_expected_shape(make):
    layer = make()
    with pytest.raises(ValueError, match=rf"{type(layer).__name__}.*\(2, 5\).*\(\.\.\., 3\)"):
        layer(jnp.ones((2, 5)))
