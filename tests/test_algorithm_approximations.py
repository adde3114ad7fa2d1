"""What algorithms approximate by construction: reported where it matters, refused by strict.

The contract over every algorithm (``test_gradient_contract.py``) checks that
``strict=True`` accepts exactly the pairs that equal BPTT; here, the cases it
does not reach: random feedback (approximate even at ``T = 1``), and a model
whose traces never carry credit (nothing to report, and the gradient is exact).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import BATCH, F64, IN, MODELS, OUT, ModelCase, _linear
from flax import nnx
from helpers import bptt_grads as bptt
from test_gradient_contract import data, online, relative_errors

import braintrace


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def test_random_feedback_is_reported_refused_and_approximate_even_at_t1():
    case = MODELS["lif"]  # ETPLinear -> LIF -> ETPLinear readout
    xs, ys = data(1, case.input_scale)
    algorithm = braintrace.EProp(feedback="random", seed=3)
    learner, got = online(case, algorithm, xs, ys)
    (approx,) = algorithm.approximations(learner.graph)
    assert approx.kind == "random-feedback"
    assert approx.param_paths == ("modules.0.bias", "modules.0.kernel")
    assert "`modules.2` (ETPLinear)" in approx.summary and "even at T = 1" in approx.summary
    with pytest.raises(ValueError, match="algorithm 'eprop' \\(EProp\\)"):
        braintrace.compile(case.build(), braintrace.EProp(feedback="random", seed=3), xs[0],
                           strict=True)
    errors = relative_errors(got, bptt(case.build(), xs, ys))
    assert max(v for k, v in errors.items() if "[2]" in k) <= 1e-10  # the readout: exact
    assert min(v for k, v in errors.items() if "[0]" in k) > 1e-3  # upstream: feedback alignment


class Memoryless(nnx.Module):
    """``h^t = W x^t``: the step never reads ``h^{t-1}``, so no trace carries credit."""

    def __init__(self):
        self.lin = _linear(IN, 4, 1)
        self.h = braintrace.HiddenState(jnp.zeros((4,), F64))
        self.out = _linear(4, OUT, 2)

    def __call__(self, x):
        self.h[...] = self.lin(x)
        return self.out(jnp.tanh(self.h[...]))


@pytest.mark.parametrize("algorithm", [lambda: braintrace.ES_D_RTRL(0.7), braintrace.UORO,
                                       lambda: braintrace.EProp(0.5)])
def test_an_algorithm_reports_nothing_where_no_trace_carries_credit(algorithm):
    case = ModelCase(Memoryless, exact=True)
    xs, ys = data(6, 1.0)
    learner, got = online(case, algorithm(), xs, ys, strict=True)
    assert learner.algorithm.approximations(learner.graph) == ()
    assert "approximations: none" in learner.report()
    want = bptt(case.build(), xs, ys)
    assert max(relative_errors(got, want).values()) <= 1e-10
    assert np.max(np.abs(np.asarray(want["lin"]["kernel"][...]))) > 1e-3  # a live gradient


def test_the_strict_error_gives_the_sentence_the_alternatives_and_then_the_details():
    x = jnp.zeros((BATCH, IN), F64)
    with pytest.raises(ValueError) as error:
        braintrace.compile(MODELS["lif"].build(), braintrace.ES_D_RTRL(0.7), x, strict=True)
    message = str(error.value)
    sentence = message.index("ESDRTRL ('es_d_rtrl') replaces D-RTRL's traces")
    alternatives = message.index("Exact on this model (strict=True accepts them): DRTRL(), "
                                 "RTRL()")
    details = message.index("Details:\n  - modules.0.bias, modules.0.kernel: factorised-traces:")
    assert sentence < alternatives < details


def test_dni_reports_what_its_base_algorithm_approximates():
    model = MODELS["lif"].build()
    model.synthesizer = braintrace.LinearSynthesizer(model)
    x = jnp.zeros((BATCH, IN), F64)
    with pytest.raises(ValueError, match="factorised-traces"):
        braintrace.compile(model, braintrace.DNI(model.synthesizer, base=braintrace.ES_D_RTRL()),
                           x, strict=True)


def test_compile_graph_takes_the_algorithms_scope_and_refuses_another():
    x = jnp.zeros((BATCH, IN), F64)
    graph = braintrace.compile_graph(MODELS["lif"].build(), x, algorithm=braintrace.RTRL())
    assert graph.scope == "full"
    with pytest.raises(ValueError, match="scope='diagonal', but algorithm 'rtrl' runs in the "
                                         "'full' scope"):
        braintrace.compile_graph(MODELS["lif"].build(), x, scope="diagonal",
                                 algorithm=braintrace.RTRL())
