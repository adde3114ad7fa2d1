"""Shared pieces of the benchmarks: models, data, the BPTT reference and timers.

Models, each one time step per call:

* ``snn``: two recurrent LIF layers (``RecurrentSpiking``) and a leaky readout;
* ``gru``: one GRU cell (``Stateful(GRUCell)``) and a linear readout;
* ``alif``: ``snn`` with adaptive LIF neurons, two coupled states per neuron
  (``S = 2``: the D-RTRL trace is twice as large and mixes across states),
  timed by the throughput benchmark only;
* ``demo``: the model of ``python -m braintrace`` (one recurrent ALIF layer and a
  leaky readout), at the demo's size (:data:`DEMO`), timed by the throughput
  benchmark only.

``bptt_grad_fn`` is the reference every benchmark compares against: ``jax.grad``
of the mean loss through ``jax.lax.scan`` of the pure step (the model split
into Params, hidden states and the rest, and re-merged every step).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import braintrace
from braintrace import layers

MODELS = ("snn", "gru")
SPIKING = ("snn", "alif", "demo")

# Full-size configuration shared by the memory and throughput benchmarks.
FULL = {"hidden": 256, "inputs": 64, "outputs": 10, "batch": 16}
QUICK = {"hidden": 16, "inputs": 8, "outputs": 3, "batch": 2}
# The demo's size (python -m braintrace): 64 ALIF neurons, 20 inputs, 10 classes, batch 32.
DEMO = {"hidden": 64, "inputs": 20, "outputs": 10, "batch": 32}


class SNN(nnx.Module):
    """Two recurrent spiking layers (LIF by default) and a leaky-integrator readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs,
                 dtype=jnp.float32, neuron=layers.LIF):
        self.l1 = layers.RecurrentSpiking(inputs, neuron(hidden, param_dtype=dtype),
                                          rngs=rngs, param_dtype=dtype)
        self.l2 = layers.RecurrentSpiking(hidden, neuron(hidden, param_dtype=dtype),
                                          rngs=rngs, param_dtype=dtype)
        self.readout = layers.LeakyReadout(hidden, outputs, rngs=rngs, param_dtype=dtype)

    def __call__(self, x):
        return self.readout(self.l2(self.l1(x)))


class GRUNet(nnx.Module):
    """One GRU cell and a linear readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.rnn = layers.Stateful(layers.GRUCell(inputs, hidden, rngs=rngs, param_dtype=dtype))
        self.readout = layers.ETPLinear(hidden, outputs, rngs=rngs, param_dtype=dtype)

    def __call__(self, x):
        return self.readout(self.rnn(x))


def build(name: str, inputs: int, hidden: int, outputs: int, batch: int, seed: int = 0,
          dtype=jnp.float32) -> nnx.Module:
    """A fresh model with hidden states initialised for ``batch``."""
    if name == "alif":
        model = SNN(inputs, hidden, outputs, nnx.Rngs(seed), dtype, neuron=layers.ALIF)
    elif name == "demo":
        from braintrace.__main__ import SpikingNet
        model = SpikingNet(inputs, hidden, outputs, rngs=nnx.Rngs(seed))
    else:
        model = {"snn": SNN, "gru": GRUNet}[name](inputs, hidden, outputs, nnx.Rngs(seed), dtype)
    braintrace.init_states(model, batch)
    return model


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def data(name: str, T: int, inputs: int, outputs: int, batch: int, key: int = 0,
         dtype=jnp.float32):
    """Inputs and targets, time axis leading. The SNN gets inputs that make it spike."""
    kx, ky = jax.random.split(jax.random.key(key))
    scale = 2.0 if name in SPIKING else 1.0
    xs = scale * jax.random.normal(kx, (T, batch, inputs), dtype)
    ys = jax.random.normal(ky, (T, batch, outputs), dtype)
    return xs, ys


def split(model: nnx.Module):
    return nnx.split(model, nnx.Param, braintrace.HiddenState, ...)


def bptt_grad_fn(model: nnx.Module, loss_fn=mse) -> tuple[Callable, Any, Any]:
    """``(jitted grad(params, hidden, xs, ys), params, hidden)`` for full BPTT."""
    graphdef, params, hidden, other = split(model)

    def total(params, hidden, xs, ys):
        def body(h, xy):
            m = nnx.merge(graphdef, params, h, other, copy=True)
            y = m(xy[0])
            return split(m)[2], loss_fn(y, xy[1])

        return jax.lax.scan(body, hidden, (xs, ys))[1].mean()

    return jax.jit(jax.grad(total)), params, hidden


def flat(tree) -> jnp.ndarray:
    return jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(tree)])


def block(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf.block_until_ready()


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()`` until its outputs are ready."""
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def device_seconds(fn: Callable[[], Any]) -> float | None:
    """Seconds the accelerator spent executing ``fn()``'s programs, from a profile.

    ``fn`` runs once under ``jax.profiler.trace``; the durations of the device's
    ``XLA Modules`` (whole programs) are summed from the Perfetto trace it writes. What the
    host spends dispatching, checking and copying is left out. ``None`` on the CPU backend,
    whose programs run on the host (no device lane in the trace).
    """
    import glob
    import gzip
    import tempfile

    if jax.default_backend() == "cpu":
        return None
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            block(fn())
        files = glob.glob(f"{logdir}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
            return None
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in e["args"]["name"]}
    total = sum(e.get("dur", 0.0) for e in events if e.get("ph") == "X" and e["pid"] in devices
                and names.get((e["pid"], e.get("tid"))) == "XLA Modules")
    return total * 1e-6


def library_state() -> dict[str, Any]:
    """Which braintrace was measured: the commit and a hash of uncommitted library changes."""
    import hashlib
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=False, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    diff = git("diff", "HEAD", "--", "braintrace", "layers")
    untracked = git("ls-files", "--others", "--exclude-standard", "braintrace", "layers")
    return {"commit": git("rev-parse", "HEAD").strip(),
            "uncommitted_library_diff_sha1": hashlib.sha1((diff + untracked).encode())
            .hexdigest()[:12] if (diff or untracked) else None}


def environment() -> dict[str, Any]:
    return {
        "braintrace": library_state(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=_default)
        f.write("\n")


def _default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def count_params(model: nnx.Module) -> int:
    return int(sum(np.size(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))))


def firing_rates(model: nnx.Module, xs) -> dict[str, float]:
    """Mean spike rate of each LIF layer of an :class:`SNN` over ``xs`` (zero initial state)."""
    graphdef, params, hidden, other = split(model)

    def body(h, x):
        m = nnx.merge(graphdef, params, h, other, copy=True)
        m(x)
        return split(m)[2], (jnp.mean(m.l1.neuron.spikes()), jnp.mean(m.l2.neuron.spikes()))

    _, (r1, r2) = jax.lax.scan(body, hidden, xs)
    return {"l1": float(jnp.mean(r1)), "l2": float(jnp.mean(r2))}


def data_numpy(name: str, T: int, inputs: int, outputs: int, batch: int, seed: int = 0):
    """Like :func:`data`, but drawn by NumPy in float32 with no temporaries of the full size.

    For memory measurements: creating the inputs then costs one host copy, not the
    several full-size buffers of a random-number program.
    """
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((T, batch, inputs), dtype=np.float32)
    if name in SPIKING:
        xs *= 2.0
    ys = rng.standard_normal((T, batch, outputs), dtype=np.float32)
    return xs, ys
