"""The TPU's staged Pallas kernels for the sparse sums, run on the CPU in Pallas' interpreter.

With ``_sparse_tpu.KERNELS = 'staged'`` the sparse primitive's TPU formulation takes the
staged kernels (``_sparse_staged.py`` over the lane tiles of ``_sparse_tiles.py``); in
``formulation('pallas')`` they run interpreted (Pallas' TPU interpreter, which raises on a
read out of bounds; or JAX's). Each sum must give the XLA formulation's float32 values
(``_sparse_accelerator.py``, the reference) on hostile connectivity: every synapse into one
neuron (a tile 19 wide beside empty ones), inputs and outputs no connection touches, repeated
pairs, sizes that are multiples of neither 128 nor the chunk, sources in several chunks (the
calls adding up), rows of ``v`` in two groups of 128, batch 1, and a uniform fan-in of 3
(the pair-sum's targets padded to 8 rows). ``KERNELS = 'packed'`` (several sources per row of
the staged table, for values of at most 64 rows) is checked the same way, its gather-sums at
R = 1, 5, 32, 33, 64 (packed), 65, 128 and 200 (not: the staged kernels). The pair-sum over
several source chunks (``_sparse_tpu.CHUNKED_PAIR``: each chunk's call stages every
connection, those of other chunks reading its zero row) gives XLA's values in connection
order at fan-ins 1, 3 and 8, 1 to 129 rows, a last chunk shorter than the others, and its
tiles are checked at a fan-in of 130 too; so does each chunk's call staging its own
connections alone (``_sparse_tpu.OWN_CHUNK_PAIR``: into a stage zeroed first where it does not
pack; its tiles' entries put every connection in its staged row once); packed (``'packed'``: each staged row summed over
its own quarter of the table row) at R = 1, 20, 32 (4 sources per row), 64 (2) and 65 (1);
with the flag the weight pullback's program gathers nothing, without it it gathers every
value. The tiles' index arithmetic is checked on a
million neurons without a kernel; a layer's gradients through the kernels equal those
through XLA's formulation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import test_sparse_pallas
from flax import nnx
from helpers import mse
from jax.experimental.pallas import tpu as pltpu
from test_sparse_layouts import KINDS
from test_sparse_pallas import _star, _uniform

import braintrace
from braintrace._platform import formulation
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives import _sparse_staged as staged
from braintrace._primitives import _sparse_tpu as tpu
from braintrace._primitives._sparse import Connectivity
from braintrace._primitives._sparse_tiles import LANES, REGIONS, gather_tiles, pair_tiles

RTOL = 1e-6
"""Float32 sums of a few dozen terms in another order."""

TPU = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True,
                            out_of_bounds_reads="raise", dma_execution_mode="on_wait")
"""Pallas' TPU interpreter as close to the chip as it goes: memory that the kernel reads before
it writes it holds NaN (JAX's generic interpreter zero-fills it), a read out of bounds raises
(the generic one clamps it), a copy lands only when it is waited for, and two accesses to one
buffer that nothing orders count as a race. The kernels run the chip's program in it (the
staging loop unrolled 16 times; in the generic interpreter, once)."""

NO_RACES = dataclasses.replace(TPU, detect_races=False)
""":data:`TPU` without the race detector (a few times faster)."""

CASES = {
    # name: (connectivity, rows R, source chunk, interpreter, kernels)
    "odd-chunked": (KINDS["odd"], 5, 9, NO_RACES, "staged"),  # repeats, unused rows, 2 chunks
    "star-batch-1": (_star, 1, None, NO_RACES, "staged"),     # one target of 19 sources
    "uniform-two-groups": (_uniform, 130, None, True, "staged"),  # R 130: two groups; fan-in 3
    # 'packed': P = 4 sources per table row for R <= 32, 2 for R <= 64, else 'staged'
    "packed-odd-chunked": (KINDS["odd"], 5, 3, NO_RACES, "packed"),  # P 4, 2 chunks, Q 2
    "packed-star-3-chunks": (_star, 33, 4, True, "packed"),  # P 2, the hub over quarters
    "packed-odd-batch-1": (KINDS["odd"], 1, 2, True, "packed"),  # P 4, 2 chunks, Q 2
    "packed-uniform-32": (_uniform, 32, 10, True, "packed"),  # P 4, Q 10, one chunk, uniform
    "packed-uniform-64": (_uniform, 64, 19, True, "packed"),  # P 2, Q 19, one chunk, uniform
    "packed-star-65": (_star, 65, 7, True, "packed"),  # P 1: 'staged', 3 chunks
    "packed-odd-128": (KINDS["odd"], 128, 5, True, "packed"),  # P 1, 4 chunks
    "packed-uniform-200": (_uniform, 200, None, True, "packed"),  # P 1, two groups of 128
}
"""The staged cases' first two run in the TPU interpreter; the third, which adds the groups of
rows (XLA around the calls), in JAX's generic one (8× faster); the race detector runs in
:func:`test_the_copies_of_v_are_race_free_in_the_tpu_interpreter`. The uniform cases (in
output order) compare the pair-sum too, packed as their gather-sums."""

PACKS = {"packed-odd-chunked": 4, "packed-star-3-chunks": 2, "packed-odd-batch-1": 4,
         "packed-uniform-32": 4, "packed-uniform-64": 2}
"""The sources per table row of each packed case's gather tiles (the rest: 1)."""


@pytest.fixture(autouse=True)
def _pack_one_chunk(monkeypatch):
    """The packed kernels' tests pack within one chunk too (the default packs a gather-sum
    only where that saves chunks: ``test_a_tpu_runs_the_staged_kernels_by_default...``)."""
    monkeypatch.setattr(tpu, "PACK_ONE_CHUNK", True)


def _sums(module, conn, pullback: bool):
    """The product, the input pullback and (``pullback``: where the staged pair-sum applies;
    elsewhere the cells' kernel, ``test_sparse_pallas.py``) the weight pullback."""
    return lambda x, d, w: (module.product(x, w, conn), module.transposed_product(d, w, conn),
                            *((module.weight_pullback(x, d, conn),) if pullback else ()))


@pytest.mark.parametrize("case", CASES)
def test_staged_kernels_equal_the_xla_formulation_on_hostile_connectivity(monkeypatch, case):
    make, rows, chunk, interpreter, kernels = CASES[case]
    rng = np.random.default_rng(0)
    conn = make(rng)
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(tpu, "BLOCK_ROWS", LANES)
    monkeypatch.setattr(tpu, "INTERPRET", interpreter)
    w = jnp.asarray(rng.standard_normal(conn.nnz), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, conn.num_in)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((rows, conn.num_out)), jnp.float32)
    incoming = tpu._staged("gather_sum", conn, "incoming", x, w)[1]
    outgoing = tpu._staged("gather_sum", conn, "outgoing", d, w)[1]
    pair = (tpu._staged("pair_sum", conn, "pair", x, d) or (None, None))[1]
    assert incoming is not None and outgoing is not None  # the kernels run, not the fallback
    assert incoming.pack == outgoing.pack == PACKS.get(case, 1)
    assert (pair is not None) == ("uniform" in case)  # connections in output order
    assert pair is None or pair.pack == incoming.pack
    if chunk and not case.startswith("packed-uniform"):
        assert incoming.chunks > 1 and outgoing.chunks > 1 and pair is None
    if incoming.pack > 1:  # sources in several quarters of a table row
        assert 0 < incoming.quarter < min(incoming.chunk, conn.num_in)
    if case in ("packed-uniform-32", "packed-uniform-64"):
        assert incoming.uniform == 3 and incoming.perm is None and incoming.chunks == 1
    if case == "star-batch-1":
        assert incoming.widths[0, :2].tolist() == [conn.nnz, 0] and incoming.perm is not None
    if case == "uniform-two-groups":
        assert incoming.uniform == 3 and incoming.perm is None and pair.width_cap == 8
    want = jax.jit(_sums(accelerator, conn, pair is not None))(x, d, w)
    with formulation("pallas"):
        got = jax.jit(_sums(tpu, conn, pair is not None))(x, d, w)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("kernels, rows", [("staged", 3), ("packed", 37)])
def test_the_copies_of_v_are_race_free_in_the_tpu_interpreter(monkeypatch, kernels, rows):
    """300 sources copied 128 columns at a time (two copies in flight, then a tail), three
    blocks (the table kept over the grid): with uninitialized memory NaN and the race
    detector on, the gather-sums equal XLA's and no two accesses race. Packed (37 rows: two
    sources per table row), two quarters of 256 rows, each two blocks of 128 columns: two
    copies per block and quarter (32 rows, then 5), two blocks in flight, the second quarter
    past ``v``'s last column."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    n = 300
    rng = np.random.default_rng(0)
    conn = Connectivity.from_indices(rng.permutation(n), np.arange(n), n, n)
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "BLOCK_ROWS", LANES)
    monkeypatch.setattr(tpu, "INTERPRET", TPU)
    monkeypatch.setattr(staged, "COPY_COLUMNS", LANES)
    x = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(n), jnp.float32)
    tiles = tpu._staged("gather_sum", conn, "incoming", x, w)[1]
    assert tiles.blocks == 3 and tpu.staged_tiles(conn, "outgoing").perm is not None
    assert (tiles.pack, tiles.quarter) == ((1, 0) if kernels == "staged" else (2, 256))
    pltpu.reset_tpu_interpret_mode_state()
    want = jax.jit(_sums(accelerator, conn, False))(x, x, w)
    with formulation("pallas"):
        got = jax.jit(_sums(tpu, conn, False))(x, x, w)
    assert not interpreter.races.races_found
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(b))))


def test_a_tpu_runs_the_staged_kernels_by_default_and_the_cells_where_they_do_not_apply(
        monkeypatch):
    """Off the interpreter (a TPU's program) the default kernels are the staged ones (packed
    where that saves chunks), called
    as the chip's program (``interpret=False``); a side without lane tiles (one hub whose
    padding exceeds ``MAX_FILL``) and other dtypes fall back."""
    conn = _star(None)
    x, w = jnp.ones((1, conn.num_in)), jnp.ones((conn.nnz,))
    monkeypatch.setattr(tpu, "interpreting", lambda: False)
    monkeypatch.setattr(tpu, "PACK_ONE_CHUNK", False)
    assert tpu.KERNELS == "packed"  # one chunk: its gather-sums unpacked, the staged ones
    kernel, tiles, interpret = tpu._staged("gather_sum", conn, "incoming", x, w)
    assert kernel is staged.gather_sum and tiles.kind == "gather" and interpret is False
    uniform, ones = _uniform(np.random.default_rng(0)), jnp.ones((1, 37))
    assert tiles.pack == 1 and tpu._staged("pair_sum", uniform, "pair", ones, ones)[1].pack == 4
    monkeypatch.setattr(tpu, "CHUNK_ROWS", 8)  # 19 sources in 3 chunks unpacked: packed
    assert tpu._staged("gather_sum", conn, "incoming", x, w)[1].pack == 4
    monkeypatch.setattr(tpu, "CHUNK_ROWS", None)
    assert tpu._staged("gather_sum", conn, "incoming", x.astype(jnp.bfloat16), w) is None
    pre = np.r_[np.arange(2000), np.arange(127)]  # 2,000 into target 0, one into 1 … 127
    hub = Connectivity.from_indices(pre, np.r_[np.zeros(2000, int), np.arange(1, 128)], 2000,
                                    2048)
    assert tpu.staged_tiles(hub, "incoming") is None
    assert tpu._staged("gather_sum", hub, "incoming", jnp.ones((1, 2000)),
                       jnp.ones(hub.nnz)) is None
    monkeypatch.setattr(tpu, "KERNELS", "cells")
    assert tpu._staged("gather_sum", conn, "incoming", x, w) is None


def test_tiles_place_every_connection_once_with_int32_indices_at_a_million_neurons():
    """S = T = 2^20 in 4 chunks by 256 blocks (cell·T + target reaches 2^30): every connection is read by exactly one staged
    row, of its source, in the tile and lane of its target, with its weight beside it; the
    targets of a cell sorted by count, the tiles as wide as their first."""
    rng = np.random.default_rng(0)
    n, nnz, chunk, block = 2**20, 2**20, 2**18, 2**12
    pre, post = rng.integers(0, n, nnz), rng.integers(0, n, nnz)
    t = gather_tiles(pre, post, n, n, chunk, block)
    assert (t.chunks, t.blocks) == (4, 256) and t.perm is not None
    assert all(a.dtype == np.int32 for a in (t.source, t.slot, t.perm, t.widths))
    cell, row, lane = np.nonzero(t.slot < nnz)
    k = t.slot[cell, row, lane]
    np.testing.assert_array_equal(np.sort(k), np.arange(nnz))  # each connection once
    np.testing.assert_array_equal(cell // t.blocks, pre[k] // chunk)
    np.testing.assert_array_equal(cell % t.blocks, post[k] // block)
    widths = t.widths.astype(np.int64)
    first = np.concatenate([np.zeros((len(widths), 1), np.int64),
                            np.cumsum(widths, axis=1)[:, :-1]], axis=1)
    stride = int(first.max()) + 1  # each cell's first rows in a range of its own
    flat = (first + stride * np.arange(len(first))[:, None]).ravel()
    tile = np.searchsorted(flat, row + stride * cell, side="right") - 1 - cell * first.shape[1]
    j = row - first[cell, tile]
    assert np.all(j < widths[cell, tile])
    np.testing.assert_array_equal(t.perm[cell, tile * LANES + lane], post[k] % block)
    q, g = np.divmod(j * LANES + lane, REGIONS)  # the staged row 128·j + u
    np.testing.assert_array_equal(t.source[cell, g, (LANES // REGIONS) * first[cell, tile] + q],
                                  pre[k] % chunk)
    assert np.all(np.diff(widths, axis=1) <= 0)  # tiles widest first
    uniform = pair_tiles(np.arange(3 * 5) % 7, 7, 5, fan_in=3, block=LANES)
    assert uniform.width_cap == 8 and uniform.kind == "pair"


def _es_d_rtrl_gradients(model: nnx.Module, batch: int, steps: int = 4):
    """A function giving ES-D-RTRL's gradients of one ``etrace_grad`` call on ``model`` (3
    inputs, 2 outputs, ``batch`` samples) over random data, under the formulation it is
    called in."""
    rng = np.random.default_rng(3)
    example = jnp.zeros((batch, 3), jnp.float32)
    xs = jnp.asarray(2.0 * rng.standard_normal((steps, batch, 3)), jnp.float32)
    ys = jnp.asarray(rng.standard_normal((steps, batch, 2)), jnp.float32)

    def gradients():
        learner = braintrace.compile(nnx.clone(model), "es_d_rtrl", example, batch_size=batch)
        return jax.tree.leaves(learner.etrace_grad(xs, ys, mse))

    return gradients


@pytest.mark.parametrize("kernels, chunk, pack", [("staged", None, 1), ("packed", 4, 4)])
def test_layer_gradients_through_the_staged_kernels_equal_the_xla_formulation(
        monkeypatch, kernels, chunk, pack):
    """ES-D-RTRL's gradients of a spiking network with a sparse recurrence (unused neurons, a
    repeated pair: the weight pullback keeps the cells' kernel), its gather-sums through the
    staged kernels, equal those through XLA's formulation; ``'packed'`` (batch 3: four
    sources per table row, quarters of 4 of the 14 neurons), too."""
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "CHUNK_ROWS", chunk)
    gradients = _es_d_rtrl_gradients(test_sparse_pallas._network(3), 3)
    with formulation("accelerator"):
        want = gradients()
    calls = []
    kernel = staged.gather_sum  # count the kernel's calls as they are traced
    monkeypatch.setattr(staged, "gather_sum",
                        lambda *a, **k: (calls.append(a[2].pack), kernel(*a, **k))[1])
    with formulation("pallas"):
        got = gradients()
    assert len(calls) >= 2 and set(calls) == {pack}  # the product and the input pullback
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", ["staged", "packed", "cells"])
def test_every_scalar_memory_block_is_one_dimensional(monkeypatch, kernels):
    """The kernels read their index tables from one-dimensional SMEM blocks only: a first
    version of the staged kernels read two-dimensional ones, right in both of Pallas'
    interpreters and wrong on a TPU v5e (its sums 1.2–1.5 times XLA's largest value off)."""
    rng = np.random.default_rng(0)
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "BLOCK_ROWS", LANES)
    blocks = []
    for conn in (_uniform(rng), _star(rng)):
        x, w = jnp.ones((3, conn.num_in)), jnp.ones((conn.nnz,))
        d = jnp.ones((3, conn.num_out))
        with formulation("pallas"):
            jaxpr = jax.make_jaxpr(lambda x, d, w, conn=conn: (
                tpu.product(x, w, conn), tpu.transposed_product(d, w, conn),
                tpu.weight_pullback(x, d, conn)))(x, d, w)
        calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert len(calls) == 3  # every sum is a kernel
        blocks += [bm.block_shape for e in calls for bm in e.params["grid_mapping"].block_mappings
                   if str(bm.transformed_block_aval.memory_space) == "smem"]
    assert blocks and all(len(shape) == 1 for shape in blocks)


@pytest.mark.parametrize("kernels", ["staged", "packed"])
def test_every_copy_of_v_into_vmem_is_whole_tiles_of_8_rows_or_within_one(monkeypatch, kernels):
    """Mosaic slices VMEM in whole (8, 128) tiles or within one: a copy of 20 or 33 rows of
    ``v`` into the copy buffer did not compile for a v5e. At 20 and 33 rows (packed: 4 and 2
    sources per table row) every copy's rows start at a multiple of 8 and are a multiple of 8
    or fewer."""
    rng = np.random.default_rng(0)
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "BLOCK_ROWS", LANES)
    copies, make_copy = [], pltpu.make_async_copy

    def record(src, dst, sem):
        index = dst.transforms[-1].indices[1]  # the rows of buf[slot]
        copies.append((int(index.start), int(index.size)))
        return make_copy(src, dst, sem)

    monkeypatch.setattr(staged.pltpu, "make_async_copy", record)
    conn = _star(rng)
    for rows in (20, 33):
        x, w = jnp.ones((rows, conn.num_in)), jnp.ones((conn.nnz,))
        with formulation("pallas"):
            jax.make_jaxpr(lambda x, w: tpu.product(x, w, conn))(x, w)
    assert {size for _, size in copies} == {16, 4, 32, 1}
    assert all(start % 8 == 0 and (size % 8 == 0 or size < 8) for start, size in copies)

PAIR_CASES = {
    # name: (neurons, fan-in, rows R, source chunk, interpreter, kernels)
    "fan-in-8-rows-32": (100, 8, 32, 40, NO_RACES, "staged"),  # chunks 40, 40, 20: last short
    "fan-in-1-rows-1": (100, 1, 1, 48, True, "staged"),         # chunks 48, 48, 4
    "fan-in-8-rows-64-blocks": (300, 8, 64, 130, True, "staged"),  # 3 chunks by 3 blocks
    "fan-in-3-rows-129": (37, 3, 129, 16, True, "staged"),      # two groups of 128 rows
    # 'packed': P = 4 sources per table row for R <= 32, 2 for R <= 64, else 1
    "packed-fan-in-8-rows-32": (50, 8, 32, 30, NO_RACES, "packed"),  # P 4, Q 8: 30, 20 (3 q.)
    "packed-fan-in-1-rows-1": (100, 1, 1, 48, True, "packed"),   # P 4, Q 12: 48, 48, 4
    "packed-fan-in-3-rows-20": (37, 3, 20, 16, True, "packed"),  # P 4, Q 4: 16, 16, 5
    "packed-fan-in-8-rows-64-blocks": (300, 8, 64, 130, True, "packed"),  # P 2, Q 65, 3 blocks
    "packed-fan-in-8-rows-65": (37, 8, 65, 16, True, "packed"),  # P 1: the staged pair-sum
}
"""The chunked pair-sum's cases: sizes multiples of neither 128 nor the chunk, the first of
each kernels in Pallas' TPU interpreter (uninitialised memory NaN, reads out of bounds raise),
the others in JAX's (faster). A fan-in above 128 (``Fp`` 256: a target's rows across several
groups of 128, as with one chunk) is checked on the tiles alone: its kernel takes ~10 s to
interpret."""

PAIR_PACKS = {"packed-fan-in-8-rows-32": 4, "packed-fan-in-1-rows-1": 4,
              "packed-fan-in-3-rows-20": 4, "packed-fan-in-8-rows-64-blocks": 2}
"""The sources per table row of each packed pair case's tiles (the rest: 1)."""


def test_packed_pair_tiles_refuse_values_of_more_rows_than_a_quarter_holds():
    """Four sources per table row leave 32 lanes to each: 33 rows of values are refused."""
    tiles = pair_tiles(np.array([0, 2, 1]), 3, 3, fan_in=1, block=LANES, pack=4)
    with pytest.raises(ValueError, match="at most 32 rows, got 33"):
        staged.pair_sum(jnp.ones((33, 3)), jnp.ones((33, 3)), tiles, 3, interpret=True)


def _in_output_order(n: int, fan_in: int, rng) -> np.ndarray:
    """``fan_in`` distinct random sources for each of ``n`` targets, in target order."""
    return np.concatenate([rng.choice(n, fan_in, replace=False) for _ in range(n)])


OWN_CASES = ("fan-in-8-rows-32", "fan-in-1-rows-1", "fan-in-3-rows-129",
             "packed-fan-in-8-rows-32", "packed-fan-in-8-rows-64-blocks")
"""The pair cases run with each chunk's call staging its own connections too: zeroed stages
in the TPU interpreter (NaN where unwritten), one source per target, two groups of rows, and
packed in it and over several blocks."""


@pytest.mark.parametrize("case, own", [(case, False) for case in PAIR_CASES]
                         + [(case, True) for case in OWN_CASES])
def test_the_chunked_pair_sum_equals_the_xla_formulation(monkeypatch, case, own):
    """Over several source chunks, each call staging every connection (those of other chunks
    reading its zero row; ``own``: its own chunk's alone, into a stage zeroed first unless
    packed) and adding into the last one's output: the pair-sum in connection order equals
    XLA's weight pullback; packed (``P`` sources per table row, each staged row summed over
    its own quarter's lanes), too, its connections in every quarter."""
    n, fan_in, rows, chunk, interpreter, kernels = PAIR_CASES[case]
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    rng = np.random.default_rng(1)
    pre = _in_output_order(n, fan_in, rng)
    conn = Connectivity.from_indices(pre, np.repeat(np.arange(n), fan_in), n, n)
    tiles = pair_tiles(pre, n, n, fan_in, LANES, chunk, tpu.packing(rows), own)
    assert (tiles.positions is not None) == own
    assert tiles.chunks > 1 and n - (tiles.chunks - 1) * chunk < chunk  # the last chunk short
    assert tiles.pack == PAIR_PACKS.get(case, 1)
    if tiles.pack > 1:  # sources in every quarter of a table row; other chunks' rows in none
        assert tiles.quarter == -(-chunk // tiles.pack)
        assert set(np.unique(tiles.quarters).tolist()) == set(range(tiles.pack + 1))
    x = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    got = jax.jit(lambda x, d: staged.pair_sum(x, d, tiles, conn.nnz, interpret=interpreter))(
        x, d)
    want = accelerator.weight_pullback(x, d, conn)
    assert got.shape == want.shape == (conn.nnz,)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("fan_in, pack", [(1, 1), (8, 1), (130, 1), (1, 4), (8, 2), (130, 4)])
def test_each_chunk_of_the_pair_tiles_reads_its_own_connections_and_zeros_elsewhere(fan_in,
                                                                                     pack):
    """Every chunk's index set, read from that chunk's table (its rows, then zero rows), and
    summed over the chunks: each staged row is its connection's source row (in connection
    order, ``Fp`` rows per target) or zero (padding); every index inside the table. Packed,
    table row ``s``'s quarter ``q`` holds the chunk's source ``q·Q + s``, and each staged row
    reads its index's row in its quarter (none: zero)."""
    n, chunk = 300, 110  # chunks 110, 110, 80; 3 blocks of 128 targets
    rng = np.random.default_rng(0)
    pre = _in_output_order(n, fan_in, rng)
    tiles = pair_tiles(pre, n, n, fan_in, LANES, chunk, pack)
    assert (tiles.chunks, tiles.blocks, tiles.uniform, tiles.pack) == (3, 3, fan_in, pack)
    v = rng.standard_normal(n) + 10.0  # no source reads zero
    staged_rows = np.zeros((tiles.blocks, tiles.block * tiles.width_cap))  # one tile a block
    q, g = np.divmod(np.arange(staged_rows.shape[1]), REGIONS)
    quarter = tiles.quarter or chunk
    for c in range(tiles.chunks):
        size = min(chunk, n - c * chunk)
        sources = np.concatenate([v[c * chunk:c * chunk + size], np.zeros(pack * quarter - size)])
        table = np.concatenate([sources.reshape(pack, quarter).T, np.zeros((8, pack))])
        table = np.concatenate([table, np.zeros((len(table), 1))], axis=1)  # quarter P: none
        index = tiles.source[c * tiles.blocks:(c + 1) * tiles.blocks]
        zero = tiles.quarter if pack > 1 else size
        assert index.min() >= 0 and index.max() <= zero  # in the table, padding at its zero row
        own = np.zeros(index[:, g, q].shape, np.int64) if pack == 1 else \
            tiles.quarters[c * tiles.blocks:(c + 1) * tiles.blocks].reshape(tiles.blocks, -1)
        staged_rows += table[index[:, g, q], own]
    width = tiles.width_cap
    want = np.zeros((tiles.blocks * LANES, width))
    want[:n, :fan_in] = v[pre].reshape(n, fan_in)
    np.testing.assert_array_equal(staged_rows, want.reshape(tiles.blocks, -1))


@pytest.mark.parametrize("pack, rows", [(1, 40), (4, 20)])
def test_own_pair_tiles_over_several_tiles_a_block_equal_the_xla_formulation(pack, rows):
    """Blocks of 512 targets (4 lane tiles each, their entries one after another in the cell,
    each tile's start carried from the groups of those before it), 3 chunks: the pair-sum that
    stages each chunk's own connections equals XLA's weight pullback."""
    n, fan_in, chunk = 600, 8, 250
    rng = np.random.default_rng(4)
    pre = _in_output_order(n, fan_in, rng)
    conn = Connectivity.from_indices(pre, np.repeat(np.arange(n), fan_in), n, n)
    tiles = pair_tiles(pre, n, n, fan_in, 512, chunk, pack, own=True)
    assert (tiles.chunks, tiles.blocks, tiles.block) == (3, 2, 512)
    first_blocks = tiles.groups[::tiles.blocks]  # targets 0-511 of every chunk: 4 tiles
    assert (first_blocks[:, :4] > 0).all() and (tiles.groups[:, 4:] == 0).all()
    x = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    got = jax.jit(lambda x, d: staged.pair_sum(x, d, tiles, conn.nnz, interpret=True))(x, d)
    want = accelerator.weight_pullback(x, d, conn)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("fan_in, pack", [(1, 1), (8, 1), (130, 1), (1, 4), (8, 2), (130, 4)])
def test_each_chunk_of_own_pair_tiles_stages_its_own_connections_into_their_rows(fan_in,
                                                                                 pack):
    """Tiles that stage each chunk's own connections alone: every chunk's entries, read from
    that chunk's table into their staged rows (padding into the spare row, from the zero
    row), and summed over the chunks, give each staged row its connection's source row in
    connection order (packed: in its quarter) and zero elsewhere; ``nnz`` entries in all but
    the padding, each tile's a whole number of groups."""
    n, chunk = 300, 110  # chunks 110, 110, 80; 3 blocks of 128 targets
    rng = np.random.default_rng(0)
    pre = _in_output_order(n, fan_in, rng)
    tiles = pair_tiles(pre, n, n, fan_in, LANES, chunk, pack, own=True)
    every = pair_tiles(pre, n, n, fan_in, LANES, chunk, pack)  # the quarters: the same
    assert (tiles.chunks, tiles.blocks) == (3, 3) and tiles.groups.shape[0] == 9
    assert every.positions is None and tiles.source.shape == tiles.positions.shape
    width = tiles.width_cap
    spare = LANES * width
    v = rng.standard_normal(n) + 10.0  # no source reads zero
    staged_rows = np.zeros((tiles.blocks, spare + 1))  # a block's one tile, then the spare
    live = 0
    for c in range(tiles.chunks):
        size = min(chunk, n - c * chunk)
        quarter = tiles.quarter or size
        sources = np.concatenate([v[c * chunk:c * chunk + size], np.zeros(pack * quarter - size)])
        table = np.concatenate([sources.reshape(pack, quarter).T, np.zeros((8, pack))])
        table = np.concatenate([table, np.zeros((len(table), 1))], axis=1)  # quarter P: none
        for b in range(tiles.blocks):
            cell = c * tiles.blocks + b
            count = int(tiles.groups[cell, 0]) * 8  # one tile a block
            index, at = tiles.source[cell, :count], tiles.positions[cell, :count]
            assert index.min() >= 0 and index.max() <= (tiles.quarter or size)
            assert (tiles.source[cell, count:] == (tiles.quarter or size)).all()  # padding
            assert (tiles.positions[cell, count:] == spare).all()
            live += int((at < spare).sum())
            assert len(np.unique(at[at < spare])) == (at < spare).sum()  # each row once
            own = np.zeros(count, np.int64) if pack == 1 else np.minimum(
                every.quarters[cell].reshape(-1)[np.minimum(at, spare - 1)], pack)
            np.add.at(staged_rows[b], at, np.where(at < spare, table[index, own], 0.0))
    assert live == n * fan_in
    want = np.zeros((tiles.blocks * LANES, width))
    want[:n, :fan_in] = v[pre].reshape(n, fan_in)
    np.testing.assert_array_equal(staged_rows[:, :spare], want.reshape(tiles.blocks, -1))


def _gathers(jaxpr) -> list[tuple]:
    """The shapes of the XLA gathers in ``jaxpr`` and the programs it calls (not inside a
    Pallas kernel)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
            found.append(eqn.outvars[0].aval.shape)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", param)
            if isinstance(sub, jax.extend.core.Jaxpr):
                found += _gathers(sub)
    return found


def _uniform_connectivity(n: int, fan_in: int, seed: int) -> Connectivity:
    pre = _in_output_order(n, fan_in, np.random.default_rng(seed))
    return Connectivity.from_indices(pre, np.repeat(np.arange(n), fan_in), n, n)


@pytest.mark.parametrize("kernels, chunk", [("staged", 40), ("packed", 10)])
def test_with_chunked_pair_the_pullback_over_several_chunks_gathers_nothing(monkeypatch,
                                                                            kernels, chunk):
    """A TPU's program (``interpret=False``) of the weight pullback at 3 chunks (packed: of 4
    sources per table row): with :data:`CHUNKED_PAIR` the staged pair-sum, one call per
    chunk, and no XLA gather; without it (negative control) the cells' pair-sum and a gather
    of all ``nnz`` values into connection order."""
    conn = _uniform_connectivity(100, 8, 0)
    monkeypatch.setattr(tpu, "interpreting", lambda: False)
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "CHUNK_ROWS", chunk)
    x, d = jnp.ones((3, conn.num_in)), jnp.ones((3, conn.num_out))
    staged_calls, kernel = [], staged.pair_sum
    monkeypatch.setattr(staged, "pair_sum",
                        lambda *a, **k: (staged_calls.append(1), kernel(*a, **k))[1])
    programs = {}
    for flag in (False, True):
        monkeypatch.setattr(tpu, "CHUNKED_PAIR", flag)
        with formulation("pallas"):
            programs[flag] = jax.make_jaxpr(lambda x, d: tpu.weight_pullback(x, d, conn))(x, d)
        assert len(staged_calls) == flag  # the staged pair-sum only with the flag
    pack = tpu.packing(3)
    assert pack == {"staged": 1, "packed": 4}[kernels]
    assert tpu.staged_tiles(conn, "pair", pack).chunks == 3
    calls = {flag: [e for e in p.jaxpr.eqns if e.primitive.name == "pallas_call"]
             for flag, p in programs.items()}
    assert len(calls[True]) == 3 and len(calls[False]) == -(-100 // chunk)  # one per chunk
    assert all(e.params["interpret"] is False for e in calls[True])  # the chip's program
    assert (conn.nnz,) in _gathers(programs[False].jaxpr)
    assert _gathers(programs[True].jaxpr) == []


@pytest.mark.parametrize("kernels, chunk, pack, own", [
    ("staged", 5, 1, False), ("packed", 2, 4, False), ("staged", 5, 1, True),
    ("packed", 2, 4, True)])
def test_layer_gradients_through_the_chunked_pair_sum_equal_the_xla_formulation(
        monkeypatch, kernels, chunk, pack, own):
    """ES-D-RTRL's gradients of a spiking network with a uniform sparse recurrence over
    several source chunks (``'staged'``: 3 of 5, 5, 4 neurons; ``'packed'``: 2 of 7, four
    sources per table row, quarters of 2), its weight pullback (the block product) through
    the chunked staged pair-sum (``own``: each chunk's call staging its own connections,
    :data:`~braintrace._primitives._sparse_tpu.OWN_CHUNK_PAIR`), equal those through XLA's
    formulation."""
    monkeypatch.setattr(tpu, "KERNELS", kernels)
    monkeypatch.setattr(tpu, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(tpu, "CHUNKED_PAIR", True)
    monkeypatch.setattr(tpu, "OWN_CHUNK_PAIR", own)
    uniform = _uniform_connectivity(14, 3, 2)
    gradients = _es_d_rtrl_gradients(test_sparse_pallas._network(3, uniform), 3)
    with formulation("accelerator"):
        want = gradients()
    calls = []
    kernel = staged.pair_sum  # count the kernel's calls and their tiles as they are traced
    monkeypatch.setattr(staged, "pair_sum",
                        lambda *a, **k: (calls.append((a[0].shape[0], a[2])), kernel(*a, **k))[1])
    with formulation("pallas"):
        got = gradients()
    assert calls  # the weight pullback ran the chunked pair-sum
    assert all(t.pack == pack and t.chunks == (3 if pack == 1 else 2)
               and (t.positions is not None) == own for _, t in calls)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
