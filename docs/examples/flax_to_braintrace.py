"""From Flax to braintrace: one GRU regression trained with BPTT in Flax, then online.

``docs/flax_to_braintrace.md`` shows this file in parts (between the ``# [name]`` and
``# [/name]`` markers); ``tests/test_docs.py`` runs it and checks what the page claims: the
braintrace model loads the Flax weights as they are and computes the same outputs, and both
trainings lower the loss. ``BRAINTRACE_QUICK=1`` (set by the test suite) shrinks the sizes.
"""

# [imports]
import os

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import braintrace
from braintrace import layers
from braintrace.tasks import Integrator

# [/imports]

# [task]
T, BATCH, STEPS = 100, 32, 200  # sequence length, batch size, training steps
if os.environ.get("BRAINTRACE_QUICK") == "1":  # the test suite's toy sizes
    T, BATCH, STEPS = 20, 8, 30
task = Integrator(num_inputs=2, seq_len=T, decay=0.9)  # xs, ys: (T, batch, features)


def mse(y, target):
    return jnp.mean((y - target) ** 2)
# [/task]


# [before]
class FlaxNet(nnx.Module):
    def __init__(self, n_in, n_hidden, n_out, *, rngs):
        self.rnn = nnx.RNN(nnx.GRUCell(n_in, n_hidden, rngs=rngs), time_major=True)
        self.readout = nnx.Linear(n_hidden, n_out, rngs=rngs)

    def __call__(self, xs):  # the whole sequence: xs is (T, batch, n_in)
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
    batch = task.sample(jax.random.key(step), BATCH)
    bptt_losses.append(float(bptt_step(flax_model, flax_optimizer, batch.xs, batch.ys)))
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


model = Net(2, 32, 2, rngs=nnx.Rngs(1))  # any seed: the Flax weights replace these
nnx.update(model, initial_flax_params)  # the same Param tree: Flax weights load as they are
learner = braintrace.compile(model, "d_rtrl", jnp.zeros((BATCH, 2)), batch_size=BATCH)
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
online_losses = []
for step in range(STEPS):
    batch = task.sample(jax.random.key(step), BATCH)
    learner.reset()  # fresh hidden state and traces for a new batch of sequences
    grads, losses = learner.etrace_grad(batch.xs, batch.ys, mse, return_losses=True)
    optimizer.update(model, grads)  # grads: an nnx.State of Params, as nnx.grad gives
    online_losses.append(float(losses.mean()))
# [/after]

# [trainer]
trainer = braintrace.OnlineTrainer(learner, optax.adam(3e-3), loss_fn=mse, update_every=10)
learner.reset()
batch = task.sample(jax.random.key(STEPS), BATCH)
trainer_losses = trainer.step(batch.xs, batch.ys)  # (T,): an optax update every 10 steps
# [/trainer]
