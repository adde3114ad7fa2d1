"""The pure core: online gradients and updates inside the user's own ``jit``-ed train step.

* ``online_grad`` / ``online_update`` under ``nnx.jit`` and a ``lax.scan`` over chunks give
  the Params of the stateful ``OnlineLearner`` / ``OnlineTrainer`` (one implementation);
* ``model.eval()`` / ``model.train()`` after compile take effect in every driver;
* evaluation at another batch size touches nothing and compiles no training program;
* ``BPTT()`` equals ``jax.grad`` through an unrolled scan;
* a non-finite step is a returned flag inside ``jit``, never a silent NaN update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, built_on_the_host, compilations

import braintrace
from braintrace import layers

B, IN, HID, OUT, T = 3, 2, 5, 2, 6


def mse(y, t):
    return jnp.mean((y - t) ** 2)


@built_on_the_host
class Net(nnx.Module):
    """Encoder → GRU → readout (float64 when asked)."""

    def __init__(self, dtype=jnp.float32, seed=0):
        rngs = nnx.Rngs(seed)
        self.enc = layers.ETPLinear(IN, HID, param_dtype=dtype, rngs=rngs)
        self.rnn = layers.Stateful(layers.GRUCell(HID, HID, param_dtype=dtype, rngs=rngs))
        self.out = layers.ETPLinear(HID, OUT, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rnn(jnp.tanh(self.enc(x))))


@built_on_the_host
class Spiking(nnx.Module):
    """ETPLinear → LIF → readout (float64 when asked)."""

    def __init__(self, dtype=jnp.float32, seed=0):
        rngs = nnx.Rngs(seed)
        self.enc = layers.ETPLinear(IN, HID, param_dtype=dtype, rngs=rngs)
        self.lif = layers.LIF(HID, tau=4.0, v_th=0.3, param_dtype=dtype)
        self.out = layers.ETPLinear(HID, OUT, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.enc(x)))


@built_on_the_host
def data(dtype, chunks=3, seed=1):
    xs = jax.random.normal(jax.random.key(seed), (chunks, T, B, IN), dtype)
    ys = jax.random.normal(jax.random.key(seed + 1), (chunks, T, B, OUT), dtype)
    return xs, ys


def params_of(model):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_params_close(got, want, rtol):
    for a, b in zip(got, want, strict=True):
        scale = max(np.max(np.abs(b)), 1e-30)
        assert np.max(np.abs(a - b)) / scale <= rtol, np.max(np.abs(a - b)) / scale


def stateful_run(net, algorithm, dtype, tx, chunks):
    """The reference: the eager learner, one etrace_grad and one optimizer update per chunk."""
    model = net(dtype)
    learner = braintrace.compile(model, algorithm, jnp.zeros((B, IN), dtype), batch_size=B)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    xs, ys = chunks
    for k in range(xs.shape[0]):
        optimizer.update(model, learner.etrace_grad(xs[k], ys[k], mse))
    return params_of(model)


CASES = [("d_rtrl", Net), ("es_d_rtrl", Net), ("rtrl", Net), ("bptt", Net),
         ("d_rtrl", Spiking), ("fptt", Spiking), ("osttp", Spiking)]
"""The same user train step for each: switching a rule is one string."""


@pytest.mark.parametrize("algorithm, net, dtype, rtol", [
    *((a, n, jnp.float64, 1e-12) for a, n in CASES),
    *((a, n, jnp.float32, 1e-6) for a, n in CASES if a in ("d_rtrl", "bptt") and n is Net)])
def test_nnx_jit_train_step_equals_the_stateful_learner(algorithm, net, dtype, rtol):
    with jax.enable_x64(dtype == jnp.float64):
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
        chunks = data(dtype)
        want = stateful_run(net, algorithm, dtype, tx, chunks)

        model = net(dtype)
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, IN), dtype), batch_size=B)
        online = braintrace.online_grad(learner, mse)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, state, xs, ys):
            grads, state, stats = online.grad(model, state, xs, ys)
            optimizer.update(model, grads)
            return state, stats

        state = online.init(model)
        for k in range(chunks[0].shape[0]):
            state, stats = train_step(model, optimizer, state, chunks[0][k], chunks[1][k])
            assert bool(stats.finite) and stats.losses.shape == (T,)
        assert_params_close(params_of(model), want, rtol)


# One algorithm per loop (blocked, per step, windowed): the scan over chunks is the drivers' own;
# ES-D-RTRL's traces across calls are checked by the train-step test above.
@pytest.mark.parametrize("algorithm", ["d_rtrl", "rtrl", "bptt"])
def test_a_scan_over_chunks_equals_one_call_per_chunk(algorithm):
    with jax.enable_x64(True):
        tx = optax.adam(1e-2)
        chunks = data(jnp.float64, chunks=4)
        want = stateful_run(Net, algorithm, jnp.float64, tx, chunks)

        model = Net(jnp.float64)
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, IN), jnp.float64),
                                     batch_size=B)
        online = braintrace.online_grad(learner, mse)
        graphdef, params = nnx.split(model, nnx.Param, ...)[:2]
        rest = nnx.split(model, nnx.Param, ...)[2]

        @jax.jit
        def train_stream(params, opt_state, state, xs, ys):
            def body(carry, chunk):
                params, opt_state, state = carry
                model = nnx.merge(graphdef, params, rest)
                grads, state, stats = online.grad(model, state, *chunk)
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state, state), stats.losses

            return jax.lax.scan(body, (params, opt_state, state), (xs, ys))

        (params, _, _), losses = train_stream(params, tx.init(params), online.init(model),
                                                  *chunks)
        assert losses.shape == (4, T)
        assert_params_close([np.asarray(a) for a in jax.tree.leaves(params)], want, 1e-12)


def test_online_update_under_jit_equals_the_stateful_trainer():
    with jax.enable_x64(True):
        xs, ys = data(jnp.float64, chunks=2)
        tx = optax.adam(0.05)  # stateful: an update applied before the first window would show
        model = Net(jnp.float64)
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), jnp.float64),
                                     batch_size=B)
        trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=mse, update_every=2)
        for k in range(2):
            trainer.step(xs[k], ys[k])
        want = params_of(model)

        model = Net(jnp.float64)
        learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN), jnp.float64),
                                     batch_size=B)
        train = braintrace.online_update(learner, mse, tx, update_every=2)
        opt_state, state = train.init(model)
        update = nnx.jit(train.update)
        for k in range(2):
            params, opt_state, state, stats = update(model, opt_state, state, xs[k], ys[k])
            nnx.update(model, params)
            assert bool(stats.finite)
        assert_params_close(params_of(model), want, 1e-12)


# -- modes ------------------------------------------------------------------------------------


class Noisy(nnx.Module):
    """Dropout and BatchNorm before a LIF layer: both read the mode."""

    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.enc = layers.ETPLinear(IN, HID, rngs=rngs)
        self.norm = nnx.BatchNorm(HID, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lif = layers.LIF(HID)
        self.out = layers.ETPLinear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.drop(self.norm(self.enc(x)) + 1.0)))


def plain_outputs(model, xs):
    """The model itself, step by step, on a copy (its own mode)."""
    copy = nnx.clone(model)
    return jnp.stack([copy(x) for x in xs])


def test_eval_and_train_after_compile_take_effect_in_every_driver():
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0] * 3.0, ys[0]
    model = Noisy()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    model.eval()
    learner.reset()
    want = plain_outputs(model, xs)
    np.testing.assert_allclose(learner.etrace_evolve(xs), want, rtol=1e-6, atol=1e-6)
    learner.reset()
    np.testing.assert_allclose(learner.evaluate(xs), want, rtol=1e-6, atol=1e-6)

    model.train()
    learner.reset()
    want_train = plain_outputs(model, xs)
    assert np.max(np.abs(np.asarray(want_train) - np.asarray(want))) > 1e-2  # modes differ
    np.testing.assert_allclose(learner.etrace_evolve(xs), want_train, rtol=1e-6, atol=1e-6)

    # through the trainer: one update at the end, so every step's loss is the model's own
    model.eval()  # (training mode updated BatchNorm's running averages: the model's own again)
    learner.reset()
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=T)
    want = plain_outputs(model, xs)
    losses = trainer.step(xs, ys)
    np.testing.assert_allclose(losses, jax.vmap(mse)(want, ys), rtol=1e-5)


def test_the_pure_gradient_reads_the_mode_of_the_model_it_is_given():
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0] * 3.0, ys[0]
    model = Noisy()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    online = braintrace.online_grad(learner, mse)
    model.eval()
    state = online.init(model)
    _, _, stats = jax.jit(online.grad)(model, state, xs, ys)
    np.testing.assert_allclose(stats.losses, jax.vmap(mse)(plain_outputs(model, xs), ys),
                               rtol=1e-5)


# -- evaluation ---------------------------------------------------------------------------------


def test_evaluation_at_another_batch_size_touches_nothing_and_compiles_no_training_program():
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0], ys[0]
    model = Net()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    learner.etrace_grad(xs, ys, mse)
    before = [np.asarray(a) for a in jax.tree.leaves((nnx.state(model), learner.traces))]
    big = jax.random.normal(jax.random.key(5), (T, 11, IN))
    with compilations() as compiled:
        out = learner.evaluate(big)
        out_again = learner.evaluate(big)
    assert out.shape == (T, 11, OUT)
    np.testing.assert_array_equal(out, out_again)
    assert "grad_program" not in compiled and compiled.count("_run") == 1
    after = [np.asarray(a) for a in jax.tree.leaves((nnx.state(model), learner.traces))]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    # the samples are independent: the first three equal a batch of three from fresh states
    fresh = braintrace.evaluate(model, big[:, :B], batch_size=B)
    np.testing.assert_allclose(out[:, :B], fresh, rtol=1e-5, atol=1e-7)


# -- BPTT -----------------------------------------------------------------------------------------


def oracle_mean_grads(model, xs, ys):
    """The oracle of ``tests/helpers.py`` for the mean loss, from fresh states of the batch."""
    model = nnx.clone(model)
    braintrace.init_states(model, batch_size=xs.shape[1])
    return bptt_grads(model, xs, ys, jnp.full(xs.shape[0], 1 / xs.shape[0], xs.dtype), mse)


def test_bptt_equals_the_oracle():
    with jax.enable_x64(True):
        xs, ys = data(jnp.float64, chunks=1)
        xs, ys = xs[0], ys[0]
        model = Net(jnp.float64)
        want = oracle_mean_grads(model, xs, ys)
        learner = braintrace.compile(model, braintrace.BPTT(), jnp.zeros((B, IN), jnp.float64),
                                     batch_size=B)
        got = learner.etrace_grad(xs, ys, mse)
        assert_params_close(params_of_state(got), params_of_state(want), 1e-12)
        assert not learner.graph.approximations or "bptt" in learner.report()


def params_of_state(state):
    return [np.asarray(a) for a in jax.tree.leaves(state)]


def test_truncated_bptt_is_bptt_per_chunk_with_the_state_carried():
    with jax.enable_x64(True):
        xs, ys = data(jnp.float64, chunks=1)
        xs, ys = xs[0], ys[0]
        learner = braintrace.compile(Net(jnp.float64), "bptt", jnp.zeros((B, IN), jnp.float64),
                                     batch_size=B)
        truncated = learner.etrace_grad(xs, ys, mse, chunk_size=3, reduction="sum")
        again = braintrace.compile(Net(jnp.float64), "bptt", jnp.zeros((B, IN), jnp.float64),
                                   batch_size=B)
        first = again.etrace_grad(xs[:3], ys[:3], mse, reduction="sum")
        second = again.etrace_grad(xs[3:], ys[3:], mse, reduction="sum")
        assert_params_close(params_of_state(truncated),
                            [a + b for a, b in zip(params_of_state(first),
                                                   params_of_state(second))], 1e-12)


# -- non-finite steps inside jit ----------------------------------------------------------------


def test_a_non_finite_step_is_a_flag_inside_jit_and_the_update_is_skipped():
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0], ys[0]
    xs = xs.at[2, 0, 0].set(jnp.nan)
    model = Net()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    online = braintrace.online_grad(learner, mse)
    _, _, stats = jax.jit(online.grad)(model, online.init(model), xs, ys)
    assert not bool(stats.finite)
    train = braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=2)
    opt_state, state = train.init(model)
    before = params_of(model)
    params, _, _, ustats = jax.jit(train.update)(model, opt_state, state, xs, ys)
    assert not bool(ustats.finite)
    # the first window's update (steps 0-1) was applied; the one reading the NaN was skipped
    assert int(ustats.bad_update_at) == 3
    after = params_of_state(params)
    assert all(np.all(np.isfinite(a)) for a in after)
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(after, before))


def test_the_last_windows_update_is_skipped_too_and_the_earlier_ones_stand():
    """The last window's update is applied after the loop: a non-finite one is skipped and
    reported there as well, and equals the run that stops before that window."""
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0], ys[0]
    model = Net()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    train = braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=2)
    opt_state, state = train.init(model)
    update = jax.jit(train.update)
    params, _, _, stats = update(model, opt_state, state, xs.at[T - 1, 0, 0].set(jnp.nan), ys)
    assert not bool(stats.finite) and int(stats.bad_update_at) == T - 1
    kept, _, _, good = update(model, opt_state, state, xs[:T - 2], ys[:T - 2])
    assert bool(good.finite)
    for a, b in zip(params_of_state(params), params_of_state(kept)):
        np.testing.assert_array_equal(a, b)


def test_the_eager_learner_inside_jit_says_what_to_use_instead():
    xs, ys = data(jnp.float32, chunks=1)
    model = Net()
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    with pytest.raises(TypeError, match="online_grad"):
        jax.jit(lambda x, y: learner.etrace_grad(x, y, mse))(xs[0], ys[0])


def test_reduce_on_plateau_lowers_the_rate_in_the_trainer():
    xs, ys = data(jnp.float32, chunks=1)
    xs, ys = xs[0], ys[0]
    learner = braintrace.compile(Net(), "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    tx = optax.chain(optax.sgd(1e-3),
                     optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.5,
                                                     accumulation_size=1))
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=mse, update_every=1)
    for _ in range(4):
        learner.reset()
        trainer.step(xs, ys * 0 + 100.0)  # an unreachable target: the loss plateaus
    scale = float(trainer.opt_state[1].scale)
    assert scale < 1.0
