"""from_nir refuses nodes it cannot import faithfully with an error naming the node.

A neuron with an infinite (or NaN) resistance or time constant has no braintrace
counterpart: its input gain ``R·dt/τ`` would be multiplied into the weights
before it as ``inf`` (and a zero bias into ``nan``). A bias that does not have
one entry per output of its weight is a malformed node, not a numpy broadcast.
Each error names the node and the values or shapes, and leaves the graph as it
was.
"""

from __future__ import annotations

import jax
import nir
import numpy as np
import pytest

from braintrace.nir import from_nir

DT = 1e-3
N, IN = 4, 3


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _lif(r=20.0, tau=0.02, n=N):
    return nir.LIF(tau=np.full(n, tau), r=np.full(n, r), v_leak=np.zeros(n),
                   v_threshold=np.ones(n), v_reset=np.zeros(n))


def _li(r=20.0, n=N):
    return nir.LI(tau=np.full(n, 0.02), r=np.full(n, r), v_leak=np.zeros(n))


def _cuba(w_in=20.0, n=N):
    return nir.CubaLIF(tau_syn=np.full(n, 0.02), tau_mem=np.full(n, 0.02), r=np.full(n, 20.0),
                       v_leak=np.zeros(n), v_threshold=np.ones(n), v_reset=np.zeros(n),
                       w_in=np.full(n, w_in))


def _affine(bias_shape=(N,), out=N):
    rng = np.random.default_rng(0)
    return nir.Affine(weight=rng.normal(size=(out, IN)), bias=np.zeros(bias_shape))


def _recurrent(weight_bias_shape=None, input_bias_shape=(N,)):
    """Affine -> subgraph ``input -> LIF <-> W, LIF -> output``; ``W`` an Affine if shaped."""
    rng = np.random.default_rng(1)
    loop = (nir.Linear(weight=rng.normal(size=(N, N))) if weight_bias_shape is None else
            nir.Affine(weight=rng.normal(size=(N, N)), bias=np.zeros(weight_bias_shape)))
    sub = nir.NIRGraph(
        nodes={"input": nir.Input(np.array([N])), "neuron": _lif(), "w": loop,
               "output": nir.Output(np.array([N]))},
        edges=[("input", "neuron"), ("neuron", "w"), ("w", "neuron"), ("neuron", "output")])
    return nir.NIRGraph.from_list(_affine(input_bias_shape), sub)


def _conv(bias_channels):
    return nir.Conv2d(input_shape=(4, 4), weight=np.ones((2, 1, 3, 3)), stride=1, padding=1,
                      dilation=1, groups=1, bias=np.zeros(bias_channels))


NOT_FINITE = {
    "lif-r-inf": (lambda: nir.NIRGraph.from_list(_affine(), _lif(r=np.inf)),
                  (r"node 'lif' has r = inf \(4 of 4 entries not finite\); its input gain "
                   r"r·dt/tau .* must be finite\. Give the node finite values of r\.")),
    "lif-r-nan": (lambda: nir.NIRGraph.from_list(_affine(), _lif(r=np.nan)),
                  r"node 'lif' has r = nan"),
    "lif-r-inf-alone": (lambda: nir.NIRGraph.from_list(_lif(r=np.inf)),
                        r"node 'lif' has r = inf"),
    "lif-tau-inf": (lambda: nir.NIRGraph.from_list(_affine(), _lif(tau=np.inf)),
                    r"node 'lif' has tau = inf .*τ must be finite"),
    "li-r-inf": (lambda: nir.NIRGraph.from_list(_affine(), _li(r=np.inf)),
                 r"node 'li' has r = inf"),
    "cubalif-w-in-inf": (lambda: nir.NIRGraph.from_list(_affine(), _cuba(w_in=np.inf)),
                         r"node 'cubalif' has w_in = inf .*w_in·dt/tau_syn"),
    "recurrent-r-inf": (lambda: nir.NIRGraph.from_list(
        _affine(), to_nir_loop(r=np.inf)), r"node 'nirgraph.neuron' has r = inf"),
}


def to_nir_loop(r):
    """A recurrent subgraph whose LIF has resistance ``r``."""
    sub = _recurrent().nodes["nirgraph"]
    sub.nodes["neuron"] = _lif(r=r)
    return sub


BIAS = {
    "affine-lif": (lambda: nir.NIRGraph.from_list(_affine((5,)), _lif()),
                   "affine", r"\(5,\)", r"\(4, 3\)"),
    "affine-alone": (lambda: nir.NIRGraph.from_list(_affine((N, 1))),
                     "affine", r"\(4, 1\)", r"\(4, 3\)"),
    "affine-one-entry": (lambda: nir.NIRGraph.from_list(_affine((1,)), _lif()),
                         "affine", r"\(1,\)", r"\(4, 3\)"),
    "affine-li": (lambda: nir.NIRGraph.from_list(_affine((2,)), _li()),
                  "affine", r"\(2,\)", r"\(4, 3\)"),
    "affine-recurrent": (lambda: _recurrent(input_bias_shape=(6,)),
                         "affine", r"\(6,\)", r"\(4, 3\)"),
    "recurrent-weight": (lambda: _recurrent(weight_bias_shape=(3,)),
                         "nirgraph.w", r"\(3,\)", r"\(4, 4\)"),
    "conv2d": (lambda: nir.NIRGraph.from_list(_conv(3)), "conv2d", r"\(3,\)", r"\(2, 1, 3, 3\)"),
}


def _arrays(graph):
    """Every array of every node (and subgraph node), to show a failed import changed none."""
    out = {}
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            out.update({f"{name}.{k}": v for k, v in _arrays(node).items()})
            continue
        for field, value in vars(node).items():
            if isinstance(value, np.ndarray):
                out[f"{name}.{field}"] = value.copy()
    return out


def _assert_unchanged(graph, before):
    after = _arrays(graph)
    assert after.keys() == before.keys()
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


@pytest.mark.parametrize("case", sorted(NOT_FINITE))
def test_import_refuses_a_neuron_with_an_infinite_gain_or_time_constant(case):
    make, message = NOT_FINITE[case]
    graph = make()
    before = _arrays(graph)
    with pytest.raises(ValueError, match=r"from_nir: " + message):
        from_nir(graph, dt=DT)
    _assert_unchanged(graph, before)


@pytest.mark.parametrize("case", sorted(BIAS))
def test_import_names_the_node_whose_bias_does_not_fit_its_weight(case):
    make, node, bias, weight = BIAS[case]
    graph = make()
    before = _arrays(graph)
    with pytest.raises(ValueError, match=(
            rf"from_nir: node '{node}' has a bias of shape {bias} that does not fit its "
            rf"weight of shape {weight} \(out, \.\.\.\): the bias has one entry per output")):
        from_nir(graph, dt=DT)
    _assert_unchanged(graph, before)


def test_a_finite_gain_is_still_folded_into_the_weights_before_the_neuron():
    graph = nir.NIRGraph.from_list(_affine(), _lif(r=1.0))  # Norse-style R = 1: gain 0.05
    before = _arrays(graph)
    model = from_nir(graph, dt=DT)
    np.testing.assert_allclose(np.asarray(model.layers[0].kernel[...]),
                               graph.nodes["affine"].weight.T * 0.05, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(model.layers[0].bias[...])))
    _assert_unchanged(graph, before)
