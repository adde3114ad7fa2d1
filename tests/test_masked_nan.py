"""What a mask weighs 0 is ignored, even when it is not finite (float64, against BPTT).

A batch of sequences of lengths 6, 4 and 2 is padded to ``T = 6``: the padding
is NaN, in the targets and in the inputs. docs/tasks.md promises that padded
steps add nothing to the loss, the gradient or the metrics, so every driver
must give the masked BPTT oracle of the *finite* batch (the padding replaced by
zeros). ``0 · nan = nan``: a mask that only multiplies leaks the NaN.

An input at an unscored step that still reaches a later scored step is data,
not padding: a non-finite one is an error naming it and its step (and so is a
non-finite input whose loss is finite, which used to be blamed on the learning
rate or the inputs' scale). The error leaves every state as it was.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, mse

import braintrace
from braintrace import layers
from braintrace.tasks import Batch, accuracy

T, B, IN, OUT = 6, 3, 2, 2
LENGTHS = (6, 4, 2)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def build(batch=B):
    f64 = {"param_dtype": jnp.float64}
    model = nnx.Sequential(layers.ETPLinear(IN, 4, rngs=nnx.Rngs(0), **f64),
                           layers.LIF(4, tau=4.0, v_th=0.3, **f64),
                           layers.ETPLinear(4, OUT, rngs=nnx.Rngs(1), **f64))
    braintrace.init_states(model, batch)
    return model


def padded(fill):
    """``(xs, ys, mask)``: sequences of ``LENGTHS`` padded with ``fill``."""
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(1), (T, B, OUT), jnp.float64)
    mask = (jnp.arange(T)[:, None] < jnp.array(LENGTHS)[None]).astype(jnp.float64)
    scored = mask[..., None] > 0
    return jnp.where(scored, xs, fill), jnp.where(scored, ys, fill), mask


def masked_oracle(xs, ys, mask, reduction="mean"):
    """BPTT of ``Σ_tb m_tb ℓ_tb / B`` (``'mean'``: over the scored pairs), on finite data."""
    def loss_fn(y, target):
        t, m = target
        return jnp.sum(m * jax.vmap(mse)(y, t)) / y.shape[0]

    grads = bptt_grads(build(), xs, (ys, mask), loss_fn=loss_fn)
    scale = jnp.sum(mask) / mask.shape[1] if reduction == "mean" else 1.0
    return jax.tree.map(lambda g: g / scale, grads)


def assert_close(got, want, tol=1e-10):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        w = np.asarray(w)
        assert np.max(np.abs(w)) > 1e-6, path  # a live reference
        err = np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))
        assert err <= tol, (jax.tree_util.keystr(path), err)


def snapshot(learner, trainer=None):
    """Host copies of everything a call may change: Params, model state, traces (optimiser)."""
    arrays = [*jax.tree.leaves(nnx.state(learner.model)), *jax.tree.leaves(learner.traces)]
    if trainer is not None:
        arrays += jax.tree.leaves(trainer.opt_state)
    return [np.array(a) for a in arrays]


def assert_same(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# -- the gradient: every loop, the pure function, the trainer ----------------------------------

@pytest.mark.parametrize("algorithm, options", [
    ("d_rtrl", {"block_size": 1}),   # the per-step loop
    ("d_rtrl", {}),                  # the time-blocked loop
    ("d_rtrl", {"chunk_size": 2}),   # the windowed loop
    ("bptt", {}),
])
def test_nan_padding_adds_nothing_to_etrace_grad(algorithm, options):
    xs, ys, mask = padded(jnp.nan)
    want = masked_oracle(*padded(0.0))
    learner = braintrace.compile(build(), algorithm, xs[0], strict=algorithm != "bptt")
    grads, losses = learner.etrace_grad(xs, ys, mse, mask=mask, return_losses=True, **options)
    assert_close(grads, want)
    assert np.all(np.isfinite(losses))
    assert all(np.all(np.isfinite(h)) for h in jax.tree.leaves(nnx.state(learner.model)))


def test_a_step_mask_ignores_nan_targets_but_reads_the_stimulus_before_the_answer():
    """A ``(T,)`` mask scoring an answer period (steps 2, 3): the stimulus at steps 0, 1 is
    unscored but reaches the answer, so it is read; the NaN targets at every unscored step and
    the NaN inputs after the answer (steps 4, 5) add nothing."""
    mask = jnp.array([0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(1), (T, B, OUT), jnp.float64)
    after = (jnp.arange(T) > 3)[:, None, None]
    want = bptt_grads(build(), jnp.where(after, 0.0, xs), ys, weights=mask / 2)
    learner = braintrace.compile(build(), "d_rtrl", xs[0], strict=True)
    got = learner.etrace_grad(jnp.where(after, jnp.nan, xs),
                              jnp.where(mask[:, None, None] > 0, ys, jnp.nan), mse, mask=mask)
    assert_close(got, want)


def test_the_pure_gradient_ignores_nan_padding_under_jit():
    xs, ys, mask = padded(jnp.nan)
    clean = padded(0.0)
    model = build()
    online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", xs[0]), mse)
    run = jax.jit(lambda s, x, y, m: online.grad(model, s, x, y, mask=m))
    grads, state, stats = run(online.init(model), xs, ys, mask)
    assert bool(stats.finite)
    assert_close(grads, masked_oracle(*clean))
    _, clean_state, clean_stats = run(online.init(model), *clean)
    np.testing.assert_array_equal(stats.losses, clean_stats.losses)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(clean_state)):
        np.testing.assert_array_equal(a, b)  # the state after the padding, too


def test_the_trainer_ignores_nan_padding():
    xs, ys, mask = padded(jnp.nan)
    want = masked_oracle(*padded(0.0), reduction="sum")
    model = build()
    trainer = braintrace.OnlineTrainer(braintrace.compile(model, "d_rtrl", xs[0]),
                                       optax.sgd(1.0), loss_fn=mse, update_every=T)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    losses = trainer.step(xs, ys, mask)
    assert np.all(np.isfinite(losses))
    step = jax.tree.map(lambda a, b: (a - b) * T, before, nnx.state(model, nnx.Param))
    assert_close(step, want, 1e-9)  # sgd(1): Params move by the window's mean gradient


def test_the_trainer_with_an_update_every_step_gives_the_params_of_the_finite_batch():
    def trained(fill):
        model = build()
        trainer = braintrace.OnlineTrainer(braintrace.compile(model, "d_rtrl", jnp.ones((B, IN))),
                                           optax.adam(1e-2), loss_fn=mse)
        trainer.step(*padded(fill))
        return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]

    for a, b in zip(trained(jnp.nan), trained(0.0), strict=True):
        np.testing.assert_array_equal(a, b)


# -- a loss singular where the mask is 0: selected before it reaches the gradient ---------------

def relative(y, t):
    """A per-sample loss singular at a zero target: inf there, with an infinite derivative."""
    return jnp.mean(((y - t) / t) ** 2)


def relative_oracle(reduction="mean"):
    """The masked BPTT oracle of ``relative`` on the zero-padded batch (its padding made 1)."""
    xs, ys, mask = padded(0.0)

    def loss_fn(y, target):
        t, m = target
        return jnp.sum(m * jax.vmap(relative)(y, t)) / y.shape[0]

    grads = bptt_grads(build(), xs, (jnp.where(mask[..., None] > 0, ys, 1.0), mask),
                       loss_fn=loss_fn)
    scale = jnp.sum(mask) / B if reduction == "mean" else 1.0
    return jax.tree.map(lambda g: g / scale, grads)


@pytest.mark.parametrize("algorithm, options", [
    ("d_rtrl", {"block_size": 1}),   # the per-step loop
    ("d_rtrl", {}),                  # the time-blocked loop
    ("bptt", {}),                    # the windowed loop
])
def test_a_loss_singular_at_the_zero_padding_adds_nothing_to_etrace_grad(algorithm, options):
    xs, ys, mask = padded(0.0)
    learner = braintrace.compile(build(), algorithm, xs[0], strict=True)
    grads, losses = learner.etrace_grad(xs, ys, relative, mask=mask, return_losses=True,
                                        **options)
    assert np.all(np.isfinite(losses))
    assert_close(grads, relative_oracle())


def test_a_step_that_scores_nothing_reports_0_even_where_the_loss_is_singular():
    """A ``(T,)`` mask scoring steps 0-3, the targets 0 after: those steps add nothing and
    report 0 (their loss, inf, is never read), as a ``(T, B)`` step whose samples are all
    padding does."""
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(1), (T, B, OUT), jnp.float64)
    mask = (jnp.arange(T) < 4).astype(jnp.float64)
    zeroed = jnp.where(mask[:, None, None] > 0, ys, 0.0)
    want = bptt_grads(build(), xs, jnp.where(mask[:, None, None] > 0, ys, 1.0),
                      weights=mask / jnp.sum(mask), loss_fn=relative)
    learner = braintrace.compile(build(), "d_rtrl", xs[0], strict=True)
    for weights in (mask, jnp.broadcast_to(mask[:, None], (T, B))):
        learner.reset()
        grads, losses = learner.etrace_grad(xs, zeroed, relative, mask=weights,
                                            return_losses=True)
        assert_close(grads, want)
        np.testing.assert_array_equal(np.asarray(losses)[4:], 0.0)
        assert np.all(np.asarray(losses)[:4] > 0)


def test_a_loss_singular_at_the_zero_padding_adds_nothing_to_online_grad_trainer_and_fit():
    xs, ys, mask = padded(0.0)
    model = build()
    online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", xs[0]), relative)
    grads, _, stats = jax.jit(lambda s: online.grad(model, s, xs, ys, mask=mask))(
        online.init(model))
    assert bool(stats.finite)
    assert_close(grads, relative_oracle())
    want = relative_oracle("sum")
    for train in (lambda trainer: trainer.step(xs, ys, mask),
                  lambda trainer: trainer.fit([(xs, ys, mask)], progress=False).losses):
        model = build()
        trainer = braintrace.OnlineTrainer(braintrace.compile(model, "d_rtrl", xs[0]),
                                           optax.sgd(1.0), loss_fn=relative, update_every=T)
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        assert np.all(np.isfinite(train(trainer)))
        step = jax.tree.map(lambda a, b: (a - b) * T, before, nnx.state(model, nnx.Param))
        assert_close(step, want, 1e-9)  # sgd(1): Params move by the window's mean gradient


# -- the metrics: fit's history and the tasks' accuracy -----------------------------------------

def test_fit_records_the_loss_and_validation_metrics_of_the_scored_steps_only():
    xs, ys, mask = padded(jnp.nan)
    clean = padded(0.0)

    def fitted(batch):
        trainer = braintrace.OnlineTrainer(braintrace.compile(build(), "d_rtrl", xs[0]),
                                           optax.sgd(0.0), loss_fn=mse, update_every=T)
        return trainer.fit([batch], validation=batch, progress=False,
                           metrics={"scored": lambda out, b: jnp.sum(
                               jnp.where(b[2][..., None] > 0, out, 0.0))})

    history, want = fitted((xs, ys, mask)), fitted(clean)
    assert np.isfinite(history[0]) and history[0] == want[0]
    assert history.evaluations == want.evaluations
    # the validation loss is the mean over the scored (step, sample) pairs
    outputs = braintrace.evaluate(build(), clean[0], batch_size=B)
    ell = np.asarray(jax.vmap(jax.vmap(mse))(outputs, clean[1]))
    np.testing.assert_allclose(history.evaluations[0]["val_loss"],
                               np.sum(ell * mask) / np.sum(mask), rtol=1e-12)


def test_accuracy_reads_no_output_the_mask_ignores():
    labels = jnp.array([[0, 1]] * 3)
    logits = jnp.array([[[jnp.nan, 0.0], [0.0, jnp.nan]], [[1.0, 0], [0, 1]], [[1.0, 0], [1, 0]]])
    assert float(accuracy(logits, Batch(jnp.zeros((3, 2, 1)), labels,
                                        jnp.array([0.0, 1, 1])))) == 0.5


# -- errors: a non-finite input that reaches a scored step is named ------------------------------

def last_step_mask():
    return jnp.zeros(T).at[-1].set(1.0)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_non_finite_input_that_reaches_a_scored_step_is_named(bad):
    """Only the last step is scored; ``xs[2, 1, 0]`` is unscored but reaches it."""
    xs, ys, _ = padded(0.0)
    xs = xs.at[2, 1, 0].set(bad)
    learner = braintrace.compile(build(), "d_rtrl", xs[0])
    learner.etrace_evolve(xs[:2] + 1.0)  # hidden state and traces that are not initial
    before = snapshot(learner)
    learner.etrace_grad(xs, ys, mse, mask=last_step_mask())
    with pytest.raises(FloatingPointError,
                       match=rf"the input xs\[2, 1, 0\] at time step 2 is {bad}.*"
                             r"A mask does not hide an input that reaches a scored step"):
        learner.sync()
    assert_same(before, snapshot(learner))
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse)
    before = snapshot(learner, trainer)
    trainer.step(xs, ys, last_step_mask())
    with pytest.raises(FloatingPointError, match=r"the input xs\[2, 1, 0\] at time step 2"):
        trainer.sync()
    assert_same(before, snapshot(learner, trainer))


def test_an_infinite_input_with_finite_losses_is_named_not_blamed_on_the_learning_rate():
    """``inf`` into a LIF layer: the spikes and so every loss stay finite, the gradient does
    not. The message names the input and its step, not the learning rate or the scale."""
    xs, ys, _ = padded(0.0)
    xs = xs.at[2, 1, 0].set(jnp.inf)
    learner = braintrace.compile(build(), "d_rtrl", xs[0])
    before = snapshot(learner)
    learner.etrace_grad(xs, ys, mse)
    with pytest.raises(FloatingPointError, match=r"not finite although every loss is: the "
                                                 r"input xs\[2, 1, 0\] at time step 2 is inf\. "
                                                 r"No gradient.*Replace the non-finite inputs\.$"):
        learner.sync()
    assert_same(before, snapshot(learner))
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse)
    before = snapshot(learner, trainer)
    trainer.step(xs, ys)
    with pytest.raises(FloatingPointError) as info:
        trainer.sync()
    message = str(info.value)
    assert "the input xs[2, 1, 0] at time step 2 is inf" in message
    assert "learning rate" not in message
    assert_same(before, snapshot(learner, trainer))


# -- memory: the loops clean each step as they read it, no copy of the sequence ----------------

@pytest.mark.parametrize("algorithm, options", [
    ("es_d_rtrl", {"block_size": 1}),  # the per-step loop
    ("es_d_rtrl", {}),                 # the time-blocked loop (a block's steps at most)
    ("bptt", {}),                      # the windowed loop, one window over the sequence
])
def test_a_mask_costs_no_copy_of_the_inputs(algorithm, options):
    """XLA's temporaries of the masked program exceed the unmasked one's by far less than one
    copy of ``xs`` (``T·B·I·4`` bytes, 1 MiB): what a mask ignores is replaced in each step as
    the loop reads it, not in a cleaned copy of the whole sequence made before the loop."""
    steps, batch, width = 512, 4, 128
    f32 = {"param_dtype": jnp.float32}
    model = nnx.Sequential(layers.ETPLinear(width, 8, rngs=nnx.Rngs(0), **f32), layers.LIF(8))
    learner = braintrace.compile(model, algorithm, jnp.zeros((batch, width), jnp.float32),
                                 batch_size=batch)
    xs = jax.ShapeDtypeStruct((steps, batch, width), jnp.float32)
    ys = jax.ShapeDtypeStruct((steps, batch, 8), jnp.float32)
    mask = (jnp.arange(steps)[:, None] < jnp.array([512, 300, 200, 100])).astype(jnp.float32)

    def temp_bytes(mask):
        lowered = learner.lower_etrace_grad(xs, ys, mse, mask=mask, **options)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    copy = steps * batch * width * 4
    assert temp_bytes(mask) - temp_bytes(None) < copy / 4
