"""UORO: unbiased (the average over every sign pattern equals RTRL), and its variance.

The expectation is exact, not sampled: on a tiny tanh RNN (2 hidden units, one
sample, 3 steps) the UORO update is driven with each of the ``4³`` sign
sequences and the gradients are averaged. A negative control keeps only one
sign pattern, which is not RTRL.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._algorithms._uoro import uoro_update
from braintrace._compiler import StepLeaves, programs, split_model
from braintrace._loops import LoopContext, init_carry, param_gradients, step_jacobians

F64 = jnp.float64
T, IN, HID = 3, 1, 2


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


class TinyRNN(nnx.Module):
    def __init__(self):
        self.cell = layers.Stateful(layers.SimpleCell(IN, HID, param_dtype=F64, dtype=F64,
                                                      rngs=nnx.Rngs(0)))
        self.out = layers.ETPLinear(HID, 1, param_dtype=F64, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.out(self.cell(x))


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def data():
    xs = jax.random.normal(jax.random.key(0), (T, IN), F64)
    ys = jax.random.normal(jax.random.key(1), (T, 1), F64)
    return xs, ys


def model():
    m = TinyRNN()
    m.cell.carry.set_value(jnp.asarray([0.3, -0.5], F64))
    return m


def uoro_gradient(signs):
    """UORO's gradient with the given signs ``(T, HID)``, one step at a time."""
    return _uoro_gradient_program()(signs)


@functools.cache
def _uoro_gradient_program():
    """:func:`_uoro_gradient` of one compiled learner, under ``jax.jit`` (one compilation for
    every sign pattern)."""
    learner = braintrace.compile(model(), braintrace.UORO(), data()[0][0])
    return jax.jit(functools.partial(_uoro_gradient, learner))


def _uoro_gradient(learner, signs):
    xs, ys = data()
    graph, rules = learner.graph, learner.rules
    _, params, hidden, other = split_model(learner.model)
    params, hidden, other = (jax.tree.leaves(s) for s in (params, hidden, other))
    operands = programs.operands(graph, params)
    traces = learner.traces
    summed, same = None, [jnp.zeros_like(p) for p in params]
    for t in range(T):
        leaves = StepLeaves(params, hidden, other, [xs[t]])

        def loss(p, h, leaves=leaves, t=t):
            outs, rel_x = programs.forward(graph, leaves._replace(params=p, hidden=h))
            return mse(outs.y[0], ys[t]), (outs, rel_x)

        (grads, signal), (outs, rel_x) = jax.grad(loss, argnums=(0, 1), has_aux=True)(
            params, hidden)
        term = rules.contribution(traces, signal, operands)
        summed = term if summed is None else jax.tree.map(jnp.add, summed, term)
        same = [a + b for a, b in zip(same, grads)]
        jac = step_jacobians(rules, leaves)
        traces = [uoro_update(r, s, jac.d[r.group], jac.df[r.index], x, theta, signs[t])
                  for r, s, x, theta in zip(graph.relations, traces, rel_x, operands)]
        hidden, other = outs.hidden, outs.other

    ctx = LoopContext.build(rules, mse, params)
    carry = init_carry(ctx, hidden, other, traces)._replace(summed=summed, same_step=same)
    return jnp.concatenate([jnp.ravel(g) for g in param_gradients(ctx, carry)])


def rtrl_gradient():
    xs, ys = data()
    learner = braintrace.compile(model(), braintrace.RTRL(), xs[0])
    grads = learner.etrace_grad(xs, ys, mse, reduction="sum")
    return np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


def test_uoro_is_unbiased_over_every_sign_pattern_and_reports_its_variance():
    patterns = [np.asarray(p, np.float64).reshape(T, HID)
                for p in itertools.product((-1.0, 1.0), repeat=T * HID)]
    samples = np.stack([uoro_gradient(jnp.asarray(p)) for p in patterns])
    want = rtrl_gradient()
    mean = samples.mean(axis=0)
    np.testing.assert_allclose(mean, want, rtol=1e-9, atol=1e-12)
    # not vacuous: a single pattern is not RTRL, and RTRL is not D-RTRL here
    assert np.max(np.abs(samples[0] - want)) > 1e-3 * np.max(np.abs(want))
    variance = samples.var(axis=0).sum() / np.sum(want ** 2)
    # measured: total variance 3.7e-4 × |∇|² on this model (the cost of being unbiased; it
    # grows with the number of hidden units and steps)
    print(f"UORO variance / |grad|^2 = {variance:.3g}")
    assert variance > 1e-5
