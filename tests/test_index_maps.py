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
    return jnp.where((index >= 0)[:, None], values[np.maximum(index, 0)], 0)


def check_against_gather(index, source_size):
    rng = np.random.default_rng(0)
    m = FlatMap.of(index, source_size)
    values = jnp.asarray(rng.standard_normal((source_size, 2)))
    np.testing.assert_array_equal(m.take(values), gather(values, index))
    np.testing.assert_array_equal(m.take(values, feeds_large=True), gather(values, index))
    cotangent = jnp.asarray(rng.standard_normal((index.size, 2)))
    (expected,) = jax.vjp(lambda v: gather(v, index), values)[1](cotangent)
    np.testing.assert_allclose(m.sum_into(cotangent), expected, rtol=1e-6, atol=1e-6)
    return m


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
