"""OptimizedLSTMCell (Flax parity, approximate D-RTRL) and MinLSTMCell (exact D-RTRL)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import randomize_hidden
from flax import nnx
from flax.nnx.nn import dtypes
from helpers import bptt_grads as bptt
from helpers import mse, primitive_names
from test_gradient_contract import assert_live, relative_errors

import braintrace
from braintrace import layers

F64 = jnp.float64
IN, HID, B = 3, 5, 2


def _state(cell):
    return nnx.state(cell, nnx.Param)


def test_optimized_lstm_has_flax_params_and_draws_the_same_init():
    theirs = nnx.OptimizedLSTMCell(IN, HID, rngs=nnx.Rngs(0))
    ours = layers.OptimizedLSTMCell(IN, HID, rngs=nnx.Rngs(0))
    assert (jax.tree.map(lambda v: (v.shape, v.dtype), _state(ours))
            == jax.tree.map(lambda v: (v.shape, v.dtype), _state(theirs)))
    jax.tree.map(np.testing.assert_array_equal, _state(ours), _state(theirs))


def _loaded_pair(**kw):
    theirs = nnx.OptimizedLSTMCell(IN, HID, bias_init=nnx.initializers.normal(),
                                   rngs=nnx.Rngs(1), **kw)
    ours = layers.OptimizedLSTMCell(IN, HID, rngs=nnx.Rngs(2), **kw)
    nnx.update(ours, nnx.state(theirs))
    return theirs, ours


def test_optimized_lstm_steps_like_flax_directly_in_nnx_rnn_and_under_jit():
    theirs, ours = _loaded_pair()
    x = jax.random.normal(jax.random.key(0), (4, IN))
    carry = theirs.initialize_carry(x.shape, nnx.Rngs(0), nnx.initializers.normal())
    jax.tree.map(np.testing.assert_array_equal, ours(carry, x), theirs(carry, x))
    jitted = nnx.jit(lambda cell, c, x: cell(c, x))
    jax.tree.map(np.testing.assert_array_equal, jitted(ours, carry, x), jitted(theirs, carry, x))
    xs = jax.random.normal(jax.random.key(1), (B, 6, IN))
    np.testing.assert_array_equal(nnx.RNN(ours)(xs), nnx.RNN(theirs)(xs))


def test_optimized_lstm_initialize_carry_draws_as_flax():
    theirs, ours = _loaded_pair()
    for carry_init in (None, nnx.initializers.normal()):
        jax.tree.map(np.testing.assert_array_equal,
                     ours.initialize_carry((4, IN), nnx.Rngs(3), carry_init),
                     theirs.initialize_carry((4, IN), nnx.Rngs(3), carry_init))
    assert [c.shape for c in ours.initialize_carry((4, IN))] == [(4, HID), (4, HID)]
    with pytest.raises(ValueError, match="OptimizedLSTMCell.initialize_carry.*needs rngs"):
        ours.initialize_carry((4, IN), carry_init=nnx.initializers.normal())


def test_optimized_lstm_honours_dtype_and_promote_dtype():
    calls = []

    def promote(arrays, dtype=None):
        calls.append(dtype)
        return dtypes.promote_dtype(arrays, dtype=dtype)

    theirs, ours = _loaded_pair(dtype=jnp.bfloat16, promote_dtype=promote)
    x = jnp.ones((2, IN))
    carry = ours.initialize_carry(x.shape)
    (c, _), y = ours(carry, x)
    assert calls == [jnp.bfloat16, jnp.bfloat16]  # both fused maps promote through it
    (want_c, _), want_y = theirs(carry, x)
    assert (c.dtype, y.dtype) == (want_c.dtype, want_y.dtype)
    np.testing.assert_array_equal(y, want_y)


def test_optimized_lstm_binds_two_dense_primitives_and_no_dot_general():
    cell = layers.OptimizedLSTMCell(IN, HID, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(cell)
    x = jnp.ones((4, IN))
    names = primitive_names(lambda s, c, x: nnx.merge(graphdef, s)(c, x), state,
                            cell.initialize_carry(x.shape), x)
    assert "etp_dense_batched" in names and "dot_general" not in names


class Readout(nnx.Module):
    """``Stateful(cell)`` -> tanh -> ETPLinear readout (float64)."""

    def __init__(self, cell):
        self.cell = layers.Stateful(cell)
        self.out = layers.ETPLinear(HID, 2, param_dtype=F64, rngs=nnx.Rngs(9))

    def __call__(self, x):
        return self.out(jnp.tanh(self.cell(x)))


def _built(cls):
    model = Readout(cls(IN, HID, param_dtype=F64, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, batch_size=B)
    return randomize_hidden(model)


def _data(steps):
    xs = jax.random.normal(jax.random.key(1), (steps, B, IN), F64)
    return xs, jax.random.normal(jax.random.key(2), (steps, B, 2), F64)


def test_optimized_lstm_compiles_with_its_approximation_reported_and_equals_bptt_at_t1():
    with jax.enable_x64(True):
        xs, ys = _data(1)
        with pytest.raises(ValueError, match="strict"):
            braintrace.compile(_built(layers.OptimizedLSTMCell), "d_rtrl", xs[0], strict=True)
        learner = braintrace.compile(_built(layers.OptimizedLSTMCell), "d_rtrl", xs[0])
        assert learner.graph.approximations and "approximat" in learner.report()
        assert {"cell.cell.dense_i.kernel", "cell.cell.dense_h.kernel"} <= set(
            learner.graph.traced_param_paths)
        want = bptt(_built(layers.OptimizedLSTMCell), xs, ys)
        assert_live(want)
        errors = relative_errors(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)
    assert max(errors.values()) <= 1e-10, errors


def test_min_lstm_mixes_carry_and_candidate_with_normalised_gates():
    cell = layers.MinLSTMCell(IN, 4, rngs=nnx.Rngs(0))
    x, h = jnp.ones(IN), jnp.full(4, 2.0)
    f, i = jax.nn.sigmoid(cell.dense_f(x)), jax.nn.sigmoid(cell.dense_i(x))
    new_h, y = cell(h, x)
    np.testing.assert_allclose(new_h, (f * h + i * cell.dense_h(x)) / (f + i), rtol=1e-6)
    np.testing.assert_array_equal(new_h, y)
    with pytest.raises(ValueError, match=r"MinLSTMCell.*expected input shape \(3,\)"):
        cell(h, jnp.ones(5))


def test_min_lstm_d_rtrl_equals_float64_bptt_and_compiles_strictly():
    with jax.enable_x64(True):
        xs, ys = _data(5)
        want = bptt(_built(layers.MinLSTMCell), xs, ys)
        assert_live(want)
        learner = braintrace.compile(_built(layers.MinLSTMCell), braintrace.D_RTRL(), xs[0],
                                     strict=True)
        assert {f"cell.cell.dense_{k}.{p}" for k in "fih" for p in ("kernel", "bias")} == set(
            learner.graph.traced_param_paths)
        errors = relative_errors(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)
    assert len(errors) == 8 and max(errors.values()) <= 1e-8, errors


def test_optimized_lstm_constructor_has_flax_arguments_and_plain_defaults():
    theirs = inspect.signature(nnx.OptimizedLSTMCell.__init__).parameters
    ours = inspect.signature(layers.OptimizedLSTMCell.__init__).parameters
    assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind)
                                                         for p in theirs.values()]
    for name, p in theirs.items():
        if not callable(p.default) or p.default is dtypes.promote_dtype:
            assert ours[name].default == p.default, name
