"""What ``etrace_grad``'s docstring says of the loss: traced once per function object.

``jax.jit`` keys a static function by the object, and so do the programs of
``etrace_grad`` and the trainer (keying by what the loss computes would trace it at
every call: about 1 ms, as much as the rest of the call's host time). So:

* a value passed with the targets (the documented recipe) gives each value's gradient
  from one program;
* the same function object reading a changed closure value keeps the first value, as
  documented, and a new function object gets the new one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from helpers import compilations
from reference_models import rel_errors

import braintrace
from braintrace import layers

B, I, O, T = 2, 3, 2, 4


def _learner():
    model = nnx.Sequential(layers.ETPLinear(I, O, rngs=nnx.Rngs(0)), layers.LIF(O, tau=4.0))
    return braintrace.compile(model, "d_rtrl", jnp.zeros((B, I)), batch_size=B)


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def test_a_changing_value_passed_with_the_targets_gets_its_gradient_from_one_program():
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, I))
    ys = jax.random.normal(jax.random.key(1), (T, B, O))
    weighted = lambda y, target: target[1] * _mse(y, target[0])
    learner, reference = _learner(), _learner()  # the same start, the same hidden states
    with compilations() as compiled:
        for value in (1.0, 0.5, 3.0):
            got = learner.etrace_grad(xs, (ys, jnp.full(T, value)), weighted, block_size=1)
            want = jax.tree.map(lambda g: value * g,
                                reference.etrace_grad(xs, ys, _mse, block_size=1))
            assert max(rel_errors(got, want).values()) < 1e-5, value
    # etrace_grad runs checked_grad_program: the weighted loss compiled once, the reference once
    assert compiled.count("checked_grad_program") == 2


def test_the_same_loss_object_keeps_the_value_it_read_when_first_traced():
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, I))
    ys = jax.random.normal(jax.random.key(1), (T, B, O))
    weight = 1.0

    def annealed(y, t):
        return weight * _mse(y, t)

    first, same, new = _learner(), _learner(), _learner()
    g1 = first.etrace_grad(xs, ys, annealed, block_size=1)
    same.etrace_grad(xs, ys, annealed, block_size=1)  # same's states advance as first's
    weight = 3.0
    stale = same.etrace_grad(xs, ys, annealed, block_size=1)
    new.etrace_grad(xs, ys, annealed, block_size=1)
    fresh = new.etrace_grad(xs, ys, lambda y, t: annealed(y, t), block_size=1)
    again = first.etrace_grad(xs, ys, _mse, block_size=1)  # weight 1's gradient, states alike
    assert max(rel_errors(stale, again).values()) < 1e-5  # the first value, as documented
    assert max(rel_errors(fresh, jax.tree.map(lambda g: 3.0 * g, again)).values()) < 1e-5
    assert max(rel_errors(g1, again).values()) > 1e-3  # the states moved: a live comparison
