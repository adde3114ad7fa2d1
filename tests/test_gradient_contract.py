"""The gradient contract: every algorithm on every built-in model shape (float64).

* ``T = 1``: every execution path equals BPTT to ``1e-10`` relative on every
  model, whatever its structure (no path is dropped from the same-step
  gradient). At ``T = 1`` every algorithm's traces start at zero, so what can
  differ is the path the gradient takes, not the rule: the loop (per step,
  blocked with D-RTRL's or ES-D-RTRL's block product, windowed: BPTT), the
  scope the graph is compiled in (diagonal, coupled, full). ``PATHS``
  holds one algorithm per path; the oracle is computed once per model. A pair that
  the over-time tests show exact (blocked D-RTRL on an exact model, RTRL wherever every
  trainable operation is traced) is left to them: an exact gradient over six steps contains
  the same-step one.
* Over time: where the compiler finds no approximation (``strict=True``
  compiles), D-RTRL equals BPTT to ``1e-8``; where it finds one, ``strict=True``
  refuses the model, the report lists the approximation, and D-RTRL really
  differs from BPTT (the approximation is not a false alarm).
* RTRL equals BPTT wherever every trainable operation is an ETP operation,
  whatever lies between an operation and the hidden state.
* ``strict=True`` accepts exactly the (algorithm, model) pairs whose gradient
  equals BPTT, and names the algorithm when it refuses one that approximates
  by construction; SnAp(n) is exact from the saturation ``n`` it states.

A new model shape joins by one line in ``contract_models.MODELS``, a new
algorithm by one line in ``contract_models.ALGORITHMS``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import ALGORITHMS, BATCH, IN, MODELS, OUT
from helpers import bptt_grads, mse

import braintrace

T_LONG = 6


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def data(T, scale, seed=1):
    xs = scale * jax.random.normal(jax.random.key(seed), (T, BATCH, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(seed + 100), (T, BATCH, OUT), jnp.float64)
    return xs, ys


def relative_errors(got, want):
    flat = lambda s: {jax.tree_util.keystr(p): np.asarray(v)
                      for p, v in jax.tree_util.tree_flatten_with_path(s)[0]}
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys()
    return {k: float(np.max(np.abs(g[k] - w[k])) / max(np.max(np.abs(w[k])), 1e-300))
            for k in w}


def online(case, algorithm, xs, ys, **compile_kw):
    model = case.build()
    learner = braintrace.compile(model, algorithm, xs[0], **compile_kw)
    return learner, learner.etrace_grad(xs, ys, mse, reduction="sum")


def assert_live(grads):
    for path, v in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.max(np.abs(np.asarray(v))) > 1e-10, f"BPTT gradient of {path} is zero"


PATHS = {
    "blocked": (braintrace.DRTRL, {}),
    "blocked-factorised": (ALGORITHMS["es_d_rtrl"], {}),
    "coupled-scope": (braintrace.OSTLRecurrent, {}),
    "full-scope": (braintrace.RTRL, {}),
    "bptt": (braintrace.BPTT, {}),
}
"""One algorithm and loop per distinct execution path of the ``T = 1`` contract: the blocked
loop with D-RTRL's and with ES-D-RTRL's block product (diagonal scope), the per-step loop in the
coupled and in the full scope, and the windowed loop (BPTT). D-RTRL per step and windowed D-RTRL
run the same loops as these (``tests/test_blocked.py`` and ``tests/test_algorithms_exact.py``
check them against the blocked form and BPTT over time)."""


@functools.cache
def _bptt_t1(name):
    case = MODELS[name]
    xs, ys = data(1, case.input_scale)
    return xs, ys, bptt_grads(case.build(), xs, ys)


RTRL_EXACT = {"gru", "lstm", "simple-cell", "recurrent-lif", "recurrent-lif-2-layers",
              "alif-leaky-readout", "lif-leaky-readout", "recurrent-alif", "encoder-gru",
              "encoder-recurrent-lif", "lru-2-layers", "conv-encoder-recurrent-convlif",
              "recurrent-cuba-lif"}
"""Models D-RTRL only approximates (recurrent weights, coupled layers, an ETP operation that
reaches the state only through another) where RTRL is exact."""


ROTATING = ("blocked-factorised", "coupled-scope", "bptt")


def _exact_over_time(name: str, path: str) -> bool:
    """Whether ``test_over_time_equals_bptt`` shows this path exact on this model over
    ``T_LONG`` steps: D-RTRL (blocked) where the model is exact, RTRL (full scope) where every
    trainable operation is traced. An exact gradient over several steps contains the
    same-step one, so the ``T = 1`` check of that pair would repeat it."""
    case = MODELS[name]
    return ((path == "blocked" and case.exact)
            or (path == "full-scope" and (case.exact or name in RTRL_EXACT)))


def _t1_cases() -> list[tuple[str, str]]:
    """Every model on the two scopes furthest apart (blocked diagonal, full per step) and on
    one of the three other paths in turn (each then runs on a third of the models); a pair
    the over-time test already shows exact is left to it."""
    return [(name, path) for i, name in enumerate(sorted(MODELS))
            for path in ("blocked", "full-scope", ROTATING[i % len(ROTATING)])
            if not _exact_over_time(name, path)]


@pytest.mark.parametrize(("name", "path"), _t1_cases())
def test_every_path_equals_bptt_at_t1(name, path):
    case = MODELS[name]
    xs, ys, want = _bptt_t1(name)
    assert np.max(np.abs(np.concatenate([np.ravel(v) for v in jax.tree.leaves(want)]))) > 1e-3
    make, loop = PATHS[path]
    learner = braintrace.compile(case.build(), make(), xs[0])
    got = learner.etrace_grad(xs, ys, mse, reduction="sum", **loop)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-10, errors


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_equals_bptt_at_t1_on_a_recurrent_alif_layer(algorithm):
    """Each algorithm's own rules at ``T = 1`` (initial traces, contributions of zero)."""
    case = MODELS["recurrent-alif"]
    xs, ys, want = _bptt_t1("recurrent-alif")
    _, got = online(case, ALGORITHMS[algorithm](), xs, ys)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-10, errors


@functools.cache
def _bptt_long(name):
    case = MODELS[name]
    xs, ys = data(T_LONG, case.input_scale)
    return bptt_grads(case.build(), xs, ys)


OVER_TIME = [(name, rule) for name in sorted(MODELS) for rule in ("d_rtrl", "rtrl")]
"""Both rules on a model side by side, so that one worker computes its BPTT oracle once."""


@pytest.mark.parametrize(("name", "rule"), OVER_TIME)
def test_over_time_equals_bptt(name, rule):
    """D-RTRL exactly where ``strict=True`` compiles it (and really different where it
    refuses); RTRL wherever every trainable operation is traced."""
    if rule == "d_rtrl":
        _d_rtrl_equals_bptt_over_time_exactly_where_strict_compiles(name)
    else:
        _rtrl_equals_bptt_over_time_wherever_every_trainable_operation_is_traced(name)


def _d_rtrl_equals_bptt_over_time_exactly_where_strict_compiles(name):
    case = MODELS[name]
    xs, ys = data(T_LONG, case.input_scale)
    want = _bptt_long(name)
    assert_live(want)
    if case.exact:
        learner, got = online(case, braintrace.D_RTRL(), xs, ys, strict=True)
        assert not learner.graph.approximations
        errors = relative_errors(got, want)
        assert max(errors.values()) <= 1e-8, errors
        return
    with pytest.raises(ValueError, match="strict"):
        braintrace.compile(case.build(), "d_rtrl", xs[0], strict=True)
    learner, got = online(case, braintrace.D_RTRL(), xs, ys)
    assert learner.graph.approximations
    assert "approximat" in learner.report()
    errors = relative_errors(got, want)
    assert max(errors.values()) > 1e-6, errors  # the approximation is real


def _rtrl_equals_bptt_over_time_wherever_every_trainable_operation_is_traced(name):
    case = MODELS[name]
    xs, ys = data(T_LONG, case.input_scale)
    x = xs[0]
    graph = braintrace.compile_graph(case.build(), x, scope="full")
    if graph.approximations:  # Params no trace can follow, samples mixed by batch statistics
        assert {a.kind for a in graph.approximations} <= {"untraced-path", "carried-state",
                                                          "sample-mixing"}
        assert name not in RTRL_EXACT and not case.exact
        with pytest.raises(ValueError, match="strict"):
            braintrace.compile(case.build(), braintrace.RTRL(), x, strict=True)
        return
    want = _bptt_long(name)
    assert_live(want)
    _, got = online(case, braintrace.RTRL(), xs, ys, strict=True)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-8, errors
    assert name in RTRL_EXACT or case.exact  # the list above is complete


def test_rtrl_refuses_influence_matrices_over_its_budget():
    case = MODELS["gru"]
    x = data(1, 1.0)[0][0]
    with pytest.raises(ValueError, match=r"max_trace_bytes=1,000.*RTRL\(max_trace_bytes"):
        braintrace.compile(case.build(), braintrace.RTRL(max_trace_bytes=1000), x)


SNAP_SATURATION = {"dense": 1, "lif": 1, "gru": 2, "lstm": 2, "simple-cell": 2,
                   "recurrent-lif-2-layers": 2, "alif-learned-taus": 2, "recurrent-alif": 3}
"""The ``n`` from which SnAp(n) is RTRL, as the docstring and docs/algorithms.md state it: a diagonal
model 1, a dense recurrence of one state per unit (and an LSTM) 2, ALIF's adaptation 2 without
recurrence and 3 with (``v_j → v_k → a_k``)."""


@pytest.mark.parametrize("name", sorted(SNAP_SATURATION))
def test_snap_equals_rtrl_from_its_saturation_and_strict_refuses_it_below(name):
    case = MODELS[name]
    xs, ys = data(T_LONG, case.input_scale)
    n = SNAP_SATURATION[name]
    graph = braintrace.compile_graph(case.build(), xs[0], algorithm=braintrace.SnAp(1))
    assert braintrace.SnAp(1).saturation(graph) == n
    _, rtrl = online(case, braintrace.RTRL(), xs, ys)
    _, saturated = online(case, braintrace.SnAp(n), xs, ys, strict=True)
    assert max(relative_errors(saturated, rtrl).values()) <= 1e-10
    if n == 1:
        return
    with pytest.raises(ValueError, match=rf"(?s)algorithm 'snap'.*SnAp\({n - 1}\) keeps the "
                                         rf"influence only.*SnAp\({n}\) keeps all of it"):
        braintrace.compile(case.build(), braintrace.SnAp(n - 1), xs[0], strict=True)
    _, below = online(case, braintrace.SnAp(n - 1), xs, ys)
    assert max(relative_errors(below, rtrl).values()) > 1e-7  # the dropped influence is real


STRICT_MODELS = ("lif", "gru", "recurrent-alif", "if", "cuba-lif")
"""Models on which every algorithm's ``strict`` verdict is checked against BPTT: one where
D-RTRL is exact, a dense recurrence with one state per unit and one with two, and the other
neurons: IF (no leak) and CuBaLIF (a synaptic current feeding its membrane in the step)."""


@pytest.mark.parametrize("algorithm", sorted(set(ALGORITHMS) - {"d_rtrl", "rtrl"}))
@pytest.mark.parametrize("name", STRICT_MODELS)
def test_strict_accepts_exactly_the_algorithms_that_equal_bptt(name, algorithm):
    """(D-RTRL's and RTRL's verdicts on every model, these included: ``test_over_time_...``.)"""
    case = MODELS[name]
    xs, ys = data(T_LONG, case.input_scale)
    want = _bptt_long(name)
    try:
        learner, got = online(case, ALGORITHMS[algorithm](), xs, ys, strict=True)
    except ValueError as error:
        assert "strict=True" in str(error)
        learner, got = online(case, ALGORITHMS[algorithm](), xs, ys)
        name_of = learner.algorithm.name
        if learner.algorithm.approximations(learner.graph):  # by construction: named
            assert f"algorithm '{name_of}'" in str(error)
            assert "approximations (" in learner.report()
        assert max(relative_errors(got, want).values()) > 1e-7, algorithm  # a real difference
        return
    assert max(relative_errors(got, want).values()) <= 1e-8, algorithm
    assert "approximations: none" in learner.report()
