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
from helpers import bptt_grads as bptt
from helpers import mse
from test_gradient_contract import assert_live, relative_errors

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


def _assert_d_rtrl_equals_bptt(build, xs):
    """Compiles ``build()`` with ``strict=True``; returns the learner and the largest error."""
    ys = _targets()
    want = bptt(build(), xs, ys)
    assert_live(want)
    learner = braintrace.compile(build(), braintrace.D_RTRL(), xs[0], strict=True)
    got = learner.etrace_grad(xs, ys, mse, reduction="sum")
    assert not learner.graph.approximations
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-8, errors
    return learner, max(errors.values())


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
    """Two tokens per sample and step, each driving its own row of a ``(2, F)`` state."""
    xs = jax.random.randint(jax.random.key(1), (STEPS, BATCH, 2), 0, 6)
    xs = xs.at[2].set(xs[0])  # rows visited again: their traces must keep decaying in between
    build = lambda: _leaky(layers.ETPEmbed(6, 3, param_dtype=F64, rngs=nnx.Rngs(0)), (2, 3))
    _assert_d_rtrl_equals_bptt(build, xs)


def test_embedding_refuses_io_dim_algorithms_and_runs_rtrl(x64):
    build = lambda: _leaky(layers.ETPEmbed(6, 3, param_dtype=F64, rngs=nnx.Rngs(0)), (3,))
    xs = jax.random.randint(jax.random.key(1), (STEPS, BATCH), 0, 6)
    with pytest.raises(braintrace.MissingRuleError, match="'init_pp' of primitive 'etp_embed"):
        braintrace.compile(build(), braintrace.ES_D_RTRL(0.5), xs[0])
    ys = _targets()
    got = braintrace.compile(build(), braintrace.RTRL(), xs[0]).etrace_grad(
        xs, ys, mse, reduction="sum")
    assert max(relative_errors(got, bptt(build(), xs, ys)).values()) <= 1e-8


# -- einsum and general linear -------------------------------------------------------------------

EINSUMS = [("nta,hab->nthb", (4, 2, 3), (4, 3), (5, 6, 2)),
           ("...d,dhk->...hk", (3, 2, 4), (2, 4), (5, 3)),
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


LINEAR_GENERALS = [((2, 3), (4, 5), (-2, -1), (7, 2, 3)), ((2, 3), 4, (0, 2), (2, 5, 3))]


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
    layer = _sparse(max_events=3)
    conn, params = layer.connectivity, (layer.weight[...], layer.bias[...])
    spikes = jax.random.bernoulli(jax.random.key(3), 0.5, (6, 4))
    floats = spikes.astype(F64)

    @jax.jit
    def outputs_and_grads(weight, bias, x):
        def loss(weight, bias):
            y = braintrace.sparse_matmul(x, weight, conn, bias, max_events=3)
            return jnp.sum(jnp.sin(y)), y
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(weight, bias)

    spikes = spikes.at[:, 0].set(False)  # at most 3 of the 4 inputs active
    floats = spikes.astype(F64)
    assert "max_events=3" in str(jax.make_jaxpr(layer)(spikes))  # the event path was taken
    assert "max_events=None" in str(jax.make_jaxpr(layer)(floats))
    (dw, db), y = outputs_and_grads(*params, spikes)
    (dw_f, db_f), y_f = outputs_and_grads(*params, floats)
    np.testing.assert_array_equal(y, y_f)
    np.testing.assert_allclose(dw, dw_f, rtol=1e-12)
    np.testing.assert_allclose(db, db_f, rtol=1e-12)
    crowded = braintrace.sparse_matmul(  # more active inputs than max_events: NaN, no silent cut
        jnp.array([[True, True, False, False], [False, False, True, False]]), params[0], conn,
        max_events=1)
    assert np.all(np.isnan(crowded[0])) and np.all(np.isfinite(crowded[1]))


def test_sparse_trace_is_per_connection(x64):
    learner = braintrace.compile(_leaky(_sparse(), (3,)), braintrace.D_RTRL(), _inputs((4,))[0])
    (relation,) = [r for r in learner.graph.relations if r.primitive.name.startswith("etp_sparse")]
    shapes = {tuple(a.shape) for a in jax.tree.leaves(learner.traces)}
    assert (BATCH, int(MASK.sum())) in shapes and (BATCH, 4, 3) not in shapes
    assert relation.operands == {"weight": 1, "bias": 2}


# -- each layer driving its own leaky state, D-RTRL against BPTT ----------------------------------


class LeakyDrives(nnx.Module):
    """Five layers, each driving its own leaky state ``h_k' = 0.8 h_k + layer_k(x)``.

    ``x (B, 6)`` reaches an ``ETPEinsum``, an ``ETPLinearGeneral`` (on ``x`` as
    ``(B, 2, 3)``), an ``ETPGroupedLinear``, and an ``ETPSparseLinear`` twice: on
    ``x`` and, event-driven, on the spikes ``x > 0.3``. One readout of all states.
    """

    def __init__(self):
        kw = {"param_dtype": F64}
        self.drives = nnx.List([
            layers.ETPEinsum("bd,dhk->bhk", (6, 2, 2), (2, 2), rngs=nnx.Rngs(0), **kw),
            layers.ETPLinearGeneral((2, 3), (2, 2), axis=(-2, -1), rngs=nnx.Rngs(1), **kw),
            layers.ETPGroupedLinear(6, 4, 2, rngs=nnx.Rngs(2), **kw),
            layers.ETPSparseLinear(6, 3, connectivity=SPARSE_MASK, rngs=nnx.Rngs(3), **kw),
            layers.ETPSparseLinear(6, 3, connectivity=SPARSE_MASK[::-1], max_events=6,
                                   rngs=nnx.Rngs(4), **kw)])
        self.shapes = ((2, 2), (2, 2), (4,), (3,), (3,))
        self.h = nnx.List([braintrace.HiddenState(jnp.zeros(s, F64)) for s in self.shapes])
        self.out = layers.ETPLinear(4 + 4 + 4 + 3 + 3, OUT, rngs=nnx.Rngs(12), **kw)

    def __call__(self, x):
        inputs = (x, x.reshape(*x.shape[:-1], 2, 3), x, x, x > 0.3)
        features = []
        for drive, h, shape, u in zip(self.drives, self.h, self.shapes, inputs, strict=True):
            h[...] = 0.8 * h[...] + drive(u)
            features.append(jnp.tanh(h[...]).reshape(*x.shape[:-1], -1))
        return self.out(jnp.concatenate(features, axis=-1))


SPARSE_MASK = np.random.default_rng(0).random((6, 3)) < 0.5


def _leaky_drives() -> LeakyDrives:
    model = LeakyDrives()
    braintrace.init_states(model, BATCH)
    for k, h in enumerate(model.h):
        h.set_value(0.5 * jax.random.normal(jax.random.key(7 + k), h.shape, F64))
    return model


def test_d_rtrl_equals_bptt_on_each_layer_driving_a_leaky_state(x64):
    learner, error = _assert_d_rtrl_equals_bptt(_leaky_drives, _inputs((6,)))
    traced = {r.primitive.name for r in learner.graph.relations}
    assert traced == {"etp_einsum_batched", "etp_grouped_batched", "etp_sparse_batched"}
    assert len(learner.graph.relations) == 5 and error <= 1e-8
    # Every trace is shaped like its Param, per sample: (B, *θ) for each of the S = 1 states.
    shapes = {tuple(a.shape) for a in jax.tree.leaves(learner.traces)}
    assert {(BATCH, 6, 2, 2), (BATCH, 2, 3, 2, 2), (BATCH, 2, 3, 2),
            (BATCH, int(SPARSE_MASK.sum()))} <= shapes
