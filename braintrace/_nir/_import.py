"""``from_nir``: a chain of NIR nodes as an ``nnx.Sequential`` of braintrace layers.

The graph must be a chain from its one Input to its one Output (a recurrent
subgraph counts as one node). Nodes are read in order; a weight node (Affine,
Linear, Conv1d, Conv2d) folds the input gain ``R dt/τ`` of the neuron after it
into its weights, and pairs with that neuron where braintrace has one layer for
both (LeakyReadout, RecurrentSpiking, ConvLIF).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace.layers import (
    IF,
    LIF,
    ConvLIF,
    ETPConv,
    ETPLinear,
    ExpSynapse,
    LeakyReadout,
    RecurrentSpiking,
)

from ._package import nir_package
from ._units import (
    as_tuple,
    finite,
    layer_time_constant,
    nir_shape,
    per_channel,
    positive_dt,
    uniform,
)
from ._weightless import POOLS, flatten_layer, pool_layer

Shape = tuple[int, ...]
SUPPORTED = ("Affine, Linear, Conv1d, Conv2d, LIF, CubaLIF, LI, IF, SumPool2d, AvgPool2d, "
             "Flatten and recurrent subgraphs (input -> LIF <-> Affine/Linear, LIF -> output) "
             "after an Affine or Linear")
_WEIGHTS = ("Affine", "Linear", "Conv1d", "Conv2d")


class _Build:
    """What every new layer needs: ``dt``, the Param dtype and (overwritten) initial draws."""

    def __init__(self, dt: float, param_dtype: Any):
        self.dt, self.param_dtype, self.rngs = dt, param_dtype, nnx.Rngs(0)


def _kind(node: Any) -> str:
    return type(node).__name__


def _chain(graph: Any, where: str) -> list[str]:
    """The names of the nodes between the Input and the Output of a chain graph, in order."""
    ends = {kind: [k for k, n in graph.nodes.items() if _kind(n) == kind]
            for kind in ("Input", "Output")}
    if len(ends["Input"]) != 1 or len(ends["Output"]) != 1:
        raise ValueError(f"from_nir: {where} has inputs {ends['Input']} and outputs "
                         f"{ends['Output']}; it must have one Input and one Output node.")
    successors: dict[str, list[str]] = {}
    for src, dst in graph.edges:
        successors.setdefault(src, []).append(dst)
    chain = [ends["Input"][0]]
    while chain[-1] != ends["Output"][0]:
        after = successors.get(chain[-1], [])
        if len(after) != 1 or after[0] in chain:
            raise ValueError(
                f"from_nir: node '{chain[-1]}' of {where} has edges to {after}; from_nir reads "
                f"chains (each node feeds the next; cycles only inside recurrent subgraphs).")
        chain.append(after[0])
    if len(chain) != len(graph.nodes) or len(graph.edges) != len(chain) - 1:
        off = sorted(set(graph.nodes) - set(chain))
        raise ValueError(f"from_nir: {where} has nodes or edges off its input-output chain "
                         f"(nodes {off}, {len(graph.edges)} edges); from_nir reads chains.")
    return chain[1:-1]


def _set(param: nnx.Param, value: Any) -> None:
    value = jnp.asarray(value, dtype=param[...].dtype)
    assert value.shape == param.shape, (value.shape, param.shape)
    param.set_value(value)


def _tau_kwargs(tau: float | np.ndarray, prefix: str = "") -> dict[str, Any]:
    """Constructor arguments for a time constant: fixed if shared, else learnable per unit."""
    shared = isinstance(tau, float)
    return {f"{prefix}tau": tau if shared else float(tau[0]), f"learn_{prefix}tau": not shared}


def _set_tau(holder: Any, tau: float | np.ndarray) -> None:
    if not isinstance(tau, float):
        _set(holder.weight, tau)


def _leaky(node: Any, fields: tuple[str, str], build: _Build,
           name: str) -> tuple[Any, np.ndarray]:
    """``(layer τ, input gain R dt/τ_NIR)`` of the node's fields ``(τ, R)``, one per channel.

    Both must be finite and of one shape: no braintrace layer has an infinite
    gain (``R = inf``) or no leak (``τ = inf``), so such a node is an error
    naming it rather than weights of ``inf`` and biases of ``nan``.
    """
    tau_field, r_field = fields
    finite(getattr(node, tau_field), name, tau_field,
           "a braintrace neuron decays by exp(-dt/τ) < 1 per step, so τ must be finite")
    finite(getattr(node, r_field), name, r_field,
           f"its input gain {r_field}·dt/{tau_field} is multiplied into the weights before "
           "it and must be finite")
    tau_nir = per_channel(getattr(node, tau_field), name, "time constants")
    r = per_channel(getattr(node, r_field), name, "resistances")
    if r.shape != tau_nir.shape:
        raise ValueError(f"from_nir: node '{name}' has {tau_field} of shape "
                         f"{np.shape(getattr(node, tau_field))} but {r_field} of shape "
                         f"{np.shape(getattr(node, r_field))}; give both one value per neuron.")
    return layer_time_constant(tau_nir, build.dt, name), r * build.dt / tau_nir


def _membrane(node: Any, build: _Build, name: str) -> tuple[Any, np.ndarray]:
    """``(layer τ, gain)`` of a NIR LIF or of a CubaLIF's membrane (``v_leak`` must be 0)."""
    if np.any(np.asarray(node.v_leak) != 0):
        raise ValueError(f"from_nir: node '{name}' has v_leak != 0; braintrace neurons leak "
                         f"towards 0.")
    return _leaky(node, ("tau" if _kind(node) == "LIF" else "tau_mem", "r"), build, name)


def _current(node: Any, build: _Build, name: str) -> tuple[Any, np.ndarray]:
    """``(layer τ, gain)`` of a NIR LI or of a CubaLIF's synaptic current."""
    if _kind(node) == "CubaLIF":
        return _leaky(node, ("tau_syn", "w_in"), build, name)
    if np.any(np.asarray(node.v_leak) != 0):
        raise ValueError(f"from_nir: node '{name}' has v_leak != 0; braintrace integrators "
                         f"leak towards 0.")
    return _leaky(node, ("tau", "r"), build, name)


def _spike_kwargs(node: Any, name: str) -> dict[str, Any]:
    return {"reset": "hard", "v_th": uniform(node.v_threshold, name, "v_threshold"),
            "v_reset": uniform(node.v_reset, name, "v_reset")}


def _lif(node: Any, build: _Build, name: str) -> tuple[LIF, np.ndarray]:
    """A hard-reset LIF of a NIR LIF or CubaLIF (its membrane part), and its input gain."""
    tau, gain = _membrane(node, build, name)
    lif = LIF(gain.size, **_tau_kwargs(tau), dt=build.dt, **_spike_kwargs(node, name),
              param_dtype=build.param_dtype)
    _set_tau(lif.tau, tau)
    return lif, gain


def _synapse(node: Any, build: _Build, name: str) -> tuple[ExpSynapse, np.ndarray]:
    """An ExpSynapse of a NIR LI or of a CubaLIF's synaptic current, and its input gain."""
    tau, gain = _current(node, build, name)
    synapse = ExpSynapse(gain.size, **_tau_kwargs(tau), dt=build.dt,
                         param_dtype=build.param_dtype)
    _set_tau(synapse.tau, tau)
    return synapse, gain


def _if_gain(node: Any, build: _Build, name: str) -> np.ndarray:
    """The input gain ``R dt`` of a NIR IF (Euler's ``v + dt R I``), one per channel."""
    finite(node.r, name, "r", "its input gain r·dt is multiplied into the weights before it "
           "and must be finite")
    return per_channel(node.r, name, "resistances") * build.dt


def _if(node: Any, build: _Build, name: str) -> tuple[IF, np.ndarray]:
    """A hard-reset IF of a NIR IF, and its input gain."""
    gain = _if_gain(node, build, name)
    return IF(gain.size, **_spike_kwargs(node, name), param_dtype=build.param_dtype), gain


def _neuron(node: Any, name: str, size: int, build: _Build) -> tuple[list[nnx.Module], np.ndarray]:
    """The layers of a LIF (LIF), IF (IF), CubaLIF (ExpSynapse, LIF) or LI (ExpSynapse), and
    their gain."""
    if np.atleast_1d(node.output_type["output"]).tolist() != [size]:
        raise ValueError(f"from_nir: node '{name}' ({_kind(node)}) of shape "
                         f"{node.output_type['output']} receives vectors of size {size}.")
    if _kind(node) == "IF":
        neuron, gain = _if(node, build, name)
        return [neuron], gain
    if _kind(node) == "LIF":
        lif, gain = _lif(node, build, name)
        return [lif], gain
    synapse, gain = _synapse(node, build, name)
    if _kind(node) == "LI":
        return [synapse], gain
    lif, mem_gain = _lif(node, build, name)
    return [synapse, lif], gain * mem_gain


def _unit_gain(gain: np.ndarray, name: str, formula: str) -> None:
    if not np.allclose(gain, 1.0, rtol=1e-6, atol=0.0):
        raise ValueError(
            f"from_nir: node '{name}' scales its input by {formula} = {np.unique(gain)}; "
            f"braintrace neurons add their input with gain 1 and no Affine, Linear or Conv node "
            f"comes before it to take the gain into its weights.")


def _dense(node: Any, name: str, gain: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(kernel (in, out), bias)`` of an Affine/Linear, each output scaled by ``gain``.

    ``gain`` has one entry per output (the caller checks the neuron after the
    node has as many units); an Affine's bias must have one too.
    """
    weight = np.asarray(node.weight, np.float64)
    bias = None
    if _kind(node) == "Affine":
        bias = np.asarray(node.bias, np.float64)
        _check_bias(bias, weight, name)
        bias = bias * gain
    return (weight * gain[:, None]).T, bias


def _check_bias(bias: np.ndarray, weight: np.ndarray, name: str) -> None:
    """Nothing, or a ValueError naming the node whose bias is not one value per output."""
    if bias.shape != weight.shape[:1]:
        raise ValueError(
            f"from_nir: node '{name}' has a bias of shape {bias.shape} that does not fit its "
            f"weight of shape {weight.shape} (out, ...): the bias has one entry per output, "
            f"shape {weight.shape[:1]}. Fix the node's bias or weight in the graph.")


def _fits(dense: Any, names: tuple[str, str], size: int) -> None:
    """Nothing, or a ValueError when the weight node ``names[0]`` does not feed ``size`` units."""
    outputs = np.shape(dense.weight)[0]
    if outputs != size:
        raise ValueError(
            f"from_nir: node '{names[0]}' has {outputs} outputs (weight "
            f"{np.shape(dense.weight)}, (out, in)) but the node '{names[1]}' after it has "
            f"{size} neurons.")


def _etp_linear(kernel: np.ndarray, bias: np.ndarray | None, build: _Build) -> ETPLinear:
    layer = ETPLinear(*kernel.shape, use_bias=bias is not None, param_dtype=build.param_dtype,
                      rngs=build.rngs)
    _set(layer.kernel, kernel)
    if bias is not None:
        _set(layer.bias, bias)
    return layer


def _conv_geometry(node: Any, shape: Shape, name: str, build: _Build) -> dict[str, Any]:
    """ETPConv constructor arguments of a Conv1d / Conv2d for frames ``shape = (*spatial, C)``."""
    weight = np.asarray(node.weight)
    n, groups = weight.ndim - 2, int(node.groups)
    if len(shape) != n + 1 or shape[-1] != weight.shape[1] * groups:
        raise ValueError(f"from_nir: node '{name}' ({_kind(node)}) convolves frames of "
                         f"{weight.shape[1] * groups} channels but receives {nir_shape(shape)} "
                         f"(channels first).")
    strides = as_tuple(node.stride, n)
    padding = node.padding.decode() if isinstance(node.padding, bytes) else node.padding
    if isinstance(padding, str):
        if padding not in ("same", "valid") or (padding == "same" and strides != (1,) * n):
            raise ValueError(f"from_nir: node '{name}' pads {padding!r} with strides {strides}; "
                             f"'same' is defined for stride 1 only.")
        padding = padding.upper()
    else:
        padding = tuple((p, p) for p in as_tuple(padding, n))  # hashable: a static of jit
    return {"in_features": weight.shape[1] * groups, "out_features": weight.shape[0],
            "kernel_size": weight.shape[2:], "strides": strides, "padding": padding,
            "kernel_dilation": as_tuple(node.dilation, n), "feature_group_count": groups,
            "use_bias": True, "param_dtype": build.param_dtype, "rngs": build.rngs}


def _conv_params(layer: ETPConv, node: Any, name: str, gain: np.ndarray) -> None:
    """Kernel ``(*k, in/groups, out)`` and bias of a conv node, each output channel × ``gain``."""
    weight = np.asarray(node.weight, np.float64)
    bias = np.asarray(node.bias, np.float64)
    _check_bias(bias, weight, name)
    gain = gain.reshape(-1, *([1] * (weight.ndim - 1)))
    _set(layer.kernel, np.moveaxis(weight * gain, (0, 1), (-1, -2)))
    _set(layer.bias, bias * gain.reshape(-1))


def _conv(node: Any, name: str, shape: Shape, build: _Build) -> tuple[ETPConv, Shape]:
    layer = ETPConv(**_conv_geometry(node, shape, name, build))
    _conv_params(layer, node, name, np.ones(layer.out_features))
    out = jax.eval_shape(layer, jax.ShapeDtypeStruct(shape, layer.kernel[...].dtype)).shape
    return layer, tuple(out)


def _conv_lif(conv: Any, node: Any, names: tuple[str, str], shape: Shape,
              build: _Build) -> tuple[ConvLIF, Shape]:
    """A ConvLIF of a conv node and the LIF (or IF: ``τ = ∞``) after it, per channel."""
    if _kind(node) == "IF":
        tau, gain = math.inf, _if_gain(node, build, names[1])
    else:
        tau, gain = _membrane(node, build, names[1])
    layer = ConvLIF(**_conv_geometry(conv, shape, names[0], build), input_size=shape[:-1],
                    **_tau_kwargs(tau), dt=build.dt, **_spike_kwargs(node, names[1]))
    if np.atleast_1d(node.output_type["output"]).tolist() != nir_shape(layer.output_shape).tolist():
        raise ValueError(f"from_nir: node '{names[1]}' has shape {node.output_type['output']} "
                         f"but the convolution '{names[0]}' gives "
                         f"{nir_shape(layer.output_shape)}.")
    _conv_params(layer.conv, conv, names[0], gain)
    _set_tau(layer.neuron.tau, tau)
    return layer, layer.output_shape


def _loop_parts(graph: Any, name: str) -> tuple[str, str]:
    """The names of the LIF and the weight ``W`` of a subgraph ``input -> LIF <-> W -> LIF``."""
    by_kind: dict[str, list[str]] = {}
    for key, node in graph.nodes.items():
        by_kind.setdefault(_kind(node), []).append(key)
    weights = by_kind.get("Affine", []) + by_kind.get("Linear", [])
    parts = [by_kind.get(k, []) for k in ("Input", "LIF", "Output")] + [weights]
    if len(graph.nodes) == 4 and all(len(p) == 1 for p in parts):
        (src,), (lif,), (dst,), (weight,) = parts
        if set(map(tuple, graph.edges)) == {(src, lif), (lif, weight), (weight, lif), (lif, dst)}:
            return lif, weight
    raise ValueError(
        f"from_nir: subgraph '{name}' is not a recurrent spiking layer; expected the nodes "
        f"Input, LIF, Affine or Linear, Output with edges input -> LIF, LIF -> W, W -> LIF, "
        f"LIF -> output, got {dict(by_kind)} with edges {list(graph.edges)}.")


def _recurrent(dense: Any, loop: Any, names: tuple[str, str],
               build: _Build) -> RecurrentSpiking:
    """RecurrentSpiking of ``dense_i`` and a loop subgraph; a bias of ``W_h`` joins ``dense_i``'s."""
    lif_name, rec_name = _loop_parts(loop, names[1])
    rec = loop.nodes[rec_name]
    neuron, gain = _lif(loop.nodes[lif_name], build, f"{names[1]}.{lif_name}")
    if np.shape(dense.weight)[0] != gain.size or np.shape(rec.weight) != (gain.size,) * 2:
        raise ValueError(f"from_nir: '{names[0]}' {np.shape(dense.weight)} and the recurrent "
                         f"weight {np.shape(rec.weight)} of '{names[1]}' do not fit "
                         f"{gain.size} neurons.")
    kernel_i, bias_i = _dense(dense, names[0], gain)
    kernel_h, bias_h = _dense(rec, f"{names[1]}.{rec_name}", gain)
    if bias_h is not None:
        bias_i = bias_h if bias_i is None else bias_i + bias_h
    layer = RecurrentSpiking(kernel_i.shape[0], neuron, use_bias=bias_i is not None,
                             param_dtype=build.param_dtype, rngs=build.rngs)
    _set(layer.dense_i.kernel, kernel_i)
    if bias_i is not None:
        _set(layer.dense_i.bias, bias_i)
    _set(layer.dense_h.kernel, kernel_h)
    return layer


def _readout(dense: Any, li: Any, names: tuple[str, str], build: _Build) -> LeakyReadout:
    """LeakyReadout of an Affine/Linear and the LI after it."""
    tau, gain = _current(li, build, names[1])
    _fits(dense, names, gain.size)
    kernel, bias = _dense(dense, names[0], gain)
    layer = LeakyReadout(*kernel.shape, **_tau_kwargs(tau), dt=build.dt,
                         use_bias=bias is not None, param_dtype=build.param_dtype,
                         rngs=build.rngs)
    _set_tau(layer.tau, tau)
    _set(layer.linear.kernel, kernel)
    if bias is not None:
        _set(layer.linear.bias, bias)
    return layer


def _unsupported(name: str, node: Any, after: str | None = None) -> ValueError:
    where = f" after the {after}" if after else ""
    return ValueError(f"from_nir: node '{name}' is a {_kind(node)}{where}, which has no "
                      f"braintrace layer; supported: {SUPPORTED}.")


def _after_dense(nodes: list[tuple[str, Any]], i: int, shape: Shape,
                 build: _Build) -> tuple[list[nnx.Module], int, Shape]:
    """The layers of the Affine/Linear at ``i`` and the node it pairs with; nodes consumed."""
    name, dense = nodes[i]
    if np.shape(dense.weight)[1:] != tuple(shape):
        raise ValueError(f"from_nir: node '{name}' of weight {np.shape(dense.weight)} (out, in) "
                         f"receives vectors of shape {nir_shape(shape)}.")
    nxt_name, nxt = nodes[i + 1] if i + 1 < len(nodes) else (None, None)
    out = (np.shape(dense.weight)[0],)
    if _kind(nxt) == "LI":
        return [_readout(dense, nxt, (name, nxt_name), build)], 2, out
    if _kind(nxt) == "NIRGraph":
        return [_recurrent(dense, nxt, (name, nxt_name), build)], 2, out
    if _kind(nxt) in ("LIF", "CubaLIF", "IF"):
        neurons, gain = _neuron(nxt, nxt_name, out[0], build)
        return [_etp_linear(*_dense(dense, name, gain), build), *neurons], 2, out
    return [_etp_linear(*_dense(dense, name, np.ones(out)), build)], 1, out


def _after_conv(nodes: list[tuple[str, Any]], i: int, shape: Shape,
                build: _Build) -> tuple[list[nnx.Module], int, Shape]:
    """The layer of the Conv1d/Conv2d at ``i`` (a ConvLIF with the LIF after it)."""
    name, conv = nodes[i]
    nxt_name, nxt = nodes[i + 1] if i + 1 < len(nodes) else (None, None)
    if _kind(nxt) in ("LIF", "IF"):
        layer, out = _conv_lif(conv, nxt, (name, nxt_name), shape, build)
        return [layer], 2, out
    if _kind(nxt) in ("LI", "CubaLIF", "NIRGraph"):
        raise _unsupported(nxt_name, nxt, after=f"{_kind(conv)} '{name}'")
    layer, out = _conv(conv, name, shape, build)
    return [layer], 1, out


def _layers(nodes: list[tuple[str, Any]], shape: Shape, build: _Build) -> tuple[list, Shape]:
    """The braintrace layers of a chain of NIR nodes and the per-sample output shape."""
    layers: list[nnx.Module] = []
    i = 0
    while i < len(nodes):
        name, node = nodes[i]
        kind = _kind(node)
        if kind in ("Affine", "Linear"):
            new, used, shape = _after_dense(nodes, i, shape, build)
        elif kind in ("Conv1d", "Conv2d"):
            new, used, shape = _after_conv(nodes, i, shape, build)
        elif kind in POOLS or kind == "Flatten":
            layer, shape = (pool_layer if kind in POOLS else flatten_layer)(node, name, shape)
            new, used = [layer], 1
        elif kind in ("LIF", "CubaLIF", "LI", "IF"):
            if len(shape) != 1:
                raise ValueError(
                    f"from_nir: node '{name}' is a {kind} on frames {nir_shape(shape)}; braintrace "
                    f"has per-position neurons only as ConvLIF (a Conv node followed by a LIF or "
                    f"an IF).")
            new, gain = _neuron(node, name, shape[0], build)
            _unit_gain(gain, name, "R·dt" if kind == "IF" else "R·dt/τ")
            used = 1
        elif kind == "NIRGraph":
            raise ValueError(
                f"from_nir: node '{name}' is a subgraph with no Affine or Linear node before it; "
                f"a recurrent subgraph imports as RecurrentSpiking, whose input weights (dense_i) "
                f"that node gives.")
        else:
            raise _unsupported(name, node)
        layers += new
        i += used
    return layers, shape


def from_nir(graph: Any, *, dt: float, param_dtype: Any = jnp.float32) -> nnx.Sequential:
    """See :func:`braintrace.nir.from_nir`."""
    nir_package("from_nir")
    build = _Build(positive_dt(dt, "from_nir"), param_dtype)
    names = _chain(graph, "the graph")
    source = next(n for n in graph.nodes.values() if _kind(n) == "Input")
    target = next(n for n in graph.nodes.values() if _kind(n) == "Output")
    first = [int(s) for s in np.atleast_1d(source.output_type["output"])]
    shape = tuple(first if len(first) == 1 else (*first[1:], first[0]))
    layers, out = _layers([(n, graph.nodes[n]) for n in names], shape, build)
    if not layers:
        raise ValueError("from_nir: the graph has no node between its Input and its Output.")
    expected = target.output_type["output"]
    if expected is not None and np.atleast_1d(expected).tolist() != nir_shape(out).tolist():
        raise ValueError(f"from_nir: the graph's Output has shape {expected} but its last "
                         f"node gives {nir_shape(out)}.")
    return nnx.Sequential(*layers)
