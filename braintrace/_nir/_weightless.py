"""Pooling and flattening between NIR and braintrace: nodes without weights or state.

A braintrace frame is channels last ``(H, W, C)``, NIR's channels first
``(C, H, W)``. ``SumPool2d``/``AvgPool2d`` carry their window, stride and
padding (both sides of each axis) unchanged. braintrace's
:class:`~braintrace.layers.Flatten` flattens channels first, which is NIR's
``Flatten`` of the whole per-sample frame (``start_dim=0``, ``end_dim=-1``):
the node means what the layer computes, and the weights after it are not
permuted either way.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from braintrace.layers import AvgPool2d, Flatten, SumPool2d

from ._units import as_tuple, nir_shape

Shape = tuple[int, ...]
POOLS = {"SumPool2d": SumPool2d, "AvgPool2d": AvgPool2d}


def _where(path: str) -> str:
    return path or "the model itself"


def pool_node(nir: ModuleType, layer: SumPool2d | AvgPool2d, shape: Shape,
              path: str) -> tuple[Any, Shape]:
    """The NIR pooling node of a pooling layer on frames ``shape = (H, W, C)``."""
    if len(shape) != 3:
        raise ValueError(f"to_nir: the {type(layer).__name__} at '{_where(path)}' pools frames "
                         f"(rows, columns, channels) but receives {tuple(shape)}.")
    node = getattr(nir, type(layer).__name__)(kernel_size=np.array(layer.kernel_size),
                                             stride=np.array(layer.strides),
                                             padding=np.array(layer.padding))
    return node, layer.output_shape(shape)


def flatten_node(nir: ModuleType, layer: Flatten, shape: Shape, path: str) -> tuple[Any, Shape]:
    """NIR's Flatten of the whole channels-first frame."""
    if len(shape) != layer.ndim:
        raise ValueError(f"to_nir: the Flatten at '{_where(path)}' flattens frames of "
                         f"{layer.ndim} axes but receives {tuple(shape)}.")
    node = nir.Flatten(input_type={"input": nir_shape(shape)}, start_dim=0, end_dim=-1)
    return node, (int(np.prod(shape)),)


def pool_layer(node: Any, name: str, shape: Shape) -> tuple[SumPool2d | AvgPool2d, Shape]:
    """A pooling layer of a NIR ``SumPool2d``/``AvgPool2d`` node on frames ``(H, W, C)``."""
    kind = type(node).__name__
    if len(shape) != 3:
        raise ValueError(f"from_nir: node '{name}' ({kind}) pools 2-D frames but receives "
                         f"{nir_shape(shape)} (channels first).")
    layer = POOLS[kind](as_tuple(node.kernel_size, 2), as_tuple(node.stride, 2),
                        as_tuple(node.padding, 2))
    out = layer.output_shape(shape)
    if min(out) < 1:
        raise ValueError(f"from_nir: node '{name}' ({kind}) with window {layer.kernel_size} "
                         f"leaves nothing of frames {nir_shape(shape)}.")
    return layer, out


def flatten_layer(node: Any, name: str, shape: Shape) -> tuple[Flatten, Shape]:
    """:class:`Flatten` of a NIR ``Flatten`` of the whole per-sample frame."""
    frame = nir_shape(shape)
    given = node.input_type.get("input")
    if given is not None and np.atleast_1d(given).tolist() != frame.tolist():
        raise ValueError(f"from_nir: node '{name}' (Flatten) flattens inputs of shape "
                         f"{np.atleast_1d(given).tolist()} but receives {frame.tolist()} "
                         f"(channels first).")
    start, end = (int(d) % len(shape) for d in (node.start_dim, node.end_dim))
    if (start, end) != (0, len(shape) - 1):
        raise ValueError(
            f"from_nir: node '{name}' (Flatten) flattens axes {node.start_dim} to "
            f"{node.end_dim} of frames {frame.tolist()}; braintrace's Flatten flattens a whole "
            f"frame (start_dim=0, end_dim=-1).")
    return Flatten(len(shape)), (int(np.prod(shape)),)
