"""``OnlineTrainer``'s windows equal the learner's gradient and an optax step per window (float64).

The trainer runs every window of ``update_every`` steps in one program and
leaves each window's last trace update pending, applying it at the next
window's first step with the operands of the Params it was computed with
(``braintrace/_drivers/_programs.py``). That must change nothing: the
reference here calls ``learner.etrace_grad`` once per window (each call
finishes its traces) and applies ``optax`` to the model by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_models import ALGORITHMS, BATCH, IN, MODELS, OUT
from flax import nnx

import braintrace

T = 6


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def data(scale):
    xs = scale * jax.random.normal(jax.random.key(1), (T, BATCH, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(2), (T, BATCH, OUT), jnp.float64)
    return xs, ys


def state(learner, losses):
    return [np.asarray(a) for a in jax.tree.leaves((losses, learner.leaves(), learner.traces))]


def by_hand(case, algorithm, every, tx):
    """An ``etrace_grad`` per window (per-step form), then ``tx`` applied to the model."""
    model = case.build()
    learner = braintrace.compile(model, ALGORITHMS[algorithm](), jnp.zeros((BATCH, IN)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    xs, ys = data(case.input_scale)
    losses = []
    for start in range(0, T, every):
        window = slice(start, start + every)
        grads, window_losses = learner.etrace_grad(xs[window], ys[window], mse, block_size=1,
                                                   reduction="mean", return_losses=True)
        optimizer.update(model, grads)
        losses.append(window_losses)
    return state(learner, jnp.concatenate(losses))


def trained(case, algorithm, every, tx):
    learner = braintrace.compile(case.build(), ALGORITHMS[algorithm](), jnp.zeros((BATCH, IN)))
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=mse, update_every=every,
                                       blocked=False)
    return state(learner, trainer.step(*data(case.input_scale)))


@pytest.mark.parametrize(("name", "algorithm", "every"), [
    ("lora", "d_rtrl", 1), ("lora", "es_d_rtrl", 3), ("gru", "d_rtrl", 1),
    ("recurrent-lif-2-layers", "rtrl", 2)])
def test_trainer_windows_equal_a_gradient_and_an_optax_step_per_window(name, algorithm, every):
    tx = optax.adam(0.05)
    got = trained(MODELS[name], algorithm, every, tx)
    want = by_hand(MODELS[name], algorithm, every, tx)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(w).max()))
