"""Embedding, einsum / general linear, grouped and sparse layers: Flax parity and exact D-RTRL.

* Flax parity: ``ETPEmbed``, ``ETPEinsum`` and ``ETPLinearGeneral`` build the same
  Params as ``nnx.Embed``/``nnx.Einsum``/``nnx.LinearGeneral`` under the same
  ``rngs`` and return the same outputs.
* Each layer driving a leaky state (``h' = 0.8 h + layer(x)``): D-RTRL, compiled
  with ``strict=True``, equals float64 BPTT (``jax.grad`` through ``lax.scan``)
  to 1e-8 relative over ``T = 5`` steps.
* The rules the layers rely on: the embedding's pullback is a scatter-add, the
  grouped layer is a block-diagonal dense layer, the sparse layer's event-driven
  path equals its dense-input path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_gradient_contract import assert_live, bptt, mse, relative_errors

import braintrace
from braintrace import layers

F64 = jnp.float64
BATCH, STEPS, OUT = 2, 5, 2


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


class LeakyOn(nnx.Module):
    """``h' = 0.8 h + drive(x)`` on a state of shape ``shape``, read out by ``tanh(h) W``."""

    def __init__(self, drive: nnx.Module, shape: tuple[int, ...]):
        self.drive = drive
        self.sample_shape = shape
        self.h = braintrace.HiddenState(jnp.zeros(shape, F64))
        self.out = layers.ETPLinear(int(np.prod(shape)), OUT, param_dtype=F64, rngs=nnx.Rngs(12))

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.drive(x)
        h = self.h[...]
        return self.out(jnp.tanh(h.reshape(*h.shape[:h.ndim - len(self.sample_shape)], -1)))


def _leaky(drive: nnx.Module, shape: tuple[int, ...]) -> LeakyOn:
    model = LeakyOn(drive, shape)
    braintrace.init_states(model, BATCH)
    model.h.set_value(0.5 * jax.random.normal(jax.random.key(7), model.h.shape, F64))
    return model


def _targets(seed: int = 3) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (STEPS, BATCH, OUT), F64)


def _inputs(shape: tuple[int, ...], seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (STEPS, BATCH, *shape), F64)


def _assert_d_rtrl_equals_bptt(build, xs) -> float:
    ys = _targets()
    want = bptt(build(), xs, ys)
    assert_live(want)
    learner = braintrace.compile(build(), braintrace.D_RTRL(), xs[0], strict=True)
    got = learner.etrace_grad(xs, ys, mse, reduction="sum")
    assert not learner.graph.approximations
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-8, errors
    return max(errors.values())


# -- embedding ---------------------------------------------------------------------------------


def test_embed_matches_flax_embed():
    ours, flax = layers.ETPEmbed(7, 3, rngs=nnx.Rngs(0)), nnx.Embed(7, 3, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(
        jnp.shape, nnx.state(flax, nnx.Param))
    np.testing.assert_array_equal(ours.embedding[...], flax.embedding[...])
    x = jnp.array([[0, 6, 3], [2, 9, -1]])  # 9: out of range, NaN rows in both
    np.testing.assert_array_equal(ours(x), flax(x))
    q = jnp.ones((4, 3))
    np.testing.assert_allclose(ours.attend(q), flax.attend(q), rtol=1e-6)
    with pytest.raises(ValueError, match="integer"):
        ours(jnp.ones(3))


def test_embed_pullback_is_a_scatter_add_not_a_one_hot_matmul():
    table, x = jnp.ones((50, 4)), jnp.array([3, 7, 3])
    rule = braintrace.etp_embed_batched_p.rule("xy_to_dw")
    jaxpr = str(jax.make_jaxpr(lambda d: rule(x, d, {"embedding": table}))(jnp.ones((3, 4))))
    assert "scatter-add" in jaxpr and "dot_general" not in jaxpr
    grad = rule(x, jnp.arange(12.0).reshape(3, 4), {"embedding": table})["embedding"]
    np.testing.assert_array_equal(grad[3], jnp.array([8.0, 10.0, 12.0, 14.0]))
    assert float(jnp.abs(grad).sum()) == float(jnp.arange(12.0).sum())


def test_d_rtrl_equals_bptt_on_embedding_to_leaky_state(x64):
    xs = jax.random.randint(jax.random.key(1), (STEPS, BATCH), 0, 6)
    xs = xs.at[2].set(xs[0])  # a row visited twice: its trace must keep decaying in between
    build = lambda: _leaky(layers.ETPEmbed(6, 3, param_dtype=F64, rngs=nnx.Rngs(0)), (3,))
    _assert_d_rtrl_equals_bptt(build, xs)


def test_embedding_refuses_io_dim_algorithms_with_a_clear_error(x64):
    model = _leaky(layers.ETPEmbed(6, 3, param_dtype=F64, rngs=nnx.Rngs(0)), (3,))
    xs = jax.random.randint(jax.random.key(1), (STEPS, BATCH), 0, 6)
    learner = braintrace.compile(model, braintrace.ES_D_RTRL(0.5), xs[0])
    with pytest.raises(TypeError, match="integer indices.*D_RTRL"):
        learner.etrace_grad(xs, _targets(), mse)


# -- einsum and general linear -------------------------------------------------------------------

EINSUMS = [("nta,hab->nthb", (4, 2, 3), (4, 3), (5, 6, 2)),
           ("...d,dhk->...hk", (3, 2, 4), (2, 4), (5, 3)),
           ("ab,bc->ac", (3, 4), (4,), (6, 3)),
           ("bi,oi->bo", (4, 3), None, (6, 3))]


@pytest.mark.parametrize(("spec", "kernel_shape", "bias_shape", "x_shape"), EINSUMS,
                         ids=[e[0] for e in EINSUMS])
def test_einsum_matches_flax_einsum(spec, kernel_shape, bias_shape, x_shape):
    ours = layers.ETPEinsum(spec, kernel_shape, bias_shape, rngs=nnx.Rngs(0))
    flax = nnx.Einsum(spec, kernel_shape, bias_shape, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(
        jnp.shape, nnx.state(flax, nnx.Param))
    np.testing.assert_array_equal(ours.kernel[...], flax.kernel[...])
    if bias_shape is not None:  # a non-zero bias, the same in both
        bias = jax.random.normal(jax.random.key(4), bias_shape)
        ours.bias.set_value(bias)
        flax.bias.set_value(bias)
    x = jax.random.normal(jax.random.key(2), x_shape)
    np.testing.assert_allclose(ours(x), flax(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("spec", "x_shape", "kernel_shape", "message"), [
    ("ab,bc->c", (2, 3), (3, 4), "input axes summed without a weight"),
    ("ab,bcd->ac", (2, 3), (3, 4, 5), "kernel axes summed without an input"),
    ("nab,bc->nca", (2, 3, 4), (4, 5), "batch axes .* must lead the output"),
    ("ab,bb->ab", (2, 3), (3, 3), "repeats an axis letter"),
    ("ab->b", (2, 3), (3,), "exactly two operands"),
])
def test_einsum_refuses_strings_the_rules_cannot_trace(spec, x_shape, kernel_shape, message):
    with pytest.raises(ValueError, match=message):
        braintrace.einsum(spec, jnp.ones(x_shape), jnp.ones(kernel_shape))


LINEAR_GENERALS = [((2, 3), (4, 5), (-2, -1), (7, 2, 3)), (3, 4, -1, (2, 5, 3)),
                   ((2, 3), 4, (0, 2), (2, 5, 3))]


@pytest.mark.parametrize(("in_features", "out_features", "axis", "x_shape"), LINEAR_GENERALS)
def test_linear_general_matches_flax_linear_general(in_features, out_features, axis, x_shape):
    ours = layers.ETPLinearGeneral(in_features, out_features, axis=axis, rngs=nnx.Rngs(0))
    flax = nnx.LinearGeneral(in_features, out_features, axis=axis, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(
        jnp.shape, nnx.state(flax, nnx.Param))
    np.testing.assert_array_equal(ours.kernel[...], flax.kernel[...])
    bias = jax.random.normal(jax.random.key(4), ours.bias.shape)
    ours.bias.set_value(bias)
    flax.bias.set_value(bias)
    x = jax.random.normal(jax.random.key(2), x_shape)
    np.testing.assert_allclose(ours(x), flax(x), rtol=1e-6, atol=1e-6)


def test_linear_general_refuses_batch_axis():
    with pytest.raises(ValueError, match="batch_axis is not supported"):
        layers.ETPLinearGeneral(3, 4, axis=1, batch_axis={0: 2}, rngs=nnx.Rngs(0))


def test_d_rtrl_equals_bptt_on_einsum_to_leaky_state(x64):
    build = lambda: _leaky(layers.ETPEinsum("bd,dhk->bhk", (3, 2, 2), (2, 2), param_dtype=F64,
                                            rngs=nnx.Rngs(0)), (2, 2))
    _assert_d_rtrl_equals_bptt(build, _inputs((3,)))


def test_d_rtrl_equals_bptt_on_linear_general_to_leaky_state(x64):
    build = lambda: _leaky(layers.ETPLinearGeneral((2, 3), (2, 2), axis=(-2, -1),
                                                   param_dtype=F64, rngs=nnx.Rngs(0)), (2, 2))
    _assert_d_rtrl_equals_bptt(build, _inputs((2, 3)))


# -- grouped ------------------------------------------------------------------------------------


def test_grouped_linear_is_a_block_diagonal_linear():
    grouped = layers.ETPGroupedLinear(6, 9, 3, rngs=nnx.Rngs(0))
    grouped.bias.set_value(jax.random.normal(jax.random.key(5), (9,)))
    dense = layers.ETPLinear(6, 9, rngs=nnx.Rngs(1))
    dense.kernel.set_value(jax.scipy.linalg.block_diag(*grouped.kernel[...]))
    dense.bias.set_value(grouped.bias[...])
    x = jax.random.normal(jax.random.key(2), (5, 6))
    np.testing.assert_allclose(grouped(x), dense(x), rtol=1e-6, atol=1e-6)
    assert jax.tree.map(jnp.shape, nnx.state(grouped, nnx.Param)) == {
        "bias": (9,), "kernel": (3, 2, 3)}


def test_grouped_linear_initialises_each_block_like_nnx_linear():
    kernel = layers.ETPGroupedLinear(512, 64, 4, rngs=nnx.Rngs(0)).kernel[...]
    fan_in = 512 // 4
    np.testing.assert_allclose(float(jnp.std(kernel)), fan_in ** -0.5, rtol=0.05)
    with pytest.raises(ValueError, match="multiples of num_groups=3"):
        layers.ETPGroupedLinear(6, 4, 3, rngs=nnx.Rngs(0))


def test_d_rtrl_equals_bptt_on_grouped_to_leaky_state(x64):
    build = lambda: _leaky(layers.ETPGroupedLinear(4, 6, 2, param_dtype=F64,
                                                   rngs=nnx.Rngs(0)), (6,))
    _assert_d_rtrl_equals_bptt(build, _inputs((4,)))


# -- sparse -------------------------------------------------------------------------------------

MASK = np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 1]], bool)


def _sparse(**kw) -> layers.ETPSparseLinear:
    return layers.ETPSparseLinear(4, 3, connectivity=MASK, param_dtype=F64, rngs=nnx.Rngs(0), **kw)


def test_sparse_linear_is_a_masked_dense_map():
    layer = layers.ETPSparseLinear(4, 3, connectivity=MASK, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param)) == {"bias": (3,), "weight": (7,)}
    layer.bias.set_value(jnp.arange(3.0))
    dense = jnp.zeros((4, 3)).at[np.nonzero(MASK)].set(layer.weight[...])
    x = jax.random.normal(jax.random.key(2), (5, 4))
    np.testing.assert_allclose(layer(x), x @ dense + jnp.arange(3.0), rtol=1e-6, atol=1e-6)
    pre, post = np.nonzero(MASK)
    by_index = layers.ETPSparseLinear(4, 3, connectivity=(pre, post), rngs=nnx.Rngs(0))
    assert by_index.connectivity == layer.connectivity
    np.testing.assert_array_equal(by_index.weight[...], layer.weight[...])


@pytest.mark.parametrize(("connectivity", "message"), [
    (np.ones((3, 3), bool), "boolean mask of shape \\(4, 3\\)"),
    (([0, 4], [1, 1]), "out of range"),
    (([0, 0], [1, 1]), "more than once"),
])
def test_sparse_linear_refuses_bad_connectivity(connectivity, message):
    with pytest.raises(ValueError, match=message):
        layers.ETPSparseLinear(4, 3, connectivity=connectivity, rngs=nnx.Rngs(0))


def test_sparse_event_driven_path_equals_the_dense_input_path(x64):
    layer = _sparse()
    spikes = jax.random.bernoulli(jax.random.key(3), 0.5, (6, 4))
    floats = spikes.astype(F64)
    jaxpr = str(jax.make_jaxpr(lambda x: layer(x))(spikes))
    assert "max_events=4" in jaxpr  # the event path was taken
    np.testing.assert_array_equal(layer(spikes), layer(floats))

    def grads(x):
        return nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)

    for got, want in zip(jax.tree.leaves(grads(spikes)), jax.tree.leaves(grads(floats)),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    crowded = _sparse(max_events=1)  # more active inputs than max_events: NaN, not a silent cut
    out = crowded(jnp.array([[True, True, False, False], [False, False, True, False]]))
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))


@pytest.mark.parametrize("spiking", [False, True], ids=["real-input", "spike-input"])
def test_d_rtrl_equals_bptt_on_sparse_to_leaky_state(x64, spiking):
    xs = _inputs((4,))
    if spiking:
        xs = xs > 0.3
    error = _assert_d_rtrl_equals_bptt(lambda: _leaky(_sparse(), (3,)), xs)
    assert error <= 1e-8


def test_sparse_trace_is_per_connection(x64):
    learner = braintrace.compile(_leaky(_sparse(), (3,)), braintrace.D_RTRL(), _inputs((4,))[0])
    (relation,) = [r for r in learner.graph.relations if r.primitive.name.startswith("etp_sparse")]
    shapes = {tuple(a.shape) for a in jax.tree.leaves(learner.traces)}
    assert (BATCH, int(MASK.sum())) in shapes and (BATCH, 4, 3) not in shapes
    assert relation.operands == {"weight": 1, "bias": 2}
