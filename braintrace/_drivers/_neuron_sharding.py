"""Neuron parallel: which axis of each array is split over the mesh's neuron axis.

A network too large for one device is split by post-synaptic neuron: every
device holds the Params, hidden states and traces of ``N / n`` of the hidden
units. This module decides, per leaf, the *sample spec*: a mesh axis name (or
``None``) for each axis after the batch axis; :func:`braintrace._drivers._sharding.layout`
puts the data axis in front of it for batched leaves. XLA partitions the
programs from these shardings (GSPMD) and inserts the collectives, so the
gradients are the one-device ones.

* A Param follows Flax's convention: its ``out_sharding`` metadata
  (``nnx.with_partitioning(init, (None, 'neuron'))``, or
  ``param.set_metadata(out_sharding=...)``; ``None`` entries keep an axis
  whole) when it has one, else its last axis is the neuron axis:
  ``ETPLinear.kernel (in, out)`` by ``out``, biases and per-neuron time
  constants by neuron, ``ETPSparseLinear.weight (nnz,)`` by synapse (whole
  neurons per device when the synapses are in post-synaptic order).
* A hidden state is split along its last (feature) axis when that divides by
  the axis size, else kept whole (a readout's few outputs).
* A trace leaf is mapped through the compiled graph: traces are kept per
  relation (``y = f(x, θ)`` feeding a hidden group), and a leaf whose axes
  after the batch axis lead with the shape of an operand ``θ`` takes the
  sample spec of the Param ``θ`` is read from; one that leads with the
  shape of ``y`` or of ``x`` is split along that array's last axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from braintrace._compiler import ETraceGraph

__all__ = ["hidden_specs", "param_specs", "trace_specs"]

Spec = P


def param_specs(variables: Sequence[nnx.Variable], paths: Sequence[str], mesh: Mesh,
                axis: str) -> list[Spec]:
    """A sample spec per Param: its ``out_sharding`` metadata, else its last axis on ``axis``.

    Raises:
        ValueError: A declared spec names an axis the mesh does not have or has
            another length than the Param's rank, or the axis split over ``axis``
            does not divide by its size (the message names the Param's path).

    Example:
        >>> import jax
        >>> from flax import nnx
        >>> from braintrace._drivers._neuron_sharding import param_specs
        >>> mesh = jax.make_mesh((1,), ('neuron',))
        >>> linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> param_specs([linear.kernel, linear.bias], ['kernel', 'bias'], mesh, 'neuron')
        [P(None, 'neuron'), P('neuron',)]
    """
    specs = []
    for var, path in zip(variables, paths, strict=True):
        shape = np.shape(var[...])
        declared = var.get_metadata().get("out_sharding")
        if declared:
            spec = _declared(tuple(declared), shape, path, mesh)
        else:
            spec = (None,) * (len(shape) - 1) + (axis,) if shape else ()
        _check_divisible(f"Param '{path}'", shape, spec, mesh)
        specs.append(P(*spec))
    return specs


def hidden_specs(sample_shapes: Sequence[tuple[int, ...]], mesh: Mesh, axis: str) -> list[Spec]:
    """A sample spec per hidden state: its last axis on ``axis`` when that divides, else whole.

    Example:
        >>> import jax
        >>> from braintrace._drivers._neuron_sharding import hidden_specs
        >>> mesh = jax.make_mesh((1,), ('neuron',))
        >>> hidden_specs([(8,), ()], mesh, 'neuron')
        [P('neuron',), P()]
    """
    return [_last_axis(shape, mesh, axis) for shape in sample_shapes]


def trace_specs(graph: ETraceGraph, traces: Any, batched: Any,
                params: dict[str, Spec], mesh: Mesh, axis: str) -> Any:
    """A sample spec per trace leaf, read from the relation the leaf belongs to.

    Args:
        graph: The compiled graph.
        traces: The traces (arrays or ``jax.ShapeDtypeStruct``), one entry per
            relation at the top when the algorithm keeps them so.
        batched: Per leaf of ``traces``, whether its leading axis is the batch axis.
        params: The sample spec of every Param, by path.
        mesh: The mesh.
        axis: The neuron axis of ``mesh``.
    """
    per_relation = (isinstance(traces, (list, tuple)) and not hasattr(traces, "_fields")
                    and len(traces) == len(graph.relations))
    groups = list(traces) if per_relation else [traces]
    flags = list(batched) if per_relation else [batched]
    out = []
    for k, (tree, flag) in enumerate(zip(groups, flags, strict=True)):
        relations = [graph.relations[k]] if per_relation else list(graph.relations)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        specs = [_trace_leaf(relations, path, np.shape(leaf)[int(b):], graph, params, mesh, axis)
                 for (path, leaf), b in zip(leaves, jax.tree.leaves(flag), strict=True)]
        out.append(jax.tree.unflatten(treedef, specs))
    return type(traces)(out) if per_relation else out[0]


def _trace_leaf(relations: list, path: tuple, shape: tuple[int, ...], graph: ETraceGraph,
                params: dict[str, Spec], mesh: Mesh, axis: str) -> Spec:
    """The sample spec of one trace leaf of per-sample ``shape`` (see :func:`trace_specs`)."""
    names = {str(getattr(key, "key", getattr(key, "name", ""))) for key in path}
    for r in relations:
        for key, position in getattr(r, "operands", {}).items():
            theta = tuple(graph.jaxpr.eqns[r.eqn_index].invars[position].aval.shape)
            sources = r.param_paths.get(key, ())
            if key in names and shape[:len(theta)] == theta and len(sources) == 1:
                spec = tuple(params[sources[0]])
                if len(spec) <= len(theta):
                    return _fit(spec, shape, mesh)
        for array_shape in (_sample(r, "y_shape"), _sample(r, "x_shape")):
            if array_shape and shape[:len(array_shape)] == array_shape:
                return _fit(_last_axis(array_shape, mesh, axis), shape, mesh)
    return P()


def _sample(relation: Any, name: str) -> tuple[int, ...] | None:
    """The relation's ``y`` or ``x`` shape without its batch axis (``None``: it has none)."""
    shape = getattr(relation, name, None)
    if shape is None:
        return None
    return tuple(shape)[1:] if relation.batched else tuple(shape)


def _fit(spec: Spec, shape: tuple[int, ...], mesh: Mesh) -> Spec:
    """``spec`` padded with ``None`` to ``shape``'s rank; whole where an axis does not divide."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*(None if name is not None and shape[i] % _size(mesh, name) else name
               for i, name in enumerate(spec)))


def _last_axis(shape: tuple[int, ...], mesh: Mesh, axis: str) -> Spec:
    if not shape or shape[-1] % mesh.shape[axis]:
        return P()
    return P(*(None,) * (len(shape) - 1), axis)


def _size(mesh: Mesh, names: Any) -> int:
    names = names if isinstance(names, tuple) else (names,)
    return int(np.prod([mesh.shape[n] for n in names]))


def _declared(spec: Spec, shape: tuple[int, ...], path: str, mesh: Mesh) -> Spec:
    """A Param's ``out_sharding`` metadata, checked against the mesh and its rank."""
    if len(spec) != len(shape):
        raise ValueError(
            f"Param '{path}' of shape {shape} declares out_sharding={spec}, one entry per "
            f"axis is needed ({len(shape)}). Declare a mesh axis name or None for each axis.")
    for name in spec:
        for part in (name if isinstance(name, tuple) else (name,)):
            if part is not None and part not in mesh.axis_names:
                raise ValueError(
                    f"Param '{path}' declares out_sharding={spec}, but the mesh has no axis "
                    f"{part!r} (its axes: {tuple(mesh.axis_names)}). Name mesh axes, or None "
                    "to keep an axis whole.")
    return spec


def _check_divisible(what: str, shape: tuple[int, ...], spec: Spec, mesh: Mesh) -> None:
    for i, name in enumerate(spec):
        if name is not None and shape[i] % _size(mesh, name):
            raise ValueError(
                f"{what} of shape {shape}: its axis {i} of size {shape[i]} is not divisible by "
                f"the size {_size(mesh, name)} of the mesh axis {name!r} it is split over; every "
                f"device must hold the same number of neurons. Use a size that is a multiple "
                f"of {_size(mesh, name)}, or declare how to split it with Flax's partitioning "
                f"metadata, e.g. param.set_metadata(out_sharding=(...)) with None for an axis "
                f"kept whole.")
