"""The forms a TPU's programs give a time-blocked step, checked on the CPU (float64).

Under ``formulation('pallas')`` (a TPU's programs, traced here) two computations take other
forms than the CPU's: the Jacobians' responses are one JVP per slot instead of one vmapped
JVP (``_jacobians.jacobian_responses``), and the decayed sums of a block of up to
``_block_algebra.SUMMED_STEPS`` steps are summed term by term instead of products
(``decayed_sums``, ``decayed_end``). Each is checked against the CPU's form and against a
NumPy oracle, and ES-D-RTRL and D-RTRL in such blocks against their per-step form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import ALGORITHMS, BATCH, IN, MODELS
from test_blocked import assert_same, data, mse
from test_compiler_jacobians import setup

import braintrace
from braintrace._algorithms import _block_algebra
from braintrace._algorithms._block_algebra import SUMMED_STEPS, decayed_end, decayed_sums
from braintrace._compiler import StepLeaves, programs
from braintrace._platform import formulation


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("name", ["leaky", "lif", "alif", "roll", "two-layer", "dense-alif"])
def test_one_jvp_per_slot_gives_the_vmapped_responses(name, x64):
    """The responses (and the ``D``, ``Df`` assembled from them) of a TPU's programs equal
    the CPU's, slot for slot; both hold values (the comparison sees them)."""
    _, graph, P, Hs, O, X = setup(name)
    responses = jax.jit(lambda *a: programs.jacobian_responses(graph, StepLeaves(*a)))
    jacobians = jax.jit(lambda *a: programs.jacobians(graph, StepLeaves(*a)))
    with formulation("cpu"):
        vmapped, (d, df) = responses(P, Hs, O, X), jacobians(P, Hs, O, X)
    with formulation("pallas"):
        looped, (d_tpu, df_tpu) = responses(P, Hs, O, X), jacobians(P, Hs, O, X)
    assert [a.shape for a in looped] == [a.shape for a in vmapped]
    assert any(a.size and float(jnp.max(jnp.abs(a))) > 1e-3 for a in vmapped)
    for got, want in zip(jax.tree.leaves((looped, d_tpu, df_tpu)),
                         jax.tree.leaves((vmapped, d, df))):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def oracle_sums(values: np.ndarray, decay: float, start: np.ndarray):
    """``c = Σ_k α^k v_k``, ``e_j = Σ_{k>j} α^{k-1-j} v_k`` and ``α^K start + Σ_j α^{K-1-j}
    v_j``, by loops."""
    K = values.shape[0]
    c = sum(decay ** k * values[k] for k in range(K))
    e = np.stack([sum((decay ** (k - 1 - j) * values[k] for k in range(j + 1, K)),
                      np.zeros_like(values[0])) for j in range(K)])
    end = start
    for k in range(K):
        end = decay * end + values[k]
    return c, e, end


@pytest.mark.parametrize("steps", [1, 2, 3, SUMMED_STEPS, SUMMED_STEPS + 3])
@pytest.mark.parametrize("name", ["cpu", "pallas"])
def test_decayed_sums_in_either_form_are_the_loops(steps, name, x64):
    values = np.random.default_rng(steps).normal(size=(steps, 3, 5))
    start, plus = np.full((3, 5), 2.0), np.random.default_rng(9).normal(size=(steps, 3, 5))
    c_want, e_want, end_want = oracle_sums(values, 0.7, start)
    with formulation(name):
        c, e = jax.jit(lambda v, p: decayed_sums(v, 0.7, p))(values, plus)
        end = jax.jit(lambda s, v: decayed_end(s, v, 0.7))(start, values)
        jaxpr = jax.make_jaxpr(lambda v: decayed_sums(v, 0.7))(values)
    np.testing.assert_allclose(c, c_want, rtol=1e-14)
    np.testing.assert_allclose(e, e_want + plus, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(end, end_want, rtol=1e-14)
    dots = [eq for eq in jaxpr.jaxpr.eqns if eq.primitive.name == "dot_general"]
    if name == "pallas" and steps <= SUMMED_STEPS:
        assert not dots  # summed term by term: nothing for a matrix unit
    else:  # products, at the precision JAX's configuration gives the model's own
        assert len(dots) == 2
        assert all(eq.params["precision"] is None for eq in dots)


@pytest.mark.parametrize("algorithm", ["es_d_rtrl", "d_rtrl"])
@pytest.mark.parametrize("name", ["alif-learned-taus", "lif-expsynapse"])
def test_a_tpus_blocks_of_three_steps_are_the_per_step_form(name, algorithm, monkeypatch, x64):
    """In a TPU's programs (traced on the CPU), blocks of 3 steps over T = 7 (two blocks and
    a tail of 1) give the per-step form's gradients, losses, traces and hidden state; with
    the sums summed term by term and the products (``SUMMED_STEPS`` patched to 0) alike."""
    case = MODELS[name]

    def run(block_size):
        learner = braintrace.compile(case.build(), ALGORITHMS[algorithm](),
                                     jnp.zeros((BATCH, IN)))
        xs, ys = data(case.input_scale)
        grads, losses = learner.etrace_grad(xs, ys, mse, block_size=block_size,
                                            return_losses=True)
        out = jax.tree.leaves((grads, losses, learner.traces, learner.leaves()[1]))
        return [np.asarray(a) for a in out]

    with formulation("pallas"):
        per_step = run(1)
        summed = run(3)
        monkeypatch.setattr(_block_algebra, "SUMMED_STEPS", 0)
        jax.clear_caches()  # traced anew, with the products
        products = run(3)
    assert any(np.max(np.abs(a)) > 0 for a in per_step)  # the comparison sees values
    assert_same(summed, per_step)
    assert_same(products, per_step)
