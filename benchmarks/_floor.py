"""An analytic floor for one time step: the bytes it must move over the measured bandwidth.

Per time step of a sequence, from the model's shapes and dtypes (bytes):

* ``W``: the Params, ``|θ|`` elements, read once by the forward pass;
* ``X``: the step's inputs and targets, ``B·(I + O)`` elements, read once;
* ``Hd``: the hidden states, ``B·Σ N·S``, read and written once (``2·Hd``);
* ``Tr``: the traces, read and written once per block of ``K`` steps, ``⌈T/K⌉`` blocks over
  ``T`` steps (the last may be shorter: ``2·Tr·⌈T/K⌉/T`` per step; ``K = 1`` in the per-step
  form): D-RTRL's ``B·|θ|·S`` per traced weight, ES-D-RTRL's ``B·(I + O·S)`` per traced
  operation (``I`` its inputs, ``O`` its outputs): the sizes of the learner's trace arrays.

An online method moves at least ``W + X + 2·Hd + 2·Tr·⌈T/K⌉/T``. BPTT moves at least
``2·W + X + 4·Hd``: the forward's ``W + X + 2·Hd`` (the state it writes is kept), and the
backward reads the Params again, the kept state and the state's cotangent. Both leave out
what an implementation may keep on chip (the gradient's running sum, a block's per-step
values, a step's temporaries), so they are lower bounds: ``measured ÷ floor`` says how far a
step is from the memory limit, not how far from the best implementation.

The bandwidth is measured in the same process (:func:`bandwidth`): ``passes`` in-place
passes ``a ← a + 1`` over one large float32 array inside one program, each reading and
writing the array once. On a CPU a small model's working set sits in the caches, above
main-memory bandwidth, so the ratio may be below 1 there; the floor is meant for the
accelerator, whose on-chip memory a scan's carry does not stay in between steps.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import braintrace
from _floor_bytes import online_bytes_per_step

FORMULAS = {
    "online": "W + X + 2*Hd + 2*Tr*ceil(T/K)/T",
    "bptt": "2*W + X + 4*Hd",
}
TERMS = {
    "W": "Params: |theta| elements, read once",
    "X": "one step's inputs and targets: B*(I + O) elements, read once",
    "Hd": "hidden states: B*sum(N*S), read and written once",
    "Tr": ("traces, read and written once per block of K steps, ceil(T/K) blocks over T steps "
           "(K = 1 per step): D-RTRL B*|theta|*S per traced weight, ES-D-RTRL B*(I + O*S) per "
           "traced operation"),
}


def nbytes(tree: Any) -> int:
    """The bytes of a pytree's arrays (``jax.ShapeDtypeStruct`` leaves too)."""
    return int(sum(np.prod(a.shape, dtype=np.int64) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(tree)))


def model_terms(model: nnx.Module, x: Any, y: Any) -> dict[str, int]:
    """``W``, ``X`` and ``Hd`` of one step of ``model`` on input ``x`` and target ``y``."""
    return {"W": nbytes(nnx.state(model, nnx.Param)), "X": nbytes((x, y)),
            "Hd": nbytes(nnx.state(model, braintrace.HiddenState))}


def floor(terms: dict[str, int], *, traces: Any = None, block: int = 1,
          length: int = 1) -> dict[str, Any]:
    """The bytes per step and their formula: BPTT's without ``traces``, else an online
    method's with ``traces`` (its trace arrays) advanced in blocks of ``block`` steps over a
    sequence of ``length`` steps (``⌈length/block⌉`` passes over them)."""
    if traces is None:
        total = 2 * terms["W"] + terms["X"] + 4 * terms["Hd"]
        return {"formula": FORMULAS["bptt"], "terms": dict(terms), "bytes_per_step": total}
    tr = nbytes(traces)
    total = online_bytes_per_step(terms, tr, block, length)
    return {"formula": FORMULAS["online"],
            "terms": {**terms, "Tr": tr, "K": block, "T": length}, "bytes_per_step": total}


def bandwidth(megabytes: int, passes: int = 8, repeats: int = 3) -> dict[str, Any]:
    """Bytes per second of ``passes`` in-place passes over a ``megabytes`` float32 array
    (each reads and writes it: ``2 · size · passes`` bytes), the fastest of ``repeats``."""
    a = jnp.zeros((megabytes * 2**20 // 4,), jnp.float32)
    run = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda _, v: v + 1.0, a))
    run(a).block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(a).block_until_ready()
        seconds.append(time.perf_counter() - start)
    moved = 2 * a.nbytes * passes
    return {"bytes_per_s": moved / min(seconds), "gb_per_s": moved / min(seconds) / 1e9,
            "probe": f"{passes} passes a <- a + 1 over {megabytes} MiB of float32 in one "
                     f"program, fastest of {repeats}"}


def floor_ratio(entry: dict, probe: dict) -> dict[str, Any]:
    """``entry``'s floor (:func:`floor`) in µs per step at the probe's bandwidth, and
    ``measured ÷ floor`` of the device time, else the jit step's, else the stateful call's;
    where the jit step's device time was measured, also its ``jit_device_ratio``."""
    found = entry["floor"]
    us = found["bytes_per_step"] / probe["bytes_per_s"] * 1e6
    if entry.get("jit_device_step_us") is not None:
        found = {**found, "jit_device_ratio": entry["jit_device_step_us"] / us}
    for key, of in (("device_step_us", "device"), ("jit_step_us_median", "jit_step"),
                    ("step_us_median", "wall")):
        if entry.get(key) is not None:
            return {**found, "us_per_step": us, "ratio": entry[key] / us, "ratio_of": of}
    raise KeyError("no measured time per step")
