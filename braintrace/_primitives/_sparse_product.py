"""The sparse product as a bilinear JAX primitive with gather-only derivatives.

``sparse_product_p.bind(x, w, connectivity=c)`` computes, for rows ``x (R, I)``
and weights ``w (nnz,)`` of one dtype,

.. math::

    y[r, o] = \\sum_{k:\\, post[k] = o} w[k]\\, x[r, pre[k]] \\qquad (R, O).

It is linear in ``x`` and in ``w`` (``ad.defbilinear``), and its two
transposes are written out rather than derived from the gathers:

* with respect to ``x``: the same product over the transposed connectivity,
  ``x̄[r, i] = Σ_{k: pre[k]=i} w[k] ȳ[r, post[k]]`` (a gather over the
  connections grouped by *input*), where JAX would scatter-add every product
  into ``x̄`` (with the forward: 35 against 5 ms at ``B = 32``, ``N = 16,384`` on CPU);
* with respect to ``w``: :func:`weight_pullback`, which sums over the rows a
  group at a time instead of materialising ``R × nnz`` gathered products.

So a learning signal or BPTT through an ``ETPSparseLinear`` costs two more
products of the forward's kind, not scatters. The ETP primitive's impl binds
this one (``_sparse.py``); its own JVP follows from this JVP.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from braintrace._platform import by_platform
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives import _sparse_tpu as tpu
from braintrace._primitives._sparse_kernels import pullback, slot_product, sum_rows

__all__ = ["product", "sparse_product_p", "weight_pullback"]


def _whole_inputs(x: jax.Array) -> jax.Array:
    """``x (..., I)`` with its input axis whole on every device, when the drivers split the
    program (they trace under a mesh of Auto axes).

    Each connection reads the input ``pre`` names, so a device needs every input even
    when ``x`` arrives split by neuron (neuron parallel). Said here, XLA gathers ``x``
    once per product; left to itself it gathered each row a loop reads on its own (eight
    all-gathers per step of :func:`~braintrace._primitives._sparse_kernels.sum_rows`, and
    all-to-alls). Fewer collectives that can be in flight at once are also what keeps
    forced host devices from waiting in different ones (``docs/devices.md``):
    a 4-device D-RTRL program of a spiking net held 79 all-gathers and 4 all-to-alls; 41
    and none with this, 17 with it and the identity map of
    ``InputRelation.gather_hidden`` kept as is. The other axes keep their sharding (a
    batch split over devices stays split).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._primitives._sparse_product import _whole_inputs
        >>> _whole_inputs(jnp.ones((2, 3))).shape   # no mesh: x itself
        (2, 3)
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    if mesh.empty or mesh.size == 1 or not auto:
        # Nothing split, or a mesh of explicit axes (``jax.set_mesh`` with JAX's
        # default ``jax.make_mesh``): there each array's sharding is part of its type
        # and the product follows it; the drivers trace under a mesh of Auto axes.
        return x
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    spec = jax.sharding.PartitionSpec(*[free] * (x.ndim - 1), None)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def product(x: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """``y (R, O)`` for ``x (R, I)``: on the CPU the slot sum over the connections grouped by
    output, or (fan-ins too uneven to group) a ``segment_sum`` over ``post``; on a TPU the
    Pallas kernels (``_sparse_tpu.product``); elsewhere ``_sparse_accelerator.product``."""
    return by_platform(cpu=functools.partial(_cpu_product, connectivity=connectivity),
                       accelerator=functools.partial(accelerator.product,
                                                     connectivity=connectivity),
                       tpu=functools.partial(tpu.product, connectivity=connectivity)
                       )(_whole_inputs(x), weight)


def _cpu_product(x: jax.Array, weight: jax.Array, connectivity: Any) -> jax.Array:
    """:func:`product` on the CPU."""
    if connectivity.by_output is not None:
        return slot_product(x, weight, connectivity.by_output)
    contrib = jnp.take(x, connectivity.pre, axis=-1) * weight
    return jax.ops.segment_sum(contrib.T, connectivity.post,
                               num_segments=connectivity.num_out).T


def weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any) -> jax.Array:
    """``dw[k] = Σ_r x[r, pre[k]]·d[r, post[k]]`` for ``x (R, I)``, ``d (R, O)``: ``(nnz,)``.

    Where ``R·nnz ≥ I·O`` (dense-like, many rows) it is ``(xᵀ d)[pre, post]``, one
    matrix product and a gather. Otherwise, on the CPU, summed a group of rows at a time
    (never ``R × nnz`` values at once); on a TPU the Pallas kernels
    (``_sparse_tpu.weight_pullback``); elsewhere ``_sparse_accelerator.weight_pullback``.
    """
    conn = connectivity
    x = _whole_inputs(x)
    if x.shape[0] * conn.nnz >= conn.num_in * conn.num_out:
        outer = jnp.matmul(x.T, d, precision=jax.lax.Precision.HIGHEST)
        return outer[conn.pre, conn.post]
    return by_platform(cpu=functools.partial(_cpu_weight_pullback, connectivity=conn),
                       accelerator=functools.partial(accelerator.weight_pullback,
                                                     connectivity=conn),
                       tpu=functools.partial(tpu.weight_pullback, connectivity=conn))(x, d)


def _cpu_weight_pullback(x: jax.Array, d: jax.Array, connectivity: Any) -> jax.Array:
    """:func:`weight_pullback` on the CPU, below the dense-like size."""
    conn = connectivity
    if conn.by_output is not None:
        return pullback(x, d, conn.by_output)
    return sum_rows(lambda xr, dr: jnp.take(xr, conn.pre) * jnp.take(dr, conn.post), x, d)


sparse_product_p = Primitive("sparse_product")
"""``y = sparse_product_p.bind(x (R, I), w (nnz,), connectivity=c)``: ``(R, O)``."""


def _abstract_eval(x: Any, weight: Any, *, connectivity: Any) -> jax.core.ShapedArray:
    return jax.core.ShapedArray((x.shape[0], connectivity.num_out), weight.dtype)


def _x_transpose(ct: jax.Array, x: Any, weight: jax.Array, *, connectivity: Any) -> jax.Array:
    """The same product over the transposed connectivity: on the CPU its slot sum, elsewhere
    the sums over each input's outgoing connections (``_sparse_tpu.transposed_product``
    on a TPU, ``_sparse_accelerator.transposed_product``)."""
    del x
    transposed = lambda ct, w: sparse_product_p.bind(ct, w, connectivity=connectivity.transposed)
    return by_platform(cpu=transposed,
                       accelerator=functools.partial(accelerator.transposed_product,
                                                     connectivity=connectivity),
                       tpu=functools.partial(tpu.transposed_product,
                                             connectivity=connectivity))(ct, weight)


def _w_transpose(ct: jax.Array, x: jax.Array, weight: Any, *, connectivity: Any) -> jax.Array:
    del weight
    return weight_pullback(x, ct, connectivity)


def _batch(args: Any, dims: Any, *, connectivity: Any) -> tuple[jax.Array, int]:
    """Mapped ``x`` alone: more rows. A mapped weight: the plain product's pure-JAX
    formulations, vmapped (the TPU kernels take one weight vector)."""
    (x, weight), (x_dim, w_dim) = args, dims
    if w_dim is None:
        x = jnp.moveaxis(x, x_dim, 0)
        y = sparse_product_p.bind(x.reshape(-1, x.shape[-1]), weight, connectivity=connectivity)
        return y.reshape(*x.shape[:2], y.shape[-1]), 0
    one = by_platform(cpu=functools.partial(_cpu_product, connectivity=connectivity),
                      accelerator=functools.partial(accelerator.product,
                                                    connectivity=connectivity))
    return jax.vmap(one, in_axes=(x_dim, w_dim))(x, weight), 0


sparse_product_p.def_impl(product)
sparse_product_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(sparse_product_p, mlir.lower_fun(product, multiple_results=False))
ad.defbilinear(sparse_product_p, _x_transpose, _w_transpose)
batching.primitive_batchers[sparse_product_p] = _batch
