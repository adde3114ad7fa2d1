"""From Flax to braintrace: one GRU regression trained with BPTT in Flax, then online.

``docs/flax_to_braintrace.md`` shows this file in parts (between the ``# [name]`` and
``# [/name]`` markers); ``tests/test_docs.py`` runs it and checks what the page claims: the
braintrace model loads the Flax weights as they are and computes the same outputs, both
trainings lower the loss, the user's own ``@nnx.jit`` step gives the learner's gradients,
evaluation writes nothing, the mask scores only the steps it names, dropout draws new masks in
training and none in evaluation, and a checkpoint restores the Params and the optimizer.
``BRAINTRACE_QUICK=1`` (set by the test suite) shrinks the sizes.
"""

# [imports]
import os
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import braintrace
from braintrace import layers
from braintrace.tasks import Integrator, SpikePatterns, accuracy

# [/imports]

# [task]
T, BATCH, STEPS = 100, 32, 200  # sequence length, batch size, training steps
if os.environ.get("BRAINTRACE_QUICK") == "1":  # the test suite's toy sizes
    T, BATCH, STEPS = 20, 8, 30
task = Integrator(num_inputs=2, seq_len=T, decay=0.9)


def data(step):
    """A batch as a Flax input pipeline yields it: batch-major, (batch, T, features)."""
    batch = task.sample(jax.random.key(step), BATCH)  # the task itself makes (T, batch, ...)
    return jnp.swapaxes(batch.xs, 0, 1), jnp.swapaxes(batch.ys, 0, 1)


def mse(y, target):
    return jnp.mean((y - target) ** 2)
# [/task]


# [before]
class FlaxNet(nnx.Module):
    def __init__(self, n_in, n_hidden, n_out, *, rngs):
        self.rnn = nnx.RNN(nnx.GRUCell(n_in, n_hidden, rngs=rngs))  # batch-major by default
        self.readout = nnx.Linear(n_hidden, n_out, rngs=rngs)

    def __call__(self, xs):  # the whole sequence: xs is (batch, T, n_in)
        return self.readout(self.rnn(xs))


@nnx.jit
def bptt_step(model, optimizer, xs, ys):
    loss, grads = nnx.value_and_grad(lambda m: mse(m(xs), ys))(model)  # backward through time
    optimizer.update(model, grads)
    return loss


flax_model = FlaxNet(2, 32, 2, rngs=nnx.Rngs(0))
flax_optimizer = nnx.Optimizer(flax_model, optax.adam(1e-2), wrt=nnx.Param)
bptt_losses = []
for step in range(STEPS):
    xs, ys = data(step)  # (batch, T, 2)
    bptt_losses.append(float(bptt_step(flax_model, flax_optimizer, xs, ys)))
# [/before]


# [after]
# The Flax model's initial weights (same seed), so that both trainings start at one point.
initial_flax_params = nnx.state(FlaxNet(2, 32, 2, rngs=nnx.Rngs(0)), nnx.Param)


class Net(nnx.Module):
    def __init__(self, n_in, n_hidden, n_out, *, rngs):
        self.rnn = layers.Stateful(layers.GRUCell(n_in, n_hidden, rngs=rngs))  # nnx.GRUCell
        self.readout = layers.ETPLinear(n_hidden, n_out, rngs=rngs)            # nnx.Linear

    def __call__(self, x):  # ONE time step: x is (batch, n_in); the carry is a HiddenState
        return self.readout(self.rnn(x))


def time_major(*arrays):
    """(batch, T, ...) -> (T, batch, ...): braintrace runs the time loop over axis 0."""
    return tuple(jnp.swapaxes(a, 0, 1) for a in arrays)


model = Net(2, 32, 2, rngs=nnx.Rngs(1))  # any seed: the Flax weights replace these
nnx.update(model, initial_flax_params)  # the same Param tree: Flax weights load as they are
learner = braintrace.compile(model, "d_rtrl", jnp.zeros((BATCH, 2)), batch_size=BATCH)
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
online_losses = []
for step in range(STEPS):
    xs, ys = time_major(*data(step))  # (T, batch, 2)
    learner.reset()  # fresh hidden state and traces for a new batch of sequences
    grads, losses = learner.etrace_grad(xs, ys, mse, return_losses=True)
    optimizer.update(model, grads)  # grads: an nnx.State of Params, as nnx.grad gives
    online_losses.append(float(losses.mean()))
# [/after]

# [own-step]
online = braintrace.online_grad(learner, mse)  # a pair of pure functions: init, grad


@nnx.jit
def online_step(model, optimizer, state, xs, ys):
    grads, state, stats = online.grad(model, state, xs, ys)  # xs, ys: (T, batch, ...)
    optimizer.update(model, grads)
    return state, stats.losses


braintrace.init_states(model, BATCH)  # the model's hidden states to their initial values
own_losses = []
for step in range(STEPS, STEPS + 10):
    xs, ys = time_major(*data(step))
    state = online.init(model)  # those hidden states (grad never writes the model), zero traces
    state, losses = online_step(model, optimizer, state, xs, ys)
    own_losses.append(float(losses.mean()))
# [/own-step]

# [evaluate]
test_xs, test_ys = data(10_000)  # batch-major, as the pipeline yields it
flax_predictions = flax_model(test_xs)  # Flax: the model on the whole sequence
model.eval()  # braintrace.evaluate runs in the model's mode (Dropout off, BatchNorm averages)
predictions = braintrace.evaluate(model, *time_major(test_xs), batch_size=BATCH)  # (T, batch, 2)
model.train()
test_mse = {"BPTT": float(mse(flax_predictions, test_ys)),
            "online": float(mse(jnp.swapaxes(predictions, 0, 1), test_ys))}
# [/evaluate]

# [classification]
patterns = SpikePatterns(num_classes=3, num_inputs=8, seq_len=T, response_steps=5)


def cross_entropy(logits, labels):  # one step: logits (batch, 3), labels (batch,)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


classifier = Net(8, 32, 3, rngs=nnx.Rngs(2))
classifier_learner = braintrace.compile(classifier, "d_rtrl", jnp.zeros((BATCH, 8)),
                                        batch_size=BATCH)
classify = braintrace.online_grad(classifier_learner, cross_entropy)
classifier_optimizer = nnx.Optimizer(classifier, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def classifier_step(model, optimizer, state, xs, labels, mask):
    grads, state, stats = classify.grad(model, state, xs, labels, mask=mask)
    optimizer.update(model, grads)
    return state, stats.losses


for step in range(STEPS):
    batch = patterns.sample(jax.random.key(step), BATCH)
    # batch.xs (T, batch, 8); batch.ys (T, batch): the label at every step; batch.mask (T,):
    # 1 in the last 5 steps. Only those steps count, in the loss, the gradient and the mean.
    classifier_step(classifier, classifier_optimizer, classify.init(classifier), batch.xs,
                    batch.ys, batch.mask)

test = patterns.sample(jax.random.key(10_000), BATCH)
classifier.eval()
test_accuracy = float(accuracy(braintrace.evaluate(classifier, test.xs, batch_size=BATCH),
                               test))  # votes over the masked steps
classifier.train()

# Sequences of different lengths, padded at the end: a (T, batch) mask scores, per sequence,
# its own last 5 steps and none of its padding.
lengths = jnp.linspace(T // 2, T, BATCH).astype(int)  # each sequence's own length
steps = jnp.arange(T)[:, None]
per_sample_mask = ((steps >= lengths - 5) & (steps < lengths)).astype(jnp.float32)
_, _, padded_stats = classify.grad(classifier, classify.init(classifier), test.xs, test.ys,
                                   mask=per_sample_mask)
# [/classification]

# [dropout]
class DropoutNet(nnx.Module):
    def __init__(self, n_in, n_hidden, n_out, *, rngs):
        self.rnn = layers.Stateful(layers.GRUCell(n_in, n_hidden, rngs=rngs))
        self.dropout = nnx.Dropout(0.2, rngs=rngs)  # nnx.Dropout itself: it draws from rngs
        self.readout = layers.ETPLinear(n_hidden, n_out, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.dropout(self.rnn(x)))


noisy = DropoutNet(2, 32, 2, rngs=nnx.Rngs(0, dropout=1))
noisy_learner = braintrace.compile(noisy, "d_rtrl", jnp.zeros((BATCH, 2)), batch_size=BATCH)
xs, ys = time_major(*data(0))
noisy.train()  # Dropout on: every step of every call draws a new mask
dropout_losses = []
for _ in range(2):  # the same batch twice: other masks, other losses
    noisy_learner.reset()  # new sequences; the RNG stream runs on
    dropout_losses.append(noisy_learner.etrace_grad(xs, ys, mse, return_losses=True)[1])
noisy.eval()  # Dropout off, in every driver: each mode is compiled once and kept
eval_outputs = [braintrace.evaluate(noisy, xs, batch_size=BATCH) for _ in range(2)]
noisy.train()
# [/dropout]

# [trainer]
trainer = braintrace.OnlineTrainer(learner, optax.adam(3e-3), loss_fn=mse, update_every=10)
learner.reset()
xs, ys = time_major(*data(2 * STEPS))
trainer_losses = trainer.step(xs, ys)  # (T,): an optax update every 10 steps
# [/trainer]

# [checkpoint]
checkpoints = tempfile.mkdtemp()
with braintrace.CheckpointManager(checkpoints, max_to_keep=2, best_fn=lambda m: m["loss"],
                                  best_mode="min") as manager:
    # Params, hidden state, traces, RNG state and your optimizer, as step STEPS
    manager.save(STEPS, learner, optimizer=optimizer, metrics={"loss": online_losses[-1]})

resumed_model = Net(2, 32, 2, rngs=nnx.Rngs(3))  # a fresh process would build it so
resumed_learner = braintrace.compile(resumed_model, "d_rtrl", jnp.zeros((BATCH, 2)),
                                     batch_size=BATCH)
resumed_optimizer = nnx.Optimizer(resumed_model, optax.adam(1e-2), wrt=nnx.Param)
with braintrace.CheckpointManager(checkpoints) as manager:
    restored_step = manager.restore(resumed_learner, optimizer=resumed_optimizer)  # the latest
# [/checkpoint]
