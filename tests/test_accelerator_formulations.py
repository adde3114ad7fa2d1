"""The formulations chosen for accelerators, against the CPU ones and dense oracles (float64).

``braintrace._platform.by_platform`` keeps two formulations of one computation and lets
the lowering pick one. The CPU suite runs the accelerator formulation too
(``formulation('accelerator')``), so every one is checked here:

* the sparse sums of ``_sparse_accelerator.py`` (product, the cotangent of ``x``, the
  weight pullback over few and many rows and over groups of rows, ``contract``) against the
  masked dense map, for every connectivity layout;
* a hidden map spread by reshapes (``FlatMap``), a broadcast or tiled, equals its gather;
* whole learners (D-RTRL and ES-D-RTRL, blocked and per step, on a GRU and on the sparse
  ALIF network of ``benchmarks/scale.py``, and BPTT through the sparse layer) give the same
  gradients under both formulations;
* a program lowered for a TPU holds only the accelerator formulation (cross-platform
  lowering, no TPU needed): no element gathers in a GRU's D-RTRL step, no slot loop in the
  sparse product, no product over the stacked steps in ES-D-RTRL's block, one product per
  weight and step in the per-step ES-D-RTRL, the block's output side stacked steps second;
* loops running several steps per iteration (as on accelerators) give the same gradients.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import built_on_the_host, mse
from test_sparse_layouts import KINDS, _case

import braintrace
from braintrace import layers
from braintrace._compiler._index_maps import FlatMap
from braintrace._platform import by_platform, formulation
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives._rules import sum_leading
from braintrace._primitives._sparse import SPARSE_RULES, Connectivity

TOL = 1e-12


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_by_platform_runs_one_formulation_per_lowering():
    pick = by_platform(cpu=lambda a: a + 1.0, accelerator=lambda a: a - 1.0)
    traced = jax.jit(pick).trace(jnp.zeros(()))
    by_backend = 1.0 if jax.default_backend() == "cpu" else -1.0
    assert float(jax.jit(pick)(jnp.zeros(()))) == by_backend
    assert "subtract" in traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "subtract" not in traced.lower(lowering_platforms=("cpu",)).as_text()
    with formulation("accelerator"):
        assert float(jax.jit(pick)(jnp.zeros(()))) == -1.0
    assert float(jax.jit(pick)(jnp.zeros(()))) == by_backend  # nothing traced inside is reused
    with pytest.raises(ValueError, match="formulation must be one of"):
        with formulation("gpu"):
            pass


@pytest.mark.parametrize("rows", (3, 19))
@pytest.mark.parametrize("kind", KINDS)
def test_accelerator_sparse_sums_equal_the_dense_map(x64, monkeypatch, kind, rows):
    conn, weight, dense, x, d = _case(kind, rows)

    def sums(x, d, weight):  # one program each: eager, every op would compile on its own
        return (accelerator.product(x, weight, conn),
                accelerator.transposed_product(d, weight, conn),
                accelerator.weight_pullback(x, d, conn))

    expected = (x @ dense, d @ dense.T, (x.T @ d)[conn.pre, conn.post])
    for got, want in zip(jax.jit(sums)(x, d, weight), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    # each sum over groups of a few target rows or connections (a loop)
    monkeypatch.setattr(accelerator, "GATHER_BUDGET", 3 * rows * x.dtype.itemsize)
    for got, want in zip(jax.jit(sums)(x, d, weight), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_sums_padded_to_tpu_lanes_equal_the_dense_map(x64, monkeypatch, kind):
    """The TPU's form of each sum (rows padded with zeros to 128 values) gives the dense
    map's values, in one call and over groups (a loop)."""
    rows = 5
    conn, weight, dense, x, d = _case(kind, rows)
    lanes = accelerator.TPU_LANES

    def sums(x, d, weight):
        return (accelerator._product(x, weight, conn, lanes),
                accelerator._transposed_product(d, weight, conn, lanes),
                accelerator._weight_pullback(x, d, conn, lanes))

    expected = (x @ dense, d @ dense.T, (x.T @ d)[conn.pre, conn.post])
    for budget in (accelerator.GATHER_BUDGET, 3 * rows * x.dtype.itemsize):
        monkeypatch.setattr(accelerator, "GATHER_BUDGET", budget)
        for got, want in zip(jax.jit(sums)(x, d, weight), expected, strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_sparse_sums_lowered_for_a_tpu_gather_whole_lane_rows():
    """Lowered for a TPU, the sums gather rows of 128 values (``R = 5`` padded); lowered for
    another accelerator, rows of ``R`` (the negative control)."""
    conn, weight, _, x, d = _case("odd", 5)

    def sums(x, d, weight):
        return (accelerator.product(x, weight, conn),
                accelerator.transposed_product(d, weight, conn),
                accelerator.weight_pullback(x, d, conn))

    traced = jax.jit(sums).trace(x, d, weight)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    lane_rows = f"x{accelerator.TPU_LANES}xf32>"
    wide = lambda text: [line for line in text.splitlines()
                         if "stablehlo.gather" in line and lane_rows in line]
    assert wide(tpu) and not wide(gpu)


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_rules_agree_under_both_formulations(x64, kind):
    conn, weight, _, x, d = _case(kind, 5)
    trace = jnp.asarray(np.random.default_rng(1).standard_normal((5, conn.nnz)))
    theta = {"weight": weight}

    @jax.jit
    def rules(x, d, trace, weight):
        pull = jax.vjp(lambda x, w: braintrace.sparse_matmul(x, w, conn), x, weight)[1](d)
        return (SPARSE_RULES.xy_to_dw(x, d, theta, connectivity=conn)["weight"],
                SPARSE_RULES.contract(d, {"weight": trace}, connectivity=conn)["weight"],
                sum_leading(d), *pull)

    on_cpu = rules(x, d, trace, weight)
    with formulation("accelerator"):
        on_accelerator = jax.jit(rules.__wrapped__)(x, d, trace, weight)
    for a, b in zip(on_cpu, on_accelerator, strict=True):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(on_cpu[1], (trace * d[:, conn.post]).sum(0), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("index, source", [
    (np.tile(np.arange(4), 3), 4),                                   # a GRU's fused gates
    (np.arange(12).reshape(3, 4).T.reshape(-1), 12),                 # a transpose
    (np.repeat(np.arange(4), 2), 4),                                 # each unit twice
    ((np.arange(6)[:, None] * 4 + np.tile(np.arange(4), 3)[None]).reshape(-1), 24),  # per sample
    (np.tile(np.repeat(np.arange(3), 2), 3), 3),                     # repeated outside and in
    (np.tile(np.arange(3), 20), 3),                                  # many copies: broadcast
])
def test_spread_hidden_map_equals_its_gather(x64, index, source):
    """Both reshape forms, the broadcast (the CPU's) and the tiled one (accelerators')."""
    flat = FlatMap.of(index, source)
    assert flat.is_reshape and not flat.is_identity
    values = jnp.asarray(np.random.default_rng(0).standard_normal((source, 2)))
    np.testing.assert_array_equal(flat._spread(values), flat._gather(values))
    np.testing.assert_array_equal(flat._tiled(values), flat._gather(values))
    np.testing.assert_array_equal(flat.take(values, feeds_large=True), flat._gather(values))
    with formulation("accelerator"):
        np.testing.assert_array_equal(jax.jit(flat.take)(values), flat._gather(values))


def test_gru_gates_map_lowered_for_a_tpu_concatenates_whole_rows():
    """A GRU's ``(B, H) -> (B, 3H)`` map: copies concatenated along ``H`` for a TPU, a
    broadcast over a ``(B, 3, H)`` array on the CPU (the negative control)."""
    batch, hidden = 2, 4
    index = (np.arange(batch)[:, None] * hidden + np.tile(np.arange(hidden), 3)[None]).reshape(-1)
    flat = FlatMap.of(index, batch * hidden)
    assert flat.repeats_outside
    traced = jax.jit(flat.take).trace(jnp.ones((batch * hidden, 1)))
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "stablehlo.concatenate" in tpu and "stablehlo.concatenate" not in cpu
    assert "tensor<2x3x4x1xf32>" in cpu and "tensor<2x3x4x1xf32>" not in tpu


@built_on_the_host
def _gru(batch: int):
    model = layers.Stateful(layers.GRUCell(3, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64))
    braintrace.init_states(model, batch)
    return model


def _lif(batch: int):
    """A dense layer into LIF neurons into a readout, float64: one state per unit."""
    rngs, f64 = nnx.Rngs(0), {"param_dtype": jnp.float64}
    model = nnx.Sequential(layers.ETPLinear(3, 6, rngs=rngs, **f64), layers.LIF(6, **f64),
                           layers.ETPLinear(6, 5, rngs=rngs, **f64))
    braintrace.init_states(model, batch)
    return model


@built_on_the_host
def _sparse_alif(batch: int, connectivity: Connectivity | None = None):
    """``benchmarks/scale.py``'s model at 24 neurons: dense input, sparse recurrence, ALIF
    (or at ``connectivity.num_in`` neurons, with that recurrence)."""
    if connectivity is None:
        n, degree = 24, 3
        rng = np.random.default_rng(0)
        pre = np.concatenate([rng.choice(n, degree, replace=False) for _ in range(n)])
        connectivity = Connectivity.from_indices(pre, np.repeat(np.arange(n), degree), n, n)
    n = connectivity.num_in

    class SparseALIF(nnx.Module):
        def __init__(self, rngs):
            self.inp = layers.ETPLinear(4, n, rngs=rngs, param_dtype=jnp.float64)
            self.rec = layers.ETPSparseLinear(n, n, connectivity=connectivity, use_bias=False,
                                              rngs=rngs, param_dtype=jnp.float64)
            self.neuron = layers.ALIF(n, param_dtype=jnp.float64)
            self.readout = layers.LeakyReadout(n, 2, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.readout(self.neuron(self.inp(x) + 4.0 * self.rec(self.neuron.spikes())))

    model = SparseALIF(nnx.Rngs(0))
    braintrace.init_states(model, batch)
    return model


@pytest.mark.parametrize("method", ["d_rtrl", "es_d_rtrl", "d_rtrl@1", "es_d_rtrl@1", "bptt"])
@pytest.mark.parametrize("make", [_gru, _sparse_alif], ids=["gru", "sparse-alif"])
def test_learners_give_the_same_gradients_under_both_formulations(x64, make, method):
    name, _, block = method.partition("@")
    batch, steps = 2, 7
    rng = np.random.default_rng(3)
    model = make(batch)
    example = jnp.zeros((batch, 4 if make is _sparse_alif else 3))
    xs = jnp.asarray(2.0 * rng.standard_normal((steps, *example.shape)))
    ys = jnp.asarray(rng.standard_normal((steps, batch, 2 if make is _sparse_alif else 5)))

    def gradients():
        learner = braintrace.compile(nnx.clone(model), name, example, batch_size=batch)
        grads = learner.etrace_grad(xs, ys, mse, block_size=int(block) if block else None)
        return jax.tree.leaves(grads)

    on_cpu = gradients()
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in on_cpu)  # a live reference
    with formulation("accelerator"):
        on_accelerator = gradients()
    for a, b in zip(on_cpu, on_accelerator, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)


def _lowered_for_tpu(learner, xs, ys, block_size):
    from braintrace._drivers._programs import GRAD_PROGRAM

    entry, spec, args = learner._grad_call(xs, ys, mask=None, chunk_size=None,
                                           block_size=block_size, reduction="mean",
                                           signal_inputs={})
    traced = GRAD_PROGRAM.trace(entry, mse, spec, *args)
    return (traced.lower(lowering_platforms=("cpu",)).as_text(),
            traced.lower(lowering_platforms=("tpu",)).as_text())


def test_gru_d_rtrl_step_lowered_for_a_tpu_spreads_its_gates_without_gathers():
    """The per-step D-RTRL update maps ``D`` from hidden units to the ``(in, 3h)`` kernel's
    outputs: a gather on the CPU (measured faster there), reshapes for a TPU."""
    batch = 4
    model = layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, batch)
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((batch, 3)), batch_size=batch)
    xs, ys = jnp.ones((4, batch, 3)), jnp.zeros((4, batch, 8))
    cpu, tpu = _lowered_for_tpu(learner, xs, ys, block_size=1)
    assert "stablehlo.gather" in cpu  # the negative control: the CPU formulation gathers
    assert "stablehlo.gather" not in tpu


def test_per_step_es_lowered_for_a_tpu_takes_one_product_per_weight_and_step():
    """Per step, ES-D-RTRL's temporal term ``xy_to_dw(ε_x, d)`` and the weight's same-step
    share ``xy_to_dw(x, dy)`` are one product over the rows of both for a TPU; two on the
    CPU (the negative control). A GRU's two kernels, ``(3, 24)`` and ``(8, 24)``."""
    batch = 4
    model = layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, batch)
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((batch, 3)), batch_size=batch)
    xs, ys = jnp.ones((4, batch, 3)), jnp.zeros((4, batch, 8))
    cpu, tpu = _lowered_for_tpu(learner, xs, ys, block_size=1)

    def kernel_products(text):
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        return [sum(f"-> tensor<{shape}xf32>" in line for line in dots)
                for shape in ("3x24", "8x24")]

    assert kernel_products(cpu) == [2, 2]
    assert kernel_products(tpu) == [1, 1]


def _group_steps(monkeypatch, rule) -> None:
    """Sets how many steps the loops run per iteration (``_groups.step_group``), in the
    module whose ``scan_grouped`` the loops call: collecting ``_groups.py``'s doctests may
    load that file a second time, and patching the second copy would change nothing."""
    from braintrace._loops import _blocked

    monkeypatch.setitem(_blocked.scan_grouped.__globals__, "step_group", rule)


def test_blocked_es_stacks_its_output_side_steps_second(monkeypatch):
    """Grouped as on accelerators (8 steps per iteration), the blocked ES-D-RTRL loop stacks
    each group's output-side values (a GRU's ``dy`` and ``d``, ``(4, 24)`` per step) along
    the second axis, ``(4, 8, 24)``: XLA then keeps the steps one after another in the
    block's buffer, which the decayed sums reorder once per block (``_groups.stack_group``).
    The inputs' stacks (``x`` ``(4, 3)``, ``h`` ``(4, 8)``) keep the steps first (the
    control)."""
    _group_steps(monkeypatch, lambda length: min(length, 8))
    batch = 4
    model = layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, batch)
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((batch, 3)), batch_size=batch)
    _, tpu = _lowered_for_tpu(learner, jnp.ones((16, batch, 3)), jnp.zeros((16, batch, 8)),
                              block_size=16)
    stacks = [line.split("->")[-1].strip() for line in tpu.splitlines()
              if "stablehlo.concatenate" in line]
    assert stacks.count("tensor<4x8x24xf32>") == 4  # dy and d of both kernels
    assert "tensor<8x4x24xf32>" not in stacks
    assert "tensor<8x4x3xf32>" in stacks and "tensor<8x4x8xf32>" in stacks


def test_blocked_loops_stack_values_of_one_state_per_unit_without_the_unit_axes(x64,
                                                                               monkeypatch):
    """Grouped as on accelerators, D-RTRL's blocks on LIF neurons stack ``Df`` ``(B, N, 1)``
    and ``D`` ``(B, N, 1, 1)`` per step as ``(8, B, N)`` groups: with the unit axes in the
    stack, XLA:TPU tiled it ``T(1,128)`` and copied the loop's whole buffer at every
    iteration (``_groups._without_unit_tail``). The stacked steps get their axes back after
    the loop (the gradients: ``test_loops_stacking_steps_in_groups_give_the_same_gradients``)."""
    _group_steps(monkeypatch, lambda length: min(length, 8))
    batch = 4
    model = _lif(batch)
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((batch, 3)), batch_size=batch)
    _, tpu = _lowered_for_tpu(learner, jnp.ones((16, batch, 3)), jnp.zeros((16, batch, 5)),
                              block_size=16)
    stacks = [line.split("->")[-1].strip() for line in tpu.splitlines()
              if "stablehlo.concatenate" in line]
    assert "tensor<8x4x6xf64>" in stacks
    assert not any(re.search(r"tensor<8x4x6(x1)+xf64>", t) for t in stacks), stacks


@pytest.mark.parametrize("kind", ["ungrouped", "odd"])
def test_sparse_sums_lowered_for_a_tpu_gather_and_never_scatter(kind):
    """The product, its two transposes, the trace rules and the event-driven path, on a
    connectivity the CPU sums with ``segment_sum`` and on a list as it may come."""
    conn, weight, _, x, d = _case(kind, 5)
    trace = jnp.ones((5, conn.nnz))

    def everything(x, weight, d, trace):
        y, pull = jax.vjp(lambda x, w: braintrace.sparse_matmul(x, w, conn), x, weight)
        return (y, *pull(d), SPARSE_RULES.xy_to_dw(x, d, {"weight": weight}, connectivity=conn),
                SPARSE_RULES.dt_to_t(d, {"weight": trace}, connectivity=conn),
                SPARSE_RULES.contract(d, {"weight": trace}, connectivity=conn),
                braintrace.sparse_matmul(x > 0, weight, conn, max_events=3))

    traced = jax.jit(everything).trace(x, weight, d, trace)
    assert "scatter" in traced.lower(lowering_platforms=("cpu",)).as_text()  # the control
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "scatter" not in tpu and "gather" in tpu


def test_sparse_network_lowered_for_a_tpu_never_scatters(x64):
    """A whole ES-D-RTRL update of the sparse ALIF network over a connection list as it may
    come: the exact learning signal's pullback, the block products, the loop (BPTT's
    backward pass is the product's two transposes, above)."""
    conn = KINDS["odd"](np.random.default_rng(0))
    batch = 2
    model = _sparse_alif(batch, conn)
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((batch, 4)), batch_size=batch)
    xs, ys = jnp.ones((3, batch, 4)), jnp.zeros((3, batch, 2))
    _, tpu = _lowered_for_tpu(learner, xs, ys, block_size=None)
    assert "scatter" not in tpu and "gather" in tpu


def test_sparse_event_path_on_accelerators_gives_the_event_values(x64):
    """On accelerators the event-driven path is the dense-input product: the same outputs,
    NaN likewise for a sample past ``max_events``."""
    conn, weight, _, x, _ = _case("odd", 4)
    spikes = (x > 0).at[0].set(True)  # sample 0: every input active, past max_events
    events = lambda spikes, weight: braintrace.sparse_matmul(spikes, weight, conn, max_events=10)
    on_cpu = jax.jit(events)(spikes, weight)
    with formulation("accelerator"):
        on_accelerator = jax.jit(events)(spikes, weight)
    assert np.all(np.isnan(on_cpu[0])) and np.all(np.isnan(on_accelerator[0]))
    assert np.all(np.isfinite(on_accelerator[1:]))
    np.testing.assert_allclose(on_accelerator, on_cpu, rtol=TOL, atol=TOL)


def test_sparse_product_lowered_for_a_tpu_has_no_slot_loop():
    conn = Connectivity.from_indices(np.arange(64) % 16, np.repeat(np.arange(16), 4), 16, 16)
    fn = jax.jit(lambda x, w: braintrace.sparse_matmul(x, w, conn))
    traced = fn.trace(jnp.ones((8, 16)), jnp.ones(conn.nnz))
    assert "stablehlo.while" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.while" not in traced.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("make, method, block_size",
                         [(_gru, "d_rtrl", 16), (_sparse_alif, "es_d_rtrl", 16),
                          (_gru, "es_d_rtrl", 1), (_lif, "d_rtrl", 16)],
                         ids=["gru-d_rtrl", "sparse-alif-es_d_rtrl", "gru-es_d_rtrl@1",
                              "lif-d_rtrl"])
def test_loops_stacking_steps_in_groups_give_the_same_gradients(x64, monkeypatch, make, method,
                                                                block_size):
    """Accelerators run a loop's steps 8 per iteration (``_groups.step_group``), a short
    block all at once; the CPU one. Blocks of 16 steps (two groups) and a last one of 5 (one
    group), and the per-step loop over 21 steps (three groups of 7), both ways, float64."""
    from braintrace._loops import _groups

    if jax.default_backend() == "cpu":
        assert _groups.step_group(16) == 1

    batch, steps = 2, 21
    rng = np.random.default_rng(4)
    model = make(batch)
    example = jnp.zeros((batch, 4 if make is _sparse_alif else 3))
    xs = jnp.asarray(2.0 * rng.standard_normal((steps, *example.shape)))
    ys = jnp.asarray(rng.standard_normal((steps, batch, 2 if make is _sparse_alif else 5)))

    def gradients():
        jax.clear_caches()
        learner = braintrace.compile(nnx.clone(model), method, example, batch_size=batch)
        return jax.tree.leaves(learner.etrace_grad(xs, ys, mse, block_size=block_size))

    _group_steps(monkeypatch, lambda length: 1)
    one_by_one = gradients()
    _group_steps(monkeypatch, lambda length: {16: 8, 21: 7}.get(length, length))
    grouped = gradients()
    for a, b in zip(one_by_one, grouped, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
