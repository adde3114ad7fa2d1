"""The pure API's state across calls: the model's RNG advances, and any batch size runs.

* ``online_grad`` / ``online_update`` with ``state = online.init(model)`` per batch draw new
  Dropout masks for every batch (the model's RNG counters advance as a call of the model
  advances them), equal to the plain Flax loop and to the stateful learner; the same seed
  gives the same run;
* full batches and a partial last batch run in one ``@nnx.jit`` train step
  (``online.init(model, batch_size=b)``), each batch size compiled once, the gradients equal
  to the float64 oracle and to a learner compiled for that batch size.
"""

from __future__ import annotations

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, compilations, mse

import braintrace
from braintrace import layers

B, IN, HID, OUT, T = 3, 2, 6, 2, 5
F64 = jnp.float64


class Dropped(nnx.Module):
    """ETPLinear → Dropout → LIF → ETPLinear: exact for D-RTRL (the mask is elementwise)."""

    def __init__(self, seed=0, dtype=F64):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.enc = layers.ETPLinear(IN, HID, param_dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lif = layers.LIF(HID, tau=4.0, param_dtype=dtype)
        self.out = layers.ETPLinear(HID, OUT, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.drop(self.enc(x)) + 1.0))


def batch(seed, batch_size=B, length=T, dtype=F64):
    xs = jax.random.normal(jax.random.key(seed), (length, batch_size, IN), dtype)
    ys = jax.random.normal(jax.random.key(seed + 50), (length, batch_size, OUT), dtype)
    return xs, ys


def leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def assert_close(got, want, rtol):
    for a, b in zip(leaves(got), leaves(want), strict=True):
        scale = max(float(np.max(np.abs(b))), 1e-30)
        assert float(np.max(np.abs(a - b))) / scale <= rtol


def flax_loop(model, batches):
    """The oracle, Flax alone, on a copy of ``model``: per batch, fresh hidden states, the
    gradient of the mean loss (``jax.grad`` through a scan of the pure step) and the losses
    of the model called step by step, as a Flax user's loop calls it (which advances its RNG
    counters for the next batch)."""
    model = nnx.clone(model)
    results = []
    for xs, ys in batches:
        braintrace.init_states(model, batch_size=xs.shape[1])
        grads = bptt_grads(model, xs, ys, jnp.full((xs.shape[0],), 1 / xs.shape[0], F64))
        losses = jnp.stack([mse(model(x), y) for x, y in zip(xs, ys, strict=True)])
        results.append((losses, grads))
    return results


def rng_counts(model):
    return [int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))]


# -- the model's RNG -------------------------------------------------------------------------


def test_online_grad_draws_new_dropout_masks_for_every_batch():
    """``state = online.init(model)`` per batch (README, "Inside your own train step"): the
    second batch draws other masks than the first, as the Flax loop does."""
    with jax.enable_x64(True):
        model = Dropped()
        want = flax_loop(model, [batch(1), batch(1)])
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), F64), batch_size=B)
        online = braintrace.online_grad(learner, mse)

        @nnx.jit
        def step(model, state, xs, ys):
            grads, state, stats = online.grad(model, state, xs, ys)
            return grads, stats.losses

        got = [step(model, online.init(model), *batch(1)) for _ in range(2)]
        assert not np.array_equal(got[0][1], got[1][1])  # other masks, the same data
        for (grads, losses), (want_losses, want_grads) in zip(got, want, strict=True):
            np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
            assert_close(grads, want_grads, 1e-10)
        assert rng_counts(model) == [2 * T]


def test_online_update_advances_the_models_rng_too():
    with jax.enable_x64(True):
        model = Dropped()
        want = flax_loop(model, [batch(1), batch(1)])
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), F64), batch_size=B)
        train = braintrace.online_update(learner, mse, optax.sgd(0.0), update_every=T)
        update = nnx.jit(train.update)
        for want_losses, _ in want:
            params, _, _, stats = update(model, *train.init(model), *batch(1))
            nnx.update(model, params)
            np.testing.assert_allclose(stats.losses, want_losses, rtol=1e-12)
        assert rng_counts(model) == [2 * T]


def test_the_same_seed_gives_the_same_run_and_the_stateful_learners_masks():
    """Two runs from one seed are bit-identical; both equal the stateful learner (reset per
    batch), which always advanced the model's RNG."""
    with jax.enable_x64(True):
        def pure_run(seed):
            model = Dropped(seed)
            learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), F64),
                                         batch_size=B)
            online = braintrace.online_grad(learner, mse)
            step = nnx.jit(online.grad)
            return [np.asarray(step(model, online.init(model), *batch(k))[2].losses)
                    for k in range(3)]

        first, again, other_seed = pure_run(0), pure_run(0), pure_run(3)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)
        assert not any(np.array_equal(a, b) for a, b in zip(first, other_seed, strict=True))

        model = Dropped(0)
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), F64), batch_size=B)
        for k in range(3):
            learner.reset()
            _, losses = learner.etrace_grad(*batch(k), mse, return_losses=True)
            np.testing.assert_allclose(first[k], losses, rtol=1e-12)


def test_under_jax_jit_the_state_carries_the_rng_and_a_closed_over_model_is_named():
    """``jax.jit`` drops writes to a model passed as an argument, as for any Flax module: the
    carried state's ``other`` still advances the RNG. A model closed over by the jit cannot be
    written at all (Flax's TraceContextError), and the message says to pass it."""
    model = Dropped(dtype=jnp.float32)
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    online = braintrace.online_grad(learner, mse)
    xs, ys = batch(1, dtype=jnp.float32)
    state = online.init(model)
    losses = []
    for _ in range(2):
        _, state, stats = jax.jit(online.grad)(model, state, xs, ys)
        losses.append(stats.losses)
    assert not np.array_equal(losses[0], losses[1])
    assert rng_counts(model) == [0] and jax.tree.leaves(nnx.state(state.other,
                                                                  nnx.RngCount)) == [2 * T]
    with pytest.raises(flax.errors.TraceContextError,
                       match=r"online_grad: grad writes the model's RNG counters and batch "
                             r"statistics \(\['drop\.rngs\.count', 'drop\.rngs\.key'\]\).*"
                             r"Pass the model as an argument"):
        jax.jit(lambda s, x, y: online.grad(model, s, x, y))(state, xs, ys)
    assert rng_counts(model) == [0]


def values(tree):
    """Every leaf of ``tree`` as a NumPy array (PRNG keys as their key data)."""
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                       else a) for a in jax.tree.leaves(tree)]


def test_a_kept_state_is_a_value_that_a_call_never_changes():
    """A state kept from ``init`` is unchanged by ``online_grad`` calls (eager and under
    ``nnx.jit``), ``online_update`` calls and calls of the model, which all advance the model's
    RNG: replayed, it gives the same results bit for bit; only the returned state advances."""
    model = Dropped(dtype=jnp.float32)
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    online = braintrace.online_grad(learner, mse)
    train = braintrace.online_update(learner, mse, optax.sgd(0.0), update_every=T)
    xs, ys = batch(1, dtype=jnp.float32)
    opt_state, kept = train.init(model)
    frozen = values(kept)
    calls = [lambda model, state: online.grad(model, state, xs, ys),
             nnx.jit(lambda model, state: online.grad(model, state, xs, ys)),
             nnx.jit(lambda model, state: train.update(model, opt_state, state, xs, ys))]
    for call in calls:
        first = call(model, kept)
        model(xs[0])
        again = call(model, kept)
        for a, b in zip(values(first), values(again), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(values(kept), frozen, strict=True):
            np.testing.assert_array_equal(a, b)
        returned = first[1] if len(first) == 3 else first[2]
        assert jax.tree.leaves(nnx.state(returned.other, nnx.RngCount)) == [T]
    assert jax.tree.leaves(nnx.state(kept.other, nnx.RngCount)) == [0]
    assert rng_counts(model) == [T]  # each call writes its state's advance into the model


# -- any batch size ------------------------------------------------------------------------


class Leaky(nnx.Module):
    """ETPLinear → LIF (learnable τ) → ETPLinear, float64: D-RTRL is exact on it."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.enc = layers.ETPLinear(IN, HID, param_dtype=F64, rngs=rngs,
                                    kernel_init=nnx.initializers.normal(1.0))
        self.lif = layers.LIF(HID, tau=4.0, learn_tau=True, param_dtype=F64)
        self.out = layers.ETPLinear(HID, OUT, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.enc(x)))


def oracle(model, xs, ys):
    model = nnx.clone(model)
    braintrace.init_states(model, batch_size=xs.shape[1])
    return bptt_grads(model, xs, ys, jnp.full((xs.shape[0],), 1 / xs.shape[0], F64))


def test_a_partial_last_batch_runs_in_the_same_jit_train_step():
    """Batches of 32 and a last one of 20 in one ``@nnx.jit`` step: the gradients are the
    oracle's and a learner's compiled for 20; each shape is compiled once."""
    with jax.enable_x64(True):
        xs, ys = batch(2, batch_size=52)
        model = Leaky()
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((32, IN), F64), batch_size=32)
        online = braintrace.online_grad(learner, mse)

        @nnx.jit
        def train_step(model, xs, ys):
            state = online.init(model, batch_size=xs.shape[1])
            grads, _, stats = online.grad(model, state, xs, ys)
            outputs = braintrace.evaluate(model, xs, batch_size=xs.shape[1])
            return grads, stats.losses, outputs

        parts = [(xs[:, :32], ys[:, :32]), (xs[:, 32:], ys[:, 32:])]
        got = [train_step(model, *part) for part in parts]
        with compilations() as compiled:
            again = [train_step(model, *part) for part in parts]
        assert compiled == []  # every shape met before: nothing traced or compiled again
        for (grads, losses, outputs), (xs_b, ys_b) in zip(got, parts, strict=True):
            assert_close(grads, oracle(model, xs_b, ys_b), 1e-10)
            np.testing.assert_allclose(losses, jax.vmap(mse)(outputs, ys_b), rtol=1e-12)
        for a, b in zip(leaves(got), leaves(again), strict=True):
            np.testing.assert_array_equal(a, b)

        last = Leaky()
        at_20 = braintrace.compile(last, "d_rtrl", jnp.zeros((20, IN), F64), batch_size=20)
        assert_close(got[1][0], at_20.etrace_grad(*parts[1], mse), 1e-13)
        assert model.lif.v.shape == (32, HID)  # the model's own hidden state is untouched


def test_online_update_runs_a_partial_batch_from_a_state_made_for_it():
    with jax.enable_x64(True):
        xs, ys = batch(4, batch_size=7, length=4)
        model = Leaky()
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((4, IN), F64), batch_size=4)
        train = braintrace.online_update(learner, mse, optax.sgd(1.0), update_every=4)
        before = nnx.state(model, nnx.Param)
        update = nnx.jit(train.update)
        for part in ((xs[:, :4], ys[:, :4]), (xs[:, 4:], ys[:, 4:])):
            opt_state, state = train.init(model, batch_size=part[0].shape[1])
            params, _, state, stats = update(model, opt_state, state, *part)
            assert bool(stats.finite) and state.hidden["lif"]["v"].shape == (part[0].shape[1],
                                                                            HID)
            # one SGD step of rate 1 after the window: the Params minus the mean gradient
            want = jax.tree.map(lambda p, g: p - g, before, oracle(model, *part))
            assert_close(params, want, 1e-10)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_init_at_a_batch_size_starts_from_initial_states_and_leaves_the_model(batch_size):
    with jax.enable_x64(True):
        model = Leaky()
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((3, IN), F64), batch_size=3)
        model.lif.v[...] = jnp.ones_like(model.lif.v[...])  # mid-sequence
        online = braintrace.online_grad(learner, mse)
        state = online.init(model, batch_size=batch_size)
        shape = (HID,) if batch_size is None else (batch_size, HID)
        np.testing.assert_array_equal(state.hidden["lif"]["v"][...], np.zeros(shape))
        np.testing.assert_array_equal(model.lif.v[...], np.ones((3, HID)))
        np.testing.assert_array_equal(online.init(model).hidden["lif"]["v"][...],
                                      np.ones((3, HID)))  # the default: as they are
