"""Data and neuron parallel: where each of a learner's arrays lives on a mesh.

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

With a neuron axis (``neuron_axis=``), the hidden units are split over it as
well: each leaf gets a *sample spec* for its axes after the batch axis
(``_neuron_sharding``), and Params and the optimiser state are split with
them instead of being replicated. A mesh may have a neuron axis only.

On several hosts (``jax.distributed.initialize``), each process gives its local
part of the batch and :func:`place` assembles the global arrays with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from braintrace._arguments import ArgumentTypeError
from braintrace._compiler import splitting_batch

__all__ = [
    "Layout",
    "auto_mesh",
    "batched_leaves",
    "check_mesh",
    "constrain",
    "gathered",
    "host_array",
    "host_arrays",
    "input_shardings",
    "layout",
    "on_mesh",
    "opt_state_shardings",
    "place",
    "place_inputs",
]


class Layout(NamedTuple):
    """The shardings of a learner's arrays at one batch size.

    Attributes:
        mesh: The device mesh.
        axis: The name of its data axis (``None``: the batch is not split).
        batch_size: The global batch size.
        params: The sharding of every Param (replicated without a neuron axis).
        hidden: A sharding per hidden state (batch axis over ``axis``).
        other: A sharding per other Variable.
        traces: The traces' structure with a sharding per leaf.
        neuron_axis: The name of the neuron axis, or ``None``.
    """

    mesh: Mesh
    axis: str | None
    batch_size: int | None
    params: list[NamedSharding]
    hidden: list[NamedSharding]
    other: list[NamedSharding]
    traces: Any
    neuron_axis: str | None = None

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of an array held whole by every device."""
        return NamedSharding(self.mesh, P())


def check_mesh(mesh: Any, axis: Any, batch_size: int | None,
               neuron_axis: Any = None) -> str | None:
    """Checks that ``batch_size`` can be split over ``mesh``'s axis ``axis``.

    With a ``neuron_axis``, the mesh may lack ``axis`` (``axis=None`` or a name
    it does not have): the batch is then not split.

    Returns:
        The data axis the batch is split over (``None``: none).

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: The mesh has no axis named
            ``axis`` (or ``neuron_axis``), the learner runs per sample, or
            ``batch_size`` is not a multiple of the axis size.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), "
                         f"('data',))), got {type(mesh).__name__}.")
    if neuron_axis is not None:
        if neuron_axis not in mesh.axis_names:
            raise ValueError(
                f"The mesh has no axis named {neuron_axis!r}; its axes are "
                f"{tuple(mesh.axis_names)}. Pass neuron_axis=<the name of the axis to split "
                "the hidden units over>.")
        if axis == neuron_axis:
            raise ValueError(f"data_axis and neuron_axis are both {axis!r}; name two axes.")
        if axis is None or axis not in mesh.axis_names:
            return None
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
    return axis


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with ``Auto`` axes (XLA propagates the shardings inside the programs),
    whatever their type in ``mesh`` (``jax.make_mesh`` makes ``Explicit`` ones)."""
    return Mesh(mesh.devices, mesh.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def batched_leaves(at_b: Any, at_2b: Any) -> Any:
    """Per leaf, whether its leading axis grows with the batch size (shapes at ``B``, ``2B``)."""
    return jax.tree.map(lambda a, b: bool(np.ndim(a) > 0 and np.shape(a)[0] != np.shape(b)[0]),
                        at_b, at_2b)


def layout(mesh: Mesh, axis: str | None, batch_size: int | None, at_b: Sequence[Any],
           at_2b: Sequence[Any], samples: Sequence[Any] | None = None,
           neuron_axis: str | None = None) -> Layout:
    """The :class:`Layout` of leaves whose shapes at ``B`` and ``2B`` are ``at_b`` and ``at_2b``.

    ``at_b`` and ``at_2b`` are ``(params, hidden, other, traces)`` of arrays
    or ``jax.ShapeDtypeStruct``s, of the same structure. A leaf whose leading
    axis grows with the batch size has it split over ``axis``. ``samples``
    gives, in the same structure, each leaf's sample spec (a ``PartitionSpec``
    of its axes after the batch axis; ``None``: every leaf's are whole).

    Example:
        >>> import jax, numpy as np
        >>> from braintrace._drivers._sharding import layout
        >>> mesh = jax.make_mesh((1, 1), ('data', 'neuron'))
        >>> at = lambda b: ([np.zeros(4)], [np.zeros((b, 4))], [], [])
        >>> P = jax.sharding.PartitionSpec
        >>> lay = layout(mesh, 'data', 2, at(2), at(4), ([P('neuron')], [P('neuron')], [], []),
        ...              'neuron')
        >>> lay.params[0].spec, lay.hidden[0].spec
        (P('neuron',), P('data', 'neuron'))
    """
    mesh = auto_mesh(mesh)
    batched = [batched_leaves(a, b) for a, b in zip(at_b, at_2b, strict=True)]
    if samples is None:
        samples = [jax.tree.map(lambda _: P(), group) for group in batched]

    def sharding(grows: bool, sample: P) -> NamedSharding:
        spec = ((axis,) if grows else ()) + tuple(sample)
        return NamedSharding(mesh, P(*_trimmed(spec)))

    params, hidden, other, traces = (jax.tree.map(sharding, flags, spec)
                                     for flags, spec in zip(batched, samples, strict=True))
    return Layout(mesh, axis, batch_size, list(params), list(hidden), list(other), traces,
                  neuron_axis)


def _trimmed(spec: tuple[Any, ...]) -> tuple[Any, ...]:
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def input_shardings(lay: Layout, tree: Any) -> Any:
    """A sharding per leaf of inputs or targets (time axis leading, batch axis second)."""
    if lay.axis is None:
        return jax.tree.map(lambda _: lay.replicated, tree)
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


@contextlib.contextmanager
def on_mesh(lay: Layout | None) -> Iterator[None]:
    """The context a program is traced in: its layout's mesh, as JAX's abstract mesh.

    Inside, ``jax.sharding.get_abstract_mesh()`` names the devices the batch is
    split over, so the rules reduce over the whole batch axis instead of slicing
    single samples out of it (which would move rows between devices inside the
    time loop); :func:`braintrace._compiler.batch_shards` says how many devices
    the batch is split over (the data axis's size; a neuron axis does not split
    the batch). Without a layout, nothing changes.
    """
    if lay is None:
        yield
        return
    shards = 1 if lay.axis is None else lay.mesh.shape[lay.axis]
    with jax.sharding.use_abstract_mesh(lay.mesh.abstract_mesh), splitting_batch(shards):
        yield


def gathered(name: str, tree: Any) -> Any:
    """``tree`` with every array split over explicit mesh axes gathered whole, for a learner
    compiled without ``mesh=`` (which runs on one device).

    ``jax.make_mesh`` makes ``Explicit`` axes: an array sharded over one carries
    the split in its type (``float32[6,4@data,3]``), which the steps of such a
    learner (reshapes over the batch axis, ``vmap``) refuse. Outside ``jit`` it
    is copied whole onto the default device (uncommitted, so it joins the
    learner's arrays wherever they are); other leaves are returned as they are.

    Raises:
        ArgumentTypeError: Such a leaf inside ``jit`` (a tracer), where it cannot
            be gathered (a ``TypeError``, as JAX's ``ShardingTypeError``, and a
            ``ValueError``): the message names it (``name``, its path) and says
            to pass the mesh to :func:`braintrace.compile`.

    Example:
        >>> import jax.numpy as jnp
        >>> gathered('xs', jnp.ones((2, 3))).shape
        (2, 3)
    """
    def whole(path: Any, a: Any) -> Any:
        kind = jax.typeof(a)
        axes = [axis for axis in kind.sharding.spec if axis is not None]
        if not axes:
            return a
        if isinstance(a, jax.core.Tracer):
            raise ArgumentTypeError(
                f"{name}{jax.tree_util.keystr(path)} is split over the mesh axes {axes} "
                f"({kind.str_short()}) inside jit, but this learner was compiled without "
                "mesh=, for one device. Pass the mesh to braintrace.compile(model, algorithm, "
                "example_x, batch_size=..., mesh=mesh) to split the batch over it, or gather "
                "the inputs before the jit (or call outside it, where they are gathered).")
        return jax.numpy.asarray(np.asarray(a))

    return jax.tree_util.tree_map_with_path(whole, tree)


def constrain(tree: Any, shardings: Any) -> Any:
    """``jax.lax.with_sharding_constraint`` on every leaf, inside ``jit``."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def host_array(a: Any) -> np.ndarray:
    """A replicated array's value on this host (also for arrays spanning several processes)."""
    return host_arrays(a)[0]


def host_arrays(*arrays: Any) -> tuple[np.ndarray, ...]:
    """Several replicated arrays' values on this host (also for arrays spanning several
    processes: each one's first local copy).

    Every copy to the host is started before the first is waited on, so the
    call waits for the device once, not once per array (on an accelerator each
    wait costs a round trip of about a millisecond).

    Example:
        >>> import jax.numpy as jnp
        >>> [a.tolist() for a in host_arrays(jnp.arange(2), jnp.ones(1))]
        [[0, 1], [1.0]]
    """
    local = [a.addressable_data(0) if isinstance(a, jax.Array) and not a.is_fully_addressable
             else a for a in arrays]
    for a in local:
        if isinstance(a, jax.Array):
            a.copy_to_host_async()
    return tuple(np.asarray(a) for a in local)


def opt_state_shardings(lay: Layout, tx: Any, opt_state: Any, params: Any) -> Any:
    """A sharding per leaf of ``tx``'s state: a leaf that mirrors a Param (Adam's moments)
    is split as that Param is; the rest (step counts) is replicated.

    ``params`` is the Params' tree as ``tx`` sees it (``nnx.state(model, nnx.Param)``);
    its leaves are in the order of :attr:`Layout.params`.
    """
    if lay.neuron_axis is None:
        return jax.tree.map(lambda _: lay.replicated, opt_state)
    shardings = jax.tree.unflatten(jax.tree.structure(params), lay.params)
    return optax.tree_map_params(tx, lambda _, sharding: sharding, opt_state, shardings,
                                 transform_non_params=lambda _: lay.replicated)
