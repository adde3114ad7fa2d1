"""Hostile model structures: what the compiler reports and refuses.

Gradients of every structure here are checked against float64 BPTT by
``test_gradient_contract.py`` (the models are in ``contract_models.py``);
this module pins the *report*: each approximation is named with its Params,
its kind and the operations on the path, nothing spurious is reported, and
``strict=True`` refuses exactly the approximate models.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import BATCH, IN, MODELS
from flax import nnx

import braintrace
from braintrace import layers


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def graph_of(name):
    return braintrace.compile_graph(MODELS[name].build(), jnp.zeros((BATCH, IN), jnp.float64))


def kinds(graph):
    return {(a.kind, p) for a in graph.approximations for p in a.param_paths}


def test_traced_param_also_used_by_plain_ops_is_reported_with_the_path():
    graph = graph_of("traced-param-in-plain-ops")
    assert "drive.lin.kernel" in graph.traced_param_paths
    (approx,) = graph.approximations
    assert approx.kind == "untraced-path" and approx.param_paths == ("drive.lin.kernel",)
    assert "'sin'" in approx.detail and "'reduce_sum'" in approx.detail


@pytest.mark.parametrize("name", ["layernorm", "batchnorm"])
def test_normalisation_after_an_etp_op_is_an_output_mixing_approximation(name):
    graph = graph_of(name)
    assert ("output-mixing", "drive.lin.kernel") in kinds(graph)
    mixing = next(a for a in graph.approximations if a.kind == "output-mixing")
    assert "reduce_sum" in mixing.detail
    # the normalisation's own Params feed the state through plain operations
    assert ("untraced-path", "drive.norm.scale") in kinds(graph)


def test_lstm_reports_its_recurrent_kernels_as_hidden_coupling():
    graph = graph_of("lstm")
    coupled = {p for k, p in kinds(graph) if k == "hidden-coupling"}
    assert {"cell.cell.hi.kernel", "cell.cell.ii.kernel"} <= coupled
    assert graph.groups[0].num_states == 2  # c and h in one group


def test_plain_linear_beside_an_etp_op_is_an_untraced_path():
    assert kinds(graph_of("plain-linear-beside-etp")) == {
        ("untraced-path", "drive.plain.kernel"), ("untraced-path", "drive.plain.bias")}


@pytest.mark.parametrize("name", ["remat", "nnx-jit"])
def test_remat_and_jit_around_a_layer_compile_and_are_exact(name):
    graph = graph_of(name)
    assert graph.traced_param_paths == ("drive.lin.bias", "drive.lin.kernel")
    assert graph.approximations == ()


def test_custom_vjp_activation_on_the_weight_to_state_path_compiles():
    graph = graph_of("custom-vjp-activation")
    assert any(e.primitive.name == "custom_vjp_call" for e in graph.jaxpr.eqns)
    assert graph.approximations == ()


def test_integer_hidden_state_is_kept_as_non_differentiable_state():
    model = MODELS["integer-state"].build()
    xs = jnp.ones((3, BATCH, IN), jnp.float64)
    learner = braintrace.compile(model, "d_rtrl", xs[0])
    assert learner.graph.other_paths == ("count",)
    assert "count" not in learner.graph.hidden_paths
    before = np.asarray(model.count[...])
    learner.etrace_grad(xs, jnp.zeros((3, BATCH, 2)), lambda y, t: jnp.mean((y - t) ** 2))
    np.testing.assert_array_equal(model.count[...], before + 3)


class PlainReadout(nnx.Module):
    """A leaky state read out by a plain ``nnx.Linear`` (a dense ``dot_general``) on 3-D input."""

    def __init__(self):
        self.lin = layers.ETPLinear(IN, 4, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        self.h = braintrace.HiddenState(jnp.zeros((5, 4), jnp.float64))
        self.out = layers.ETPLinear(4, 2, param_dtype=jnp.float64, rngs=nnx.Rngs(1))
        self.plain = nnx.Linear(4, 2, param_dtype=jnp.float64, rngs=nnx.Rngs(2))

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.lin(x)
        return self.out(self.h[...]) + self.plain(self.h[...])


def test_readouts_raise_no_warning_and_no_approximation():
    model = PlainReadout()
    braintrace.init_states(model, BATCH)
    graph = braintrace.compile_graph(model, jnp.zeros((BATCH, 5, IN), jnp.float64))
    assert graph.warnings == () and graph.approximations == ()
    reasons = [x.reason for x in graph.exclusions if "out.kernel" in x.param_paths]
    assert reasons == ["reaches no hidden state (a readout)"]
    assert "approximations: none" in graph.report()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_strict_refuses_exactly_the_models_with_approximations(name):
    case = MODELS[name]
    graph = graph_of(name)
    assert (graph.approximations == ()) == case.exact, graph.report()
    x = jnp.zeros((BATCH, IN), jnp.float64)
    if case.exact:
        braintrace.compile(case.build(), "d_rtrl", x, strict=True)
    else:
        with pytest.raises(ValueError, match="strict=True") as error:
            braintrace.compile(case.build(), "d_rtrl", x, strict=True)
        assert graph.approximations[0].param_paths[0] in str(error.value)


def test_batch_statistics_are_reported_for_exact_rtrl():
    """RTRL keeps per-sample influences: a step that mixes samples is an approximation."""
    graph = braintrace.compile_graph(MODELS["batchnorm"].build(),
                                     jnp.zeros((BATCH, IN), jnp.float64), scope="full")
    mixing = [a for a in graph.approximations if a.kind == "sample-mixing"]
    assert len(mixing) == 1 and "drive.lin.kernel" in mixing[0].param_paths
    assert "reduce_sum" in mixing[0].detail
    full = braintrace.compile_graph(MODELS["layernorm"].build(),
                                    jnp.zeros((BATCH, IN), jnp.float64), scope="full")
    assert "sample-mixing" not in {a.kind for a in full.approximations}  # per-sample norm


def test_complex_hidden_state_is_refused_with_the_path():
    """Traces are real: a complex state would silently lose the imaginary part of its traces."""

    class ComplexLeaky(nnx.Module):
        def __init__(self):
            self.w = layers.ETPLinear(3, 4, rngs=nnx.Rngs(0))
            self.h = braintrace.HiddenState(jnp.zeros((2, 4), jnp.complex64))

        def __call__(self, x):
            self.h.value = (0.5 + 0.5j) * self.h.value + self.w(x)
            return jnp.real(self.h.value)

    with pytest.raises(ValueError, match=r"hidden state 'h' is complex.*h_re"):
        braintrace.compile(ComplexLeaky(), "d_rtrl", jnp.ones((2, 3)))
