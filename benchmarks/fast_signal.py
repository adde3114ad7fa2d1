"""The fast learning signal (``signal='fast'``) against the exact one and BPTT, in one run.

On the benchmark GRU and two-layer recurrent LIF networks (``_models.py``; hidden 256,
input 64, batch 16), for ES-D-RTRL and D-RTRL with ``signal='exact'`` and ``'fast'`` and
BPTT:

* ``step_us``: median wall time of one compiled ``etrace_grad`` pass (BPTT: one ``jax.grad``
  pass) over ``T`` steps, divided by ``T``, over ``--repeats`` runs taken round-robin so
  that a change in machine load hits every method alike; ``ratio_to_bptt`` in the same run;
* ``cosine``: of each gradient to BPTT's at ``T = --cosine-length`` (float32, same weights
  and data).

Usage::

    python benchmarks/fast_signal.py                  # T = 250 and 1000, 3 repeats
    python benchmarks/fast_signal.py --quick          # seconds
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np
from _models import (
    FULL,
    QUICK,
    block,
    bptt_grad_fn,
    build,
    data,
    environment,
    flat,
    mse,
    timed,
    write_json,
)

import braintrace

METHODS = ("bptt", "es_d_rtrl", "es_d_rtrl:fast", "d_rtrl", "d_rtrl:fast")


def algorithm(method: str):
    """``'es_d_rtrl:fast'`` -> ``ESDRTRL(signal='fast')``."""
    name, _, signal = method.partition(":")
    cls = braintrace.ESDRTRL if name == "es_d_rtrl" else braintrace.DRTRL
    return cls(signal=signal or "exact")


def prepare(model_name: str, method: str, cfg: dict, xs, ys):
    """``(run, first)``: a compiled pass ``run() -> grads`` and its first gradient, from the
    model's initial state (as BPTT's; later online passes continue from where they ended)."""
    model = build(model_name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
    if method == "bptt":
        grad_fn, params, hidden = bptt_grad_fn(model)
        compiled = grad_fn.lower(params, hidden, xs, ys).compile()

        def run():
            return compiled(params, hidden, xs, ys)
    else:
        learner = braintrace.compile(model, algorithm(method), xs[0], batch_size=cfg["batch"])

        def run():
            return learner.etrace_grad(xs, ys, mse)

    first = run()  # compiles (online: on the first call)
    block(first)
    return run, np.asarray(flat(first))


def measure(model_name: str, cfg: dict, lengths, cosine_length: int, repeats: int) -> dict:
    out = {}
    for length in lengths:
        xs, ys = data(model_name, length, cfg["inputs"], cfg["outputs"], cfg["batch"])
        prepared = {m: prepare(model_name, m, cfg, xs, ys) for m in METHODS}
        runs = {m: run for m, (run, _) in prepared.items()}
        times = {m: [] for m in METHODS}
        for _ in range(repeats):
            for m in METHODS:
                times[m].append(timed(runs[m]) / length * 1e6)
        bptt = float(np.median(times["bptt"]))
        out[str(length)] = {m: {"step_us": float(np.median(t)), "min_us": float(np.min(t)),
                                "ratio_to_bptt": float(np.median(t)) / bptt}
                            for m, t in times.items()}
        if length == cosine_length:
            grads = {m: first for m, (_, first) in prepared.items()}
            for m in METHODS:
                ref = grads["bptt"]
                out[str(length)][m]["cosine"] = float(
                    grads[m] @ ref / np.linalg.norm(grads[m]) / np.linalg.norm(ref))
        print(model_name, length, {m: round(v["step_us"], 1) for m, v in out[str(length)].items()},
              flush=True)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, name in zip(axes[0], models):
        per_length = results["models"][name]
        lengths = sorted(per_length, key=int)
        for m in METHODS:
            ax.plot([int(t) for t in lengths], [per_length[t][m]["ratio_to_bptt"]
                                                for t in lengths], "o-", label=m)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=name, xlabel="T", ylabel="time per step / BPTT's", xscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--cosine-length", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    lengths = [20] if args.quick else args.lengths
    cosine_length = 20 if args.quick else args.cosine_length
    results = {"config": cfg, "methods": METHODS, "repeats": args.repeats,
               "environment": environment(),
               "note": "median of round-robin repeats on a shared 2-core CPU; ratios in one run",
               "models": {name: measure(name, cfg, lengths, cosine_length, args.repeats)
                          for name in ("gru", "snn")}}
    write_json(os.path.join(args.out, "fast_signal.json"), results)
    plot(results, os.path.join(args.out, "fast_signal.png"))
    return results


if __name__ == "__main__":
    main()
