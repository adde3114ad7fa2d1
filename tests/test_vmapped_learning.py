"""``jax.vmap`` of the pure functions over stacked states and models: exact, and silent.

A vmapped ETP primitive whose weight is mapped too (or that has no batched
counterpart) is computed as ``jax.vmap`` of its impl. In a model step that the
compiler turns into eligibility traces that loses the weight (it is no longer
an ETP operation there), and compiling says so. A ``vmap`` of ``online_grad``
runs steps compiled already: the same values and gradients, nothing to warn
about — the gradients below equal each member's float64 BPTT oracle, with
warnings as errors.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads, mse

import braintrace
from braintrace import layers

M, B, IN, HID, OUT, T = 2, 2, 2, 3, 2, 3
F64 = jnp.float64


class Net(nnx.Module):
    """ETPLinear → LIF → ETPLinear: D-RTRL equals BPTT on it."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed)
        self.enc = layers.ETPLinear(IN, HID, param_dtype=F64, rngs=rngs)
        self.lif = layers.LIF(HID, tau=4.0, param_dtype=F64)
        self.out = layers.ETPLinear(HID, OUT, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.enc(x) + 1.0))


def stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


@pytest.mark.parametrize("stacked_models", [False, True], ids=["shared-model", "stacked-models"])
def test_vmap_of_online_grad_over_stacked_states_is_exact_and_silent(stacked_models):
    with jax.enable_x64(True):
        models = [Net(seed) for seed in range(M)] if stacked_models else [Net(0)] * M
        for model in models:
            braintrace.init_states(model, B)
        learner = braintrace.compile(models[0], "d_rtrl", jnp.zeros((B, IN), F64),
                                     batch_size=B)
        online = braintrace.online_grad(learner, mse)
        graphdef = nnx.graphdef(models[0])
        xs = jax.random.normal(jax.random.key(0), (M, T, B, IN), F64)
        ys = jax.random.normal(jax.random.key(1), (M, T, B, OUT), F64)

        def member(model_state, state, xs, ys):
            return online.grad(nnx.merge(graphdef, model_state), state, xs, ys)[0]

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grads = jax.jit(jax.vmap(member, in_axes=(0 if stacked_models else None, 0, 0, 0)))(
                stack([nnx.state(m) for m in models]) if stacked_models
                else nnx.state(models[0]), stack([online.init(m) for m in models]), xs, ys)
        for k, model in enumerate(models):
            want = bptt_grads(model, xs[k], ys[k], jnp.full((T,), 1 / T, F64))
            for got, oracle in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
                assert float(np.max(np.abs(oracle))) > 0
                np.testing.assert_allclose(got[k], oracle, rtol=1e-8, atol=1e-12)


def test_compiling_a_step_that_vmaps_a_weight_warns_however_it_was_traced_before():
    """The warning is true: the step holds the primitive as plain ops, and the weight gets no
    trace. Compiling says so once, from the compiled step itself, so a call of the model
    before compiling (an inner ``jit`` then reuses its trace, the fallback runs no more)
    does not hide it."""

    @jax.jit
    def per_sample(x, w):
        return jax.vmap(braintrace.matmul)(x, w)  # w mapped with x: the fallback

    class Ensemble(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((B, IN, HID)))
            self.v = nnx.Param(jnp.ones((IN, HID)))
            self.h = braintrace.HiddenState(jnp.zeros(HID))

        def __call__(self, x):
            self.h[...] = (0.5 * self.h[...] + per_sample(x, self.w[...])
                           + braintrace.matmul(x, self.v[...]))
            return self.h[...]

    model = Ensemble()
    braintrace.init_states(model, B)
    with pytest.warns(UserWarning, match="'etp_dense' is vmapped"):  # the fallback's own
        model(jnp.ones((B, IN)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = braintrace.compile_graph(model, jnp.ones((B, IN)))
    messages = [str(w.message) for w in caught if "is vmapped" in str(w.message)]
    assert len(messages) == 1, messages  # once, from the compiler, naming the module
    assert "'etp_dense' is vmapped in the model (Ensemble)" in messages[0]
    assert graph.traced_param_paths == ("v",)
    assert "drop out of eligibility-trace learning" in graph.report()
