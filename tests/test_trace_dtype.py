"""``compile(..., trace_dtype=...)``: eligibility traces stored in another dtype.

* a storage choice only: float32 traces give the default's gradients and traces bit for
  bit (D-RTRL per step, ES-D-RTRL in time blocks);
* bfloat16 traces (every trace array bfloat16, scalars float32) give gradients within
  ``TOLERANCE`` of the float32 ones, where float8 traces (negative control) do not;
* inside a user's ``nnx.jit`` step (``online_grad``, ``online_update``), traces carried
  from call to call; a checkpoint of the online state keeps its bfloat16 traces and
  resumes bit-identically;
* a value that is not a floating dtype, float64 without x64, and an algorithm that keeps
  no such traces are clear errors (``test_sharding.py``: bfloat16 traces on a mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mse

import braintrace
from braintrace import layers

B, IN, HID, OUT, T = 4, 3, 6, 2, 8
TOLERANCE = 1e-2
"""Relative error of each Param's gradient, bfloat16 traces against float32 (the stated
tolerance of ``braintrace.compile``'s ``trace_dtype``)."""


class Net(nnx.Module):
    """Linear -> LIF -> linear readout (the readout learns by its same-step gradient)."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.enc = layers.ETPLinear(IN, HID, rngs=rngs)
        self.lif = layers.LIF(HID, tau=5.0, v_th=0.5)
        self.out = layers.ETPLinear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.enc(x)))


def chunk(i):
    xs = 2.0 * jax.random.normal(jax.random.key(i), (T, B, IN))
    return xs, jnp.tanh(jnp.cumsum(xs[..., :OUT], axis=0))


@functools.cache
def run(algorithm, trace_dtype):
    """The gradient of a chunk and the traces after it: D-RTRL per step (every step's
    update stored), ES-D-RTRL in time blocks of 2 (stored at 3 block boundaries)."""
    learner = braintrace.compile(Net(), algorithm, jnp.zeros((B, IN)), batch_size=B,
                                 trace_dtype=trace_dtype)
    block_size = {"d_rtrl": 1, "es_d_rtrl": 2}[algorithm]
    return learner.etrace_grad(*chunk(0), mse, block_size=block_size), learner.traces


def relative_errors(got, want):
    return [float(np.linalg.norm(np.float64(a) - np.float64(b)) / np.linalg.norm(np.float64(b)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
def test_float32_traces_are_the_default_bit_for_bit(algorithm):
    for a, b in zip(jax.tree.leaves(run(algorithm, jnp.float32)),
                    jax.tree.leaves(run(algorithm, None)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("algorithm", ["d_rtrl", "es_d_rtrl"])
def test_bfloat16_traces_are_within_the_tolerance_of_float32(algorithm):
    (grads, traces), (want, _) = run(algorithm, jnp.bfloat16), run(algorithm, None)
    assert {str(t.dtype) for t in jax.tree.leaves(traces) if t.ndim} == {"bfloat16"}
    assert {str(t.dtype) for t in jax.tree.leaves(traces) if not t.ndim} <= {"float32"}
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}
    errors = relative_errors(grads, want)
    assert 0 < max(errors) < TOLERANCE, errors


def test_float8_traces_are_outside_the_tolerance():
    """Negative control: the tolerance tells a coarser storage apart."""
    errors = relative_errors(run("es_d_rtrl", jnp.float8_e5m2)[0], run("es_d_rtrl", None)[0])
    assert max(errors) > TOLERANCE, errors


def test_bfloat16_traces_in_a_jit_step_resume_from_a_checkpoint_bit_identically(tmp_path):
    """``online_grad`` in an ``nnx.jit`` step: two chunks straight, or one, a checkpoint of
    the state (bfloat16 traces, restored as bfloat16) into a fresh model, and the second;
    ``online_update`` runs from the same state; a float32 learner refuses it."""
    model = Net()
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((B, IN)), batch_size=B,
                                 trace_dtype=jnp.bfloat16)
    online = braintrace.online_grad(learner, mse, block_size=4)
    step = nnx.jit(lambda model, state, xs, ys: online.grad(model, state, xs, ys)[:2])
    first = step(model, online.init(model), *chunk(0))[1]
    straight = step(model, first, *chunk(1))
    with braintrace.CheckpointManager(tmp_path) as manager:
        manager.save(1, model=model, state=first)
        fresh = Net()
        braintrace.init_states(fresh, B)
        _, restored = manager.restore(model=fresh, state=online.init(fresh, batch_size=B))
    assert {str(t.dtype) for t in jax.tree.leaves(restored.traces) if t.ndim} == {"bfloat16"}
    resumed = step(fresh, restored, *chunk(1))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)

    train = braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=4)
    _, _, state, stats = nnx.jit(train.update)(model, train.init(model)[0], first, *chunk(1))
    assert bool(stats.finite)
    assert {str(t.dtype) for t in jax.tree.leaves(state.traces) if t.ndim} == {"bfloat16"}

    wide = braintrace.online_grad(braintrace.compile(Net(), "es_d_rtrl", jnp.zeros((B, IN)),
                                                     batch_size=B), mse)
    with pytest.raises(ValueError, match=r"bfloat16 where this learner's is .* float32.*"
                                         r"another algorithm, model or trace_dtype"):
        wide.grad(model, first, *chunk(1))


@pytest.mark.parametrize("algorithm, trace_dtype, error, match", [
    ("d_rtrl", jnp.int8, TypeError, r"trace_dtype must be a floating-point dtype .* got int8"),
    ("d_rtrl", jnp.complex64, TypeError, r"floating-point dtype .* got complex64"),
    ("d_rtrl", "half precision", TypeError, r"floating-point dtype .* got 'half precision'"),
    ("d_rtrl", jnp.float64, ValueError, r"trace_dtype=float64 needs jax_enable_x64"),
    ("bptt", jnp.bfloat16, ValueError, r"algorithm 'bptt' \(BPTT\) does not take it"),
    ("rtrl", jnp.bfloat16, ValueError, r"for DRTRL, ESDRTRL .* Leave trace_dtype=None"),
])
def test_a_trace_dtype_that_is_not_a_storage_choice_is_a_clear_error(algorithm, trace_dtype,
                                                                    error, match):
    model = Net()
    with pytest.raises(error, match=match):
        braintrace.compile(model, algorithm, jnp.zeros((B, IN)), batch_size=B,
                           trace_dtype=trace_dtype)
    assert model.lif.v[...].shape == (HID,)  # nothing changed: no batch axis added
