"""NIR interchange (braintrace.nir): round trips, NIR's own semantics and file format, errors.

Round trips (export -> import, in memory and through ``nir.write``/``nir.read``)
show that nothing is lost; a forward-Euler simulator written from NIR's node
equations (``euler_run``) shows that the exported graph means what the layers
compute, so a unit mistake that cancels in a round trip still fails.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import nir
import numpy as np
import pytest
from flax import nnx
from nir_euler import channels_first as _channels_first
from nir_euler import euler_run

import braintrace
from braintrace import layers
from braintrace.nir import from_nir, to_nir

F64 = jnp.float64
DT = 1e-3
T, B = 30, 3


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _lif(n, **kwargs):
    return layers.LIF(n, **{"tau": 8.0, "reset": "hard", "v_th": 0.6, "v_reset": -0.1,
                            "param_dtype": F64, **kwargs})


def _with_taus(layer, attr, values):
    getattr(layer, attr).weight[...] = jnp.asarray(values, F64)
    return layer


CASES = {
    "ETPLinear": lambda r: (layers.ETPLinear(5, 4, param_dtype=F64, rngs=r), (5,)),
    "ETPLinear-no-bias": lambda r: (layers.ETPLinear(5, 4, use_bias=False, param_dtype=F64,
                                                     rngs=r), (5,)),
    "ETPSparseLinear": lambda r: (layers.ETPSparseLinear(
        6, 4, connectivity=np.arange(24).reshape(6, 4) % 3 == 0, param_dtype=F64, rngs=r), (6,)),
    "ETPConv-2d": lambda r: (layers.ETPConv(2, 4, (3, 3), kernel_dilation=2, feature_group_count=2,
                                            param_dtype=F64, rngs=r), (6, 6, 2)),
    "ETPConv-1d": lambda r: (layers.ETPConv(2, 3, 3, strides=2, padding=1, use_bias=False,
                                            param_dtype=F64, rngs=r), (7, 2)),
    "LIF": lambda r: (_lif(5), (5,)),
    "LIF-learnable-tau": lambda r: (_with_taus(_lif(5, learn_tau=True), "tau",
                                               [3.0, 5.0, 8.0, 13.0, 21.0]), (5,)),
    "ExpSynapse": lambda r: (layers.ExpSynapse(5, tau=4.0, param_dtype=F64), (5,)),
    "ExpSynapse-learnable-tau": lambda r: (_with_taus(
        layers.ExpSynapse(3, learn_tau=True, param_dtype=F64), "tau", [2.0, 4.0, 9.0]), (3,)),
    "ExpSynapse-LIF": lambda r: (nnx.Sequential(layers.ExpSynapse(5, tau=3.0, param_dtype=F64),
                                                _lif(5, tau=6.0)), (5,)),
    "LeakyReadout": lambda r: (layers.LeakyReadout(5, 3, tau=6.0, param_dtype=F64, rngs=r), (5,)),
    "LeakyReadout-no-bias": lambda r: (layers.LeakyReadout(5, 3, use_bias=False, param_dtype=F64,
                                                           rngs=r), (5,)),
    "RecurrentSpiking": lambda r: (layers.RecurrentSpiking(5, _lif(6), param_dtype=F64, rngs=r),
                                   (5,)),
    "ConvLIF-2d": lambda r: (layers.ConvLIF(2, 3, (3, 3), input_size=(6, 6), reset="hard",
                                            v_th=0.3, param_dtype=F64, rngs=r), (6, 6, 2)),
    "ConvLIF-1d": lambda r: (layers.ConvLIF(2, 3, 3, input_size=(8,), padding="VALID",
                                            reset="hard", v_th=0.3, param_dtype=F64, rngs=r),
                             (8, 2)),
}

CHAINS = {
    "classifier": lambda r: nnx.Sequential(
        layers.ETPLinear(6, 12, param_dtype=F64, rngs=r), _lif(12),
        layers.ETPLinear(12, 8, param_dtype=F64, rngs=r),
        layers.LeakyReadout(8, 3, tau=5.0, param_dtype=F64, rngs=r)),
    "recurrent": lambda r: nnx.Sequential(
        layers.RecurrentSpiking(6, _lif(10), param_dtype=F64, rngs=r),
        nnx.Sequential(layers.ExpSynapse(10, tau=3.0, param_dtype=F64), _lif(10, v_th=0.3)),
        layers.LeakyReadout(10, 3, param_dtype=F64, rngs=r)),
    "conv": lambda r: nnx.Sequential(
        layers.ConvLIF(2, 4, (3, 3), input_size=(6, 6), reset="hard", v_th=0.3,
                       param_dtype=F64, rngs=r),
        layers.ConvLIF(4, 3, (3, 3), input_size=(6, 6), padding="VALID", reset="hard",
                       v_th=0.3, param_dtype=F64, rngs=r)),
}


def _spikes(shape, seed=1, amplitude=0.7):
    return amplitude * jax.random.bernoulli(jax.random.key(seed), 0.4, (T, B, *shape)).astype(F64)


def _run(model, xs):
    """The model's outputs over ``xs`` from rest (one compiled scan: cheaper than eager steps)."""
    return np.asarray(braintrace.evaluate(model, xs, batch_size=xs.shape[1]))


@pytest.mark.parametrize("via_file", [False, True], ids=["memory", "file"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layer_round_trips_to_the_same_outputs(case, via_file, tmp_path):
    model, shape = CASES[case](nnx.Rngs(0))
    graph = to_nir(model, shape, dt=DT)
    if via_file:
        nir.write(tmp_path / "model.nir", graph)
        graph = nir.read(tmp_path / "model.nir")
    copy = from_nir(graph, dt=DT, param_dtype=F64)
    xs = _spikes(shape)
    ours = _run(model, xs)
    assert np.std(ours) > 0
    np.testing.assert_allclose(_run(copy, xs), ours, rtol=0, atol=1e-10)
    reference = euler_run(graph, _channels_first(np.asarray(xs)), DT)
    np.testing.assert_allclose(_channels_first(ours), reference, rtol=0, atol=1e-10)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_typical_chains_round_trip_and_mean_the_same_in_nir(chain, tmp_path):
    model = CHAINS[chain](nnx.Rngs(3))
    graph = to_nir(model, dt=DT)
    nir.write(tmp_path / "model.nir", graph)
    loaded = nir.read(tmp_path / "model.nir")
    shape = (6, 6, 2) if chain == "conv" else (6,)
    xs = _spikes(shape, seed=2, amplitude=1.0)
    ours = _run(model, xs)
    spikes = _run(model.layers[0], xs)
    assert 0 < spikes.mean() < 1  # the first spiking layer is live
    for g in (graph, loaded):
        np.testing.assert_allclose(_run(from_nir(g, dt=DT, param_dtype=F64), xs), ours,
                                   rtol=0, atol=1e-10)
        np.testing.assert_allclose(euler_run(g, _channels_first(np.asarray(xs)), DT),
                                   _channels_first(ours), rtol=0, atol=1e-10)


def _kinds(graph):
    return {name: type(node).__name__ for name, node in graph.nodes.items()}


def test_exported_node_kinds_and_edges_follow_the_mapping_table():
    graph = to_nir(CHAINS["recurrent"](nnx.Rngs(0)), dt=DT)
    assert _kinds(graph) == {
        "input": "Input", "layers.0.dense_i": "Affine", "layers.0": "NIRGraph",
        "layers.1.layers.1": "CubaLIF", "layers.2.linear": "Affine", "layers.2": "LI",
        "output": "Output"}
    names = list(_kinds(graph))
    assert graph.edges == list(itertools.pairwise(names))
    loop = graph.nodes["layers.0"]
    assert _kinds(loop) == {"input": "Input", "neuron": "LIF", "dense_h": "Linear",
                            "output": "Output"}
    assert set(loop.edges) == {("input", "neuron"), ("neuron", "dense_h"),
                               ("dense_h", "neuron"), ("neuron", "output")}
    conv = to_nir(CHAINS["conv"](nnx.Rngs(0)), dt=DT)
    assert _kinds(conv) == {"input": "Input", "layers.0.conv": "Conv2d", "layers.0.neuron": "LIF",
                            "layers.1.conv": "Conv2d", "layers.1.neuron": "LIF",
                            "output": "Output"}
    assert conv.nodes["input"].output_type["output"].tolist() == [2, 6, 6]
    assert conv.nodes["layers.1.neuron"].tau.shape == (3, 4, 4)
    sparse, _ = CASES["ETPSparseLinear"](nnx.Rngs(0))
    weight = to_nir(sparse, dt=DT).nodes["ETPSparseLinear"].weight
    mask = np.arange(24).reshape(6, 4) % 3 == 0
    assert np.all(weight.T[~mask] == 0) and np.all(weight.T[mask] == np.asarray(sparse.weight))


def test_exported_constants_are_the_euler_equivalents_of_each_layer():
    lif = layers.LIF(4, tau=20.0, dt=0.5, reset="hard", v_th=1.5, v_reset=-0.25, param_dtype=F64)
    node = to_nir(lif, dt=DT).nodes["LIF"]
    alpha = math.exp(-0.5 / 20.0)
    np.testing.assert_allclose(node.tau, DT / (1 - alpha), rtol=1e-14)
    np.testing.assert_allclose(node.r, 1 / (1 - alpha), rtol=1e-14)
    assert np.all(node.v_leak == 0) and np.all(node.v_threshold == 1.5)
    assert np.all(node.v_reset == -0.25)
    cuba = to_nir(nnx.Sequential(layers.ExpSynapse(4, tau=2.0, param_dtype=F64),
                                 layers.LIF(4, tau=10.0, reset="hard", param_dtype=F64)),
                  dt=DT).nodes["layers.1"]
    np.testing.assert_allclose(cuba.tau_syn, DT / (1 - math.exp(-0.5)), rtol=1e-14)
    np.testing.assert_allclose(cuba.w_in, 1 / (1 - math.exp(-0.5)), rtol=1e-14)
    np.testing.assert_allclose(cuba.tau_mem, DT / (1 - math.exp(-0.1)), rtol=1e-14)
    dense = layers.ETPLinear(3, 2, param_dtype=F64, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(to_nir(dense, dt=DT).nodes["ETPLinear"].weight,
                                  np.asarray(dense.kernel).T)


def _foreign_graph(r_lif, r_li):
    """Affine -> LIF -> Affine -> LI as another tool might write it (gains R·dt/τ != 1)."""
    rng = np.random.default_rng(0)
    n, h, o = 4, 6, 2
    return nir.NIRGraph.from_list(
        nir.Affine(weight=rng.normal(size=(h, n)), bias=rng.normal(size=h) * 0.1),
        nir.LIF(tau=np.full(h, 0.02), r=np.full(h, r_lif), v_leak=np.zeros(h),
                v_threshold=np.full(h, 0.05), v_reset=np.zeros(h)),
        nir.Affine(weight=rng.normal(size=(o, h)), bias=np.zeros(o)),
        nir.LI(tau=np.array([0.01, 0.03]), r=np.full(o, r_li), v_leak=np.zeros(o)))


def test_import_folds_a_neuron_input_gain_into_the_weights_before_it():
    graph = _foreign_graph(r_lif=1.0, r_li=2.0)  # Norse-style R = 1: gain dt/τ = 0.05
    model = from_nir(graph, dt=DT, param_dtype=F64)
    assert [type(layer).__name__ for layer in model.layers] == ["ETPLinear", "LIF",
                                                                "LeakyReadout"]
    assert model.layers[2].tau.weight.shape == (2,)  # one τ per unit: learnable per unit
    xs = _spikes((4,), seed=5, amplitude=1.0)
    ours = _run(model, xs)
    assert 0 < _run(nnx.Sequential(*model.layers[:2]), xs).mean() < 1
    np.testing.assert_allclose(ours, euler_run(graph, xs, DT), rtol=0, atol=1e-10)


def _error_cases():
    r = nnx.Rngs(0)
    linear = layers.ETPLinear(3, 4, param_dtype=F64, rngs=r)

    class Net(nnx.Module):
        def __call__(self, x):
            return x

    return {
        "alif": (layers.ALIF(4), ValueError, r"ALIF at 'the model itself'.*adaptive threshold"),
        "alif-in-recurrent": (nnx.Sequential(layers.RecurrentSpiking(3, layers.ALIF(4), rngs=r)),
                              ValueError, r"ALIF at 'layers.0.neuron'"),
        "soft-reset": (nnx.Sequential(linear, layers.LIF(4)), ValueError,
                       r"LIF at 'layers.1' uses reset='soft'.*reset='hard'"),
        "refractory": (layers.LIF(4, reset="hard", refractory_steps=2), ValueError,
                       r"refractory_steps=2; NIR neurons have no refractory period"),
        "gru": (nnx.Sequential(linear, layers.GRUCell(4, 4, rngs=r)), TypeError,
                (r"module at 'layers.1' is GRUCell, which has no NIR mapping; supported: "
                r"nnx.Sequential chains")),
        "function": (nnx.Sequential(linear, jax.nn.relu), TypeError,
                     r"module at 'layers.1' is relu"),
        "custom": (Net(), TypeError, r"module at 'the model itself' is Net"),
        "conv-3d": (layers.ETPConv(1, 2, (2, 2, 2), rngs=r), ValueError,
                    r"3-D; NIR has Conv1d and Conv2d only"),
        "conv-first": (layers.ETPConv(1, 2, (3, 3), rngs=r), ValueError, r"pass input_shape"),
        "shape": (nnx.Sequential(linear, layers.LIF(5, reset="hard")), ValueError,
                  (r"LIF at 'layers.1' takes per-sample inputs of shape \(5,\) but receives "
                  r"\(4,\)")),
    }


@pytest.mark.parametrize("case", ["alif", "alif-in-recurrent", "soft-reset", "refractory", "gru",
                                  "function", "custom", "conv-3d", "conv-first", "shape"])
def test_export_refuses_what_nir_cannot_express(case):
    model, error, message = _error_cases()[case]
    with pytest.raises(error, match=message):
        to_nir(model, (4, 4, 4, 1) if case == "conv-3d" else None, dt=DT)


def test_export_refuses_asymmetric_padding_and_a_bad_dt():
    conv = layers.ETPConv(1, 2, (3, 3), strides=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"pads \[\(0, 1\), \(0, 1\)\].*both sides"):
        to_nir(conv, (8, 8, 1), dt=DT)
    to_nir(conv, (7, 7, 1), dt=DT)  # SAME on 7 pads (1, 1): fine
    with pytest.raises(ValueError, match="dt .* must be a positive number, got 0"):
        to_nir(layers.LIF(3, reset="hard"), dt=0)


def _li(n, tau=0.02, v_leak=0.0):
    return nir.LI(tau=np.full(n, tau), r=np.full(n, tau / DT), v_leak=np.full(n, v_leak))


def _bad_graphs():
    lif = nir.LIF(tau=np.full(3, 0.02), r=np.full(3, 20.0), v_leak=np.zeros(3),
                  v_threshold=np.array([1.0, 1.0, 2.0]), v_reset=np.zeros(3))
    branch = nir.NIRGraph(
        nodes={"input": nir.Input(np.array([3])), "a": _li(3), "b": _li(3),
               "output": nir.Output(np.array([3]))},
        edges=[("input", "a"), ("input", "b"), ("a", "output"), ("b", "output")])
    conv = nir.Conv2d(input_shape=(4, 4), weight=np.ones((2, 1, 3, 3)), stride=1, padding=1,
                      dilation=1, groups=1, bias=np.zeros(2))
    return {
        "flatten-part": (nir.NIRGraph.from_list(nir.Flatten(input_type={"input": np.array([3, 2])},
                                                            start_dim=1)),
                         (r"node 'flatten' \(Flatten\) flattens axes 1 to -1 of frames \[3, 2\]; "
                         r"braintrace's Flatten flattens a whole frame")),
        "if-gain": (nir.NIRGraph.from_list(nir.IF(r=np.ones(3), v_threshold=np.ones(3),
                                                  v_reset=np.zeros(3))),
                    r"node 'if' scales its input by R·dt = \[0.001\]"),
        "delay": (nir.NIRGraph.from_list(nir.Delay(delay=np.ones(3))),
                  r"node 'delay' is a Delay, which has no braintrace layer"),
        "v-leak": (nir.NIRGraph.from_list(_li(3, v_leak=0.5)), r"'li' has v_leak != 0"),
        "thresholds": (nir.NIRGraph.from_list(lif), r"different v_threshold per neuron"),
        "tau-below-dt": (nir.NIRGraph.from_list(_li(3, tau=DT / 2)), r"time constant .* <= dt"),
        "branch": (branch, r"node 'input' .* has edges to \['a', 'b'\]"),
        "gain": (nir.NIRGraph.from_list(nir.LI(tau=np.full(3, 0.02), r=np.ones(3),
                                               v_leak=np.zeros(3))),
                 r"'li' scales its input by R·dt/τ = \[0.05"),
        "conv-li": (nir.NIRGraph.from_list(conv, nir.LI(tau=np.full((2, 4, 4), 0.02),
                                                        r=np.full((2, 4, 4), 20.0),
                                                        v_leak=np.zeros((2, 4, 4)))),
                    r"node 'li' is a LI after the Conv2d 'conv2d'"),
    }


@pytest.mark.parametrize("case", sorted(_bad_graphs()))
def test_import_refuses_nodes_without_a_braintrace_layer(case):
    graph, message = _bad_graphs()[case]
    with pytest.raises(ValueError, match=message):
        from_nir(graph, dt=DT)


def test_import_refuses_a_loop_without_input_weights():
    exported = to_nir(layers.RecurrentSpiking(3, _lif(4), rngs=nnx.Rngs(0)), dt=DT)
    loop = exported.nodes["RecurrentSpiking"]
    with pytest.raises(ValueError, match=r"subgraph with no Affine or Linear node before it"):
        from_nir(nir.NIRGraph.from_list(loop), dt=DT)


_WITHOUT_NIR = """
import importlib.abc, sys
class NoNir(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == 'nir':
            raise ModuleNotFoundError("No module named 'nir'", name=name)
sys.meta_path.insert(0, NoNir())
import braintrace, braintrace.nir
from braintrace import layers
for call in (lambda: braintrace.nir.to_nir(layers.LIF(2, reset='hard'), dt=1.0),
             lambda: braintrace.nir.from_nir(None, dt=1.0)):
    try:
        call()
    except ImportError as err:
        print(err)
"""


def test_braintrace_nir_imports_without_nir_and_says_how_to_install_it():
    result = subprocess.run([sys.executable, "-c", _WITHOUT_NIR], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all('pip install -e ".[nir]"' in line for line in lines)
    assert "to_nir" in lines[0] and "from_nir" in lines[1]
