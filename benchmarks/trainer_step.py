"""``OnlineTrainer`` against ``etrace_grad``, per time step, in one run.

On the benchmark GRU and two-layer recurrent LIF networks (``_models.py``; hidden 256,
input 64, batch 16), for D-RTRL and ES-D-RTRL, each over ``T`` steps:

* ``grad``: ``learner.etrace_grad`` (the default: time blocks of 32);
* ``grad@1``: ``etrace_grad(block_size=1)``, the per-step form;
* ``trainer@1``: ``OnlineTrainer(optax.adam, update_every=1)``, an update every step
  (the Params change every step, so the per-step form);
* ``trainer@32``: ``OnlineTrainer(update_every=32)`` (each window in one time block);
* ``evolve``: ``learner.etrace_evolve``, the model's step and its trace update alone (no loss,
  no gradient);
* ``optimizer``: the optax update alone (``optax.adam``, ``update`` and ``apply_updates``)
  on the model's Params, once per step in a ``scan``;

median wall time per step over ``--repeats`` passes taken round-robin (a change of machine
load hits every variant alike), and ratios to ``grad`` in the same run. ``per_step_floor``
is ``grad@1 + optimizer``: what an update every step runs at least, the per-step gradient
(its Params change every step, so it cannot use time blocks) and the optimiser, with nothing
of the trainer's own around them.

Usage::

    python benchmarks/trainer_step.py                # T = 256, 5 repeats
    python benchmarks/trainer_step.py --quick        # seconds
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import numpy as np
import optax
from _models import FULL, QUICK, build, data, environment, mse, timed, write_json
from flax import nnx

import braintrace

VARIANTS = ("grad", "grad@1", "trainer@1", "trainer@32", "evolve", "optimizer")


def optimizer_alone(model, tx, length: int):
    """``run()``: ``tx``'s update alone on ``model``'s Params, once per step over ``length``.

    The gradient is a cheap function of the Params (``1 + 10⁻³ p``), so the update cannot
    be hoisted out of the loop.
    """
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)

    @jax.jit
    def steps(params, opt_state):
        def step(carry, _):
            p, s = carry
            updates, s = tx.update(jax.tree.map(lambda a: 1.0 + 1e-3 * a, p), s, p)
            return (optax.apply_updates(p, updates), s), None

        return jax.lax.scan(step, (params, opt_state), None, length=length)[0]

    return lambda: steps(params, opt_state)


def prepare(model_name: str, method: str, cfg: dict, xs, ys) -> dict:
    """Each variant as a call ``run()`` (compiled by one first call)."""
    runs = {}
    for variant in VARIANTS:
        model = build(model_name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
        learner = braintrace.compile(model, method, xs[0], batch_size=cfg["batch"])
        kind, _, every = variant.partition("@")
        if kind == "evolve":
            runs[variant] = lambda lr=learner: lr.etrace_evolve(xs)
        elif kind == "optimizer":
            runs[variant] = optimizer_alone(model, optax.adam(1e-3), xs.shape[0])
        elif kind == "grad":
            block = None if not every else int(every)
            runs[variant] = lambda lr=learner, b=block: lr.etrace_grad(xs, ys, mse, block_size=b)
        else:
            trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-3), loss_fn=mse,
                                               update_every=int(every))
            runs[variant] = lambda tr=trainer: tr.step(xs, ys)
        timed(runs[variant])
    return runs


def measure(model_name: str, method: str, cfg: dict, length: int, repeats: int) -> dict:
    xs, ys = data(model_name, length, cfg["inputs"], cfg["outputs"], cfg["batch"])
    runs = prepare(model_name, method, cfg, xs, ys)
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            times[v].append(timed(runs[v]) / length * 1e6)
    grad = float(np.median(times["grad"]))
    out = {v: {"step_us": float(np.median(t)), "min_us": float(np.min(t)),
               "ratio_to_grad": float(np.median(t)) / grad} for v, t in times.items()}
    floor = out["grad@1"]["step_us"] + out["optimizer"]["step_us"]
    out["per_step_floor"] = {"step_us": floor, "ratio_to_grad": floor / grad}
    print(model_name, method, {v: round(r["ratio_to_grad"], 2) for v, r in out.items()},
          flush=True)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m, a) for m in results["models"] for a in results["models"][m]]
    bars = (*VARIANTS, "per_step_floor")
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(bars)
    for i, v in enumerate(bars):
        ax.bar([j + i * width for j in range(len(rows))],
               [results["models"][m][a][v]["ratio_to_grad"] for m, a in rows], width, label=v)
    ax.axhline(2.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"{m}\n{a}" for m, a in rows], fontsize=8)
    ax.set(ylabel="time per step / etrace_grad's")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    length = 64 if args.quick else args.length
    results = {"config": cfg, "T": length, "variants": VARIANTS, "repeats": args.repeats,
               "environment": environment(),
               "note": "median of round-robin repeats on a shared 2-core CPU; ratios in one run",
               "models": {name: {method: measure(name, method, cfg, length, args.repeats)
                                 for method in ("d_rtrl", "es_d_rtrl")}
                          for name in ("gru", "snn")}}
    write_json(os.path.join(args.out, "trainer_step.json"), results)
    plot(results, os.path.join(args.out, "trainer_step.png"))
    return results


if __name__ == "__main__":
    main()
