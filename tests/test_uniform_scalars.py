"""ES-D-RTRL's step-count scalars (``ε_1``, ``α_f^t``) are read from one relation of a rule.

Every relation of one rule starts them alike and decays them alike, so each relation reads the
first relation's (``RelationRule.uniform`` in ``GraphRules._tied``): the gradients are the same
bit for bit as with each relation's own, and XLA computes them once per step instead of once
per relation (its scalar ops counted in the compiled step, against the same step with
``uniform`` removed, the negative control).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import braintrace
from braintrace import layers

B, T, I, H, O = 2, 6, 3, 5, 2


def _model():
    rngs = nnx.Rngs(0)
    f64 = {"param_dtype": jnp.float64}
    return nnx.Sequential(layers.ETPLinear(I, H, rngs=rngs, **f64), layers.LIF(H, **f64),
                          layers.ETPLinear(H, H, rngs=rngs, **f64), layers.LIF(H, **f64),
                          layers.ETPLinear(H, O, rngs=rngs, **f64))


def _algorithm(uniform: bool) -> braintrace.ESDRTRL:
    algorithm = braintrace.ESDRTRL()
    if not uniform:  # each relation its own scalars, as before
        algorithm._input_rules = {k: rule._replace(uniform=None)
                                  for k, rule in algorithm._input_rules.items()}
    return algorithm


def _step(uniform: bool):
    """The gradients of one sequence and the compiled jit step's HLO (blocks of one step)."""
    model = _model()
    xs = jax.random.normal(jax.random.key(1), (T, B, I), jnp.float64)
    ys = jax.random.normal(jax.random.key(2), (T, B, O), jnp.float64)
    learner = braintrace.compile(model, _algorithm(uniform), xs[0], batch_size=B)
    loss = lambda y, t: jnp.mean((y - t) ** 2)
    online = braintrace.online_grad(learner, loss, block_size=1)
    graphdef, state = nnx.split(model)

    def step(state, carried, xs, ys):
        grads, carried, _ = online.grad(nnx.merge(graphdef, state), carried, xs, ys)
        return grads

    jitted = jax.jit(step)
    carried = online.init(model)
    text = jitted.lower(state, carried, xs, ys).compile().as_text()
    return jitted(state, carried, xs, ys), text


def _scalar_ops(text: str) -> int:
    """Scalar arithmetic (``f64[]`` multiplies, adds, subtractions, selects) in the compiled
    program, fused or not: after XLA's common-subexpression elimination."""
    return len(re.findall(r"= f64\[\]\S* (?:multiply|add|subtract|select)\(", text))


def test_every_relation_reads_the_first_relations_scalars_with_the_same_gradients():
    with jax.enable_x64(True):
        shared, shared_text = _step(uniform=True)
        own, own_text = _step(uniform=False)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(own), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.max(np.abs(np.asarray(a))) > 1e-6 for a in jax.tree.leaves(shared))
    fewer, more = (_scalar_ops(t) for t in (shared_text, own_text))
    assert 0 < fewer < more, (fewer, more)  # three relations: their updates once, not 3 times
