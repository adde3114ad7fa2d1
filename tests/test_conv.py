"""The conv ETP primitive in models: D-RTRL on convolutions equals float64 BPTT.

A convolution kernel feeds every output position, so its exact D-RTRL trace is
kept per position (``braintrace._primitives._conv``). Shown here on a
convolution driving a position-wise leaky state and on ``ConvLIF`` (a LIF
membrane per position and channel, no recurrent weights): D-RTRL over ``T``
steps and ES-D-RTRL at ``T = 1`` equal ``jax.grad`` of the unrolled loss. The
rule-by-rule oracles are in ``test_primitive_contract.py`` (case ``conv``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_models import randomize_hidden
from flax import nnx
from helpers import bptt_grads, mse

import braintrace
from braintrace import layers

F64 = jnp.float64
BATCH, OUT, T_LONG = 2, 2, 5


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


class Readout(nnx.Module):
    """``y = W vec(g(h))``: a stateless readout of a feature map (a same-step gradient)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.out = layers.ETPLinear(int(np.prod(shape)), OUT, param_dtype=F64, rngs=nnx.Rngs(9))

    def __call__(self, h):
        return self.out(h.reshape(*h.shape[:h.ndim - len(self.shape)], -1))


class LeakyConv(nnx.Module):
    """``h_t = 0.8 h_{t-1} + conv(x_t)`` per position and channel, read out by ``tanh(h)``."""

    def __init__(self, in_features: int, spatial: tuple[int, ...], **conv_kwargs):
        self.conv = layers.ETPConv(in_features, 4, param_dtype=F64, rngs=nnx.Rngs(0),
                                   **conv_kwargs)
        shape = jax.eval_shape(self.conv, jnp.zeros((*spatial, in_features), F64)).shape
        self.h = braintrace.HiddenState(jnp.zeros(shape, F64))
        self.readout = Readout(shape)

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.conv(x)
        return self.readout(jnp.tanh(self.h[...]))


class ConvSNN(nnx.Module):
    """``ConvLIF`` spikes read out by a linear map of the flattened spike map."""

    def __init__(self, in_features: int, spatial: tuple[int, ...], **kwargs):
        self.conv_lif = layers.ConvLIF(in_features, 4, input_size=spatial, param_dtype=F64,
                                       rngs=nnx.Rngs(0), **kwargs)
        self.readout = Readout(self.conv_lif.output_shape)

    def __call__(self, x):
        return self.readout(self.conv_lif(x))


MODELS = {
    "leaky-1d-valid-dilated": (lambda: LeakyConv(3, (9,), kernel_size=3, padding="VALID",
                                                 kernel_dilation=2), (9,), 3),
    "leaky-2d-grouped-strided": (lambda: LeakyConv(2, (6, 5), kernel_size=(3, 3), strides=(2, 1),
                                                   feature_group_count=2), (6, 5), 2),
    "conv-lif-2d": (lambda: ConvSNN(1, (5, 5), kernel_size=(3, 3), tau=5.0,
                                    kernel_init=nnx.initializers.normal(0.8)), (5, 5), 1),
    "conv-lif-1d-learn-tau": (lambda: ConvSNN(2, (7,), kernel_size=3, strides=2, learn_tau=True,
                                              kernel_init=nnx.initializers.normal(0.8)), (7,), 2),
}


def build(name: str) -> nnx.Module:
    model = MODELS[name][0]()
    braintrace.init_states(model, batch_size=BATCH)
    return randomize_hidden(model)


def data(name: str, steps: int):
    _, spatial, channels = MODELS[name]
    xs = jax.random.normal(jax.random.key(1), (steps, BATCH, *spatial, channels), F64)
    ys = jax.random.normal(jax.random.key(2), (steps, BATCH, OUT), F64)
    return xs, ys


def max_relative_error(got, want) -> float:
    errors = []
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        w = np.asarray(w)
        assert np.max(np.abs(w)) > 1e-8, f"BPTT gradient of {jax.tree_util.keystr(path)} is zero"
        errors.append(float(np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))))
    return max(errors)


@pytest.mark.parametrize("name", ["leaky-2d-grouped-strided", "conv-lif-1d-learn-tau"])
def test_d_rtrl_on_a_convolution_equals_bptt_over_time(name):
    xs, ys = data(name, T_LONG)
    want = bptt_grads(build(name), xs, ys)
    learner = braintrace.compile(build(name), braintrace.D_RTRL(), xs[0], strict=True)
    assert "conv.kernel" in learner.report() and not learner.graph.approximations
    got = learner.etrace_grad(xs, ys, mse, reduction="sum")
    assert max_relative_error(got, want) <= 1e-8


@pytest.mark.parametrize("name", ["conv-lif-2d"])
def test_es_d_rtrl_on_a_convolution_equals_bptt_at_t1(name):
    xs, ys = data(name, 1)
    want = bptt_grads(build(name), xs, ys)
    learner = braintrace.compile(build(name), braintrace.ES_D_RTRL(0.7, x_decay_or_rank=0.4),
                                 xs[0])
    got = learner.etrace_grad(xs, ys, mse, reduction="sum")
    assert max_relative_error(got, want) <= 1e-10


@pytest.mark.parametrize("kwargs,match", [
    ({"x": jnp.ones((5, 3)), "kernel": jnp.ones((3, 2, 4))}, r"x of shape \(5, 3\) does not match"),
    ({"x": jnp.ones((5, 4)), "kernel": jnp.ones((3, 2, 3)), "feature_group_count": 2},
     "O divisible by groups"),
    ({"x": jnp.ones((5, 2)), "kernel": jnp.ones((3, 2, 4)), "strides": (1, 1)},
     r"strides=\(1, 1\) must be a positive int or 1 positive ints"),
    ({"x": jnp.ones((5, 2)), "kernel": jnp.ones((3, 2, 4)), "padding": "FULL"},
     "padding='FULL' must be 'SAME', 'VALID'"),
])
def test_conv_names_the_offending_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        braintrace.conv(**kwargs)


def test_time_blocks_of_conv_traces_equal_the_per_step_form():
    name = "leaky-1d-valid-dilated"
    xs, ys = data(name, 4)
    model = MODELS[name][0]()
    braintrace.init_states(model, batch_size=BATCH)
    learner = braintrace.compile(model, braintrace.D_RTRL(), xs[0])
    want = learner.etrace_grad(xs, ys, mse, reduction="sum")
    learner.reset()
    got = learner.etrace_grad(xs, ys, mse, reduction="sum", block_size=2)
    assert max_relative_error(got, want) <= 1e-10


def test_conv_takes_integer_spikes_and_any_number_of_batch_axes():
    spikes = jax.random.bernoulli(jax.random.key(0), 0.3, (2, 3, 6, 6, 2)).astype(jnp.int32)
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 2, 4), F64)
    got = braintrace.conv(spikes, kernel, strides=2)
    flat = spikes.reshape(6, 6, 6, 2).astype(F64)
    want = jax.lax.conv_general_dilated(flat, kernel, (2, 2), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    want = want.reshape(2, 3, 3, 3, 4)
    assert got.shape == (2, 3, 3, 3, 4) and got.dtype == F64
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_contract_of_a_2d_kernel_trace_under_a_leading_axis_is_the_summed_product(dtype):
    """``contract`` and ``dt_to_t`` of a 2-D convolution's kernel trace ``(4, *out, *window, C,
    O)`` under one leading axis: the product ``ε·d`` summed over that axis (a NumPy oracle).
    Written on these seven axes, XLA:CPU (jaxlib 0.10.2) crashed the process on it."""
    params = {"strides": (1, 2), "padding": "SAME", "kernel_dilation": (1, 2),
              "feature_group_count": 2, "input_dilation": (1, 1), "has_bias": True,
              "precision": None}
    rng = np.random.default_rng(1)
    trace = {"kernel": rng.standard_normal((4, 4, 3, 3, 3, 1, 10)).astype(dtype),
             "bias": rng.standard_normal((4, 4, 3, 10)).astype(dtype)}
    d = rng.standard_normal((4, 4, 3, 10)).astype(dtype)
    rule = braintrace.etp_conv_p.rule
    contract = jax.jit(lambda d, t: rule("contract")(d, t, **params))(d, trace)
    scaled = jax.jit(lambda d, t: rule("dt_to_t")(d, t, **params))(d, trace)
    want = {"kernel": trace["kernel"] * d[:, :, :, None, None, None, :],
            "bias": trace["bias"] * d}
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for key, product in want.items():
        np.testing.assert_allclose(np.asarray(scaled[key]), product, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(contract[key]), product.sum(0), rtol=tol, atol=tol)
