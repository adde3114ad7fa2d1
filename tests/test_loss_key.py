"""A loss that reads a value from outside gets its current value's gradient, not its first.

``jax.jit`` keys a static function by the object; the programs of ``etrace_grad`` and the
trainer key the loss by the jaxpr it traces to (``braintrace/_drivers/_loss_key.py``):

* an annealed weight in a closure, an attribute of a config object: the same function
  object with another value gives that value's gradient (it gave the first value's);
* an unchanged loss is compiled once (equal jaxprs), a changed one once per value.
"""

from __future__ import annotations

import types

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


def test_a_loss_reading_a_changed_value_gets_that_values_gradient():
    """The reference reads the weight from the targets, as a value changing at every call
    is best passed: one program for all."""
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, I))
    ys = jax.random.normal(jax.random.key(1), (T, B, O))
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    weighted = lambda y, target: target[1] * mse(y, target[0])
    config = types.SimpleNamespace(scale=1.0)
    weight = 1.0

    def annealed(y, t):  # reads a closure variable and an attribute
        return weight * config.scale * mse(y, t)

    learner, reference = _learner(), _learner()  # the same start, the same hidden states
    with compilations() as compiled:
        for value, scale in ((1.0, 1.0), (0.5, 1.0), (0.5, 1.0), (0.5, 3.0)):
            weight, config.scale = value, scale
            got = learner.etrace_grad(xs, ys, annealed, block_size=1)
            want = reference.etrace_grad(xs, (ys, jnp.full(T, value * scale)), weighted,
                                         block_size=1)
            assert max(rel_errors(got, want).values()) < 1e-6, (value, scale)
    assert compiled.count("grad_program") == 1 + 3  # the annealed loss: one per value
