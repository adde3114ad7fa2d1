"""Shared reference models and oracles for the algorithm tests (no tests of its own).

Imported by the ``test_algorithms_*`` modules (``tests`` is on pytest's
``pythonpath``). Everything here expects float64 (``jax.enable_x64(True)``),
which the test modules turn on per test.

* :func:`bptt_grads`: the oracle, ``jax.grad`` of ``Σ_t w_t L_t`` through a
  ``jax.lax.scan`` of the pure step built with ``nnx.split``/``nnx.merge(copy=True)``.
* Exact models (D-RTRL = BPTT): leaky integrators driven by dense, LoRA and
  elementwise primitives, LIF/ALIF without recurrent weights.
* Approximate models: a GRU, a recurrent ALIF network, a leaky model coupled
  through a fixed (non-Param) matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import bptt_grads, mse, sequence_loss  # noqa: F401  (the oracle, re-exported)

import braintrace
from braintrace import layers

F64 = jnp.float64
I, H, O = 3, 4, 2


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, F64)


# -- exact models ----------------------------------------------------------------


class DenseLeaky(nnx.Module):
    """Leaky integrator(s) driven by ``matmul``; ``S = 1`` or ``S = 2`` coupled states.

    ``S = 1``: ``h' = a ⊙ h + x W + b``.
    ``S = 2``: ``h' = a ⊙ h + x W + b - 0.3 c``, ``c' = 0.5 c + tanh(h')``.
    The readout ``tanh(h') W_o`` is untraced (same-step gradient). With
    ``bias=False`` there is no ``b`` (and ``w`` may be given, e.g. with a row
    for a constant-1 input).
    """

    def __init__(self, batch=None, num_states=1, seed=0, bias=True, w=None, in_features=I):
        self.num_states = num_states
        self.w = nnx.Param(_normal(seed, (in_features, H)) if w is None else w)
        self.b = nnx.Param(_normal(seed + 1, (H,))) if bias else nnx.data(None)
        self.a = jnp.linspace(0.5, 0.95, H)
        self.wo = nnx.Param(_normal(seed + 2, (H, O)))
        shape = (H,) if batch is None else (batch, H)
        self.h = braintrace.HiddenState(jnp.zeros(shape, F64))
        if num_states == 2:
            self.c = braintrace.HiddenState(jnp.zeros(shape, F64))

    def __call__(self, x):
        b = None if self.b is None else self.b[...]
        h = self.a * self.h[...] + braintrace.matmul(x, self.w[...], b)
        if self.num_states == 2:
            h = h - 0.3 * self.c[...]
            self.c[...] = 0.5 * self.c[...] + jnp.tanh(h)
        self.h[...] = h
        return braintrace.matmul(jnp.tanh(h), self.wo[...])


class LoRALeaky(nnx.Module):
    """``h' = a ⊙ h + LoRA(x)`` (lora_b made non-zero so both factors are live)."""

    def __init__(self, batch=None, seed=0):
        rngs = nnx.Rngs(seed)
        self.lora = layers.ETPLoRA(I, 2, H, param_dtype=F64, rngs=rngs)
        self.lora.lora_b[...] = _normal(seed + 5, (2, H))
        self.a = jnp.linspace(0.6, 0.9, H)
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros((H,) if batch is None else (batch, H), F64))

    def __call__(self, x):
        h = self.a * self.h[...] + self.lora(x)
        self.h[...] = h
        return self.out(jnp.tanh(h))


class ElemLeaky(nnx.Module):
    """Learnable time constants and gains: ``h' = σ(τ) ⊙ h + g(γ) ⊙ (x M)``, ``M`` fixed."""

    def __init__(self, batch=None, seed=0):
        self.tau = layers.ETPElemwise(jnp.linspace(-1.0, 2.0, H), jax.nn.sigmoid,
                                      param_dtype=F64)
        self.gain = layers.ETPElemwise(jnp.linspace(0.5, 1.5, H), jnp.tanh, param_dtype=F64)
        self.m = _normal(seed, (I, H))
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=nnx.Rngs(seed))
        self.h = braintrace.HiddenState(jnp.zeros((H,) if batch is None else (batch, H), F64))

    def __call__(self, x):
        h = self.tau() * self.h[...] + self.gain() * (x @ self.m)
        self.h[...] = h
        return self.out(jnp.tanh(h))


class SpikingFF(nnx.Module):
    """A LIF or ALIF layer (learnable τ) driven by a dense input, no recurrent weights."""

    def __init__(self, neuron="alif", seed=0):
        rngs = nnx.Rngs(seed)
        self.inp = layers.ETPLinear(I, H, param_dtype=F64, rngs=rngs,
                                    kernel_init=nnx.initializers.normal(1.0))
        if neuron == "alif":
            self.neuron = layers.ALIF(H, tau=5.0, tau_a=10.0, beta=0.5, learn_tau=True,
                                      learn_tau_a=True, surrogate="fast_sigmoid",
                                      param_dtype=F64)
        else:
            self.neuron = layers.LIF(H, tau=5.0, learn_tau=True, param_dtype=F64)
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.neuron(self.inp(x)))


# -- approximate models ------------------------------------------------------------


class GRUNet(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.rnn = layers.Stateful(layers.GRUCell(I, H, param_dtype=F64, rngs=rngs))
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rnn(x))


class RecurrentSNN(nnx.Module):
    """A recurrent ALIF (or LIF) layer, learnable τ, with an untraced dense readout."""

    def __init__(self, seed=0, neuron="alif"):
        rngs = nnx.Rngs(seed)
        cell = (layers.ALIF(H, tau=5.0, tau_a=10.0, beta=0.5, learn_tau=True, param_dtype=F64)
                if neuron == "alif" else layers.LIF(H, tau=5.0, learn_tau=True, param_dtype=F64))
        self.rec = layers.RecurrentSpiking(
            I, cell,
            kernel_init=nnx.initializers.normal(1.0),
            recurrent_kernel_init=nnx.initializers.normal(0.5), param_dtype=F64, rngs=rngs)
        self.out = layers.ETPLinear(H, O, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rec(x))


class CoupledLeaky(nnx.Module):
    """``h' = a ⊙ h + x W + tanh(h) M``: ``M`` is a fixed array (not a Param, not ETP).

    With ``coupled=False`` ``M`` is diagonal (position-diagonal model).
    """

    def __init__(self, batch=None, coupled=True, seed=0):
        self.w = nnx.Param(_normal(seed, (I, H)))
        self.a = jnp.linspace(0.5, 0.9, H)
        m = _normal(seed + 1, (H, H), 0.6)
        self.m = m if coupled else jnp.diag(jnp.diag(m))
        self.wo = nnx.Param(_normal(seed + 2, (H, O)))
        self.h = braintrace.HiddenState(jnp.zeros((H,) if batch is None else (batch, H), F64))

    def __call__(self, x):
        h = self.a * self.h[...] + braintrace.matmul(x, self.w[...]) + jnp.dot(
            jnp.tanh(self.h[...]), self.m)
        self.h[...] = h
        return braintrace.matmul(jnp.tanh(h), self.wo[...])


# -- data, oracle, comparisons -----------------------------------------------------------


def data(T, batch=None, seed=1, scale=1.0, in_features=I):
    shape_x = (T, in_features) if batch is None else (T, batch, in_features)
    shape_y = (T, O) if batch is None else (T, batch, O)
    return _normal(seed, shape_x, scale), _normal(seed + 100, shape_y)


def randomize_hidden(model, seed=7, scale=0.5):
    """Sets every hidden state to a random value (so ``T = 1`` exercises ``h^0``)."""
    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, braintrace.HiddenState):
            node.set_value(_normal(seed + i, node[...].shape, scale))
    return model


def prefix_weights(T, length):
    """Loss weights selecting the first ``T`` of ``length`` steps: ``∇ Σ_{t<T} L_t``."""
    return (jnp.arange(length) < T).astype(F64)


class Runner:
    """A compiled learner that can run several gradients from the same start.

    Every call restores the hidden state and the traces that the learner had
    when it was made, so one compiled program serves several loss weightings
    or target sequences.
    """

    def __init__(self, model, algorithm, example_x):
        self.learner = braintrace.compile(model, algorithm, example_x)
        self.hidden = jax.tree.map(jnp.copy, nnx.state(model, braintrace.HiddenState))
        self.traces = self.learner.traces

    def grads(self, xs, ys, weights=None, chunk_size=None, loss_fn=mse, hidden=None):
        """``∇ Σ_t w_t L_t`` from the saved start (or from ``hidden``, an ``nnx.State``)."""
        nnx.update(self.learner.model, self.hidden if hidden is None else hidden)
        self.learner.traces = self.traces
        return self.learner.etrace_grad(xs, ys, loss_fn, mask=weights, chunk_size=chunk_size,
                                        reduction="sum")


def online_grads(model, algorithm, xs, ys, weights=None, chunk_size=None, loss_fn=mse):
    """``etrace_grad`` with ``reduction='sum'``: ``∇ Σ_t w_t L_t`` by ``algorithm``."""
    learner = braintrace.compile(model, algorithm, xs[0])
    return learner.etrace_grad(xs, ys, loss_fn, mask=weights, chunk_size=chunk_size,
                               reduction="sum")


def leaves(state):
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def rel_errors(a, b):
    """Per-leaf ``max|a - b| / max|b|``."""
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    return {k: float(np.max(np.abs(la[k] - lb[k])) / max(np.max(np.abs(lb[k])), 1e-300))
            for k in la}


def flat(state):
    return np.concatenate([v.ravel() for v in leaves(state).values()])


def cosine(a, b):
    va, vb = (flat(a), flat(b)) if not isinstance(a, np.ndarray) else (a, b)
    return float(va @ vb / np.linalg.norm(va) / np.linalg.norm(vb))


def assert_live(grads):
    """Every leaf of a reference gradient is non-zero (the model is live)."""
    for k, v in leaves(grads).items():
        assert np.max(np.abs(v)) > 1e-8, f"reference gradient of {k} is zero"
