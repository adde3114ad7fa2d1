"""NIR's IF, SumPool2d, AvgPool2d and Flatten nodes: round trips, their meaning in NIR, errors.

Each layer (and a spiking CNN of them) is exported, written, read and imported;
the copy must step exactly as the original, and the graph, stepped by the
forward-Euler simulator written from NIR's node equations (``nir_euler``), must
too. A graph as another tool writes it (IF with ``R = 1``) imports with its gain
in the weights. Pooling and flattening are no obstacle to the compiler: D-RTRL
equals the float64 BPTT oracle on a convolutional IF layer pooled into a readout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import nir
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads
from nir_euler import channels_first, euler_run

import braintrace
from braintrace import layers
from braintrace.nir import from_nir, to_nir

F64 = jnp.float64
DT = 1e-3
T, B = 12, 2


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _conv_if(r, **kwargs):
    return layers.ConvLIF(2, 3, (3, 3), input_size=(6, 6), tau=math.inf, reset="hard", v_th=0.3,
                          param_dtype=F64, rngs=r, **kwargs)


CASES = {
    "IF": (lambda r: layers.IF(5, reset="hard", v_th=0.6, v_reset=-0.1, param_dtype=F64), (5,),
           "IF"),
    "SumPool2d": (lambda r: layers.SumPool2d(2), (6, 6, 2), "SumPool2d"),
    "AvgPool2d": (lambda r: layers.AvgPool2d((3, 2), strides=(2, 1), padding=(1, 0)), (7, 5, 2),
                  "AvgPool2d"),
    "Flatten": (lambda r: layers.Flatten(), (3, 4, 2), "Flatten"),
}
"""Each new layer alone; the convolutional IF (a ConvLIF with ``τ = ∞``) is in the CNN below."""


def _spikes(shape, seed=1, amplitude=0.7):
    return amplitude * jax.random.bernoulli(jax.random.key(seed), 0.4, (T, B, *shape)).astype(F64)


def _run(model, xs):
    """The model's outputs over ``xs`` from rest (one compiled scan: cheaper than eager steps)."""
    return np.asarray(braintrace.evaluate(model, xs, batch_size=xs.shape[1]))


def _through_a_file(graph, tmp_path):
    nir.write(tmp_path / "model.nir", graph)
    return nir.read(tmp_path / "model.nir")


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_new_node_round_trips_through_a_file_and_means_the_same_in_nir(case, tmp_path):
    make, shape, kind = CASES[case]
    model = make(nnx.Rngs(0))
    graph = _through_a_file(to_nir(model, shape, dt=DT), tmp_path)
    assert kind in {type(node).__name__ for node in graph.nodes.values()}
    copy = from_nir(graph, dt=DT, param_dtype=F64)
    assert [type(layer).__name__ for layer in copy.layers] == [type(model).__name__]
    xs = _spikes(shape)
    ours = _run(model, xs)
    assert np.std(ours) > 0
    np.testing.assert_allclose(_run(copy, xs), ours, rtol=0, atol=1e-10)
    np.testing.assert_allclose(euler_run(graph, channels_first(np.asarray(xs)), DT),
                               channels_first(ours), rtol=0, atol=1e-10)


def _cnn(r):
    """A spiking CNN as spyx and snnTorch write to NIR: conv -> IF -> pool -> flatten -> IF."""
    return nnx.Sequential(_conv_if(r), layers.SumPool2d(2), layers.Flatten(),
                          layers.ETPLinear(27, 4, param_dtype=F64, rngs=r),
                          layers.IF(4, reset="hard", v_th=0.5, param_dtype=F64))


def test_a_spiking_cnn_round_trips_and_flattens_in_nirs_order(tmp_path):
    model = _cnn(nnx.Rngs(3))
    graph = to_nir(model, dt=DT)
    assert [type(n).__name__ for n in graph.nodes.values()] == [
        "Input", "Conv2d", "IF", "SumPool2d", "Flatten", "Affine", "IF", "Output"]
    assert graph.nodes["layers.2"].input_type["input"].tolist() == [3, 3, 3]  # channels first
    xs = _spikes((6, 6, 2), seed=2, amplitude=1.0)
    ours = _run(model, xs)
    assert 0 < _run(model.layers[0], xs).mean() < 1 and np.std(ours) > 0
    copy = from_nir(_through_a_file(graph, tmp_path), dt=DT, param_dtype=F64)
    np.testing.assert_allclose(_run(copy, xs), ours, rtol=0, atol=1e-10)
    np.testing.assert_allclose(euler_run(graph, channels_first(np.asarray(xs)), DT), ours,
                               rtol=0, atol=1e-10)
    # the negative control: a Flatten in braintrace's own (channels-last) order means another
    # network in NIR, whose weights after it would read the wrong pixels
    frames = np.asarray(jax.vmap(lambda x: model.layers[1](x))(jnp.asarray(xs)))
    assert not np.array_equal(frames.reshape(T, B, -1),
                              np.asarray(model.layers[2](jnp.asarray(frames))))


def test_a_graph_with_unit_resistances_imports_with_its_gain_in_the_weights():
    rng = np.random.default_rng(0)
    conv = nir.Conv2d(input_shape=(5, 5), weight=rng.normal(size=(2, 1, 2, 2)), stride=1,
                      padding=0, dilation=1, groups=1, bias=np.full(2, 0.1))
    graph = nir.NIRGraph.from_list(  # spyx writes IF with R = 1: the input gain is R·dt
        conv, nir.IF(r=np.ones((2, 4, 4)), v_threshold=np.full((2, 4, 4), 0.002),
                     v_reset=np.zeros((2, 4, 4))),
        nir.AvgPool2d(kernel_size=np.array([2, 2]), stride=np.array([2, 2]),
                      padding=np.array([0, 0])),
        nir.Flatten(input_type={"input": np.array([2, 2, 2])}, start_dim=0, end_dim=-1),
        nir.Linear(weight=rng.normal(size=(3, 8))),
        nir.IF(r=np.ones(3), v_threshold=np.full(3, 0.001), v_reset=np.zeros(3)))
    model = from_nir(graph, dt=DT, param_dtype=F64)
    assert [type(layer).__name__ for layer in model.layers] == [
        "ConvLIF", "AvgPool2d", "Flatten", "ETPLinear", "IF"]
    np.testing.assert_allclose(np.asarray(model.layers[3].kernel), graph.nodes["linear"].weight.T
                               * DT, rtol=1e-12)
    xs = jax.random.bernoulli(jax.random.key(4), 0.5, (T, B, 5, 5, 1)).astype(F64)
    ours = _run(model, xs)
    assert 0 < _run(model.layers[0], xs).mean() < 1 and np.std(ours) > 0
    np.testing.assert_allclose(ours, euler_run(graph, channels_first(np.asarray(xs)), DT),
                               rtol=0, atol=1e-10)


def test_d_rtrl_equals_bptt_through_pooling_and_flatten():
    rngs = nnx.Rngs(5)
    model = nnx.Sequential(
        layers.ConvLIF(1, 2, (2, 2), input_size=(5, 5), padding="VALID", tau=math.inf, v_th=0.4,
                       reset="hard", param_dtype=F64, rngs=rngs),
        layers.SumPool2d(2), layers.Flatten(), layers.ETPLinear(8, 3, param_dtype=F64,
                                                                 rngs=rngs))
    xs = jax.random.bernoulli(jax.random.key(6), 0.5, (6, B, 5, 5, 1)).astype(F64)
    ys = jax.random.normal(jax.random.key(7), (6, B, 3), F64)
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=B, strict=True)
    online = learner.etrace_grad(xs, ys, lambda y, t: jnp.mean((y - t) ** 2), reduction="sum")
    braintrace.init_states(model, B)
    oracle = bptt_grads(model, xs, ys)
    assert float(jnp.abs(oracle["layers"][0]["conv"]["kernel"][...]).max()) > 1e-3  # live
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12),
                 nnx.to_pure_dict(online), nnx.to_pure_dict(oracle))


@pytest.mark.parametrize("model, shape, message", [
    (layers.IF(3), (3,), r"the IF at 'the model itself' uses reset='soft'.*reset='hard'"),
    (layers.IF(3, reset="hard", refractory_steps=1), (3,), r"the IF at .* has refractory_steps=1"),
    (layers.Flatten(), (12,), (r"the Flatten at 'the model itself' flattens frames of 3 axes but "
                              r"receives \(12,\)")),
    (layers.SumPool2d(2), (6, 2), (r"the SumPool2d at 'the model itself' pools frames \(rows, "
                                  r"columns, channels\) but receives \(6, 2\)")),
])
def test_export_refuses_what_the_new_nodes_cannot_express(model, shape, message):
    with pytest.raises(ValueError, match="to_nir: " + message):
        to_nir(model, shape, dt=DT)


def _pool(kind="SumPool2d", size=2):
    return getattr(nir, kind)(kernel_size=np.array([size, size]), stride=np.array([size, size]),
                              padding=np.array([0, 0]))


@pytest.mark.parametrize("nodes, message", [
    ((nir.Input(np.array([4])), _pool()), (r"node 'sumpool2d' \(SumPool2d\) pools 2-D frames but "
                                          r"receives \[4\]")),
    ((nir.Input(np.array([1, 3, 3])), _pool("AvgPool2d", 4)),
     r"node 'avgpool2d' \(AvgPool2d\) with window \(4, 4\) leaves nothing of frames \[1 3 3\]"),
    ((nir.Input(np.array([2, 4, 4])), nir.Flatten(input_type={"input": np.array([2, 16])},
                                                  start_dim=0)),
     r"node 'flatten' \(Flatten\) flattens inputs of shape \[2, 16\] but receives \[2, 4, 4\]"),
    ((nir.Input(np.array([2, 4, 4])), _pool(),
      nir.IF(r=np.full((2, 2, 2), 1e3), v_threshold=np.ones((2, 2, 2)),
             v_reset=np.zeros((2, 2, 2)))),
     (r"node 'if' is a IF on frames \[2 2 2\]; braintrace has per-position neurons only as "
     r"ConvLIF \(a Conv node followed by a LIF or an IF\)")),
])
def test_import_refuses_what_the_new_layers_cannot_express(nodes, message):
    graph = nir.NIRGraph.from_list(*nodes[1:], type_check=False)
    graph.nodes["input"] = nodes[0]
    with pytest.raises(ValueError, match="from_nir: " + message):
        from_nir(graph, dt=DT)
