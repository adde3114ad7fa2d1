"""Sparse vs dense: D-RTRL step time and trace memory of (layer -> leaky state).

The model is ``h' = 0.9 h + layer(x)`` on ``hidden`` units with a readout
``tanh(h) @ W_o`` (an ``ETPLinear``, same-step gradient only). ``layer`` is an
``ETPLinear (inputs, hidden)`` (``dense``) or an ``ETPSparseLinear`` with a
random connectivity of 10 % or 1 % of the ``inputs × hidden`` pairs
(``sparse_10pct``, ``sparse_1pct``); ``sparse_1pct_spikes`` feeds the 1 % layer
boolean spikes, 10 % of the inputs active, on the event-driven path
(``max_events = inputs / 4``). For each, one
D-RTRL training pass over ``T`` steps is compiled, in two forms (``d_rtrl``:
``etrace_grad``'s default time-blocked traces; ``d_rtrl@1``: the per-step form),
and run ``--repeats`` times, all passes round-robin so that load changes hit
all alike. Reported per form and variant:

* ``trace_bytes``: bytes of the learner's eligibility traces;
* ``xla_temp_bytes``: XLA temporary bytes of the compiled pass;
* ``step_us_median`` / ``step_us_min``: wall time of a pass / ``T``;
* ratios of each to ``dense`` in the same form.

The issue's target: at 1 % connectivity, trace memory ≤ 2 % of dense and a
step faster than dense, in each form (``summary.targets_met``).

Usage::

    python benchmarks/sparse.py            # inputs = hidden = 512, batch 16, T 32
    python benchmarks/sparse.py --quick    # seconds (no spike variant)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.numpy as jnp
import numpy as np
from _models import block, environment, mse, timed, write_json
from flax import nnx

import braintrace
from braintrace import layers

NAME = "sparse"
FULL = {"inputs": 512, "hidden": 512, "outputs": 10, "batch": 16, "T": 32, "repeats": 5}
QUICK = {"inputs": 64, "hidden": 64, "outputs": 3, "batch": 4, "T": 8, "repeats": 2}
VARIANTS = {"dense": None, "sparse_10pct": 0.10, "sparse_1pct": 0.01,
            "sparse_1pct_spikes": 0.01}
FORMS = {"d_rtrl": None, "d_rtrl@1": 1}
"""D-RTRL forms: the default (time-blocked traces) and the per-step form (``block_size=1``)."""
TARGETS = {"trace_ratio_at_1pct": 0.02, "step_ratio_at_1pct": 1.0}


class LeakyLayer(nnx.Module):
    """``h' = 0.9 h + drive(x)``, read out by ``tanh(h) @ W_o``."""

    def __init__(self, drive: nnx.Module, hidden: int, outputs: int):
        self.drive = drive
        self.h = braintrace.HiddenState(jnp.zeros((hidden,)))
        self.out = layers.ETPLinear(hidden, outputs, rngs=nnx.Rngs(1))

    def __call__(self, x):
        self.h[...] = 0.9 * self.h[...] + self.drive(x)
        return self.out(jnp.tanh(self.h[...]))


def build(variant: str, cfg: dict) -> LeakyLayer:
    inputs, hidden = cfg["inputs"], cfg["hidden"]
    density = VARIANTS[variant]
    if density is None:
        drive = layers.ETPLinear(inputs, hidden, rngs=nnx.Rngs(0))
    else:
        mask = np.random.default_rng(0).random((inputs, hidden)) < density
        events = inputs // 4 if variant.endswith("spikes") else None  # ~2.5x the mean activity
        drive = layers.ETPSparseLinear(inputs, hidden, connectivity=mask, max_events=events,
                                       rngs=nnx.Rngs(0))
    model = LeakyLayer(drive, hidden, cfg["outputs"])
    braintrace.init_states(model, cfg["batch"])
    return model


def data(variant: str, cfg: dict):
    kx, ky = jax.random.split(jax.random.key(0))
    shape = (cfg["T"], cfg["batch"], cfg["inputs"])
    xs = (jax.random.bernoulli(kx, 0.1, shape) if variant.endswith("spikes")
          else jax.random.normal(kx, shape))
    ys = jax.random.normal(ky, (cfg["T"], cfg["batch"], cfg["outputs"]))
    return xs, ys


def prepare(variant: str, cfg: dict, block_size: int | None):
    """Compiles one D-RTRL pass; returns ``(run, record)``."""
    model = build(variant, cfg)
    xs, ys = data(variant, cfg)
    start = time.perf_counter()
    learner = braintrace.compile(model, braintrace.D_RTRL(), xs[0], batch_size=cfg["batch"],
                                 strict=True)
    compiled = learner.lower_etrace_grad(xs, ys, mse, block_size=block_size).compile()
    compile_s = time.perf_counter() - start
    trace_bytes = sum(int(np.size(a)) * jnp.dtype(a.dtype).itemsize
                      for a in jax.tree.leaves(learner.traces))
    analysis = compiled.memory_analysis()
    drive = model.drive
    record = {
        "connections": int(drive.kernel.size if variant == "dense" else drive.weight.size),
        "trace_bytes": trace_bytes,
        "xla_temp_bytes": int(analysis.temp_size_in_bytes) if analysis else None,
        "compile_s": compile_s,
    }

    def run():
        return learner.etrace_grad(xs, ys, mse, block_size=block_size)

    block(run())
    return run, record


def measure(cfg: dict, variants: tuple[str, ...]) -> dict:
    """``{form: {variant: record}}``, every pass timed round-robin."""
    prepared = {(f, v): prepare(v, cfg, size) for f, size in FORMS.items() for v in variants}
    times = {key: [] for key in prepared}
    for _ in range(cfg["repeats"]):
        for key, (run, _) in prepared.items():
            times[key].append(timed(run) / cfg["T"] * 1e6)
    results: dict = {form: {} for form in FORMS}
    for (form, v), (_, record) in prepared.items():
        dense = prepared[(form, "dense")][1]
        step, dense_step = float(np.median(times[(form, v)])), float(
            np.median(times[(form, "dense")]))
        record.update(step_us_median=step, step_us_min=float(np.min(times[(form, v)])),
                      trace_ratio_to_dense=record["trace_bytes"] / dense["trace_bytes"],
                      step_ratio_to_dense=step / dense_step)
        if record["xla_temp_bytes"] is not None and dense["xla_temp_bytes"]:
            record["xla_temp_ratio_to_dense"] = record["xla_temp_bytes"] / dense["xla_temp_bytes"]
        results[form][v] = record
        print(f"{form:9s} {v:20s} connections={record['connections']:8d}  trace="
              f"{record['trace_bytes'] / 2**20:8.2f} MiB ({record['trace_ratio_to_dense']:.4f}x)  "
              f"step={step:10.1f} us ({record['step_ratio_to_dense']:.3f}x)", flush=True)
    return results


def summarise(results: dict) -> dict:
    """The 1 % variant against dense, per form and fastest form against fastest form."""
    fastest = {v: min(results[f][v]["step_us_median"] for f in FORMS) for v in results["d_rtrl"]}
    one = results["d_rtrl"]["sparse_1pct"]
    best_ratio = fastest["sparse_1pct"] / fastest["dense"]
    return {
        "trace_ratio_at_1pct": one["trace_ratio_to_dense"],
        "step_ratio_at_1pct": {f: results[f]["sparse_1pct"]["step_ratio_to_dense"]
                               for f in FORMS},
        "step_ratio_at_1pct_fastest_forms": best_ratio,
        "step_ratio_at_10pct_fastest_forms": fastest["sparse_10pct"] / fastest["dense"],
        "targets": TARGETS,
        "targets_met": bool(one["trace_ratio_to_dense"] <= TARGETS["trace_ratio_at_1pct"]
                            and best_ratio < TARGETS["step_ratio_at_1pct"]
                            and all(results[f]["sparse_1pct"]["step_ratio_to_dense"]
                                    < TARGETS["step_ratio_at_1pct"] for f in FORMS)),
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["d_rtrl"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    default = results["d_rtrl"]
    bars = axes[0].bar(names, [default[n]["trace_bytes"] / 2**20 for n in names],
                       color=["tab:red"] + ["tab:blue"] * (len(names) - 1))
    for bar, n in zip(bars, names, strict=True):
        axes[0].annotate(f"{default[n]['trace_ratio_to_dense']:.3g}x",
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_title("D-RTRL trace (MiB, log)")
    width = 0.8 / len(FORMS)
    for i, form in enumerate(FORMS):
        xs = np.arange(len(names)) + (i - (len(FORMS) - 1) / 2) * width
        values = [results[form][n]["step_us_median"] for n in names]
        axes[1].bar(xs, values, width, label=form)
        for x, n, v in zip(xs, names, values, strict=True):
            axes[1].annotate(f"{results[form][n]['step_ratio_to_dense']:.2f}x", (x, v),
                             ha="center", va="bottom", fontsize=7)
    axes[1].set_xticks(np.arange(len(names)), names)
    axes[1].set_yscale("log")
    axes[1].set_title("time per step (µs, log); ratio to dense of the same form")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("ETPSparseLinear vs ETPLinear -> leaky state, D-RTRL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    load_before = os.getloadavg()
    variants = tuple(v for v in VARIANTS if not (args.quick and v.endswith("spikes")))
    results = measure(cfg, variants)
    payload = {"benchmark": NAME, "quick": args.quick, "config": cfg,
               "environment": {**environment(), "load_average_1min_before_after":
                               [load_before[0], os.getloadavg()[0]]},
               "results": results, "summary": summarise(results)}
    write_json(os.path.join(args.out, f"{NAME}.json"), payload)
    plot(results, os.path.join(args.out, f"{NAME}.png"))
    print(payload["summary"])
    return payload


if __name__ == "__main__":
    main()
