"""Recurrent cells: Flax parity (direct, nnx.jit, nnx.RNN), ETP primitives, the Stateful wrapper."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import braintrace
from braintrace import layers

PAIRS = [(nnx.SimpleCell, layers.SimpleCell), (nnx.GRUCell, layers.GRUCell),
         (nnx.LSTMCell, layers.LSTMCell)]
IDS = ["SimpleCell", "GRUCell", "LSTMCell"]




def _loaded_pair(flax_cls, our_cls):
    theirs = flax_cls(3, 5, bias_init=nnx.initializers.normal(), rngs=nnx.Rngs(1))
    ours = our_cls(3, 5, rngs=nnx.Rngs(2))
    nnx.update(ours, nnx.state(theirs))
    return theirs, ours


@pytest.mark.parametrize("flax_cls,our_cls", PAIRS, ids=IDS)
def test_cell_param_tree_equals_flax_and_same_seed_gives_same_params(flax_cls, our_cls):
    theirs, ours = flax_cls(3, 5, rngs=nnx.Rngs(0)), our_cls(3, 5, rngs=nnx.Rngs(0))
    assert (jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param))
            == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(ours, nnx.Param),
                 nnx.state(theirs, nnx.Param))


@pytest.mark.parametrize("flax_cls,our_cls", PAIRS, ids=IDS)
def test_cell_step_matches_flax_directly_and_under_nnx_jit(flax_cls, our_cls):
    theirs, ours = _loaded_pair(flax_cls, our_cls)
    x = jax.random.normal(jax.random.key(0), (4, 3))
    carry = jax.tree.map(lambda c: c + 0.3, theirs.initialize_carry(x.shape, nnx.Rngs(0)))
    jax.tree.map(np.testing.assert_array_equal, ours(carry, x), theirs(carry, x))
    jitted = nnx.jit(lambda cell, c, x: cell(c, x))
    jax.tree.map(np.testing.assert_array_equal, jitted(ours, carry, x), jitted(theirs, carry, x))
    jax.tree.map(np.testing.assert_array_equal, ours.initialize_carry(x.shape),
                 theirs.initialize_carry(x.shape, nnx.Rngs(0)))


@pytest.mark.parametrize("flax_cls,our_cls", PAIRS, ids=IDS)
def test_cell_inside_nnx_rnn_matches_flax(flax_cls, our_cls):
    theirs, ours = _loaded_pair(flax_cls, our_cls)
    xs = jax.random.normal(jax.random.key(1), (2, 6, 3))
    np.testing.assert_array_equal(nnx.RNN(ours)(xs), nnx.RNN(theirs)(xs))
    jitted = nnx.jit(lambda rnn, xs: rnn(xs))
    np.testing.assert_array_equal(jitted(nnx.RNN(ours), xs), jitted(nnx.RNN(theirs), xs))


@pytest.mark.parametrize("our_cls,count", [(layers.SimpleCell, 2), (layers.GRUCell, 2),
                                           (layers.LSTMCell, 8), (layers.MinGRUCell, 2)],
                         ids=IDS + ["MinGRUCell"])
def test_cell_step_binds_one_dense_primitive_per_linear_and_no_dot_general(our_cls, count):
    cell = our_cls(3, 5, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(cell)
    x = jnp.ones((4, 3))
    jaxpr = jax.make_jaxpr(lambda s, c, x: nnx.merge(graphdef, s)(c, x))(
        state, cell.initialize_carry(x.shape), x)
    eqns = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert eqns.count("etp_dense_batched") == count
    assert "dot_general" not in eqns


def test_min_gru_is_a_convex_mix_of_carry_and_candidate():
    cell = layers.MinGRUCell(3, 4, rngs=nnx.Rngs(0))
    x, h = jnp.ones(3), jnp.full(4, 2.0)
    z = jax.nn.sigmoid(cell.dense_z(x))
    new_h, y = cell(h, x)
    np.testing.assert_allclose(new_h, (1 - z) * h + z * cell.dense_n(x), rtol=1e-6)
    np.testing.assert_array_equal(new_h, y)


def test_cell_initialize_carry_with_random_init_needs_rngs():
    cell = layers.GRUCell(3, 4, rngs=nnx.Rngs(0))
    carry = cell.initialize_carry((2, 3), nnx.Rngs(0), carry_init=nnx.initializers.normal())
    assert carry.shape == (2, 4) and np.any(np.asarray(carry))
    with pytest.raises(ValueError, match="GRUCell.initialize_carry: a carry_init needs rngs"):
        cell.initialize_carry((2, 3), carry_init=nnx.initializers.normal())


@pytest.mark.parametrize("our_cls", [layers.SimpleCell, layers.GRUCell, layers.LSTMCell,
                                     layers.MinGRUCell])
def test_cell_with_mismatched_input_names_the_cell_and_expected_shape(our_cls):
    cell = our_cls(3, 5, rngs=nnx.Rngs(0))
    carry = cell.initialize_carry((4, 3))
    with pytest.raises(ValueError, match=rf"{our_cls.__name__}.*expected input shape \(4, 3\)"):
        cell(carry, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=rf"{our_cls.__name__}.*expected input shape \(4, 3\)"):
        cell(carry, jnp.ones((4, 7)))


@pytest.mark.parametrize("flax_cls,our_cls", PAIRS, ids=IDS)
def test_stateful_steps_equal_the_cell_scanned_by_nnx_rnn(flax_cls, our_cls):
    theirs, ours = _loaded_pair(flax_cls, our_cls)
    xs = jax.random.normal(jax.random.key(2), (2, 5, 3))
    model = layers.Stateful(ours)
    braintrace.init_states(model, batch_size=2)
    step = nnx.jit(lambda m, x: m(x))
    ys = jnp.stack([step(model, xs[:, t]) for t in range(xs.shape[1])], axis=1)
    np.testing.assert_allclose(ys, nnx.RNN(theirs)(xs), rtol=1e-6, atol=1e-6)


def test_stateful_keeps_lstm_c_and_h_as_hidden_states_of_one_shape():
    model = layers.Stateful(layers.LSTMCell(3, 5, rngs=nnx.Rngs(0)))
    states = nnx.to_flat_state(nnx.state(model, braintrace.HiddenState))
    assert {path: var.shape for path, var in states} == {("carry", 0): (5,), ("carry", 1): (5,)}
    braintrace.init_states(model, batch_size=3)
    assert [s.shape for s in model.carry] == [(3, 5), (3, 5)]


def test_stateful_wraps_a_flax_cell_given_rngs():
    model = layers.Stateful(nnx.GRUCell(3, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    assert model(jnp.ones(3)).shape == (4,)
    assert model.carry.shape == (4,)
