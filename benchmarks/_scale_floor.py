"""The analytic floor of one step of ``scale.py``'s network: what the step must move.

Per step, for ``B`` samples, ``N`` ALIF neurons (``S = 2`` states each), ``nnz = N·F``
recurrent synapses and ``P`` Params, in float32 (4 bytes):

* **bytes**: the hidden state read and written (``2BNS``), every weight read once
  (``P``), and per method what it cannot avoid: BPTT writes each step's state for
  its backward pass and reads it there (``2BNS``), reads and writes the state's
  cotangent (``2BNS``) and adds each step's gradient into the sums (``2P``);
  ES-D-RTRL reads and writes its traces (``ε_x`` of both layers' inputs, ``B(N + I)``,
  and one ``ε_f``, ``BNS``), the cotangent of its one-step learning signal
  (``2BNS``, none with the fast signal) and adds a block's gradient once per block of
  ``K`` steps (``2P/K``); plus every gathered row of the sparse sums;
* **indices**: the rows the sparse sums gather, ``nnz`` per product: BPTT's forward,
  ``x``-cotangent and weight pullback (``3 nnz``); ES-D-RTRL's forward, the learning
  signal's ``x``-cotangent (not with the fast signal) and one pullback per block over
  its ``(K + 1)·B`` rows (``(2 + 1/K)·nnz``). Each index reads a row of ``B`` values
  (``(K + 1)·B`` for the pullback): ``gathered`` bytes.

``floor_s = max(bytes / bandwidth, indices / index_rate)``, the bandwidth from a streaming
probe and the index rate from a gather probe run in the same process
(:func:`bandwidth_probe`, :func:`index_probe`); a TPU v5e streams ~635 GB/s and gathers
~360 M rows per second (:data:`INDEX_RATE_V5E`, measured there with rows of 32 floats).
A step can only approach the floor: it does not count the input layer's and readout's
products, the Jacobians or the loss.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INDEX_RATE_V5E = 360e6
"""Rows of 32 float32 values a TPU v5e gathers per second (XLA's gather, plain JAX)."""

STATES = 2
"""ALIF: membrane potential and adaptation."""

FORMULA = {
    "bptt": ("bytes = 4·(2BNS state + P weights + 2BNS stored states + 2BNS state cotangents "
             "+ 2P gradient sums + 3·nnz·B gathered); indices = 3·nnz"),
    "es_d_rtrl": ("bytes = 4·(2BNS state + P weights + 2B(N + I + NS) traces + 2BNS signal "
                  "cotangents + 2P/K gradient sums + nnz·B·(2 + (K+1)/K) gathered); "
                  "indices = (2 + 1/K)·nnz"),
    "es_d_rtrl:fast": ("bytes = 4·(2BNS state + P weights + 2B(N + I + NS) traces + 2P/K "
                       "gradient sums + nnz·B·(1 + (K+1)/K) gathered); indices = (1 + 1/K)·nnz"),
}
"""The floor's formula per method family; ``floor_s = max(bytes / bandwidth, indices /
index_rate)``."""


def _median_seconds(fn: Any, args: tuple, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bandwidth_probe(elements: int, repeats: int = 5) -> dict:
    """Streaming bandwidth: ``a·x + y`` over ``elements`` float32 (reads two, writes one)."""
    x = jnp.ones((elements,), jnp.float32)
    y = jnp.full((elements,), 2.0, jnp.float32)
    seconds = _median_seconds(jax.jit(lambda x, y: 0.5 * x + y), (x, y), repeats)
    nbytes = 3 * 4 * elements
    return {"bytes": nbytes, "s_median": seconds, "gb_per_s": nbytes / seconds / 1e9}


def index_probe(neurons: int, degree: int, batch: int, repeats: int = 5,
                rows_per_call: int = 2**24) -> dict:
    """Gather rate: ``v ← ½ Σ_j v[idx[·, j]]`` for ``v (N, B)`` float32 and ``degree`` random
    rows per output (the forward of the sparse layer in plain JAX), repeated in one program
    until about ``rows_per_call`` rows are gathered, each pass reading the last one's
    result (small sizes measure gathers, not the call). On a TPU the rows are padded with
    zeros to whole 128-lane rows, as the library gathers them there
    (``_sparse_accelerator.TPU_LANES``): unpadded, XLA:TPU lays a table above its on-chip
    memory out column-major and the probe would time a layout the library never reads."""
    from braintrace._primitives._sparse_accelerator import TPU_LANES

    rng = np.random.default_rng(0)
    index = jnp.asarray(rng.integers(0, neurons, (neurons, degree)), jnp.int32)
    lanes = TPU_LANES if jax.default_backend() == "tpu" else 1
    width = -(-batch // lanes) * lanes
    values = jnp.asarray(rng.standard_normal((neurons, width), np.float32))
    rows = neurons * degree
    passes = max(1, rows_per_call // rows)

    def gathers(v, i):
        step = lambda _, v: 0.5 * jnp.sum(jnp.take(v, i, axis=0, mode="clip"), axis=1)
        return jax.lax.fori_loop(0, passes, step, v)

    seconds = _median_seconds(jax.jit(gathers), (values, index), repeats)
    return {"rows": rows * passes, "row_values": batch, "s_median": seconds,
            "rows_per_s": rows * passes / seconds}


def method_family(method: str) -> str | None:
    """``'es_d_rtrl@2'`` -> ``'es_d_rtrl'``; ``'es_d_rtrl:fast'`` kept; ``None`` without a
    floor here (D-RTRL)."""
    name = method.partition("+")[0].partition("@")[0]
    return name if name in FORMULA else None


def analytic_floor(method: str, *, neurons: int, batch: int, degree: int, inputs: int,
                   params: int, block: int) -> dict | None:
    """The bytes and indices of one step (module docstring), by term; ``None`` for a method
    without a floor here."""
    family = method_family(method)
    if family is None:
        return None
    b, n, s, nnz, p, k = batch, neurons, STATES, neurons * degree, params, max(block, 1)
    terms = {"state": 2 * b * n * s, "weights": p}
    if family == "bptt":  # forward, x-cotangent and weight pullback, B rows each, every step
        terms.update(stored_states=2 * b * n * s, state_cotangents=2 * b * n * s,
                     gradient_sums=2 * p)
        gathers, pullback_indices, pullback_rows = 3, 0.0, 0.0
    else:  # forward and (exact signal) x-cotangent every step, the pullback once per block
        fast = family.endswith(":fast")
        terms.update(traces=2 * b * (n + inputs + n * s), gradient_sums=2 * p / k)
        if not fast:
            terms["signal_cotangents"] = 2 * b * n * s
        gathers, pullback_indices, pullback_rows = (1 if fast else 2), 1 / k, (k + 1) / k
    indices = (gathers + pullback_indices) * nnz
    terms["gathered"] = nnz * b * (gathers + pullback_rows)
    values = {key: 4.0 * v for key, v in terms.items()}
    return {"formula": FORMULA[family], "block": k, "bytes_by_term": values,
            "bytes": float(sum(values.values())), "indices": float(indices)}


def floor_seconds(floor: dict, bandwidth: dict, index: dict) -> dict:
    """``floor`` with its seconds per step: by bytes, by indices (at the probed rate and at
    the v5e's) and their maximum."""
    by_bytes = floor["bytes"] / (bandwidth["gb_per_s"] * 1e9)
    by_indices = floor["indices"] / index["rows_per_s"]
    return {**floor, "s_bytes": by_bytes, "s_indices": by_indices,
            "s_indices_at_v5e_rate": floor["indices"] / INDEX_RATE_V5E,
            "s_per_step": max(by_bytes, by_indices)}
