"""Time-blocked traces (``etrace_grad(block_size=K)``) equal the per-step form (float64).

The blocked form regroups the per-step recursion ``ε_k = d_k ε_{k-1} + f_k ⊗ x_k``
(``braintrace/_loops/_blocked.py``); it must give the very same gradients,
traces and hidden state: for dense, LoRA and elementwise (learned time
constant) relations, one and two states per unit, models where D-RTRL is exact
and where it is not (the regrouping is exact either way), and a sequence
length that ``K`` does not divide (a shorter last block).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_models import ALGORITHMS, BATCH, IN, MODELS, OUT

import braintrace
from braintrace._algorithms._block_algebra import block_coefficients
from braintrace._compiler import programs

T = 7
CASES = ["dense", "lora", "alif-learned-taus", "lif-expsynapse", "gru",
         "recurrent-lif-2-layers"]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def data(scale):
    xs = scale * jax.random.normal(jax.random.key(1), (T, BATCH, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(2), (T, BATCH, OUT), jnp.float64)
    return xs, ys


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def run(case, algorithm, block_size, mask=None):
    learner = braintrace.compile(case.build(), ALGORITHMS[algorithm](), jnp.zeros((BATCH, IN)))
    xs, ys = data(case.input_scale)
    grads, losses = learner.etrace_grad(xs, ys, mse, mask=mask, block_size=block_size,
                                        return_losses=True)
    hidden = learner.leaves()[1]
    return [np.asarray(a) for a in jax.tree.leaves((grads, losses, learner.traces, hidden))]


def assert_same(got, want, tol=1e-10):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        scale = max(float(np.max(np.abs(w), initial=0.0)), 1e-300)
        assert float(np.max(np.abs(g - w), initial=0.0)) <= tol * scale


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
@pytest.mark.parametrize("name", CASES)
def test_blocked_equals_per_step(name, algorithm):
    case = MODELS[name]
    per_step = run(case, algorithm, 1)
    assert_same(run(case, algorithm, 3), per_step)   # two blocks of 3 and one of 1
    # A negative control: the comparison sees a change of one step's input.
    assert any(np.max(np.abs(a)) > 0 for a in per_step)


def test_blocked_with_mask_and_block_longer_than_sequence():
    case = MODELS["alif-learned-taus"]
    mask = jnp.asarray([1.0, 0.0, 2.0, 1.0, 0.5, 0.0, 1.0])
    per_step = run(case, "d_rtrl", 1, mask)
    assert_same(run(case, "d_rtrl", 4, mask), per_step)
    assert_same(run(case, "d_rtrl", 16, mask), per_step)


def test_block_coefficients_match_the_products():
    rng = np.random.default_rng(0)
    k, units, s = 4, 3, 2
    u, d = rng.standard_normal((k, units, s)), rng.standard_normal((k, units, s, s))
    beta, lam, beta0, lam0 = block_coefficients(jnp.asarray(u), jnp.asarray(d))

    def product(a, j):  # L(a, j) = d_a ... d_{j+1}
        out = np.broadcast_to(np.eye(s), (units, s, s))
        for m in range(j + 1, a + 1):
            out = np.einsum("nst,ntr->nsr", d[m], out)
        return out

    for j in range(-1, k):
        want_beta = sum(np.einsum("ns,nst->nt", u[i], product(i - 1, j)) for i in range(j + 1, k))
        want_beta = np.zeros((units, s)) if j == k - 1 else want_beta
        got_beta = beta0 if j == -1 else beta[j]
        np.testing.assert_allclose(got_beta, want_beta, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lam0 if j == -1 else lam[j], product(k - 1, j),
                                   rtol=1e-12, atol=1e-12)


def test_block_size_is_checked():
    case = MODELS["dense"]
    learner = braintrace.compile(case.build(), "d_rtrl", jnp.zeros((BATCH, IN)))
    xs, ys = data(1.0)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            learner.etrace_grad(xs, ys, mse, block_size=bad)
    learner.etrace_grad(xs, ys, mse, block_size=np.int64(2))  # any integer type
    rtrl = braintrace.compile(case.build(), "rtrl", jnp.zeros((BATCH, IN)))
    with pytest.raises(ValueError, match="no time-blocked form"):
        rtrl.etrace_grad(xs, ys, mse, block_size=4)
    rtrl.etrace_grad(xs, ys, mse, block_size=1)


def test_trainer_blocked_updates_equal_per_step_updates():
    case = MODELS["lif-expsynapse"]
    xs, ys = data(case.input_scale)
    xs, ys = xs[:6], ys[:6]
    results = []
    for block in (False, True):
        learner = braintrace.compile(case.build(), "d_rtrl", jnp.zeros((BATCH, IN)))
        trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=3,
                                           blocked=block)
        losses = trainer.step(xs, ys)
        results.append([np.asarray(a) for a in jax.tree.leaves(
            (losses, learner.leaves(), learner.traces))])
    assert_same(results[1], results[0])


def test_blocked_losses_have_the_loss_dtype_and_values_of_the_per_step_form():
    case = MODELS["dense"]
    xs, ys = data(case.input_scale)
    loss32 = lambda y, t: mse(y, t).astype(jnp.float32)  # x64 on: a float32 loss of f64 outputs
    out = {}
    for k, chunk in ((1, None), (3, None), (1, 7)):  # 3: two blocks and a shorter one;
        # chunk 7: windowed mode (float64 step weights, a float32 loss: once a dtype error)
        learner = braintrace.compile(case.build(), "d_rtrl", jnp.zeros((BATCH, IN)))
        out[k, chunk] = learner.etrace_grad(xs, ys, loss32, block_size=k, chunk_size=chunk,
                                            return_losses=True)[1]
    assert {v.dtype for v in out.values()} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(out[3, None], out[1, None], rtol=1e-6)
    np.testing.assert_allclose(out[1, 7], out[1, None], rtol=1e-6)


def test_which_blocked_paths_a_model_takes():
    """The GRU's fused gates have colours, but its Jacobians come from pullbacks, which
    need no arranging; a LIF's have one colour (JVPs, nothing to arrange). ES-D-RTRL runs
    its ``ε_f`` in the step loop (``block_step``), D-RTRL does not (its block reads the
    stacked steps)."""
    learners = {name: braintrace.compile(MODELS[name].build(), alg, jnp.zeros((BATCH, IN)))
                for name, alg in (("gru", "d_rtrl"), ("lif-expsynapse", "es_d_rtrl"))}
    gru, lif = learners["gru"], learners["lif-expsynapse"]
    assert any(r.num_colours > 1 for r in gru.graph.relations)
    assert programs.pulls_jacobians(gru.graph) and not programs.pulls_jacobians(lif.graph)
    assert not programs.arranges_colours(gru.graph)
    assert not programs.arranges_colours(lif.graph)
    assert not gru.rules.has_block_steps and gru.rules.reads_stacked_steps
    assert lif.rules.has_block_steps
