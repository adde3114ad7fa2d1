"""Contract-test operands of the embedding, einsum, grouped and sparse primitives.

Each ``*_operands(sizes, lead, rng, dtype)`` follows ``primitive_cases.MakeOperands``;
each ``*_diagonal(key, jacobian, params)`` pairs every entry of ``θ[key]`` with the
one output unit it feeds, from a Jacobian ``(*y, *θ_key)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from braintrace import Connectivity
from braintrace._primitives import split_spec

__all__ = ["einsum_diagonal", "einsum_operands", "embed_operands", "grouped_diagonal",
           "grouped_operands", "sparse_diagonal", "sparse_operands"]


def _operands(*fields):
    from primitive_cases import Operands  # here: primitive_cases imports this module

    return Operands(*fields)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _square_diagonal(jacobian: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The diagonal of a ``(*shape, *shape)`` Jacobian, shaped ``shape``."""
    n = int(np.prod(shape, dtype=np.int64))
    return jnp.diagonal(jacobian.reshape(n, n)).reshape(shape)


def embed_operands(sizes, lead, rng, dtype):
    """``embedding (V, F)[x]`` with ``x`` integer indices ``lead``; hidden ``(F,)``."""
    vocab, _, features = sizes
    x = jnp.asarray(rng.integers(0, vocab, lead), jnp.int32)
    theta = {"embedding": _normal(rng, (vocab, features), dtype)}
    return _operands(x, theta, {}, {}, (features,))


EINSUM_SPECS = ("i,io->o", "i,oi->o", "ai,aio->o", "ai,aio->ao", "i,ioa->ao")
"""Per-sample contractions: plain, transposed kernel, two contracted axes, a shared
(head) axis, and an output laid out differently from the kernel."""


def einsum_operands(sizes, lead, rng, dtype):
    """``einsum(spec, x, kernel) (+ bias)`` for a spec of :data:`EINSUM_SPECS`."""
    i, a, o = sizes
    spec = EINSUM_SPECS[rng.integers(len(EINSUM_SPECS))]
    xs, ks, ys = split_spec(spec)
    size = {"i": i, "a": a, "o": o}
    theta = {"kernel": _normal(rng, tuple(size[c] for c in ks), dtype)}
    hidden = tuple(size[c] for c in ys)
    has_bias = bool(rng.integers(2))
    if has_bias:  # the bias as Flax may shape it: like y, or flat
        flat = bool(rng.integers(2))
        theta["bias"] = _normal(rng, (int(np.prod(hidden)),) if flat else hidden, dtype)
    params = {"spec": spec, "has_bias": has_bias, "precision": None}
    x = _normal(rng, (*lead, *(size[c] for c in xs)), dtype)
    return _operands(x, theta, params, {}, hidden)


def einsum_diagonal(key, jacobian, params):
    """``J[y(k), k]`` by repeating ``y``'s letters in the kernel's (a diagonal einsum)."""
    _, ks, ys = split_spec(params["spec"])
    if key == "kernel":
        return jnp.einsum(f"{ys}{ks}->{ks}", jacobian)
    return _square_diagonal(jacobian, jacobian.shape[len(ys):])


def grouped_operands(sizes, lead, rng, dtype):
    """``G = sizes[1]`` blocks ``(i, o)``: ``x (*lead, G·i)``, ``y (G·o,)``."""
    i, groups, o = sizes
    has_bias = bool(rng.integers(2))
    theta = {"kernel": _normal(rng, (groups, i, o), dtype)}
    if has_bias:
        theta["bias"] = _normal(rng, (groups * o,), dtype)
    params = {"has_bias": has_bias, "precision": None}
    return _operands(_normal(rng, (*lead, groups * i), dtype), theta, params, {}, (groups * o,))


def grouped_diagonal(key, jacobian, params):
    """Kernel: ``J[(g, o), g, i, o]``; bias: the plain diagonal."""
    del params
    if key == "kernel":
        groups, _, out = jacobian.shape[1:]
        return jnp.einsum("gogio->gio", jacobian.reshape(groups, out, groups, -1, out))
    return jnp.diagonal(jacobian)


def sparse_operands(sizes, lead, rng, dtype):
    """A random connectivity ``(I, O)`` of density ~1/2; ``x`` real or boolean spikes."""
    num_in, _, num_out = sizes
    mask = rng.random((num_in, num_out)) < 0.5
    live = rng.integers(num_in)
    mask[live, rng.integers(num_out)] = True
    conn = Connectivity.from_mask(mask)
    has_bias = bool(rng.integers(2))
    theta = {"weight": _normal(rng, (conn.nnz,), dtype)}
    if has_bias:
        theta["bias"] = _normal(rng, (num_out,), dtype)
    spikes = bool(rng.integers(2))
    if spikes:  # the input of the connection made above always spikes: a gradient to check
        events = rng.random((*lead, num_in)) < 0.5
        events[..., live] = True
        x = jnp.asarray(events)
    else:
        x = _normal(rng, (*lead, num_in), dtype)
    params = {"has_bias": has_bias, "connectivity": conn,
              "max_events": num_in if spikes else None}
    return _operands(x, theta, params, {}, (num_out,))


def sparse_diagonal(key, jacobian, params):
    """Weight: ``J[post[k], k]``; bias: the plain diagonal."""
    if key == "weight":
        conn = params["connectivity"]
        return jacobian[conn.post, np.arange(conn.nnz)]
    return jnp.diagonal(jacobian)
