"""An online state is a value that a train step may donate, for every algorithm.

``nnx.jit(train_step, donate_argnums=...)`` hands each donated array's buffer to
the program: XLA refuses a buffer that is also another argument ("Attempt to
donate a buffer which is also used by the same call") or donated twice ("the
same buffer twice"), and a buffer that is also a Variable of the model would be
deleted with it. So every array of ``online.init(model)`` (and of
``online_update``'s init, and of a learner's traces) is its own: not the
model's, not another leaf's. The CPU donates matching buffers as an accelerator
does (each donated array is deleted after the call, checked below), and pytest
turns "Some donated buffers were not usable" into an error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import mse

import braintrace
from braintrace import layers
from braintrace._algorithms import ALGORITHMS

B, IN, HID, T = 2, 2, 3, 1
NAMES = sorted({cls: name for name, cls in reversed(ALGORITHMS.items())}.values())
"""Every registered algorithm, once (``'pp_prop'`` is ``'es_d_rtrl'``)."""


class Net(nnx.Module):
    """ETPLinear → Dropout → LIF: hidden states and other Variables (the dropout's RNG)."""

    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.enc = layers.ETPLinear(IN, HID, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.lif = layers.LIF(HID, tau=4.0)

    def __call__(self, x):
        return self.lif(self.drop(self.enc(x)) + 1.0)


def inputs(name):
    """``online.grad``'s keyword inputs for ``name`` (ThreeFactor's modulators)."""
    return {"modulators": {"lif.v": jnp.ones((T, B, HID))}} if name == "three_factor" else {}


def buffers(tree):
    """The device buffer of every array leaf of ``tree``."""
    return [a.unsafe_buffer_pointer() for a in jax.tree.leaves(tree)
            if isinstance(a, jax.Array)]


def assert_own_buffers(tree, model, name):
    mine, models = buffers(tree), set(buffers(nnx.state(model)))
    assert len(set(mine)) == len(mine), f"{name}: two leaves of the state share one buffer"
    assert not models & set(mine), f"{name}: a leaf of the state is an array of the model"


def test_every_algorithms_state_is_its_own_and_the_readme_train_step_donates_it():
    """Every algorithm's ``online.init`` (at the model's batch size, its hidden states as
    they are: the README's order; and once at another), ``online_update``'s init with an
    optimiser that keeps the Params (schedule-free's ``z``) and a learner's traces share no
    buffer with the model nor among themselves. Then the README's ``train_step`` with
    ``nnx.jit(..., donate_argnums=2)``, once for every algorithm (one program: each
    algorithm's state in turn), called twice: each donated hidden state and other Variable
    is deleted (a trace that the program never reads, JAX keeps), the model's Variables are
    alive, its hidden state untouched, its Params those the optimiser made of the returned
    gradients."""
    model, lr = Net(), 0.1
    learners = [braintrace.compile(model, ALGORITHMS[name](), jnp.zeros((B, IN)), batch_size=B)
                for name in NAMES]
    onlines = [braintrace.online_grad(learner, mse) for learner in learners]
    for name, learner, online in zip(NAMES, learners, onlines, strict=True):
        train = braintrace.online_update(learner, mse, optax.contrib.schedule_free_sgd(lr))
        for made in (online.init(model), train.init(model), learner.traces):
            assert_own_buffers(made, model, name)
    assert_own_buffers(onlines[0].init(model, batch_size=B + 1), model, NAMES[0])
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

    @nnx.jit(donate_argnums=2)
    def train_step(model, optimizer, states, xs, ys):
        grads_of, new = [], []
        for name, online, state in zip(NAMES, onlines, states, strict=True):
            grads, state, _ = online.grad(model, state, xs, ys, **inputs(name))
            optimizer.update(model, grads)
            grads_of.append(grads)
            new.append(state)
        return new, grads_of

    xs = jax.random.normal(jax.random.key(0), (T, B, IN))
    ys = jnp.ones((T, B, HID))
    states = [online.init(model) for online in onlines]
    hidden = np.asarray(model.lif.v[...])
    for _ in range(2):
        params = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
        donated = jax.tree.leaves([(state.hidden, state.other) for state in states])
        states, grads_of = train_step(model, optimizer, states, xs, ys)
        assert all(a.is_deleted() for a in donated)
        for grads in grads_of:
            params = [p - np.float32(lr) * np.asarray(g)
                      for p, g in zip(params, jax.tree.leaves(grads), strict=True)]
        got = jax.tree.leaves(nnx.state(model, nnx.Param))
        for p, want in zip(got, params, strict=True):
            np.testing.assert_allclose(np.asarray(p), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(model.lif.v[...]), hidden)
        assert not any(a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))


def test_online_grad_under_jax_jit_with_the_state_donated():
    """Plain ``jax.jit(online.grad, donate_argnums=1)`` with e-prop (whose trace and filtered
    trace start equal): the state's arrays are deleted, the model's alive, and the returned
    state runs the next call."""
    model = Net()
    learner = braintrace.compile(model, braintrace.EProp(0.5), jnp.zeros((B, IN)),
                                 batch_size=B)
    online = braintrace.online_grad(learner, mse)
    grad = jax.jit(online.grad, donate_argnums=1)
    state = online.init(model)
    xs, ys = jnp.ones((T, B, IN)), jnp.ones((T, B, HID))
    for _ in range(2):
        donated = jax.tree.leaves(state)
        _, state, stats = grad(model, state, xs, ys)
        assert all(a.is_deleted() for a in donated) and bool(stats.finite)
    assert not any(a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))
