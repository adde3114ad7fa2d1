"""Control flow inside a model step: nested jit, cond, short scan, custom_jvp, while."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import braintrace
from braintrace._compiler import StepLeaves, programs, split_model

B, I, H = 2, 3, 4
W = jax.random.normal(jax.random.key(0), (I, H))
X = jax.random.normal(jax.random.key(1), (B, I))
H0 = jax.random.normal(jax.random.key(2), (B, H))


class Step(nnx.Module):
    """``h' = update(h, matmul(x, w))`` for a given ``update`` function."""

    def __init__(self, update):
        self.w = nnx.Param(W)
        self.h = braintrace.HiddenState(jnp.zeros(H))
        self.update = update

    def __call__(self, x):
        self.h[...] = self.update(self.h[...], x, self.w[...])
        return self.h[...]


def compiled(update):
    model = Step(update)
    braintrace.init_states(model, B)
    model.h[...] = H0
    return model, braintrace.compile_graph(model, X)


def jacobians(model, graph):
    _, params, hidden, other = split_model(model)
    return programs.jacobians(graph, StepLeaves(
        jax.tree.leaves(params), jax.tree.leaves(hidden), jax.tree.leaves(other), [X]))


def step_jacobian_diagonal(update):
    """Diagonal of ∂h'/∂h of the real step (position-diagonal models only)."""
    jac = jax.jacobian(lambda h: update(h, X, W))(H0).reshape(B * H, B * H)
    return jnp.diagonal(jac).reshape(B, H)


def test_nested_jit_is_inlined_and_traced():
    @jax.jit
    def inner(h, u):
        return 0.7 * jnp.tanh(h) + u

    @jax.jit
    def update(h, x, w):
        return inner(h, braintrace.matmul(x, w))

    model, graph = compiled(update)
    assert sum("inlined" in n for n in graph.notes) == 2
    assert not any(e.primitive.name in ("pjit", "jit") for e in graph.jaxpr.eqns)
    assert graph.traced_param_paths == ("w",)
    (d,), (df,) = jacobians(model, graph)
    np.testing.assert_allclose(d[..., 0, 0], step_jacobian_diagonal(update), rtol=1e-5)
    np.testing.assert_allclose(df[..., 0], 1.0)


def test_jit_called_twice_gives_two_relations():
    @jax.jit
    def drive(x, w):
        return braintrace.matmul(x, w)

    def update(h, x, w):
        return 0.5 * h + drive(x, w) + drive(2.0 * x, w)

    _, graph = compiled(update)
    assert len(graph.relations) == 2
    assert len({r.eqn_index for r in graph.relations}) == 2


def test_cond_on_hidden_state_becomes_select_of_branches():
    def update(h, x, w):
        u = braintrace.matmul(x, w)
        return jax.lax.cond(jnp.sum(h) > 0, lambda h: 0.5 * h + u, lambda h: jnp.sin(h) + 2 * u, h)

    model, graph = compiled(update)
    assert any("cond" in n and "select" in n for n in graph.notes)
    assert graph.traced_param_paths == ("w",)
    (d,), (df,) = jacobians(model, graph)
    np.testing.assert_allclose(d[..., 0, 0], step_jacobian_diagonal(update), rtol=1e-5)
    taken = float(jnp.sum(H0)) > 0
    np.testing.assert_allclose(df[..., 0], 1.0 if taken else 2.0)


def test_short_scan_inside_a_step_is_unrolled():
    def update(h, x, w):
        u = braintrace.matmul(x, w)
        h, _ = jax.lax.scan(lambda c, _: (0.9 * jnp.tanh(c) + u, None), h, None, length=3)
        return h

    model, graph = compiled(update)
    assert any("scan" in n and "unrolled (3 iteration(s))" in n for n in graph.notes)
    (d,), (df,) = jacobians(model, graph)
    np.testing.assert_allclose(d[..., 0, 0], step_jacobian_diagonal(update), rtol=1e-5)
    u = X @ W
    want = jax.vmap(jax.vmap(jax.grad(
        lambda h0, u: jax.lax.scan(lambda c, _: (0.9 * jnp.tanh(c) + u, None), h0, None,
                                   length=3)[0], argnums=1)))(H0, u)
    np.testing.assert_allclose(df[..., 0], want, rtol=1e-5)


@jax.custom_jvp
def spike(v):
    return (v > 0).astype(v.dtype)


@spike.defjvp
def _spike_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    return spike(v), dv / (1.0 + jnp.abs(v)) ** 2


def test_custom_jvp_spike_stays_opaque_and_its_surrogate_enters_d():
    def update(h, x, w):
        return 0.9 * h - spike(h - 0.5) + braintrace.matmul(x, w)

    model, graph = compiled(update)
    assert any("custom_jvp_call" in n and "opaque" in n for n in graph.notes)
    assert any(e.primitive.name == "custom_jvp_call" for e in graph.jaxpr.eqns)
    (d,), _ = jacobians(model, graph)
    want = 0.9 - 1.0 / (1.0 + jnp.abs(H0 - 0.5)) ** 2  # the surrogate, not the true 0
    np.testing.assert_allclose(d[..., 0, 0], want, rtol=1e-5)
    np.testing.assert_allclose(d[..., 0, 0], step_jacobian_diagonal(update), rtol=1e-5)


def test_etp_primitive_inside_custom_jvp_is_excluded_naming_its_param():
    @jax.custom_jvp
    def hidden_matmul(x, w):
        return braintrace.matmul(x, w)

    hidden_matmul.defjvps(lambda dx, y, x, w: dx @ w, lambda dw, y, x, w: x @ dw)

    class Opaque(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(W)
            self.v = nnx.Param(W)
            self.h = braintrace.HiddenState(jnp.zeros(H))

        def __call__(self, x):
            self.h[...] = (0.5 * self.h[...] + hidden_matmul(x, self.w[...])
                           + braintrace.matmul(x, self.v[...]))
            return self.h[...]

    model = Opaque()
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, X)
    assert graph.traced_param_paths == ("v",)
    (exclusion,) = graph.exclusions
    assert exclusion.param_paths == ("w",)
    assert "etp_dense_batched" in exclusion.reason and "opaque" in exclusion.reason
    assert "w: custom_jvp_call" in graph.report(verbose=True)


def test_while_loop_over_a_param_is_an_error_naming_the_param():
    def update(h, x, w):
        u = braintrace.matmul(x, w)
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c + jnp.abs(u) + 1.0, h)

    model = Step(update)
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"while_loop.*'w'.*scan"):
        braintrace.compile_graph(model, X)


def test_long_scan_over_a_param_is_an_error_naming_the_param():
    def update(h, x, w):
        h, _ = jax.lax.scan(lambda c, _: (0.9 * c + x @ w, None), h, None, length=100)
        return h + braintrace.matmul(x, w)

    model = Step(update)
    braintrace.init_states(model, B)
    with pytest.raises(ValueError, match=r"scan.*length 100.*'w'"):
        braintrace.compile_graph(model, X)
