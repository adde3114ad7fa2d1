"""``fit``'s counts are checked before anything is learnt; one ``EarlyStopping`` serves many fits.

A bad ``steps``, ``epochs`` or ``eval_every`` is an error naming the argument,
raised before the first batch: the model, the traces, the optimiser state and
the callbacks are as they were (``eval_every=0`` used to divide by zero after
a batch was learnt, ``epochs=-1`` to train nothing silently, ``eval_every=1.5``
to be accepted). An ``EarlyStopping`` starts afresh in every ``fit``: its best
value, its patience and its best Params are of that fit only (they used to
carry over, and ``restore_best`` wrote one trainer's Params into another model).
"""

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


def task():
    return SpikePatterns(num_classes=3, num_inputs=5, seq_len=12, response_steps=3, seed=0)


def trainer_for(t, lr):
    model = nnx.Sequential(layers.ETPLinear(t.num_inputs, 8, rngs=nnx.Rngs(0)),
                           layers.LIF(8, tau=5.0),
                           layers.LeakyReadout(8, t.num_classes, rngs=nnx.Rngs(1)))
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((B, t.num_inputs)), batch_size=B)
    ce = lambda y, label: optax.softmax_cross_entropy_with_integer_labels(y, label).mean()
    return braintrace.OnlineTrainer(learner, optax.adam(lr), loss_fn=ce)


def endless(t):
    for i in itertools.count():
        yield t.sample(jax.random.key(i), B)


def snapshot(trainer):
    """Host copies of everything ``fit`` may change: model state, traces, optimiser state."""
    learner = trainer.learner
    return [np.array(a) for a in [*jax.tree.leaves(nnx.state(learner.model)),
                                  *jax.tree.leaves(learner.traces),
                                  *jax.tree.leaves(trainer.opt_state)]]


class Recorder(braintrace.Callback):
    def __init__(self):
        self.events = []

    def on_start(self, trainer):
        self.events.append("start")

    def on_step(self, trainer, record):
        self.events.append("step")


@pytest.mark.parametrize("counts, message", [
    ({"steps": -1}, r"fit: steps must be a positive int, got -1 \(None: no budget\)\. "),
    ({"steps": 0}, r"fit: steps must be a positive int, got 0 "),
    ({"steps": 2.5}, (r"fit: steps must be a positive int \(a Python or NumPy integer, not "
                      r"a bool or a float\), got 2.5 of type float")),
    ({"epochs": -1}, r"fit: epochs must be a positive int, got -1\. "),
    ({"epochs": 0}, r"fit: epochs must be a positive int, got 0\. "),
    ({"eval_every": 0}, (r"fit: eval_every must be a positive int, got 0 \(None: after "
                         r"each epoch\)\. ")),
    ({"eval_every": 1.5}, r"fit: eval_every must be a positive int .*got 1.5 of type float"),
    ({"eval_every": True}, r"fit: eval_every must be a positive int .*got True of type bool"),
])
def test_a_bad_count_is_named_before_anything_is_learnt(counts, message):
    t = task()
    trainer = trainer_for(t, lr=1e-2)
    batches = [t.sample(jax.random.key(i), B) for i in range(2)]
    recorder = Recorder()
    before = snapshot(trainer)
    with pytest.raises(ValueError, match=message + ".*Nothing was trained"):
        trainer.fit(batches, validation=batches[0], callbacks=[recorder], progress=False,
                    **counts)
    for a, b in zip(before, snapshot(trainer), strict=True):
        np.testing.assert_array_equal(a, b)
    assert recorder.events == []  # no callback ran


def test_every_fit_starts_its_callbacks():
    t = task()
    trainer = trainer_for(t, lr=1e-2)
    recorder = Recorder()
    for _ in range(2):
        trainer.fit(endless(t), steps=2, callbacks=[recorder], progress=False)
    assert recorder.events == ["start", "step", "step"] * 2


def test_one_early_stopping_passed_to_two_fits_restores_each_its_own_best_params():
    t = task()
    validation = t.sample(jax.random.key(10_000), B)
    stop = braintrace.EarlyStopping("val_loss", patience=2, restore_best=True)
    first = trainer_for(t, lr=0.03)  # learns the validation batch itself: a best to beat
    learnt = first.fit([validation], epochs=4, eval_every=2, validation=validation,
                       callbacks=[stop], progress=False)
    second = trainer_for(t, lr=0.0)  # never changes: its best Params are its own
    initial = [np.array(p) for p in jax.tree.leaves(nnx.state(second.learner.model, nnx.Param))]
    history = second.fit(endless(t), steps=6, eval_every=2, validation=validation,
                         callbacks=[stop], progress=False)
    first_best = min(r["val_loss"] for r in learnt.evaluations)
    assert first_best < history.evaluations[0]["val_loss"]  # the first fit's best is better
    for a, b in zip(initial, jax.tree.leaves(nnx.state(second.learner.model, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # not the first trainer's best Params
    # the second fit's own best (its first evaluation), its own patience: two evaluations
    # without improvement after it stop it, not the first fit's
    assert stop.best == history.evaluations[0]["val_loss"]
    assert history.stopped_early and len(history.evaluations) == 3


class TwoInputs(nnx.Module):
    """A step whose input is a pair ``(xa, xb)``."""

    def __init__(self):
        self.a = layers.ETPLinear(2, 3, rngs=nnx.Rngs(0))
        self.b = layers.ETPLinear(1, 3, rngs=nnx.Rngs(1))
        self.lif = layers.LIF(3, tau=4.0, v_th=0.3)

    def __call__(self, x):
        xa, xb = x
        return self.lif(self.a(xa) + self.b(xb))


T = 5


@pytest.fixture(scope="module")
def two_inputs():
    """A trainer that never changes its Params (``sgd(0)``), its inputs a pair, and a batch."""
    inputs = (jax.random.normal(jax.random.key(0), (T, B, 2)),
              jax.random.normal(jax.random.key(1), (T, B, 1)))
    ys = jax.random.normal(jax.random.key(2), (T, B, 3))
    example = jax.tree.map(lambda a: a[0], inputs)
    mse = lambda y, target: jnp.mean((y - target) ** 2)
    learner = braintrace.compile(TwoInputs(), "d_rtrl", example, batch_size=B)
    return braintrace.OnlineTrainer(learner, optax.sgd(0.0), loss_fn=mse), inputs, ys


def test_bad_metrics_validation_and_callbacks_are_named_before_anything_is_learnt(two_inputs):
    trainer, inputs, ys = two_inputs
    batches = [(inputs, ys)]
    recorder = Recorder()
    cases = [
        ({"metrics": [lambda out, b: 0.0]},
         r"fit: metrics must be a dict \{name: metric\(outputs, batch\) -> scalar\}, got a list"),
        ({"metrics": {"f1": 0.5}}, r"fit: metrics\['f1'\] must be a function .*got a float"),
        ({"validation": ys}, r"fit: validation is one array \(inputs without targets\?\)"),
        ({"validation": [(inputs, ys), (inputs,)]},
         r"fit: validation\[1\] must be a batch \(xs, ys\) or \(xs, ys, mask\)"),
        ({"callbacks": braintrace.EarlyStopping()},
         (r"fit: callbacks must be a list or tuple of Callback objects, got a EarlyStopping: "
         r"pass callbacks=\[EarlyStopping\(\.\.\.\)\]")),
    ]
    trainer.learner.reset()
    before = snapshot(trainer)
    for arguments, message in cases:
        with pytest.raises((TypeError, ValueError), match=message + r".*Nothing was trained"):
            trainer.fit(batches, progress=False, **{"callbacks": [recorder], **arguments})
        for a, b in zip(before, snapshot(trainer), strict=True):
            np.testing.assert_array_equal(a, b)
    assert recorder.events == []  # no callback ran


def test_validation_takes_tuple_inputs_and_a_batch_that_scores_nothing_adds_nothing(two_inputs):
    trainer, inputs, ys = two_inputs
    metrics = {"sum": lambda outputs, batch: jnp.sum(outputs)}

    def evaluated(validation):
        history = trainer.fit([(inputs, ys)], validation=validation, metrics=metrics,
                              progress=False)
        return history.evaluations[0]

    one = evaluated((inputs, ys))  # one batch whose inputs are a tuple
    assert one == evaluated([(inputs, ys)]) and np.isfinite(one["val_loss"])
    mask = jnp.array([0.0, 1.0, 1.0, 0.0, 1.0])
    scored = evaluated([(inputs, ys, mask)])
    assert evaluated([(inputs, ys, mask), (inputs, ys, jnp.zeros(T))]) == scored
    assert scored["val_loss"] != one["val_loss"]
    assert np.isnan(evaluated([(inputs, ys, jnp.zeros((T, B)))])["val_loss"])
