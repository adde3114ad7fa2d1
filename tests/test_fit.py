"""``OnlineTrainer.fit``: streams, validation, metrics, callbacks, early stopping, scored losses."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace.tasks import SpikePatterns

B = 4


def trainer_for(task, lr=1e-2):
    model = nnx.Sequential(layers.ETPLinear(task.num_inputs, 8, rngs=nnx.Rngs(0)),
                           layers.LIF(8, tau=5.0),
                           layers.LeakyReadout(8, task.num_classes, rngs=nnx.Rngs(1)))
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((B, task.num_inputs)),
                                 batch_size=B)
    ce = lambda y, t: optax.softmax_cross_entropy_with_integer_labels(y, t).mean()
    return braintrace.OnlineTrainer(learner, optax.adam(lr), loss_fn=ce)


def task():
    return SpikePatterns(num_classes=3, num_inputs=5, seq_len=12, response_steps=3, seed=0)


def endless(task):
    """A stream that never ends, as a data loader would be."""
    for i in itertools.count():
        yield task.sample(jax.random.key(i), B)


class Recorder(braintrace.Callback):
    def __init__(self):
        self.events = []

    def on_step(self, trainer, record):
        self.events.append(("step", record["step"]))

    def on_evaluation(self, trainer, record):
        self.events.append(("evaluation", record["step"]))

    def on_end(self, trainer, history):
        self.events.append(("end", len(history)))


def test_an_endless_stream_with_validation_every_n_batches_a_callback_and_early_stopping():
    t = task()
    trainer = trainer_for(t, lr=0.0)  # nothing improves: early stopping must end the stream
    validation = [t.sample(jax.random.key(10_000 + i), B) for i in range(2)]
    recorder = Recorder()
    stop = braintrace.EarlyStopping("val_loss", patience=2)
    history = trainer.fit(endless(t), validation=validation, eval_every=3,
                          callbacks=[recorder, stop], progress=False)
    assert history.stopped_early
    # the first evaluation sets the best; two more without improvement stop it
    assert [r["step"] for r in history.evaluations] == [3, 6, 9]
    assert len(history) == 9
    assert recorder.events[-1] == ("end", 9)
    assert recorder.events.count(("evaluation", 6)) == 1
    assert [e for e in recorder.events if e[0] == "step"] == [("step", n) for n in range(1, 10)]
    steps, values = history.metric("val_loss")
    assert steps.tolist() == [3, 6, 9] and np.allclose(values, values[0])
    assert {"val_loss", "val_accuracy"} <= set(history.evaluations[0])


def test_a_budget_of_steps_ends_a_stream_and_user_metrics_are_recorded():
    t = task()
    trainer = trainer_for(t)
    first = t.sample(jax.random.key(10_000), B)
    history = trainer.fit(endless(t), steps=4, validation=first, eval_every=2,
                          metrics={"mean_output": lambda out, batch: jnp.mean(out)},
                          progress=False)
    assert not history.stopped_early and len(history) == 4
    assert [r["step"] for r in history.evaluations] == [2, 4]
    assert all("val_mean_output" in r for r in history.evaluations)


def test_the_loss_of_a_batch_is_its_mean_over_the_scored_steps():
    t = task()
    batch = t.sample(jax.random.key(0), B)
    trainer, again = trainer_for(t, lr=0.0), trainer_for(t, lr=0.0)
    losses = np.asarray(again.step(*batch))
    history = trainer.fit([batch], progress=False)
    mask = np.asarray(batch.mask)
    assert mask.sum() < mask.size  # unscored steps exist
    np.testing.assert_allclose(history[0], np.sum(losses * mask) / np.sum(mask), rtol=1e-6)
    assert not np.isclose(history[0], np.mean(losses))


def test_validation_accuracy_counts_the_scored_steps_of_integer_labels():
    t = task()
    trainer = trainer_for(t)
    batch = t.sample(jax.random.key(3), B)
    history = trainer.fit([batch], validation=batch, progress=False, steps=1)
    trainer.learner.model.eval()
    outputs = trainer.learner.evaluate(batch.xs)
    trainer.learner.model.train()
    right = np.asarray(jnp.argmax(outputs, -1) == batch.ys, np.float64)
    mask = np.asarray(batch.mask)[:, None]
    want = np.sum(right * mask) / np.sum(mask * np.ones_like(right))
    np.testing.assert_allclose(history.evaluations[-1]["val_accuracy"], want, rtol=1e-12)


def test_early_stopping_can_restore_the_best_params():
    t = task()
    trainer = trainer_for(t, lr=0.05)
    validation = t.sample(jax.random.key(10_000), B)
    stop = braintrace.EarlyStopping("val_loss", patience=10, restore_best=True)
    history = trainer.fit(endless(t), steps=6, eval_every=2, validation=validation,
                          callbacks=[stop], progress=False)
    best = min(r["val_loss"] for r in history.evaluations)
    trainer.learner.model.eval()
    out = trainer.learner.evaluate(validation.xs)
    trainer.learner.model.train()
    losses = jax.vmap(trainer.loss_fn)(out, validation.ys)
    mask = np.asarray(validation.mask)
    np.testing.assert_allclose(np.sum(np.asarray(losses) * mask) / mask.sum(), best, rtol=1e-5)


def test_a_generator_cannot_be_passed_over_twice():
    t = task()
    with pytest.raises(ValueError, match="one-shot iterator.*steps="):
        trainer_for(t).fit(endless(t), epochs=2, progress=False)


def test_epochs_over_a_list_evaluate_after_each_epoch():
    t = task()
    batches = [t.sample(jax.random.key(i), B) for i in range(2)]
    history = trainer_for(t).fit(batches, epochs=3, validation=batches[0], progress=False)
    assert [r["step"] for r in history.evaluations] == [2, 4, 6]
    assert [r["epoch"] for r in history.steps] == [0, 0, 1, 1, 2, 2]


def test_bad_early_stopping_settings_are_named():
    with pytest.raises(ValueError, match="mode"):
        braintrace.EarlyStopping(mode="lowest")
    with pytest.raises(ValueError, match="patience"):
        braintrace.EarlyStopping(patience=0)
    with pytest.raises(KeyError, match="val_f1"):
        braintrace.EarlyStopping("val_f1").on_evaluation(None, {"step": 1, "val_loss": 1.0})


class WithSpikes(nnx.Module):
    """Logits and the hidden spikes, as a model whose loss adds an activity regulariser."""

    def __init__(self, task):
        self.enc = layers.ETPLinear(task.num_inputs, 8, rngs=nnx.Rngs(0))
        self.lif = layers.LIF(8, tau=5.0)
        self.out = layers.LeakyReadout(8, task.num_classes, rngs=nnx.Rngs(1))

    def __call__(self, x):
        spikes = self.lif(self.enc(x))
        return self.out(spikes), spikes


def test_validation_of_a_model_with_several_outputs_reports_its_loss():
    t = task()
    model = WithSpikes(t)
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((B, t.num_inputs)),
                                 batch_size=B)
    ce = lambda y, target: (optax.softmax_cross_entropy_with_integer_labels(y[0], target).mean()
                            + 0.1 * braintrace.tasks.firing_rate_penalty(y[1], 0.05))
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=ce)
    batch = t.sample(jax.random.key(3), B)
    right = lambda outputs, b: jnp.mean(jnp.argmax(outputs[0][-1], -1) == b.ys[-1])
    history = trainer.fit([batch], validation=batch, metrics={"last": right}, progress=False,
                          steps=1)
    record = history.evaluations[-1]
    assert np.isfinite(record["val_loss"]) and "val_accuracy" not in record
    assert 0.0 <= record["val_last"] <= 1.0
