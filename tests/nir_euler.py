"""A forward-Euler simulator of chain NIR graphs, written from NIR's node equations.

The tests of ``braintrace.nir`` compare a model with the graph it exports stepped
here, so a unit or layout mistake that cancels in an export-import round trip
still fails. Data are channels first, as in NIR: ``(batch, C, *spatial)``.
"""

from __future__ import annotations

import jax
import nir
import numpy as np


def channels_first(a):
    """``(T, B, *spatial, C)`` as ``(T, B, C, *spatial)``; vectors as they are."""
    return np.moveaxis(a, -1, 2) if a.ndim > 3 else a


def _conv(node, x):
    n = node.weight.ndim - 2
    pad = [(int(p), int(p)) for p in np.broadcast_to(node.padding, (n,))]
    y = jax.lax.conv_general_dilated(
        x, node.weight, tuple(np.broadcast_to(node.stride, (n,)).tolist()), pad,
        rhs_dilation=tuple(np.broadcast_to(node.dilation, (n,)).tolist()),
        feature_group_count=int(node.groups))
    return np.asarray(y) + node.bias.reshape(-1, *([1] * n))


def _pool(node, x):
    """Sum (or mean) of each window of ``x (B, C, H, W)`` zero-padded on both sides."""
    (kh, kw), (sh, sw), (ph, pw) = (np.broadcast_to(a, (2,)).astype(int).tolist()
                                    for a in (node.kernel_size, node.stride, node.padding))
    x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    rows, cols = (x.shape[2] - kh) // sh + 1, (x.shape[3] - kw) // sw + 1
    out = np.zeros((*x.shape[:2], rows, cols))
    for i in range(rows):
        for j in range(cols):
            out[:, :, i, j] = x[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw].sum(axis=(2, 3))
    return out / (kh * kw) if isinstance(node, nir.AvgPool2d) else out


def euler_run(graph, xs, dt):
    """Steps a chain NIR graph by forward Euler over ``xs (T, B, ...)``, channels first."""
    order, succ = [], dict(graph.edges)
    name = next(k for k, n in graph.nodes.items() if isinstance(n, nir.Input))
    while not isinstance(graph.nodes[succ[name]], nir.Output):
        name = succ[name]
        order.append(name)
    state = {}

    def leak(v, tau, r, i, v_leak):
        return v + dt / tau * (v_leak - v + r * i)

    def fire(key, v, node):
        z = (v > node.v_threshold).astype(v.dtype)
        state[key] = np.where(z > 0, node.v_reset, v)
        return z

    def neuron(key, node, x):
        if isinstance(node, nir.LI):
            state[key] = leak(state.get(key, 0.0), node.tau, node.r, x, node.v_leak)
            return state[key]
        if isinstance(node, nir.LIF):
            return fire(key, leak(state.get(key, 0.0), node.tau, node.r, x, node.v_leak), node)
        if isinstance(node, nir.IF):  # v' = R I
            return fire(key, state.get(key, 0.0) + dt * node.r * x, node)
        assert isinstance(node, nir.CubaLIF)
        i = state[key + "/i"] = leak(state.get(key + "/i", 0.0), node.tau_syn, node.w_in, x, 0.0)
        return fire(key, leak(state.get(key, 0.0), node.tau_mem, node.r, i, node.v_leak), node)

    def apply(key, node, x):
        if isinstance(node, nir.Affine | nir.Linear):
            return x @ node.weight.T + (node.bias if isinstance(node, nir.Affine) else 0.0)
        if isinstance(node, nir.Conv1d | nir.Conv2d):
            return _conv(node, x)
        if isinstance(node, nir.SumPool2d | nir.AvgPool2d):
            return _pool(node, x)
        if isinstance(node, nir.Flatten):  # NIR shapes are per sample: keep the batch axis
            return x.reshape(x.shape[0], -1)
        if isinstance(node, nir.NIRGraph):  # input -> neuron <-> dense_h, neuron -> output
            rec = node.nodes["dense_h"]
            z_prev = state.get(key + "/z", np.zeros_like(x))
            state[key + "/z"] = neuron(key + "/neuron", node.nodes["neuron"],
                                       x + z_prev @ rec.weight.T)
            return state[key + "/z"]
        return neuron(key, node, x)

    outputs = []
    for x in np.asarray(xs):
        for key in order:
            x = apply(key, graph.nodes[key], x)
        outputs.append(x)
    return np.stack(outputs)
