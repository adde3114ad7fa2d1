"""D-RTRL's block update of a dense trace in one pass (``_dense_block_kernel.py``), on the CPU.

The Pallas kernel runs in Pallas' TPU interpreter (memory read before it is written holds NaN,
a read out of bounds raises) or JAX's, against :func:`reference` (XLA's formulation) in
float32, bfloat16 traces and float64. Through D-RTRL's time blocks under
``formulation('pallas')``: a GRU whose two traces tile takes the kernel for both and gives
the gradients of XLA's formulation (float64, to 1e-12 of the largest); one whose traces do
not tile (hidden 100) takes none, nor do traces stored in bfloat16 (read widened), nor does
either with ``_d_rtrl.FUSED_DENSE_BLOCKS`` off (the negative
controls); and on a dense layer feeding LIF
neurons, where D-RTRL is exact, the gradients through the kernel equal BPTT's (float64).
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import bptt_grads, mse
from jax.experimental.pallas import tpu as pltpu

import braintrace
from braintrace import layers
from braintrace._algorithms import _d_rtrl
from braintrace._algorithms import _dense_block_kernel as kernel
from braintrace._platform import formulation


@pytest.fixture(autouse=True)
def _fused(monkeypatch):
    """The kernel on (``_d_rtrl.FUSED_DENSE_BLOCKS``, the default; explicit here so that the
    tests hold whatever the default becomes)."""
    monkeypatch.setattr(_d_rtrl, "FUSED_DENSE_BLOCKS", True)


TPU = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
"""Pallas' TPU interpreter: an unwritten read is NaN (``c``'s tile must be zeroed first)."""


def _operands(batch, inputs, outputs, steps, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    shapes = [(batch, inputs, outputs), (batch, outputs), (batch, outputs),
              (steps, batch, inputs), (steps, batch, outputs)]
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


@pytest.mark.parametrize("dtype, interpret, shape", [
    (jnp.float32, TPU, (3, 256, 384, 4)),         # tiles 256 by 128: 3 column tiles, 3 samples
    (jnp.float32, True, (2, 1024, 2048, 1)),      # 2 by 2 tiles of 512 by 1,024; one step
    (jnp.bfloat16, True, (2, 128, 256, 5)),       # bfloat16 trace, float32 update
    (jnp.float64, True, (2, 128, 128, 3)),
])
def test_the_kernel_gives_the_reference_update_and_contraction(dtype, interpret, shape):
    batch, inputs, outputs, steps = shape
    with jax.enable_x64(dtype == jnp.float64):
        args = _operands(batch, inputs, outputs, steps, dtype)
        got = jax.jit(lambda *a: kernel.block_update(*a, interpret=interpret))(*args)
        want = kernel.reference(*args)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
            tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float64: 1e-12}[dtype]
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       atol=tol * scale, rtol=0)
        assert got[1].dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32)


def test_a_trace_that_does_not_tile_is_refused():
    assert kernel.tile_sizes(100, 128) is None and kernel.tile_sizes(128, 96) is None
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel.block_update(*_operands(1, 100, 128, 2, jnp.float32), interpret=True)


def _gru(hidden: int, dtype=jnp.float64) -> nnx.Module:
    rngs = nnx.Rngs(0)
    f64 = {"param_dtype": dtype}
    model = nnx.Sequential(layers.Stateful(layers.GRUCell(hidden, hidden, rngs=rngs, **f64)),
                           layers.ETPLinear(hidden, 2, rngs=rngs, **f64))
    braintrace.init_states(model, batch_size=2)
    return model


def _drtrl_grads(model, xs, ys, name, trace_dtype=None):
    """D-RTRL's gradients (time blocks of 3) under formulation ``name``, and the
    ``pallas_call`` equations of the traced program."""
    with formulation(name):
        learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=xs.shape[1],
                                     trace_dtype=trace_dtype)
        online = braintrace.online_grad(learner, mse, block_size=3, reduction="sum")
        carried = online.init(model)
        step = lambda c, xs, ys: online.grad(model, c, xs, ys)[0]
        calls = _pallas_calls(jax.make_jaxpr(step)(carried, xs, ys).jaxpr)
        return jax.jit(step)(carried, xs, ys), calls


def _pallas_calls(jaxpr) -> list:
    """The ``pallas_call`` equations in ``jaxpr`` and the programs it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    found += _pallas_calls(sub)
    return found


@pytest.mark.parametrize("hidden, on, calls", [(128, True, 2), (100, True, 0), (128, False, 0)])
def test_drtrl_blocks_through_the_kernel_equal_xlas_formulation(monkeypatch, hidden, on, calls):
    """GRU hidden 128: both traces (input and recurrent, ``(B, 128, 384)``) through the kernel;
    hidden 100: neither tiles, no kernel; nor with the flag off. The gradients equal XLA's
    formulation's."""
    monkeypatch.setattr(_d_rtrl, "FUSED_DENSE_BLOCKS", on)
    with jax.enable_x64(True):
        model = _gru(hidden)
        xs = jax.random.normal(jax.random.key(1), (6, 2, hidden), jnp.float64)
        ys = jax.random.normal(jax.random.key(2), (6, 2, 2), jnp.float64)
        want, none = _drtrl_grads(model, xs, ys, "accelerator")
        got, used = _drtrl_grads(model, xs, ys, "pallas")
    assert len(none) == 0 and len(used) == calls
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), strict=True) if b.size]
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * float(np.max(np.abs(b))))
    assert all(float(np.max(np.abs(b))) > 1e-6 for _, b in pairs)


def test_traces_stored_in_bfloat16_keep_xlas_passes():
    """Traces stored in bfloat16 reach the rules widened to float32: the kernel would be
    handed a whole float32 copy, so the blocks keep XLA's formulation (which fuses the
    widening into its passes) and the gradients are its own."""
    model = _gru(128, jnp.float32)
    xs = jax.random.normal(jax.random.key(1), (6, 2, 128), jnp.float32)
    ys = jax.random.normal(jax.random.key(2), (6, 2, 2), jnp.float32)
    got, used = _drtrl_grads(model, xs, ys, "pallas", jnp.bfloat16)
    want, _ = _drtrl_grads(model, xs, ys, "accelerator", jnp.bfloat16)
    assert len(used) == 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_drtrl_through_the_kernel_equals_bptt_where_it_is_exact():
    """A dense layer into LIF neurons (a diagonal hidden Jacobian): D-RTRL's gradient is
    BPTT's, through the kernel too (float64, 1e-8 of the largest)."""
    with jax.enable_x64(True):
        rngs = nnx.Rngs(0)
        f64 = {"param_dtype": jnp.float64}
        model = nnx.Sequential(layers.ETPLinear(128, 128, rngs=rngs, **f64),
                               layers.LIF(128, **f64),
                               layers.ETPLinear(128, 2, rngs=rngs, **f64))
        braintrace.init_states(model, batch_size=2)
        xs = 2.0 * jax.random.normal(jax.random.key(3), (7, 2, 128), jnp.float64)
        ys = jax.random.normal(jax.random.key(4), (7, 2, 2), jnp.float64)
        want = bptt_grads(model, xs, ys)
        got, used = _drtrl_grads(model, xs, ys, "pallas")
    assert len(used) == 2  # the first layer's trace (B, 128, 128), in blocks of 3 steps and the
    # last of 1 (T = 7); the readout's trace does not tile
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), strict=True) if b.size]
    assert any(float(np.max(np.abs(b))) > 1e-4 for _, b in pairs)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-8 * float(np.max(np.abs(b))))


def test_traces_stored_in_bfloat16_through_the_kernel_with_narrow_traces_on(monkeypatch):
    """With ``_d_rtrl.FUSED_NARROW_TRACES`` the kernel reads and writes the stored bfloat16
    traces (both, in blocks of 3 steps): the gradients are XLA's formulation's (each rounds
    the float32 update to bfloat16 once per block; 1e-5 of the largest, where storing the traces
    in float32 instead moves them by ~5e-4); the kernel is handed the bfloat16 traces, not a
    float32 copy."""
    monkeypatch.setattr(_d_rtrl, "FUSED_NARROW_TRACES", True)
    model = _gru(128, jnp.float32)
    xs = jax.random.normal(jax.random.key(1), (6, 2, 128), jnp.float32)
    ys = jax.random.normal(jax.random.key(2), (6, 2, 2), jnp.float32)
    got, used = _drtrl_grads(model, xs, ys, "pallas", jnp.bfloat16)
    want, _ = _drtrl_grads(model, xs, ys, "accelerator", jnp.bfloat16)
    assert len(used) == 2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(b)))) if b.size else 0.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)
    # the kernel's first operand, the trace: the stored bfloat16 one
    assert {eqn.invars[0].aval.dtype for eqn in used} == {jnp.dtype(jnp.bfloat16)}
