"""The TPU's Pallas kernels for the sparse sums, run on the CPU in Pallas' TPU interpreter.

``formulation('pallas')`` makes the sparse primitive take its TPU formulation
(``_sparse_tpu.py``: the kernels of ``_sparse_pallas.py`` over the cells of
``_sparse_cells.py``) in interpret mode, which raises on a read out of bounds. Each kernel
must give the XLA formulation's float32 values (``_sparse_accelerator.py``, the reference)
on hostile connectivity: every synapse into one neuron, inputs and outputs that no
connection touches, repeated pairs, sizes that are multiples of neither 128 nor the chunk
or block, sources cut into several chunks, rows cut into several groups of 128 lanes,
batch 1 and batches that are not multiples of 8 (and the uniform forward's staged form). The
cells' index arithmetic is checked
on a million-neuron table without running a kernel; a layer's forward, BPTT and online
gradients (BPTT and ES-D-RTRL, whose block product is the weight pullback over the stacked
steps) through the kernels equal those through the XLA formulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import built_on_the_host, mse
from jax.experimental.pallas import tpu as pltpu
from test_sparse_layouts import KINDS

import braintrace
from braintrace import layers
from braintrace._platform import formulation
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives import _sparse_pallas as pallas
from braintrace._primitives import _sparse_tpu as tpu
from braintrace._primitives._sparse import Connectivity
from braintrace._primitives._sparse_cells import GROUP, cells, int32_indices

RTOL = 1e-6
"""Float32 sums of a few dozen terms in another order."""


def _star(rng):
    """Every synapse into neuron 0; its transpose: one input to every neuron."""
    del rng
    n = 19
    return Connectivity.from_indices(np.arange(n), np.zeros(n, int), n, n)


def _uniform(rng):
    """Three synapses into each of 37 neurons, in output order (the kernels' transposed
    layout; the last block padded)."""
    n, fan_in = 37, 3
    pre = np.concatenate([rng.choice(n, fan_in, replace=False) for _ in range(n)])
    return Connectivity.from_indices(pre, np.repeat(np.arange(n), fan_in), n, n)


CASES = {
    # name: (connectivity, rows R, source chunk, target block, lanes per call)
    "odd-chunked": (KINDS["odd"], 5, 9, 8, None),       # repeats, unused rows, 2 chunks
    "star-batch-1": (_star, 1, None, 8, None),
    "uniform-lane-groups": (_uniform, 130, None, 16, 128),  # R 130: two calls of 128 lanes
}


@pytest.fixture(autouse=True)
def _cells_kernels(monkeypatch):
    """These tests are the cells' kernels' (``_sparse_tpu.KERNELS = 'cells'``; the staged
    ones, the default, are ``test_sparse_staged.py``'s)."""
    monkeypatch.setattr(tpu, "KERNELS", "cells")


def _sums(module, conn):
    return lambda x, d, w: (module.product(x, w, conn), module.transposed_product(d, w, conn),
                            module.weight_pullback(x, d, conn))


def _staged_product(x, w, conn):
    """The forward over uniform cells in its staged form (``_sparse_pallas.STAGED``)."""
    pallas.STAGED = True
    try:
        return tpu.product(x, w, conn)
    finally:
        pallas.STAGED = False


@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_the_xla_formulation_on_hostile_connectivity(monkeypatch, case):
    make, rows, chunk, block, lanes = CASES[case]
    rng = np.random.default_rng(0)
    conn = make(rng)
    monkeypatch.setattr(tpu, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(tpu, "BLOCK_ROWS", block)
    monkeypatch.setattr(tpu, "INTERPRET", pltpu.InterpretParams(out_of_bounds_reads="raise"))
    if lanes:
        monkeypatch.setattr(pallas, "VMEM_BUDGET", (conn.num_in + 8) * lanes * 4)
    incoming, outgoing = tpu.cut(conn, "incoming"), tpu.cut(conn, "outgoing")
    assert incoming is not None and outgoing is not None  # the kernels run, not the fallback
    if chunk:
        assert incoming.chunks > 1 and outgoing.chunks > 1
    if case == "uniform-lane-groups":
        assert incoming.uniform == 3 and not outgoing.uniform and conn.num_out % block
    w = jnp.asarray(rng.standard_normal(conn.nnz), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, conn.num_in)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((rows, conn.num_out)), jnp.float32)
    want = jax.jit(_sums(accelerator, conn))(x, d, w)
    with formulation("pallas"):
        got = jax.jit(_sums(tpu, conn))(x, d, w)
        if incoming.uniform:
            got, want = (*got, jax.jit(_staged_product, static_argnums=2)(x, w, conn)), (
                *want, want[0])
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(b))))


def test_cells_place_every_connection_once_with_int32_indices_at_a_million_neurons():
    """S = T = 2^20 cut into 32 chunks by 128 blocks: cell·T + target reaches 2^32, so the
    cut computes in int64 and stores int32; every connection sits once, where its source
    chunk, target block, source row and target row say."""
    rng = np.random.default_rng(0)
    n, nnz, chunk, block = 2**20, 2**18, 2**15, 2**13
    pre, post = rng.integers(0, n, nnz), rng.integers(0, n, nnz)
    c = cells(pre, post, n, n, chunk, block)
    assert (c.chunks, c.blocks) == (32, 128) and not c.uniform
    assert all(a.dtype == np.int32 for a in (c.source, c.slot, c.position, c.rows, c.widths))
    cell, place = np.divmod(c.position.astype(np.int64), c.slots)
    np.testing.assert_array_equal(c.slot.reshape(-1)[c.position], np.arange(nnz))
    np.testing.assert_array_equal(cell // c.blocks, pre // chunk)
    np.testing.assert_array_equal(cell % c.blocks, post // block)
    np.testing.assert_array_equal(c.source.reshape(-1)[c.position], pre % chunk)
    starts = np.concatenate([np.zeros((len(c.widths), 1), np.int64),
                             np.cumsum(GROUP * c.widths.astype(np.int64), axis=1)], axis=1)
    bounds = (np.arange(len(c.widths))[:, None] * (c.slots + 1) + starts).reshape(-1)
    group = (np.searchsorted(bounds, cell * (c.slots + 1) + place, side="right") - 1
             ) % starts.shape[1]
    lane = (place - starts[cell, group]) // c.widths[cell, group]  # target by target
    np.testing.assert_array_equal(c.rows[cell, group * GROUP + lane], post % block)
    assert np.all(np.diff(c.widths, axis=1) <= 0)  # groups widest first
    with pytest.raises(OverflowError, match="int32"):
        int32_indices(np.array([2**31]))


def test_hubs_too_wide_to_cut_keep_the_xla_formulation():
    """Two hubs of 2^16 synapses each, in one block: eight lanes of that width would pad to
    more than MAX_FILL·nnz slots, so that side has no cells and its TPU formulation is the
    XLA one (a program without the kernels' loops); the other side cuts."""
    n = 2**17
    conn = Connectivity.from_indices(np.arange(n), np.arange(n) % 2 * 9, n, 2**15)
    assert tpu.cut(conn, "outgoing") is not None and tpu.cut(conn, "incoming") is None
    x = jnp.ones((2, n), jnp.float32)
    w = jnp.ones(n, jnp.float32)
    with formulation("pallas"):
        text = jax.jit(lambda x, w: tpu.product(x, w, conn)).trace(x, w).lower().as_text()
    assert "gather" in text and "while" not in text


@built_on_the_host
def _network(batch: int, connectivity: Connectivity | None = None):
    """A float32 spiking network of 14 neurons with a sparse recurrence: ``connectivity``, by
    default one with unused neurons and a repeated pair."""
    n = 14
    if connectivity is None:
        rng = np.random.default_rng(2)
        pre = np.concatenate([rng.choice(12, 3, replace=False) for _ in range(12)] + [[3, 3]])
        post = np.concatenate([np.repeat(np.arange(12), 3), [13, 13]])
        connectivity = Connectivity(pre, post, n, n)

    class SparseALIF(nnx.Module):
        def __init__(self, rngs):
            self.inp = layers.ETPLinear(3, n, rngs=rngs)
            self.rec = layers.ETPSparseLinear(n, n, connectivity=connectivity, rngs=rngs)
            self.neuron = layers.ALIF(n)
            self.readout = layers.LeakyReadout(n, 2, rngs=rngs)

        def __call__(self, x):
            return self.readout(self.neuron(self.inp(x) + 4.0 * self.rec(self.neuron.spikes())))

    model = SparseALIF(nnx.Rngs(0))
    braintrace.init_states(model, batch)
    return model


@pytest.mark.parametrize("method", ["bptt", "es_d_rtrl"])
def test_layer_gradients_through_the_kernels_equal_the_xla_formulation(monkeypatch, method):
    monkeypatch.setattr(tpu, "BLOCK_ROWS", 8)
    batch, steps = 3, 4
    rng = np.random.default_rng(3)
    model = _network(batch)
    example = jnp.zeros((batch, 3), jnp.float32)
    xs = jnp.asarray(2.0 * rng.standard_normal((steps, batch, 3)), jnp.float32)
    ys = jnp.asarray(rng.standard_normal((steps, batch, 2)), jnp.float32)

    def gradients():
        learner = braintrace.compile(nnx.clone(model), method, example, batch_size=batch)
        return jax.tree.leaves(learner.etrace_grad(xs, ys, mse))

    with formulation("accelerator"):
        want = gradients()
    calls = []
    for name in ("gather_sum", "pair_sum"):  # count the kernels' calls as they are traced
        kernel = getattr(pallas, name)
        monkeypatch.setattr(pallas, name, lambda *a, kernel=kernel, name=name, **k: (
            calls.append(name), kernel(*a, **k))[1])
    with formulation("pallas"):
        got = gradients()
    assert "gather_sum" in calls and "pair_sum" in calls
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
