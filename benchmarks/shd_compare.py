"""SHD-format data binned as the field does: our BPTT, OTTT and ES-D-RTRL beside spyx 1.0.0's BPTT.

A generated SHD-like data set is written in the Spiking Heidelberg Digits' HDF5 format (per
sample, float16 spike times in seconds and uint16 channels as variable-length arrays, a label;
20 classes of formant sweeps across 700 channels; nothing is downloaded), read back by
``braintrace.tasks.SHD`` and binned as Zenke's SHD tutorial does: ``T = 100`` steps over
``1.4 s``, 0/1 spikes, with each sample's padding masked. The network of ``spyx_compare.py``
(700 inputs, a dense layer into 256 LIF neurons, a dense layer into a leaky readout of 20, batch
64; its ``Net`` and ``spyx_net``) is trained from the same weights on the same batches for
``steps`` Adam updates by spyx's BPTT (``spyx.nn.run``, ``jax.grad``) and by ours, the loss the
readout's cross-entropy at every scored step (the mask-weighted mean, the same in both).

Reported per method: the train step's time per time step (medians of round-robin rounds, wall
and the process's CPU time, each over spyx's, as ``spyx_compare.py`` measures), XLA's memory
analysis of the compiled step (its temporaries over spyx's), and the test accuracy after
training (the readout's outputs summed over each sample's scored steps vote,
``braintrace.tasks.accuracy``).

spyx is never a dependency of braintrace: run this in a virtual environment with both and h5py
(no test runs it)::

    python -m venv .spyx-venv && .spyx-venv/bin/pip install -e ".[shd]" spyx==1.0.0
    nice -n 5 .spyx-venv/bin/python benchmarks/shd_compare.py   # writes shd_compare.json

Its table and figure (``shd_compare.png``: each method's time per step and XLA temporaries over
spyx's, and its test accuracy) are in ``docs/tasks.md`` (``python benchmarks/render_tables.py``
renders the table; ``--plot-only`` redraws the figure from the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import block, environment, write_json
from flax import nnx
from spyx_compare import CONFIG as NETWORK
from spyx_compare import Net, _adam, _dense, cross_entropy, import_spyx, memory, spyx_net

import braintrace
from braintrace import tasks

NAME = "shd_compare"
CONFIG = {**{k: NETWORK[k] for k in ("inputs", "hidden", "outputs", "batch", "tau",
                                     "surrogate_alpha")},
          "num_steps": 100, "max_time": 1.4, "train": 2048, "test": 512, "steps": 200,
          "learning_rate": 2e-3}
METHODS = ("spyx", "bptt", "ottt", "es_d_rtrl")


def write_shd(path: pathlib.Path, n: int, templates: list, rng: np.random.Generator) -> None:
    """``n`` samples in SHD's HDF5 layout: three formant sweeps of the label's template, each
    stretched in time, shifted across the channels and scattered, in background spikes (hard
    enough that the methods' accuracies differ)."""
    with h5py.File(path, "w") as f:
        times = f.create_dataset("spikes/times", (n,), h5py.vlen_dtype(np.float16))
        units = f.create_dataset("spikes/units", (n,), h5py.vlen_dtype(np.uint16))
        labels = rng.integers(0, CONFIG["outputs"], n)
        for i, label in enumerate(labels):
            stretch, shift = rng.uniform(0.7, 1.3), rng.integers(-60, 61)
            background = rng.uniform(0.0, 1.0, rng.poisson(200))
            t, u = [background], [rng.uniform(0, CONFIG["inputs"], background.size)]
            for c0, c1, t0, t1 in templates[label]:
                s = rng.uniform(0.0, 1.0, rng.poisson(40))
                t.append((t0 + s * (t1 - t0)) * stretch + rng.normal(0.0, 0.03, s.size))
                u.append(c0 + s * (c1 - c0) + shift + rng.normal(0.0, 20.0, s.size))
            t, u = np.concatenate(t), np.concatenate(u)
            keep = (t >= 0) & (u >= 0) & (u < CONFIG["inputs"])
            order = np.argsort(t[keep])
            times[i] = t[keep][order].astype(np.float16)
            units[i] = u[keep][order].astype(np.uint16)
        f["labels"] = labels.astype(np.uint8)


def shd_like(folder: pathlib.Path) -> tasks.SHD:
    """The generated files, read and binned as the field bins SHD."""
    rng = np.random.default_rng(0)
    templates = [[(*rng.uniform(50, 650, 2), rng.uniform(0.05, 0.5), rng.uniform(0.4, 0.9))
                  for _ in range(3)] for _ in range(CONFIG["outputs"])]
    write_shd(folder / "shd_train.h5", CONFIG["train"], templates, rng)
    write_shd(folder / "shd_test.h5", CONFIG["test"], templates, rng)
    return tasks.SHD(folder, num_steps=CONFIG["num_steps"], max_time=CONFIG["max_time"],
                     validation_fraction=0.05)


def masked_cross_entropy(logits, labels, mask):
    """``Σ_tb m_tb CE_tb / Σ_tb m_tb``: the mean over the scored (step, sample) pairs."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * mask) / jnp.sum(mask)


def spyx_method(spyx, model, tx):
    """spyx's train step ``(params, opt, xs, ys, mask)`` and its readout ``(params, xs)``."""
    graphdef, params, rest = nnx.split(model, _dense, ...)

    def outputs(params, xs):
        return spyx.nn.run(nnx.merge(graphdef, params, rest), xs)[0]

    def step(params, opt, xs, ys, mask):
        value, grads = jax.value_and_grad(
            lambda p: masked_cross_entropy(outputs(p, xs), ys, mask))(params)
        return (*_adam(grads, opt, params, tx), value)

    return step, outputs, params


def our_method(model, method: str, tx, x0):
    """Our train step ``(params, opt, xs, ys, mask)`` (``online_grad`` of the rule, from rest
    for every batch) and the readout ``(params, xs)`` (``braintrace.evaluate``)."""
    learner = braintrace.compile(model, method, x0, batch_size=x0.shape[0])
    online = braintrace.online_grad(learner, cross_entropy)  # per sample: a (T, B) mask
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    start = online.init(model)

    def step(params, opt, xs, ys, mask):
        model = nnx.merge(graphdef, params, rest)
        grads, _, stats = online.grad(model, start, xs, ys, mask=mask)
        return (*_adam(grads, opt, params, tx), jnp.sum(stats.losses))

    def outputs(params, xs):
        return braintrace.evaluate(nnx.merge(graphdef, params, rest), xs)

    return step, outputs, params


def prepare(shd: tasks.SHD, spyx) -> dict[str, dict[str, Any]]:
    """Each method's compiled train step, readout, starting Params and memory analysis."""
    batch = shd.sample(jax.random.key(0), CONFIG["batch"])
    tx = optax.adam(CONFIG["learning_rate"])
    prepared = {}
    for method in METHODS:
        model = Net(NETWORK, nnx.Rngs(0))
        braintrace.init_states(model, CONFIG["batch"])
        if method == "spyx":
            step, outputs, params = spyx_method(spyx, spyx_net(spyx, model, NETWORK), tx)
        else:
            step, outputs, params = our_method(model, method, tx, batch.xs[0])
        start = time.perf_counter()
        compiled = jax.jit(step).lower(params, tx.init(params), *batch).compile()
        prepared[method] = {"step": compiled, "outputs": jax.jit(outputs), "params": params,
                            "opt": tx.init(params), "batch": batch,
                            "record": {"compile_s": time.perf_counter() - start,
                                       "xla": memory(compiled)}}
    return prepared


def time_steps(prepared: dict[str, dict[str, Any]], repeats: int) -> None:
    """Round-robin rounds of one train step per method on one batch; medians per time step."""
    wall = {m: [] for m in prepared}
    cpu = {m: [] for m in prepared}
    for _ in range(repeats):
        for method, p in prepared.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            block(p["step"](p["params"], p["opt"], *p["batch"]))
            wall[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
    steps = CONFIG["num_steps"]
    for method, p in prepared.items():
        p["record"].update(
            step_us_median=float(np.median(wall[method]) / steps * 1e6),
            cpu_us_median=float(np.median(cpu[method]) / steps * 1e6),
            time_ratio_to_spyx=float(np.median(wall[method]) / np.median(wall["spyx"])),
            cpu_ratio_to_spyx=float(np.median(cpu[method]) / np.median(cpu["spyx"])),
            temp_ratio_to_spyx=p["record"]["xla"]["temp"] / prepared["spyx"]["record"]["xla"][
                "temp"])


def train_and_test(shd: tasks.SHD, p: dict[str, Any]) -> None:
    """``steps`` updates on the epochs' shuffled batches (the same for every method), then the
    test split's accuracy."""
    params, opt, updates = p["params"], p["opt"], 0
    epoch, start = 0, time.perf_counter()
    while updates < CONFIG["steps"]:
        for batch in shd.batches("train", CONFIG["batch"], key=jax.random.key(epoch)):
            params, opt, _ = p["step"](params, opt, *batch)
            updates += 1
            if updates == CONFIG["steps"]:
                break
        epoch += 1
    right = 0.0
    for batch in shd.batches("test", CONFIG["batch"]):
        accuracy = tasks.accuracy(p["outputs"](params, batch.xs), batch)
        right += float(accuracy) * float(np.asarray(batch.mask).any(0).sum())
    p["record"].update(train_s=time.perf_counter() - start,
                       test_accuracy=right / shd.size("test"))


def plot(results: dict[str, Any], path: str) -> None:
    """Each method's wall time per step and XLA temporaries over spyx's, and its test accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (("time_ratio_to_spyx", "time per step over spyx's", 1.0),
              ("temp_ratio_to_spyx", "XLA temporaries over spyx's", 1.0),
              ("test_accuracy", "test accuracy", None))
    for ax, (key, label, reference) in zip(axes, panels):
        ax.bar(methods, [results[m][key] for m in methods],
               color=[f"C{i}" for i in range(len(methods))])
        if reference is not None:
            ax.axhline(reference, color="k", lw=0.8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("SHD-format data, T = 100, batch 64: ours beside spyx 1.0.0's BPTT (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw shd_compare.png from shd_compare.json (no spyx needed)")
    args = parser.parse_args(argv)
    out = os.path.join(HERE, "results", f"{NAME}.json")
    if args.plot_only:
        with open(out) as f:
            plot(json.load(f)["results"], out.replace(".json", ".png"))
        return
    spyx = import_spyx()
    with tempfile.TemporaryDirectory() as folder:
        shd = shd_like(pathlib.Path(folder))
        prepared = prepare(shd, spyx)
        time_steps(prepared, args.repeats)
        for method, p in prepared.items():
            train_and_test(shd, p)
            r = p["record"]
            print(f"{method:10s} {r['step_us_median']:7.1f} us/step "
                  f"({r['time_ratio_to_spyx']:.2f}x, CPU {r['cpu_ratio_to_spyx']:.2f}x)  temp "
                  f"{r['xla']['temp'] / 2**20:6.1f} MiB ({r['temp_ratio_to_spyx']:.2f}x)  test "
                  f"accuracy {r['test_accuracy']:.3f}", flush=True)
    results = {method: p["record"] for method, p in prepared.items()}
    write_json(out, {"config": CONFIG, "repeats": args.repeats, "spyx": spyx.__version__,
                     "environment": environment(), "results": results})
    plot(results, out.replace(".json", ".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
