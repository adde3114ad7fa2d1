"""``to_nir``: a chain of braintrace layers as a ``nir.NIRGraph``.

The model is flattened into its layers (``nnx.Sequential`` chains, nested or
not); each layer becomes one or two nodes in chain order, an ExpSynapse
directly before a LIF becomes one CubaLIF, and edges join consecutive nodes
from ``input`` to ``output``. Shapes follow the data per sample in
braintrace's layout (channels last) and are written in NIR's (channels first).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np
from flax import nnx

from braintrace.layers import (
    ALIF,
    IF,
    LIF,
    AvgPool2d,
    ConvLIF,
    ETPConv,
    ETPLinear,
    ETPSparseLinear,
    ExpSynapse,
    Flatten,
    LeakyReadout,
    RecurrentSpiking,
    SumPool2d,
)

from ._package import nir_package
from ._units import (
    as_tuple,
    explicit_pads,
    nir_shape,
    nir_time_constant,
    one_minus_decay,
    positive_dt,
)
from ._weightless import flatten_node, pool_node

Shape = tuple[int, ...]
Segment = list[tuple[str, Any]]  # (node name, NIR node), in chain order

SUPPORTED = ("nnx.Sequential chains (nested allowed) of ETPLinear, ETPSparseLinear, ETPConv "
             "(1-D, 2-D), LIF, IF, ExpSynapse, LeakyReadout, RecurrentSpiking, ConvLIF, "
             "SumPool2d, AvgPool2d, Flatten, or one of these layers")


def _where(path: str) -> str:
    return path or "the model itself"


def _alif_error(path: str) -> ValueError:
    return ValueError(
        f"to_nir: the ALIF at '{_where(path)}' has an adaptive threshold A_t = v_th + β a_t; "
        f"NIR has no adaptive-threshold neuron (its LIF and CubaLIF have a fixed v_threshold), "
        f"so the export would drop the adaptation. Use LIF to export.")


def _flatten(module: Any, path: str) -> list[tuple[str, nnx.Module]]:
    """``(path, layer)`` of every layer of ``module`` in call order."""
    if isinstance(module, nnx.Sequential):
        leaves = []
        for i, layer in enumerate(module.layers):
            leaves += _flatten(layer, f"{path}.layers.{i}" if path else f"layers.{i}")
        if not leaves:
            raise ValueError(f"to_nir: the nnx.Sequential at '{_where(path)}' is empty.")
        return leaves
    if type(module) is ALIF:
        raise _alif_error(path)
    if type(module) not in EXPORTERS:
        kind = type(module).__name__ if isinstance(module, nnx.Module) else \
            getattr(module, "__qualname__", type(module).__name__)
        raise TypeError(f"to_nir: the module at '{_where(path)}' is {kind}, which has no NIR "
                        f"mapping; supported: {SUPPORTED}.")
    return [(path, module)]


def _check_shape(shape: Shape, expected: Shape, path: str, layer: nnx.Module) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(
            f"to_nir: the {type(layer).__name__} at '{_where(path)}' takes per-sample inputs of "
            f"shape {tuple(expected)} but receives {tuple(shape)} (NIR has no implicit "
            f"reshape between these layers).")


def _linear_node(nir: ModuleType, kernel: np.ndarray, bias: Any) -> Any:
    """Affine (with bias) or Linear: ``weight = kernel.T``, ``(out, in)``."""
    weight = np.ascontiguousarray(np.asarray(kernel).T)
    if bias is None:
        return nir.Linear(weight=weight)
    return nir.Affine(weight=weight, bias=np.asarray(bias))


def _dense_node(nir: ModuleType, layer: ETPLinear) -> Any:
    return _linear_node(nir, layer.kernel[...], None if layer.bias is None else layer.bias[...])


def _leaky(one_minus: np.ndarray, nir_shape: Shape, dt: float, dtype: Any) -> tuple:
    """``(τ_NIR, R)`` of shape ``nir_shape`` (per-channel values go on the leading axis)."""
    tau, r = nir_time_constant(one_minus, dt)
    lead = (-1,) + (1,) * (len(nir_shape) - 1) if np.ndim(one_minus) else ()
    return tuple(np.broadcast_to(np.reshape(x, lead) if lead else x, nir_shape).astype(dtype)
                 for x in (tau, r))


def _check_spikes(neuron: LIF | IF, path: str) -> None:
    """Nothing, or a ValueError: NIR neurons reset to ``v_reset`` and are never refractory."""
    kind = type(neuron).__name__
    if neuron.reset != "hard":
        raise ValueError(
            f"to_nir: the {kind} at '{_where(path)}' uses reset='soft' (subtracts v_th - v_reset "
            f"after a spike); NIR's LIF, CubaLIF and IF set v to v_reset. Build it with "
            f"reset='hard' to export it.")
    if neuron.refractory_steps:
        raise ValueError(
            f"to_nir: the {kind} at '{_where(path)}' has refractory_steps="
            f"{neuron.refractory_steps}; NIR neurons have no refractory period.")


def _never_leaks(neuron: Any) -> bool:
    """Whether a neuron is an IF: the ``IF`` layer, or a LIF (a ConvLIF's) with ``τ = ∞``."""
    return type(neuron) is IF or (isinstance(neuron.tau, float) and math.isinf(neuron.tau))


def _if_node(nir: ModuleType, neuron: LIF | IF, nir_shape: Shape, path: str, dt: float) -> Any:
    """NIR IF (``v̇ = R I``): Euler's step ``v + dt R I`` adds the input with ``R = 1/dt``."""
    _check_spikes(neuron, path)
    dtype = neuron.v[...].dtype
    return nir.IF(r=np.full(nir_shape, 1.0 / dt, dtype),
                  v_threshold=np.full(nir_shape, neuron.v_th, dtype),
                  v_reset=np.full(nir_shape, neuron.v_reset, dtype))


def _neuron_node(nir: ModuleType, neuron: Any, nir_shape: Shape, path: str, dt: float) -> Any:
    """The NIR IF or LIF of a standalone or convolutional neuron layer."""
    if _never_leaks(neuron):
        return _if_node(nir, neuron, nir_shape, path, dt)
    return _lif_node(nir, neuron, nir_shape, path, dt)


def _lif_node(nir: ModuleType, lif: LIF, nir_shape: Shape, path: str, dt: float) -> Any:
    """NIR LIF of a hard-reset LIF without refractoriness."""
    if type(lif) is ALIF:
        raise _alif_error(path)
    if type(lif) is not LIF:  # IF, CuBaLIF: not a NIR LIF (no leak; a synaptic current)
        raise TypeError(f"to_nir: the neuron at '{_where(path)}' is {type(lif).__name__}, which "
                        f"has no NIR mapping; a LIF neuron exports here.")
    _check_spikes(lif, path)
    dtype = lif.v[...].dtype
    tau, r = _leaky(one_minus_decay(lif.tau, lif.dt, path), nir_shape, dt, dtype)
    return nir.LIF(tau=tau, r=r, v_leak=np.zeros(nir_shape, dtype),
                   v_threshold=np.full(nir_shape, lif.v_th, dtype),
                   v_reset=np.full(nir_shape, lif.v_reset, dtype))


def _li_node(nir: ModuleType, layer: Any, size: int, path: str, dt: float) -> Any:
    """NIR LI of an ExpSynapse or a LeakyReadout's integrator (``v_leak = 0``)."""
    dtype = (layer.g if isinstance(layer, ExpSynapse) else layer.y)[...].dtype
    tau, r = _leaky(one_minus_decay(layer.tau, layer.dt, path), (size,), dt, dtype)
    return nir.LI(tau=tau, r=r, v_leak=np.zeros((size,), dtype))


def _dense_groups(weight: np.ndarray, groups: int) -> np.ndarray:
    """A grouped ``(O, I/G, *k)`` weight as the equal ``(O, I, *k)`` one (zero across groups).

    nir infers a convolution's input channels as ``weight.shape[1]``, ignoring
    ``groups``, so a grouped weight would fail its type check.
    """
    out, per_group = weight.shape[:2]
    dense = np.zeros((out, per_group * groups, *weight.shape[2:]), weight.dtype)
    for g in range(groups):
        rows = slice(g * out // groups, (g + 1) * out // groups)
        dense[rows, g * per_group:(g + 1) * per_group] = weight[rows]
    return dense


def _conv_node(nir: ModuleType, conv: ETPConv, shape: Shape, path: str) -> tuple[Any, Shape]:
    """Conv1d / Conv2d of an ETPConv for per-sample frames ``shape = (*spatial, C)``."""
    n = len(conv.kernel_size)
    if n not in (1, 2):
        raise ValueError(f"to_nir: the ETPConv at '{_where(path)}' is {n}-D; NIR has Conv1d "
                         f"and Conv2d only.")
    if len(shape) != n + 1 or shape[-1] != conv.in_features:
        raise ValueError(
            f"to_nir: the ETPConv at '{_where(path)}' takes per-sample frames (*spatial, "
            f"{conv.in_features}) with {n} spatial axes but receives {tuple(shape)}; pass "
            f"input_shape=(*spatial, channels) when the model starts with it.")
    if as_tuple(conv.input_dilation, n) != (1,) * n:
        raise ValueError(f"to_nir: the ETPConv at '{_where(path)}' dilates its input; NIR "
                         f"convolutions have no input dilation.")
    strides, dilation = as_tuple(conv.strides, n), as_tuple(conv.kernel_dilation, n)
    pads = explicit_pads(conv.padding, shape[:-1], conv.kernel_size, strides, dilation, path)
    if any(low != high for low, high in pads):
        raise ValueError(
            f"to_nir: the ETPConv at '{_where(path)}' pads {pads} (low, high) for frames of "
            f"{tuple(shape[:-1])}; NIR pads both sides of an axis equally. Choose a frame size, "
            f"stride or explicit padding that pads symmetrically.")
    kernel = np.asarray(conv.kernel[...])
    if conv.mask is not None:
        kernel = kernel * np.asarray(conv.mask)
    weight = _dense_groups(np.moveaxis(kernel, (-1, -2), (0, 1)), conv.feature_group_count)
    bias = np.zeros(conv.out_features, kernel.dtype) if conv.bias is None else \
        np.asarray(conv.bias[...])
    common = {"weight": weight, "groups": 1, "bias": bias}
    if n == 1:
        node = nir.Conv1d(input_shape=shape[0], stride=strides[0], padding=pads[0][0],
                          dilation=dilation[0], **common)
    else:
        node = nir.Conv2d(input_shape=tuple(shape[:-1]), stride=strides,
                          padding=tuple(low for low, _ in pads), dilation=dilation, **common)
    out = jax.eval_shape(conv, jax.ShapeDtypeStruct(shape, kernel.dtype)).shape
    return node, tuple(out)


def _linear(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (layer.in_features,), path, layer)
    return [(path or "ETPLinear", _dense_node(nir, layer))], (layer.out_features,)


def _sparse(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (layer.in_features,), path, layer)
    conn = layer.connectivity
    kernel = np.zeros((layer.in_features, layer.out_features), layer.weight[...].dtype)
    np.add.at(kernel, (conn.pre, conn.post), np.asarray(layer.weight[...]))
    bias = None if layer.bias is None else layer.bias[...]
    return [(path or "ETPSparseLinear", _linear_node(nir, kernel, bias))], (layer.out_features,)


def _conv(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    node, out = _conv_node(nir, layer, shape, path)
    return [(path or "ETPConv", node)], out


def _lif(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (layer.num_neurons,), path, layer)
    node = _neuron_node(nir, layer, shape, path, dt)
    return [(path or type(layer).__name__, node)], shape


def _pool(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    node, out = pool_node(nir, layer, shape, path)
    return [(path or type(layer).__name__, node)], out


def _flat(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    node, out = flatten_node(nir, layer, shape, path)
    return [(path or "Flatten", node)], out


def _synapse(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (layer.num_features,), path, layer)
    return [(path or "ExpSynapse", _li_node(nir, layer, layer.num_features, path, dt))], shape


def _cuba_lif(nir, paths, synapse, lif, shape, dt) -> tuple[Segment, Shape]:
    """CubaLIF of an ExpSynapse feeding a LIF: ``w_in = 1/(1 - α_syn)``, ``R = 1/(1 - α)``."""
    (syn_path, lif_path) = paths
    _check_shape(shape, (synapse.num_features,), syn_path, synapse)
    _check_shape(shape, (lif.num_neurons,), lif_path, lif)
    mem = _lif_node(nir, lif, shape, lif_path, dt)
    tau_syn, w_in = _leaky(one_minus_decay(synapse.tau, synapse.dt, syn_path), shape, dt,
                           mem.tau.dtype)
    node = nir.CubaLIF(tau_syn=tau_syn, tau_mem=mem.tau, r=mem.r, v_leak=mem.v_leak,
                       v_threshold=mem.v_threshold, v_reset=mem.v_reset, w_in=w_in)
    return [(lif_path or "LIF", node)], shape


def _readout(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (layer.in_features,), path, layer)
    name = path or "LeakyReadout"
    li = _li_node(nir, layer, layer.out_features, path, dt)
    return [(f"{name}.linear", _dense_node(nir, layer.linear)), (name, li)], \
        (layer.out_features,)


def _recurrent(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    """``dense_i`` then a subgraph ``input -> neuron <-> dense_h``, ``neuron -> output``."""
    _check_shape(shape, (layer.in_features,), path, layer)
    n = layer.neuron.num_neurons
    name = path or "RecurrentSpiking"
    neuron = _lif_node(nir, layer.neuron, (n,), f"{path}.neuron" if path else "neuron", dt)
    loop = nir.NIRGraph(
        nodes={"input": nir.Input(np.array([n])), "neuron": neuron,
               "dense_h": _dense_node(nir, layer.dense_h), "output": nir.Output(np.array([n]))},
        edges=[("input", "neuron"), ("neuron", "dense_h"), ("dense_h", "neuron"),
               ("neuron", "output")])
    return [(f"{name}.dense_i", _dense_node(nir, layer.dense_i)), (name, loop)], (n,)


def _conv_lif(nir, path, layer, shape, dt) -> tuple[Segment, Shape]:
    _check_shape(shape, (*layer.input_size, layer.conv.in_features), path, layer)
    name = path or "ConvLIF"
    conv, out = _conv_node(nir, layer.conv, shape, f"{path}.conv" if path else "conv")
    neuron = _neuron_node(nir, layer.neuron, tuple(nir_shape(out)),
                          f"{path}.neuron" if path else "neuron", dt)
    return [(f"{name}.conv", conv), (f"{name}.neuron", neuron)], out


EXPORTERS: dict[type, Callable[..., tuple[Segment, Shape]]] = {
    ETPLinear: _linear, ETPSparseLinear: _sparse, ETPConv: _conv, LIF: _lif, IF: _lif,
    ExpSynapse: _synapse, LeakyReadout: _readout, RecurrentSpiking: _recurrent,
    ConvLIF: _conv_lif, SumPool2d: _pool, AvgPool2d: _pool, Flatten: _flat,
}


def _input_shape(path: str, layer: nnx.Module) -> Shape:
    """The per-sample input shape a chain's first layer fixes."""
    if isinstance(layer, ConvLIF):
        return (*layer.input_size, layer.conv.in_features)
    if not isinstance(layer, ETPConv):
        for attr in ("in_features", "num_neurons", "num_features"):
            if hasattr(layer, attr):
                return (getattr(layer, attr),)
    raise ValueError(f"to_nir: the model starts with the {type(layer).__name__} at "
                     f"'{_where(path)}', whose input frame size is not fixed; pass "
                     f"input_shape=(*spatial, channels).")


def _segments(nir, leaves, shape, dt) -> tuple[Segment, Shape]:
    """The chain of nodes of ``leaves``, an ExpSynapse directly before a LIF fused to CubaLIF."""
    chain: Segment = []
    i = 0
    while i < len(leaves):
        path, layer = leaves[i]
        nxt = leaves[i + 1][1] if i + 1 < len(leaves) else None
        if type(layer) is ExpSynapse and type(nxt) is LIF and not _never_leaks(nxt):
            segment, shape = _cuba_lif(nir, (path, leaves[i + 1][0]), layer, leaves[i + 1][1],
                                       shape, dt)
            i += 2
        else:
            segment, shape = EXPORTERS[type(layer)](nir, path, layer, shape, dt)
            i += 1
        chain += segment
    return chain, shape


def to_nir(model: nnx.Module, input_shape: Sequence[int] | None = None, *,
           dt: float) -> Any:
    """See :func:`braintrace.nir.to_nir`."""
    nir = nir_package("to_nir")
    dt = positive_dt(dt, "to_nir")
    leaves = _flatten(model, "")
    shape = tuple(input_shape) if input_shape is not None else _input_shape(*leaves[0])
    chain, out = _segments(nir, leaves, shape, dt)
    nodes = {"input": nir.Input(nir_shape(shape)), **dict(chain),
             "output": nir.Output(nir_shape(out))}
    names = ["input", *(name for name, _ in chain), "output"]
    return nir.NIRGraph(nodes=nodes, edges=list(itertools.pairwise(names)))
