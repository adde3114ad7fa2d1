"""The exact learning signal's pullback through a recurrent dense kernel transposed once.

``programs.x_pullbacks`` gives each dense relation whose input reads the hidden state a
copy of its kernel ``T(K)ᵀ``, made once per run outside the time loop, and
``programs.forward`` pulls the input's derivative back through it. The derivatives must
be the ones JAX's own transpose gives (float64); a wrong copy must show.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._compiler import StepLeaves, programs, split_model

B, I, H = 3, 2, 5


class Recurrent(nnx.Module):
    """An input kernel and a sign-constrained recurrent kernel (``T = abs``)."""

    def __init__(self, rngs):
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (I, H), jnp.float64))
        self.w_rec = nnx.Param(0.5 * jax.random.normal(rngs.params(), (H, H), jnp.float64))
        self.h = braintrace.HiddenState(jnp.zeros(H, jnp.float64))

    def __call__(self, x):
        h = self.h[...]
        self.h[...] = jnp.tanh(braintrace.matmul(x, self.w_in[...])
                               + braintrace.matmul(h, self.w_rec[...], kernel_transform=jnp.abs))
        return 2.0 * self.h[...]


def _setup():
    model = Recurrent(nnx.Rngs(0))
    braintrace.init_states(model, B)
    x = jax.random.normal(jax.random.key(1), (B, I), jnp.float64)
    graph = braintrace.compile_graph(model, x)
    _, params, hidden, other = split_model(model)
    params, other = jax.tree.leaves(params), jax.tree.leaves(other)
    hidden = [jax.random.normal(jax.random.key(2), (B, H), jnp.float64)]
    return graph, params, hidden, other, [x]


def _derivatives(graph, params, hidden, other, xs, pulls):
    """``∂/∂(params, hidden)`` of a loss of the step's output and new state."""
    def loss(params, hidden):
        outs, _ = programs.forward(graph, StepLeaves(params, hidden, other, xs),
                                   x_pullbacks=pulls(params))
        return jnp.sum(jnp.sin(outs.y[0])) + jnp.sum(outs.hidden[0] ** 3)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, hidden)


def test_only_the_recurrent_kernel_gets_a_transposed_copy():
    with jax.enable_x64(True):
        graph, params, *_ = _setup()
        pulls = programs.x_pullbacks(graph, programs.operands(graph, params))
        traced = {r.eqn_index: r.param_paths["kernel"] for r in graph.relations}
        assert [traced[e] for e in pulls] == [("w_rec",)]
        ((_, kernel_t),) = pulls.values()
        np.testing.assert_array_equal(kernel_t, jnp.abs(params[1]).T)  # T(K)ᵀ


def test_the_transposed_pullback_gives_jax_own_derivatives():
    with jax.enable_x64(True):
        graph, params, hidden, other, xs = _setup()
        ops = lambda p: programs.operands(graph, p)
        got = _derivatives(graph, params, hidden, other, xs,
                           lambda p: programs.x_pullbacks(graph, ops(p)))
        want = _derivatives(graph, params, hidden, other, xs, lambda p: {})
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
        assert float(jnp.max(jnp.abs(want[1][0]))) > 1e-2  # a live signal

        def wrong(p):  # negative control: the kernel itself, not its transform's transpose
            return {e: (fn, jnp.transpose(p[1])) for e, (fn, _) in
                    programs.x_pullbacks(graph, ops(p)).items()}

        bad = _derivatives(graph, params, hidden, other, xs, wrong)
        assert float(jnp.max(jnp.abs(bad[1][0] - want[1][0]))) > 1e-3


def test_random_feedback_keeps_its_own_pullback():
    """e-prop's random feedback sends the signal back through ``B``: no transposed copy."""
    model = nnx.Sequential(layers.RecurrentSpiking(I, layers.LIF(H), rngs=nnx.Rngs(0)),
                           layers.LeakyReadout(H, 2, rngs=nnx.Rngs(1)))
    learner = braintrace.compile(model, braintrace.EProp(feedback="random"),
                                 jnp.ones((B, I)), batch_size=B)
    rules = learner.rules
    params = learner.leaves().params
    with_feedback = programs.x_pullbacks(rules.graph, programs.operands(rules.graph, params),
                                         rules.feedback)
    without = programs.x_pullbacks(rules.graph, programs.operands(rules.graph, params))
    assert rules.feedback and set(rules.feedback) <= set(without)
    assert not set(rules.feedback) & set(with_feedback)
