"""Data parallel: where each of a learner's arrays lives on a mesh.

The batch axis of inputs, targets, hidden states and per-sample traces is
sharded over the mesh's data axis; Params, optimiser state and everything
without a batch axis are replicated. The drivers' programs are unchanged:
their arguments are placed with :func:`place` and constrained inside ``jit``
with :func:`constrain` (the same sharding at the scan's entry and exit), and
XLA inserts the reduction of the gradients over the devices.

Which leaves carry the batch axis is read off the data, not assumed: a leaf is
batched when its leading axis grows with the batch size (its shape at ``B``
and at ``2B`` differ), so a Param or a trace whose first axis happens to equal
``B`` stays replicated.

On several hosts (``jax.distributed.initialize``), each process gives its local
part of the batch and :func:`place` assembles the global arrays with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["Layout", "check_mesh", "constrain", "host_array", "input_shardings", "layout",
           "on_mesh", "place", "place_inputs"]


class Layout(NamedTuple):
    """The shardings of a learner's arrays at one batch size.

    Attributes:
        mesh: The device mesh.
        axis: The name of its data axis.
        batch_size: The global batch size.
        params: The sharding of every Param (replicated).
        hidden: A sharding per hidden state (batch axis over ``axis``).
        other: A sharding per other Variable.
        traces: The traces' structure with a sharding per leaf.
    """

    mesh: Mesh
    axis: str
    batch_size: int
    params: list[NamedSharding]
    hidden: list[NamedSharding]
    other: list[NamedSharding]
    traces: Any

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of an array held whole by every device."""
        return NamedSharding(self.mesh, P())


def check_mesh(mesh: Any, axis: Any, batch_size: int | None) -> None:
    """Checks that ``batch_size`` can be split over ``mesh``'s axis ``axis``.

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: The mesh has no axis named
            ``axis``, the learner runs per sample, or ``batch_size`` is not a
            multiple of the axis size.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), "
                         f"('data',))), got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"The mesh has no axis named {axis!r}; its axes are {tuple(mesh.axis_names)}. "
            "Pass data_axis=<the name of the axis to split the batch over>.")
    if batch_size is None:
        raise ValueError(
            "Data parallel splits the batch axis over the mesh, but this learner runs per "
            "sample (no batch axis). Pass batch_size=B to braintrace.compile.")
    size = mesh.shape[axis]
    if batch_size % size:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by the size {size} of the mesh's data "
            f"axis {axis!r}: every device must hold the same number of samples. Use a batch "
            f"size that is a multiple of {size}.")


def layout(mesh: Mesh, axis: str, batch_size: int, at_b: Sequence[Any],
           at_2b: Sequence[Any]) -> Layout:
    """The :class:`Layout` of leaves whose shapes at ``B`` and ``2B`` are ``at_b`` and ``at_2b``.

    ``at_b`` and ``at_2b`` are ``(params, hidden, other, traces)`` of arrays
    or ``jax.ShapeDtypeStruct``s, of the same structure. The mesh's axes are
    used as ``Auto`` axes (XLA propagates the shardings inside the programs),
    whatever their type in ``mesh`` (``jax.make_mesh`` makes ``Explicit`` ones).
    """
    mesh = Mesh(mesh.devices, mesh.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    batched, whole = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P())

    def sharding(a, b):
        grows = np.ndim(a) > 0 and np.shape(a)[0] != np.shape(b)[0]
        return batched if grows else whole

    params, hidden, other, traces = (jax.tree.map(sharding, a, b) for a, b in
                                     zip(at_b, at_2b, strict=True))
    return Layout(mesh, axis, batch_size, list(params), list(hidden), list(other), traces)


def input_shardings(lay: Layout, tree: Any) -> Any:
    """A sharding per leaf of inputs or targets (time axis leading, batch axis second)."""
    batched = NamedSharding(lay.mesh, P(None, lay.axis))
    local = lay.batch_size // jax.process_count()
    return jax.tree.map(
        lambda a: batched if np.ndim(a) >= 2 and np.shape(a)[1] in (lay.batch_size, local)
        else lay.replicated, tree)


def place_inputs(lay: Layout, tree: Any) -> Any:
    """Inputs or targets on the mesh, batch axis (the second) split over the data axis.

    On several processes, a leaf that is not already a global array is this
    process's part of the batch.
    """
    def one(a, sharding):
        if _is_global(a) or jax.process_count() == 1:
            return _on(a, sharding)
        return _keyed(lambda d: jax.make_array_from_process_local_data(sharding, d), a)

    return jax.tree.map(one, tree, input_shardings(lay, tree))


def place(tree: Any, shardings: Any) -> Any:
    """Every leaf of ``tree`` (the same value on every process) on its sharding.

    A leaf already there is returned as it is.
    """
    def one(a, sharding):
        if _is_global(a) or jax.process_count() == 1:
            return _on(a, sharding)
        return _keyed(lambda d: jax.make_array_from_callback(
            d.shape, sharding, lambda index: d[index]), a)

    return jax.tree.map(one, tree, shardings)


def _is_global(a: Any) -> bool:
    return isinstance(a, jax.Array) and not a.is_fully_addressable


def _on(a: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(a, jax.Array) and a.sharding == sharding:
        return a
    return jax.device_put(a, sharding)


def _keyed(make, a: Any) -> jax.Array:
    """``make`` on the host data of ``a``, through the key data for a typed PRNG key."""
    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(make(np.asarray(jax.random.key_data(a))),
                                        impl=jax.random.key_impl(a))
    return make(np.asarray(a))


def on_mesh(lay: Layout | None) -> contextlib.AbstractContextManager:
    """The context a program is traced in: its layout's mesh, as JAX's abstract mesh.

    Inside, ``jax.sharding.get_abstract_mesh()`` names the devices the batch is
    split over, so the rules reduce over the whole batch axis instead of slicing
    single samples out of it (which would move rows between devices inside the
    time loop). Without a layout, nothing changes.
    """
    if lay is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(lay.mesh.abstract_mesh)


def constrain(tree: Any, shardings: Any) -> Any:
    """``jax.lax.with_sharding_constraint`` on every leaf, inside ``jit``."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def host_array(a: Any) -> np.ndarray:
    """A replicated array's value on this host (also for arrays spanning several processes)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return np.asarray(a.addressable_data(0))
    return np.asarray(a)
