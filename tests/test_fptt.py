"""FPTT: each step's own gradient, and its dynamic regulariser as an optax transformation.

* The gradient of ``'fptt'`` is ``Σ_t w_t ∂ℓ_t/∂θ`` with the state each step starts from held
  fixed: against float64 ``jax.grad`` of a scan whose carry is ``lax.stop_gradient``-ed (any
  ``block_size`` runs the per-step loop: no traces to block); that it is not BPTT's where a
  state carries credit: the strict verdicts of ``test_gradient_contract.py``.
* ``fptt_regularizer`` follows its equations on a quadratic, value by value, and its ``λ`` is
  the previous loss's gradient at the new Params when each update solves its step's problem.
* FPTT with the regulariser, one update per step, in ``OnlineTrainer``, ``fit`` and a Flax
  user's ``nnx.jit`` step with ``online_update``: the Params of the same algorithm written
  with Flax and optax alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_models import MODELS
from flax import nnx
from helpers import built_on_the_host, mse
from test_gradient_contract import relative_errors

import braintrace
from braintrace import layers
from braintrace._loops import PerStep, choose_loop

F64 = jnp.float64
B, IN, OUT, T = 2, 3, 2, 4


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def instantaneous_grads(model, xs, ys):
    """``∇θ Σ_t ℓ_t`` with each step's starting state a constant (Flax and JAX alone)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def total(params):
        def body(rest, inputs):
            m = nnx.merge(graphdef, params, jax.lax.stop_gradient(rest), copy=True)
            loss = mse(m(inputs[0]), inputs[1])
            return nnx.split(m, nnx.Param, ...)[2], loss

        return jnp.sum(jax.lax.scan(body, rest, (xs, ys))[1])

    return jax.grad(total)(params)


def test_fptt_gradient_is_each_steps_own_gradient():
    case = MODELS["recurrent-lif"]
    xs = case.input_scale * jax.random.normal(jax.random.key(1), (T, B, IN), F64)
    ys = jax.random.normal(jax.random.key(2), (T, B, OUT), F64)
    want = instantaneous_grads(case.build(), xs, ys)
    learner = braintrace.compile(case.build(), "fptt", xs[0])
    assert learner.traces == []
    got = learner.etrace_grad(xs, ys, mse, reduction="sum", block_size=3)
    assert max(relative_errors(got, want).values()) <= 1e-10
    # no traces: every block size is the per-step loop (nothing to advance in blocks)
    assert choose_loop(learner.rules, length=T, block_size=3) == PerStep()
    kinds = [a.kind for a in learner.algorithm.approximations(learner.graph)]
    assert kinds == ["no-temporal-credit"]


def regularised_by_hand(alpha, beta, w0, grads_of, lr, steps):
    """The equations of ``braintrace._algorithms._fptt``, in NumPy: the Params after each
    update, and ``λ_t``, ``W̄_t`` before each."""
    w, mean, lam = np.array(w0, float), np.array(w0, float), np.zeros_like(w0, float)
    out = []
    for t in range(steps):
        g = grads_of(t, w) + alpha * (w - mean) - lam
        new = w - lr * g
        out.append((new, lam.copy(), mean.copy()))
        lam = lam - alpha * (new - mean)
        mean = (1 - beta) * mean + beta * new - (beta / alpha) * lam
        w = new
    return out


CENTRES = np.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.0], [2.0, 2.0], [0.0, -1.0]])
"""``ℓ_t(W) = ½‖W - c_t‖²``: ``∇ℓ_t(W) = W - c_t``."""


def test_fptt_regularizer_follows_its_equations_on_a_quadratic():
    alpha, beta, lr = 0.7, 0.3, 0.2
    tx = optax.chain(braintrace.fptt_regularizer(alpha, beta), optax.sgd(lr))
    params = {"w": jnp.array([0.3, -0.4], F64)}
    state = tx.init(params)
    want = regularised_by_hand(alpha, beta, params["w"], lambda t, w: w - CENTRES[t], lr, 5)
    for t, (w_next, lam, mean) in enumerate(want):
        grads = {"w": params["w"] - CENTRES[t]}
        updates, state = tx.update(grads, state, params)
        reg = state[0]
        np.testing.assert_allclose(reg.grad["w"], lam, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(reg.mean["w"], mean, rtol=1e-12, atol=1e-14)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(params["w"], w_next, rtol=1e-12, atol=1e-14)
    assert float(jnp.max(jnp.abs(state[0].grad["w"]))) > 0.1  # the regulariser acts


def test_lambda_is_the_previous_gradient_where_each_update_solves_its_step():
    """With ``ℓ_t + R_t`` quadratic of curvature ``1 + α``, a step of ``1/(1 + α)`` solves it:
    then ``λ_{t+1} = ∇ℓ_t(W_{t+1})`` and ``W̄_{t+1} = ½(W̄_t + W_{t+1}) - ∇ℓ_t(W_{t+1})/(2α)``,
    the paper's running average (``β = 1/2``)."""
    alpha = 0.5
    tx = optax.chain(braintrace.fptt_regularizer(alpha), optax.sgd(1.0 / (1.0 + alpha)))
    params = {"w": jnp.array([0.3, -0.4], F64)}
    state = tx.init(params)
    mean = params["w"]
    for t in range(4):
        updates, state = tx.update({"w": params["w"] - CENTRES[t]}, state, params)
        params = optax.apply_updates(params, updates)
        grad_at_new = params["w"] - CENTRES[t]  # ∇ℓ_t(W_{t+1})
        # the state completes step t when the next update is asked for
        _, after = tx.update({"w": jnp.zeros(2, F64)}, state, params)
        np.testing.assert_allclose(after[0].grad["w"], grad_at_new, rtol=1e-12)
        paper_mean = 0.5 * (mean + params["w"]) - grad_at_new / (2 * alpha)
        np.testing.assert_allclose(after[0].mean["w"], paper_mean, rtol=1e-12)
        mean = paper_mean


def test_fptt_regularizer_refuses_bad_arguments():
    for alpha in (0.0, -1.0, float("inf"), float("nan"), np.float32("inf")):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            braintrace.fptt_regularizer(alpha)
    for beta in (0.0, 1.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"beta must lie in \(0, 1\]"):
            braintrace.fptt_regularizer(0.1, beta=beta)
    for bad in ("0.5", True, None, np.ones(2)):
        with pytest.raises(TypeError, match="alpha must be a real number"):
            braintrace.fptt_regularizer(bad)
    assert braintrace.fptt_regularizer(np.float32(0.5)) is not None  # a NumPy scalar is one
    tx = braintrace.fptt_regularizer(0.1)
    with pytest.raises(ValueError, match="needs the Params"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


@built_on_the_host
def spiking_net():
    model = nnx.Sequential(layers.ETPLinear(IN, 5, param_dtype=F64, rngs=nnx.Rngs(0)),
                           layers.LIF(5, tau=4.0, v_th=0.3, param_dtype=F64),
                           layers.LeakyReadout(5, OUT, tau=3.0, param_dtype=F64,
                                               rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    return model


def fptt_by_hand(model, tx, batches):
    """FPTT in Flax and optax alone: per step, the step's loss differentiated from the state it
    starts from, and an update; the state runs on with the Params of its time. The Params
    after each batch."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    start = rest

    @jax.jit
    def step(params, rest, x, y):
        def loss(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return mse(m(x), y), nnx.split(m, nnx.Param, ...)[2]

        grads, rest = jax.grad(loss, has_aux=True)(params)
        return grads, rest

    opt_state = tx.init(params)
    after = []
    for xs, ys in batches:
        rest = start  # each batch from the initial state (fit's reset_each_batch)
        for x, y in zip(xs, ys):
            grads, rest = step(params, rest, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        after.append([np.asarray(a) for a in jax.tree.leaves(params)])
    return after


def test_fptt_with_its_regulariser_in_the_trainer_fit_and_a_users_nnx_jit_step():
    tx = optax.chain(braintrace.fptt_regularizer(alpha=0.5), optax.sgd(0.2))
    xs = 2.0 * jax.random.normal(jax.random.key(1), (2, T, B, IN), F64)
    ys = jax.random.normal(jax.random.key(2), (2, T, B, OUT), F64)
    batches = [(xs[0], ys[0]), (xs[1], ys[1])]
    want_one, want_two = fptt_by_hand(spiking_net(), tx, batches)
    params = lambda model: [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]

    def close(got, want):
        assert all(np.max(np.abs(g - w)) <= 1e-12 * max(1.0, np.max(np.abs(w)))
                   for g, w in zip(got, want, strict=True))

    model = spiking_net()
    learner = braintrace.compile(model, "fptt", xs[0, 0])
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=mse, update_every=1, blocked=True)
    trainer.step(*batches[0])
    close(params(model), want_one)
    assert max(np.max(np.abs(a - b)) for a, b in zip(params(spiking_net()), want_one)) > 1e-3
    history = trainer.fit(batches[1:], progress=False)  # from the initial state again
    assert len(history) == 1
    close(params(model), want_two)

    model = spiking_net()
    train = braintrace.online_update(braintrace.compile(model, "fptt", xs[0, 0]), mse, tx)
    opt_state, state = train.init(model)
    new, opt_state, state, stats = nnx.jit(train.update)(model, opt_state, state, *batches[0])
    nnx.update(model, new)
    assert bool(stats.finite)
    close(params(model), want_one)
