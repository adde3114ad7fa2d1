"""A Param used through ``jax.custom_vjp`` / ``jax.custom_jvp`` around ``braintrace.matmul``.

The compiler keeps custom-derivative bodies opaque, so an ETP operation inside
one is not traced online: its Params get their exact same-step gradient (the
report says so). When that leaves no operation traced, the learner has no
traces at all. Round 3's per-step loop then crashed (``scan body function carry
input and carry output must have the same pytree structure ... pending.d``):
its carry had no room for a deferred trace update, but each step wrote one.

Checked in float64:

* ``T = 1``: every algorithm equals BPTT (the whole gradient is same-step);
* over time: the untraced Params' gradient is the exact same-step one, that is
  BPTT of the twin model that reads its previous state through
  ``stop_gradient`` (a Flax-only oracle), through every driver (``etrace_grad``,
  windowed ``chunk_size``, ``online_grad``); a Param traced beside them still
  equals BPTT (D-RTRL on a dense layer into a leaky state is exact).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads, mse

import braintrace

B, I, H, O = 2, 3, 4, 2
EXACT_TOL = 1e-8


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@jax.custom_vjp
def vjp_matmul(x, w, b):
    """``x @ w + b`` by ``braintrace.matmul``, with a hand-written backward rule."""
    return braintrace.matmul(x, w, b)


def _vjp_fwd(x, w, b):
    return braintrace.matmul(x, w, b), (x, w)


def _vjp_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g, jnp.sum(g, axis=0)


vjp_matmul.defvjp(_vjp_fwd, _vjp_bwd)


@jax.custom_jvp
def jvp_matmul(x, w, b):
    """``x @ w + b`` by ``braintrace.matmul``, with a hand-written forward rule."""
    return braintrace.matmul(x, w, b)


jvp_matmul.defjvps(lambda dx, y, x, w, b: dx @ w,
                   lambda dw, y, x, w, b: x @ dw,
                   lambda db, y, x, w, b: jnp.broadcast_to(db, y.shape))

WRAPPERS = {"custom_vjp": vjp_matmul, "custom_jvp": jvp_matmul}


class WrappedLinear(nnx.Module):
    """An ``ETPLinear``-like layer whose product runs inside a custom-derivative function."""

    def __init__(self, wrapper, in_features, out_features, seed):
        self.wrapper = wrapper
        key = jax.random.key(seed)
        self.kernel = nnx.Param(jax.random.normal(key, (in_features, out_features), jnp.float64))
        self.bias = nnx.Param(0.1 * jnp.arange(out_features, dtype=jnp.float64))

    def __call__(self, x):
        return self.wrapper(x, self.kernel[...], self.bias[...])


class WrappedLeaky(nnx.Module):
    """``h' = a ⊙ h + wrapped(x) (+ x V)``, read out by ``tanh(h') W_o``.

    ``traced_beside=True`` adds a plain ``braintrace.matmul`` (``V``) beside the
    wrapped layer; ``cut=True`` reads ``h`` through ``stop_gradient`` (the twin
    whose BPTT gradient is the exact same-step gradient).
    """

    def __init__(self, wrapper, traced_beside=False, cut=False):
        self.drive = WrappedLinear(wrapper, I, H, seed=0)
        self.v = (nnx.Param(jax.random.normal(jax.random.key(1), (I, H), jnp.float64))
                  if traced_beside else nnx.data(None))
        self.wo = nnx.Param(jax.random.normal(jax.random.key(2), (H, O), jnp.float64))
        self.a = jnp.linspace(0.5, 0.9, H)
        self.h = braintrace.HiddenState(0.3 * jnp.ones((B, H), jnp.float64))
        self.cut = cut

    def __call__(self, x):
        previous = jax.lax.stop_gradient(self.h[...]) if self.cut else self.h[...]
        h = self.a * previous + self.drive(x)
        if self.v is not None:
            h = h + braintrace.matmul(x, self.v[...])
        self.h[...] = h
        return braintrace.matmul(jnp.tanh(h), self.wo[...])


def _data(T):
    xs = jax.random.normal(jax.random.key(10), (T, B, I), jnp.float64)
    ys = jax.random.normal(jax.random.key(11), (T, B, O), jnp.float64)
    return xs, ys


def _leaves(state):
    """``{'drive.kernel': array, ...}`` of an ``nnx.State`` of Params."""
    return {".".join(map(str, path)): np.asarray(v[...])
            for path, v in nnx.to_flat_state(state)}


def _assert_close(got, want, keys=None):
    got, want = _leaves(got), _leaves(want)
    assert got.keys() == want.keys()
    for k in keys or want:
        assert np.max(np.abs(want[k])) > 0, f"{k}: the reference gradient is zero"
        err = np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k]))
        assert err < EXACT_TOL, f"{k}: relative error {err:.2e}"


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_param_inside_a_custom_derivative_is_reported_with_a_same_step_gradient(wrapper):
    learner = braintrace.compile(WrappedLeaky(WRAPPERS[wrapper]), "d_rtrl", _data(1)[0][0])
    assert learner.graph.traced_param_paths == ()
    report = learner.report(verbose=True)
    assert f"drive.kernel: {wrapper}_call" in report
    assert "opaque" in report


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl", "eprop", "ostl_feedforward", "rtrl"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nothing_traced_equals_bptt_at_one_step(wrapper, algorithm):
    xs, ys = _data(1)
    want = bptt_grads(WrappedLeaky(WRAPPERS[wrapper]), xs, ys)
    learner = braintrace.compile(WrappedLeaky(WRAPPERS[wrapper]), algorithm, xs[0])
    _assert_close(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nothing_traced_over_time_is_the_exact_same_step_gradient(wrapper, algorithm):
    xs, ys = _data(5)
    want = bptt_grads(WrappedLeaky(WRAPPERS[wrapper], cut=True), xs, ys)
    learner = braintrace.compile(WrappedLeaky(WRAPPERS[wrapper]), algorithm, xs[0])
    _assert_close(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)
    # the negative control: the Params inside the custom derivative do get temporal credit
    # in BPTT, which the same-step gradient lacks
    full = _leaves(bptt_grads(WrappedLeaky(WRAPPERS[wrapper]), xs, ys))
    assert not np.allclose(full["drive.kernel"], _leaves(want)["drive.kernel"])


def test_nothing_traced_through_windows_and_the_pure_functions():
    xs, ys = _data(4)
    want = bptt_grads(WrappedLeaky(vjp_matmul, cut=True), xs, ys)
    learner = braintrace.compile(WrappedLeaky(vjp_matmul), "d_rtrl", xs[0])
    _assert_close(learner.etrace_grad(xs, ys, mse, reduction="sum", chunk_size=2),
                  _windowed_reference(xs, ys))
    model = WrappedLeaky(vjp_matmul)
    online = braintrace.online_grad(braintrace.compile(model, "es_d_rtrl", xs[0]), mse,
                                    reduction="sum")
    grads, _, _ = online.grad(model, online.init(model), xs, ys)
    _assert_close(grads, want)


def _windowed_reference(xs, ys):
    """Windows of 2 steps: BPTT inside each window, nothing carried across (no traces)."""
    model = WrappedLeaky(vjp_matmul)
    first = bptt_grads(model, xs[:2], ys[:2])
    model(xs[0])
    model(xs[1])
    second = bptt_grads(model, xs[2:], ys[2:])
    return jax.tree.map(jnp.add, first, second)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_param_traced_beside_a_custom_derivative_stays_exact(wrapper):
    xs, ys = _data(5)
    learner = braintrace.compile(WrappedLeaky(WRAPPERS[wrapper], traced_beside=True), "d_rtrl",
                                 xs[0])
    assert learner.graph.traced_param_paths == ("v",)
    grads = learner.etrace_grad(xs, ys, mse, reduction="sum")
    _assert_close(grads, bptt_grads(WrappedLeaky(WRAPPERS[wrapper], traced_beside=True), xs, ys),
                  keys=["v", "wo"])
    _assert_close(grads, bptt_grads(WrappedLeaky(WRAPPERS[wrapper], traced_beside=True,
                                                 cut=True), xs, ys),
                  keys=["drive.bias", "drive.kernel"])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_bptt_is_exact_through_a_custom_derivative_and_strict_accepts_it(wrapper):
    """The wrapped Param gets only a same-step gradient from every algorithm that keeps
    traces (``strict=True`` refuses D-RTRL: the negative control); BPTT keeps none, is
    accepted, reports no approximation and equals the float64 oracle."""
    make = lambda: WrappedLeaky(WRAPPERS[wrapper], traced_beside=True)
    xs, ys = _data(4)
    with pytest.raises(ValueError, match="strict=True, but"):
        braintrace.compile(make(), "d_rtrl", xs[0], strict=True)
    learner = braintrace.compile(make(), "bptt", xs[0], strict=True)
    assert "approximations: none ('bptt' equals BPTT on this model)" in learner.report()
    _assert_close(learner.etrace_grad(xs, ys, mse, reduction="sum"), bptt_grads(make(), xs, ys))
