"""``OnlineTrainer`` with BPTT: by default one update per sequence, full BPTT through it.

An update every step would give BPTT (which keeps no traces) no credit across steps: a
truncation to one step, which left a spiking classifier at chance (issue: a newcomer's
two-layer network). With SGD the update is ``-lr`` times the gradient, so the Params'
change is checked against the float64 BPTT oracle of the mean loss; the explicit
``update_every=1`` is the negative control (it differs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import bptt_grads, mse

import braintrace
from braintrace import layers

B, I, H, O, T, LR = 2, 3, 4, 2, 5, 0.1
F64 = jnp.float64


def _model():
    model = nnx.Sequential(layers.ETPLinear(I, H, param_dtype=F64, rngs=nnx.Rngs(0)),
                           layers.LIF(H, tau=4.0, param_dtype=F64),
                           layers.LeakyReadout(H, O, param_dtype=F64, rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    return model


def _change(update_every):
    model = _model()
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    learner = braintrace.compile(model, "bptt", jnp.zeros((B, I), F64), batch_size=B)
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(LR), loss_fn=mse,
                                       update_every=update_every)
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, I), F64)
    ys = jax.random.normal(jax.random.key(1), (T, B, O), F64)
    trainer.step(xs, ys)
    trainer.sync()
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    oracle = nnx.to_pure_dict(bptt_grads(_model(), xs, ys, jnp.full((T,), 1 / T, F64)))
    return jax.tree.map(lambda a, b: (a - b) / -LR, after, before), oracle


def test_bptt_trainer_updates_once_per_sequence_by_default():
    with jax.enable_x64(True):
        step, oracle = _change(None)
        for got, want in zip(jax.tree.leaves(step), jax.tree.leaves(oracle), strict=True):
            assert float(np.max(np.abs(want))) > 0
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12)
        truncated, _ = _change(1)  # the negative control: T updates of one step each
        assert max(float(np.max(np.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(truncated), jax.tree.leaves(oracle))) > 1e-4
