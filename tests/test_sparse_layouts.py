"""The sparse primitive's internal layouts, each against a dense oracle (float64).

A connectivity is grouped by output (ELL, ``_sparse_kernels.py``) in one of three
ways, or not at all; every way must give the masked dense map ``y = x W``:

* ``in_order``: ``post = repeat(arange(O), F)``, the weights are the table itself;
* ``permuted``: one fan-in for all outputs, connections in another order;
* ``padded``: uneven fan-ins, short rows padded;
* ``ungrouped``: one output takes every input, padding would exceed ``MAX_FILL``:
  gathers and a ``segment_sum``;
* ``odd``: a connection list as it may come: unsorted, repeated pairs, inputs and
  outputs that no connection touches, more different fan-ins and fan-outs than
  ``MAX_SLICES`` (the accelerators' tables round them up to a ladder of widths).

Checked for each: the forward; ``xy_to_dw`` (``(xᵀ d)[pre, post]``); ``dt_to_t``
and ``contract``; ``jax.vjp`` with respect to ``x`` and ``w`` (the primitive's
own transposes); ``jax.jvp``; ``vmap`` over the weights. Row counts above
``ROW_GROUP`` run the looped sums, fan-ins above ``SLOT_GROUP`` several slot groups. And the
two claims of the kernels: no ``rows × nnz`` temporary in the pullback, no
scatter in the gradient with respect to ``x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._primitives._sparse import SPARSE_RULES, Connectivity
from braintrace._primitives._sparse_kernels import ROW_GROUP, SLOT_GROUP
from braintrace._primitives._sparse_slices import MAX_SLICES


def _in_order(rng):
    num_in, num_out, fan_in = 9, 5, 3
    pre = np.concatenate([rng.choice(num_in, fan_in, replace=False) for _ in range(num_out)])
    return Connectivity.from_indices(pre, np.repeat(np.arange(num_out), fan_in), num_in,
                                     num_out)


def _permuted(rng):
    conn = _in_order(rng)
    order = rng.permutation(conn.nnz)
    return Connectivity.from_indices(conn.pre[order], conn.post[order], conn.num_in,
                                     conn.num_out)


def _padded(rng):
    mask = rng.random((7, 6)) < 0.5
    mask[0, :] = True  # no empty output
    return Connectivity.from_mask(mask)


def _ungrouped(rng):
    del rng
    num_in, num_out = 8, 6
    pre = np.concatenate([np.arange(num_in), [0, 1, 2, 3, 4]])
    post = np.concatenate([np.zeros(num_in, int), [1, 2, 3, 4, 5]])
    return Connectivity.from_indices(pre, post, num_in, num_out)


def _wide(rng):
    """Fan-in above ``SLOT_GROUP``: more than two slot groups."""
    num_in, num_out, fan_in = 3 * SLOT_GROUP + 5, 3, 2 * SLOT_GROUP + 4
    pre = np.concatenate([rng.choice(num_in, fan_in, replace=False) for _ in range(num_out)])
    return Connectivity.from_indices(pre, np.repeat(np.arange(num_out), fan_in), num_in,
                                     num_out)


def _odd(rng):
    """16 units to 16: fan-ins 0, 1, …, 11, 0, 1, 2, 3 (outputs 0 and 12 reached by none),
    inputs 14 and 15 unused, four pairs listed twice, the list shuffled."""
    num_in = num_out = 16
    fan_in = np.arange(num_out) % 12
    pre = np.concatenate([rng.choice(14, f, replace=False) for f in fan_in])
    post = np.repeat(np.arange(num_out), fan_in)
    pre, post = np.concatenate([pre, pre[-4:]]), np.concatenate([post, post[-4:]])
    order = rng.permutation(pre.size)
    return Connectivity(pre[order], post[order], num_in, num_out)


KINDS = {"in_order": _in_order, "permuted": _permuted, "padded": _padded,
         "ungrouped": _ungrouped, "wide": _wide, "odd": _odd}
ROWS = (1, 3, 2 * ROW_GROUP + 3)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _case(kind: str, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    conn = KINDS[kind](rng)
    weight = jnp.asarray(rng.standard_normal(conn.nnz))
    dense = np.zeros((conn.num_in, conn.num_out))
    np.add.at(dense, (conn.pre, conn.post), np.asarray(weight))  # repeated pairs add
    x = jnp.asarray(rng.standard_normal((rows, conn.num_in)))
    d = jnp.asarray(rng.standard_normal((rows, conn.num_out)))
    return conn, weight, jnp.asarray(dense), x, d


def test_each_connectivity_takes_its_layout():
    rng = np.random.default_rng(0)
    assert KINDS["in_order"](rng).in_output_order
    permuted = KINDS["permuted"](rng)
    assert permuted.by_output is not None and not permuted.by_output.padded
    assert not permuted.in_output_order
    assert KINDS["padded"](rng).by_output.padded
    assert KINDS["ungrouped"](rng).by_output is None
    assert KINDS["wide"](rng).by_output.width > 2 * SLOT_GROUP
    odd = KINDS["odd"](rng)
    assert np.unique(odd.pre * odd.num_out + odd.post).size < odd.nnz  # repeated pairs
    fan_in, fan_out = (np.bincount(a, minlength=n) for a, n in
                       ((odd.post, odd.num_out), (odd.pre, odd.num_in)))
    assert fan_in.min() == 0 and fan_out.min() == 0
    assert np.unique(fan_in).size > MAX_SLICES  # the accelerators' widths on a ladder
    assert len(odd.incoming.items) < np.unique(fan_in[fan_in > 0]).size
    assert odd.incoming.order is not None and odd.outgoing.order is not None


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_pullback_equal_the_masked_dense_map(x64, kind, rows):
    conn, weight, dense, x, d = _case(kind, rows)
    np.testing.assert_allclose(braintrace.sparse_matmul(x, weight, conn), x @ dense,
                               rtol=1e-12, atol=1e-12)
    dw = SPARSE_RULES.xy_to_dw(x, d, {"weight": weight}, connectivity=conn)["weight"]
    np.testing.assert_allclose(dw, (x.T @ d)[conn.pre, conn.post], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_trace_rules_scale_each_connection_by_its_output(x64, kind, rows):
    conn, _, _, _, d = _case(kind, rows)
    trace = jnp.asarray(np.random.default_rng(1).standard_normal((rows, conn.nnz)))
    expected = trace * d[:, conn.post]
    scaled = SPARSE_RULES.dt_to_t(d, {"weight": trace}, connectivity=conn)["weight"]
    np.testing.assert_allclose(scaled, expected, rtol=1e-12)
    summed = SPARSE_RULES.contract(d, {"weight": trace}, connectivity=conn)["weight"]
    np.testing.assert_allclose(summed, expected.sum(0), rtol=1e-12, atol=1e-12)
    one = SPARSE_RULES.contract(d[0], {"weight": trace[0]}, connectivity=conn)["weight"]
    np.testing.assert_allclose(one, expected[0], rtol=1e-12)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_derivatives_equal_the_dense_map(x64, kind, rows):
    conn, weight, dense, x, d = _case(kind, rows)
    sparse = lambda x, w: braintrace.sparse_matmul(x, w, conn)
    tx, tw = jnp.ones_like(x), jnp.linspace(-1.0, 1.0, conn.nnz)

    @jax.jit  # one program for the four derivatives (eager, each op compiles on its own)
    def derivatives(x, weight, d):
        _, pull = jax.vjp(sparse, x, weight)
        _, ty = jax.jvp(sparse, (x, weight), (tx, tw))
        second = jax.grad(lambda w: jnp.sum(jax.grad(lambda x: jnp.sum(sparse(x, w) ** 2))(x)))
        return (*pull(d), ty, second(weight))

    dx, dw, ty, second = derivatives(x, weight, d)
    np.testing.assert_allclose(dx, d @ dense.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, (x.T @ d)[conn.pre, conn.post], rtol=1e-12, atol=1e-12)
    t_dense = jnp.zeros_like(dense).at[conn.pre, conn.post].add(tw)
    np.testing.assert_allclose(ty, tx @ dense + x @ t_dense, rtol=1e-12, atol=1e-12)
    dense_second = jax.grad(lambda m: jnp.sum(jax.grad(lambda x: jnp.sum((x @ m) ** 2))(x)))
    np.testing.assert_allclose(second, dense_second(dense)[conn.pre, conn.post],
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_over_weights_and_inputs(x64, kind):
    conn, weight, dense, x, _ = _case(kind, 3)
    weights = jnp.stack([weight, 2.0 * weight])
    with pytest.warns(UserWarning, match="decomposed into plain JAX ops"):  # the ETP primitive's
        per_weight = jax.vmap(lambda w: braintrace.sparse_matmul(x, w, conn))(weights)
    np.testing.assert_allclose(per_weight, jnp.stack([x @ dense, 2.0 * x @ dense]), rtol=1e-12)
    per_sample = jax.vmap(lambda x: braintrace.sparse_matmul(x, weight, conn))(x)
    np.testing.assert_allclose(per_sample, x @ dense, rtol=1e-12, atol=1e-12)


def test_inputs_of_other_dtypes_compute_in_the_weights_dtype(x64):
    conn, weight, dense, x, _ = _case("padded", 3)
    spikes = x > 0
    y = braintrace.sparse_matmul(spikes, weight.astype(jnp.float32), conn)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, spikes.astype(jnp.float64) @ dense, rtol=1e-6, atol=1e-6)


def test_pullback_over_many_rows_makes_no_rows_by_nnz_temporary():
    """A block of steps (``rows`` large) must not materialise ``rows × nnz`` products."""
    rng = np.random.default_rng(0)
    num, fan_in, rows = 2048, 8, 128
    pre = np.concatenate([rng.choice(num, fan_in, replace=False) for _ in range(num)])
    conn = Connectivity.from_indices(pre, np.repeat(np.arange(num), fan_in), num, num)
    assert rows * conn.nnz < num * num  # not the dense-like (xᵀ d)[pre, post] branch
    x, d = (jax.ShapeDtypeStruct((rows, num), jnp.float32) for _ in range(2))
    weight = jax.ShapeDtypeStruct((conn.nnz,), jnp.float32)
    pull = jax.jit(lambda x, d, w: SPARSE_RULES.xy_to_dw(x, d, {"weight": w},
                                                         connectivity=conn)["weight"])
    temp = pull.lower(x, d, weight).compile().memory_analysis().temp_size_in_bytes
    assert temp < rows * conn.nnz * 4 / 8, temp


def test_gradient_with_respect_to_x_gathers_and_does_not_scatter():
    conn, *_ = _case("permuted", 3)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(braintrace.sparse_matmul(x, w, conn) ** 2)))
    hlo = grad.lower(jnp.ones((3, conn.num_in)), jnp.ones(conn.nnz)).as_text()
    assert "scatter" not in hlo and "gather" in hlo
