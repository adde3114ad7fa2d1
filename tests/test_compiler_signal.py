"""The learning signal and the same-step gradient from ``programs.forward``.

Differentiating the step loss through ``programs.forward`` with respect to
``h^{t-1}`` gives ``∂L_t/∂h^{t-1}`` (every path, including a loss that reads
the previous state), and with respect to the Params the exact same-step
gradient. The oracle differentiates the step written by hand, independently
of the compiler.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import braintrace
from braintrace._compiler import StepLeaves, programs, split_model

B, I, H = 2, 3, 4
W_IN = jax.random.normal(jax.random.key(0), (I, H))
W_OUT = jax.random.normal(jax.random.key(1), (H, 2))
H0 = jax.random.normal(jax.random.key(2), (B, H))
X = jax.random.normal(jax.random.key(3), (B, I))
TARGET = jax.random.normal(jax.random.key(4), (B, 2))


def transition(h_prev, x, w):
    return 0.8 * h_prev + braintrace.matmul(x, w)


def readout(h):
    return jnp.tanh(h) @ W_OUT


def loss(y):
    return jnp.sum((y - TARGET) ** 2)


class Leaky(nnx.Module):
    def __init__(self, read):
        self.w = nnx.Param(W_IN)
        self.h = braintrace.HiddenState(jnp.zeros(H))
        self.read = read

    def __call__(self, x):
        h_prev = self.h[...]
        h = transition(h_prev, x, self.w[...])
        self.h[...] = h
        if self.read == "variable":  # read the Variable after writing it
            return readout(self.h[...])
        if self.read == "local":  # use the local value
            return readout(h)
        if self.read == "local_and_previous":  # also read h^{t-1} directly
            return readout(h) + h_prev[:, :2] ** 2
        raise AssertionError(self.read)


def step_gradients(graph, model, x=X):
    """``(∂L/∂params, ∂L/∂h^{t-1})`` of one step through ``programs.forward``."""
    _, params, hidden, other = split_model(model)
    P, Hs, O = jax.tree.leaves(params), jax.tree.leaves(hidden), jax.tree.leaves(other)

    def f(p, h):
        (y, _, _), _ = programs.forward(graph, StepLeaves(p, h, O, [x]))
        return loss(jax.tree.unflatten(graph.out_treedef, y))

    return jax.grad(f, argnums=(0, 1))(P, Hs)


@pytest.mark.parametrize("read", ["variable", "local", "local_and_previous"])
def test_signal_is_the_gradient_with_respect_to_the_previous_hidden_state(read):
    model = Leaky(read)
    braintrace.init_states(model, B)
    model.h[...] = H0
    graph = braintrace.compile_graph(model, X)
    (got_w,), (got_h,) = step_gradients(graph, model)

    def step_loss(h_prev, w):
        extra = h_prev[:, :2] ** 2 if read == "local_and_previous" else 0.0
        return loss(readout(transition(h_prev, X, w)) + extra)

    want_h, want_w = jax.grad(step_loss, argnums=(0, 1))(H0, W_IN)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(want_h))) > 1e-2


def test_signal_follows_uses_of_the_value_before_a_dtype_cast():
    """The state is written as ``h.astype(float32)`` while the output uses ``h`` (float64)."""

    class Cast(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(W_IN.astype(jnp.float64))
            self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float32))

        def __call__(self, x):
            h = 0.8 * self.h[...].astype(jnp.float64) + braintrace.matmul(x, self.w[...])
            self.h[...] = h.astype(jnp.float32)
            return readout(h)

    with jax.enable_x64(True):
        model = Cast()
        braintrace.init_states(model, B)
        model.h[...] = H0
        x = X.astype(jnp.float64)
        graph = braintrace.compile_graph(model, x)
        _, (got,) = step_gradients(graph, model, x)
        want = jax.grad(lambda h: loss(readout(0.8 * h.astype(jnp.float64) + x @ W_IN)))(
            H0.astype(jnp.float32))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert float(jnp.max(jnp.abs(want))) > 1e-2


def test_signal_of_a_two_layer_stack_is_the_total_signal():
    """``∂L/∂h1^{t-1}`` includes the path through layer 2 (and its new state ``h2^t``)."""
    w2 = jax.random.normal(jax.random.key(5), (H, H))
    h2_0 = jax.random.normal(jax.random.key(6), (B, H))

    class Stack(nnx.Module):
        def __init__(self):
            self.w1 = nnx.Param(W_IN)
            self.w2 = nnx.Param(w2)
            self.h1 = braintrace.HiddenState(jnp.zeros(H))
            self.h2 = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h1[...] = transition(self.h1[...], x, self.w1[...])
            self.h2[...] = 0.6 * self.h2[...] + braintrace.matmul(jnp.tanh(self.h1[...]),
                                                                   self.w2[...])
            return readout(self.h2[...])

    model = Stack()
    braintrace.init_states(model, B)
    model.h1[...] = H0
    model.h2[...] = h2_0
    graph = braintrace.compile_graph(model, X)
    assert graph.hidden_paths == ("h1", "h2")
    _, (got_h1, got_h2) = step_gradients(graph, model)

    def step_loss(h1, h2):
        return loss(readout(0.6 * h2 + jnp.tanh(transition(h1, X, W_IN)) @ w2))

    want_h1, want_h2 = jax.grad(step_loss, argnums=(0, 1))(H0, h2_0)
    np.testing.assert_allclose(got_h2, want_h2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_h1, want_h1, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(want_h1))) > 1e-2


def test_forward_is_the_model_step():
    model = Leaky("variable")
    braintrace.init_states(model, B)
    model.h[...] = H0
    graph = braintrace.compile_graph(model, X)
    _, params, hidden, other = split_model(model)
    (y, h_out, _), rel_x = programs.forward(graph, StepLeaves(
        jax.tree.leaves(params), jax.tree.leaves(hidden), jax.tree.leaves(other), [X]))
    want_y = model(X)
    np.testing.assert_allclose(y[0], want_y, rtol=1e-6)
    np.testing.assert_allclose(h_out[0], model.h[...], rtol=1e-6)
    np.testing.assert_allclose(rel_x[0], X)
