"""A window of steps the mask scores none of makes no optimiser update (float64, against BPTT).

``OnlineTrainer`` (and so ``fit``) updates every ``update_every`` steps, by
default every step. With only the last step of a sequence scored (a
classification), the steps before it have zero gradients: applied, they are
``T - 1`` optimiser steps that Adam's momentum and AdamW's weight decay turn
into drift (0.32 against 0.88 accuracy in issue 46). So an update follows only
a window with a scored step: one per sequence there, as a Flax train step makes
one per batch; the trajectory is Adam's on the BPTT gradient of each scored
step. DNI, whose synthetic gradients do not come from the loss, updates after
every window.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, mse
from reference_models import GRUNet, data

import braintrace
from braintrace import layers

T, B, IN, OUT = 6, 3, 2, 2


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def build():
    f64 = {"param_dtype": jnp.float64}
    model = nnx.Sequential(layers.ETPLinear(IN, 4, rngs=nnx.Rngs(0), **f64),
                           layers.LIF(4, tau=4.0, v_th=0.3, **f64),
                           layers.ETPLinear(4, OUT, rngs=nnx.Rngs(1), **f64))
    braintrace.init_states(model, B)
    return model


def batch(seed):
    xs = 2.0 * jax.random.normal(jax.random.key(seed), (T, B, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(seed + 100), (T, B, OUT), jnp.float64)
    return xs, ys


def updates_made(trainer):
    return int(optax.tree_utils.tree_get(trainer.opt_state, "count"))


@pytest.mark.parametrize("mask, updates", [
    ([0, 0, 0, 0, 0, 1], 1),   # the last step: a classification
    ([0, 0, 1, 1, 0, 0], 2),   # an answer period
    ([1, 1, 1, 1, 1, 1], 6),   # every step: truly online
    ([0, 0, 0, 0, 0, 0], 0),   # nothing scored: nothing learnt
])
def test_an_update_follows_only_a_window_with_a_scored_step(mask, updates):
    model = build()
    trainer = braintrace.OnlineTrainer(braintrace.compile(model, "d_rtrl", jnp.ones((B, IN))),
                                       optax.adamw(1e-2), loss_fn=mse)
    before = [np.array(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    trainer.step(*batch(0), jnp.array(mask, jnp.float64))
    assert updates_made(trainer) == updates
    if not updates:  # AdamW's weight decay did not shrink the Params either
        for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
            np.testing.assert_array_equal(a, b)


def test_fit_on_sequences_scored_at_their_last_step_is_adam_on_each_sequences_gradient():
    """Two batches, each scored at its last step, through ``fit`` with the default
    ``update_every=1``: two Adam updates, each with the BPTT gradient of ``L_T`` (D-RTRL is
    exact on this model) at the Params the batch starts from."""
    last = jnp.zeros(T).at[-1].set(1.0)
    batches = [(*batch(seed), last) for seed in (0, 1)]
    model = build()
    trainer = braintrace.OnlineTrainer(
        braintrace.compile(model, "d_rtrl", jnp.ones((B, IN)), strict=True),
        optax.adam(1e-2), loss_fn=mse)
    trainer.fit(batches, progress=False)
    assert updates_made(trainer) == 2

    tx = optax.adam(1e-2)
    reference = build()
    params = nnx.state(reference, nnx.Param)
    opt_state = tx.init(params)
    for xs, ys, mask in batches:
        grads = bptt_grads(reference, xs, ys, weights=mask)  # the window of the last step
        assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-6
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        nnx.update(reference, params)
    for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_dni_updates_after_every_window_even_unscored():
    xs, ys = data(T)
    model = GRUNet()
    model.synth = braintrace.LinearSynthesizer(model)
    learner = braintrace.compile(model, braintrace.DNI(model.synth), xs[0])
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse, update_every=2)
    trainer.step(xs, ys, jnp.zeros(T))
    assert updates_made(trainer) == T // 2
