"""FlatMap: a constant index map runs as reshape/transpose/broadcast where it is affine, and
always gives the gather's values (and its transpose's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from braintrace._compiler._index_maps import FlatMap


def gather(values, index):
    """The gather in NumPy: position ``i`` reads ``values[index[i]]``, or 0 where it is -1."""
    return np.where((index >= 0)[:, None], values[np.maximum(index, 0)], 0)


def gather_transpose(cotangent, index, source_size):
    """The gather's transpose in NumPy: each source position sums the cotangents that read it."""
    out = np.zeros((source_size, *cotangent.shape[1:]), cotangent.dtype)
    np.add.at(out, index[index >= 0], cotangent[index >= 0])
    return out


def check_against_gather(index, source_size):
    rng = np.random.default_rng(0)
    m = FlatMap.of(index, source_size)
    values = rng.standard_normal((source_size, 2)).astype(np.float32)
    cotangent = rng.standard_normal((index.size, 2)).astype(np.float32)
    # one program for the three (eager, each reshape or transpose would compile on its own)
    taken, taken_large, summed = jax.jit(lambda v, c: (m.take(v), m.take(v, feeds_large=True),
                                                       m.sum_into(c)))(values, cotangent)
    np.testing.assert_array_equal(taken, gather(values, index))
    np.testing.assert_array_equal(taken_large, gather(values, index))
    np.testing.assert_allclose(summed, gather_transpose(cotangent, index, source_size),
                               rtol=1e-6, atol=1e-6)
    return m


def test_the_numpy_oracles_are_the_gather_and_its_vjp():
    index, size = np.array([2, -1, 0, 2, 1]), 3
    values = np.random.default_rng(1).standard_normal((size, 2)).astype(np.float32)
    cotangent = np.random.default_rng(2).standard_normal((index.size, 2)).astype(np.float32)
    jax_gather = lambda v: jnp.where((index >= 0)[:, None], v[np.maximum(index, 0)], 0)
    y, pull = jax.vjp(jax_gather, jnp.asarray(values))
    np.testing.assert_array_equal(gather(values, index), y)
    np.testing.assert_allclose(gather_transpose(cotangent, index, size),
                               pull(jnp.asarray(cotangent))[0], rtol=1e-6)


@st.composite
def affine_maps(draw):
    """A source of 1-3 axes, read through a permutation, reversals and up to two broadcasts."""
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    source = np.arange(int(np.prod(dims))).reshape(dims)
    order = draw(st.permutations(range(len(dims))))
    view = np.transpose(source, order)
    for axis in range(view.ndim):
        if draw(st.booleans()):
            view = np.flip(view, axis)
    for _ in range(draw(st.integers(0, 2))):
        axis = draw(st.integers(0, view.ndim))
        view = np.repeat(np.expand_dims(view, axis), draw(st.integers(1, 3)), axis=axis)
    return view.reshape(-1).copy(), source.size


@settings(max_examples=60, deadline=None)
@given(affine_maps())
def test_an_affine_map_is_a_reshape_with_the_gathers_values(case):
    index, size = case
    m = check_against_gather(index, size)
    assert m.is_reshape


@pytest.mark.parametrize("index, size", [
    (np.array([2, 0, 1, 3]), 4),                 # a permutation that is no transpose
    (np.array([0, -1, 2, 3]), 4),                # a masked position
    (np.arange(3), 4),                           # a source position nobody reads
    (np.arange(1, 4), 4),                        # an offset
    (np.array([0, 1, 2, 0, 1]), 3),              # runs that do not tile the positions
    (np.add.outer(np.arange(3), np.arange(3)).reshape(-1), 5),  # two axes of one stride
])
def test_other_maps_keep_the_gather(index, size):
    m = check_against_gather(index, size)
    assert not m.is_reshape


def test_a_gru_gates_map_is_a_reshape():
    # y[b, g*H + j] reads unit (b, j) of colour 2 - g, as the compiler colours a GRU's gates
    batch, hidden, gates = 3, 5, 3
    b, g, j = np.meshgrid(np.arange(batch), np.arange(gates), np.arange(hidden), indexing="ij")
    index = ((gates - 1 - g) * batch * hidden + b * hidden + j).reshape(-1)
    assert check_against_gather(index, gates * batch * hidden).is_reshape


def test_only_the_in_order_map_is_the_identity():
    assert FlatMap.of(np.arange(6), 6).is_identity
    assert not FlatMap.of(np.arange(6)[::-1].copy(), 6).is_identity
    assert not FlatMap.of(np.arange(6).reshape(2, 3).T.reshape(-1), 6).is_identity
    assert not FlatMap.of(np.arange(6), 7).is_identity
