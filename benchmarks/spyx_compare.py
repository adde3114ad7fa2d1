"""Against spyx 1.0.0: the same LIF network, time per step and XLA's memory of each train step.

spyx (a JAX SNN library on Flax NNX, trained with BPTT) and braintrace run the same network —
700 inputs, a dense layer into 256 LIF neurons, a dense layer into a leaky integrator of 20
outputs, batch 64 — from the same weights on the same data (Bernoulli input spikes, one label
per sample scored at every step by softmax cross-entropy, averaged over time), at ``T`` 100 and
1000. Each method is one compiled train step (the gradient and an Adam update of the dense
layers' kernels and biases; the leaks are fixed in both), ``jax.jit`` over pure arguments:

* ``spyx``: ``spyx.nn.run`` of a ``spyx.nn.Sequential`` (``nnx.Linear``, ``LIF``,
  ``nnx.Linear``, ``LI``), ``jax.grad`` of the loss;
* ``bptt``: ours, ``braintrace.compile(model, 'bptt')`` and ``online_grad`` in the step;
* ``jax.grad``: ours as users write it, ``jax.grad`` through ``jax.lax.scan`` of the model's
  pure step (``_models.bptt_grad_fn``'s form);
* ``jax.grad+remat``: the same with the scan's body under
  ``jax.checkpoint(..., policy=jax.checkpoint_policies.dots_saveable)`` (what ``bptt`` does);
* ``ottt``, ``es_d_rtrl``: online learning by those rules, for reference.

Reported per method and ``T``: the median (and min) wall time per step of the train step and
the median CPU time of the process per step (the methods run round-robin, as ``throughput.py``
does, so that load changes hit all alike; on a shared machine the CPU time is the steadier),
their ratios to spyx's, and XLA's memory analysis of the compiled step (``temp_size_in_bytes``
etc.) with the temporaries' ratio to spyx's. The two neurons differ in one convention: spyx's LIF
emits the spikes of the membrane before the step (a step's delay) and leaks the reset, ours
emits those after it (``layers.LIF``); both use the SuperSpike surrogate at sharpness 25.

spyx is never a dependency of braintrace: run this script in a virtual environment that has
both (no test runs it; it has no quick mode, for it needs spyx)::

    python -m venv .spyx-venv && .spyx-venv/bin/pip install -e . spyx==1.0.0
    nice -n 5 .spyx-venv/bin/python benchmarks/spyx_compare.py   # writes spyx_compare.json/.png
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import block, environment, write_json
from flax import nnx

import braintrace
from braintrace import layers

NAME = "spyx_compare"
CONFIG = {"inputs": 700, "hidden": 256, "outputs": 20, "batch": 64, "tau": 20.0,
          "surrogate_alpha": 25.0, "input_rate": 0.05, "learning_rate": 1e-3}
METHODS = ("spyx", "bptt", "jax.grad", "jax.grad+remat", "ottt", "es_d_rtrl")
INSTALL = ("spyx_compare.py needs spyx 1.0.0 beside braintrace, in its own virtual "
           "environment (spyx is not a dependency of braintrace):\n"
           "    python -m venv .spyx-venv && .spyx-venv/bin/pip install -e . spyx==1.0.0\n"
           "    .spyx-venv/bin/python benchmarks/spyx_compare.py")


def import_spyx():
    """spyx, or a clear exit that says how to get it."""
    try:
        import spyx
    except ImportError:
        raise SystemExit(INSTALL) from None
    return spyx


class Net(nnx.Module):
    """Ours: a dense layer into LIF neurons, a leaky readout (the module docstring's network)."""

    def __init__(self, cfg: dict[str, Any], rngs: nnx.Rngs):
        self.dense = layers.ETPLinear(cfg["inputs"], cfg["hidden"], rngs=rngs)
        self.lif = layers.LIF(cfg["hidden"], tau=cfg["tau"], surrogate="superspike",
                              surrogate_alpha=cfg["surrogate_alpha"])
        self.readout = layers.LeakyReadout(cfg["hidden"], cfg["outputs"], tau=cfg["tau"],
                                           rngs=rngs)

    def __call__(self, x):
        return self.readout(self.lif(self.dense(x)))


def spyx_net(spyx, ours: Net, cfg: dict[str, Any]):
    """spyx's network, its dense layers holding our initial weights."""
    beta = math.exp(-1.0 / cfg["tau"])
    rngs = nnx.Rngs(0)
    model = spyx.nn.Sequential(
        nnx.Linear(cfg["inputs"], cfg["hidden"], rngs=rngs),
        spyx.nn.LIF((cfg["hidden"],), beta=beta, activation=spyx.axn.superspike(
            cfg["surrogate_alpha"]), rngs=rngs),
        nnx.Linear(cfg["hidden"], cfg["outputs"], rngs=rngs),
        spyx.nn.LI((cfg["outputs"],), beta=beta, rngs=rngs))
    for theirs, mine in ((model.layers[0], ours.dense), (model.layers[2], ours.readout.linear)):
        theirs.kernel[...] = mine.kernel[...]
        theirs.bias[...] = mine.bias[...]
    return model


def data(T: int, cfg: dict[str, Any], seed: int = 0):
    """Bernoulli input spikes ``(T, B, inputs)`` and one label per sample, ``(T, B)``."""
    rng = np.random.default_rng(seed)
    xs = (rng.random((T, cfg["batch"], cfg["inputs"])) < cfg["input_rate"]).astype(np.float32)
    labels = rng.integers(0, cfg["outputs"], cfg["batch"])
    return jnp.asarray(xs), jnp.asarray(np.broadcast_to(labels, (T, cfg["batch"])))


def cross_entropy(y, label):
    return optax.softmax_cross_entropy_with_integer_labels(y, label).mean()


def _dense(path, value) -> bool:
    """The dense layers' kernels and biases (spyx's leaks ``beta`` stay fixed, as ours)."""
    return isinstance(value, nnx.Param) and path[-1] in ("kernel", "bias")


def _adam(grads, opt, params, tx):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt


def spyx_step(spyx, model, tx):
    """``(step, args)``: spyx's train step and its arguments."""
    graphdef, params, rest = nnx.split(model, _dense, ...)

    def loss(params, xs, ys):
        out, _ = spyx.nn.run(nnx.merge(graphdef, params, rest), xs)
        return jnp.mean(jax.vmap(cross_entropy)(out, ys))

    def step(params, opt, xs, ys):
        value, grads = jax.value_and_grad(loss)(params, xs, ys)
        return (*_adam(grads, opt, params, tx), value)

    return step, (params, tx.init(params))


def grad_step(model: Net, tx, remat: bool):
    """``(step, args)``: ``jax.grad`` through ``jax.lax.scan`` of our pure step (``remat``:
    the body under ``jax.checkpoint`` keeping the matrix products)."""
    graphdef, params, hidden, other = nnx.split(model, nnx.Param, braintrace.HiddenState, ...)

    def loss(params, hidden, xs, ys):
        def body(h, xy):
            m = nnx.merge(graphdef, params, h, other, copy=True)
            y = m(xy[0])
            return nnx.split(m, nnx.Param, braintrace.HiddenState, ...)[2], \
                cross_entropy(y, xy[1])

        if remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
        return jax.lax.scan(body, hidden, (xs, ys))[1].mean()

    def step(params, opt, hidden, xs, ys):
        value, grads = jax.value_and_grad(loss)(params, hidden, xs, ys)
        return (*_adam(grads, opt, params, tx), value)

    return step, (params, tx.init(params), hidden)


def online_step(model: Net, method: str, tx, x0):
    """``(step, args)``: ``online_grad`` of ``braintrace.compile(model, method)`` in the step."""
    learner = braintrace.compile(model, method, x0, batch_size=x0.shape[0])
    online = braintrace.online_grad(learner, cross_entropy)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, opt, state, xs, ys):
        grads, state, stats = online.grad(nnx.merge(graphdef, params, rest), state, xs, ys)
        return (*_adam(grads, opt, params, tx), jnp.mean(stats.losses))

    return step, (params, tx.init(params), online.init(model))


def memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled step, in bytes."""
    ma = compiled.memory_analysis()
    xla = {key: int(getattr(ma, f"{key}_size_in_bytes"))
           for key in ("argument", "output", "temp", "alias", "generated_code")}
    xla["peak"] = xla["argument"] + xla["output"] + xla["temp"] - xla["alias"]
    return xla


def prepare(T: int, cfg: dict[str, Any], spyx) -> dict[str, tuple[Callable[[], Any], dict]]:
    """Each method's compiled train step as ``(run, record)`` at length ``T``."""
    xs, ys = data(T, cfg)
    tx = optax.adam(cfg["learning_rate"])
    prepared = {}
    for method in METHODS:
        model = Net(cfg, nnx.Rngs(0))
        braintrace.init_states(model, cfg["batch"])
        if method == "spyx":
            step, args = spyx_step(spyx, spyx_net(spyx, model, cfg), tx)
        elif method.startswith("jax.grad"):
            step, args = grad_step(model, tx, remat=method.endswith("+remat"))
        else:
            step, args = online_step(model, method, tx, xs[0])
        start = time.perf_counter()
        compiled = jax.jit(step).lower(*args, xs, ys).compile()
        record = {"compile_s": time.perf_counter() - start, "xla": memory(compiled)}
        first = compiled(*args, xs, ys)
        record["loss"] = float(first[-1])
        prepared[method] = (lambda c=compiled, a=args: c(*a, xs, ys)), record
    return prepared


def measure(T: int, cfg: dict[str, Any], spyx, repeats: int) -> dict[str, Any]:
    """Every method at length ``T``: round-robin times (wall and the process's CPU time, which
    other jobs on a shared machine disturb less) and memory, with ratios to spyx's."""
    prepared = prepare(T, cfg, spyx)
    wall: dict[str, list[float]] = {m: [] for m in prepared}
    cpu: dict[str, list[float]] = {m: [] for m in prepared}
    for _ in range(repeats):
        for method, (run, _) in prepared.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            block(run())
            wall[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
    entries = {}
    base_wall, base_cpu = float(np.median(wall["spyx"])), float(np.median(cpu["spyx"]))
    base_temp = prepared["spyx"][1]["xla"]["temp"]
    for method, (_, record) in prepared.items():
        e = entries[method] = {
            **record, "step_us_median": float(np.median(wall[method]) / T * 1e6),
            "step_us_min": float(np.min(wall[method]) / T * 1e6),
            "cpu_us_median": float(np.median(cpu[method]) / T * 1e6),
            "time_ratio_to_spyx": float(np.median(wall[method])) / base_wall,
            "cpu_ratio_to_spyx": float(np.median(cpu[method])) / base_cpu,
            "temp_ratio_to_spyx": record["xla"]["temp"] / base_temp}
        print(f"T={T:5d} {method:15s} {e['step_us_median']:8.1f} us/step "
              f"({e['time_ratio_to_spyx']:.2f}x, CPU {e['cpu_ratio_to_spyx']:.3f}x)  temp "
              f"{e['xla']['temp'] / 2**20:7.1f} MiB ({e['temp_ratio_to_spyx']:.3f}x)", flush=True)
    return entries


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lengths = list(results)
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        where = [k + i * width for k in range(len(lengths))]
        for ax, key in zip(axes, ("temp_ratio_to_spyx", "cpu_ratio_to_spyx")):
            ax.bar(where, [results[t][method][key] for t in lengths], width, label=method)
    for ax, what in zip(axes, ("XLA temporaries", "CPU time per step")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(lengths))], lengths)
        ax.set_ylabel(f"{what} over spyx's")
    axes[1].legend(fontsize=8, loc="lower center", ncol=3)
    fig.suptitle("The same LIF network against spyx 1.0.0 (train step, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="100,1000")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default=NAME, help="the results' file name, without .json")
    args = parser.parse_args(argv)
    spyx = import_spyx()
    results = {}
    for T in (int(t) for t in args.lengths.split(",")):
        results[f"T={T}"] = measure(T, CONFIG, spyx, args.repeats)
    out = os.path.join(HERE, "results", f"{args.name}.json")
    write_json(out, {"config": CONFIG, "repeats": args.repeats,
                     "spyx": spyx.__version__, "environment": environment(),
                     "results": results})
    plot(results, out.replace(".json", ".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
