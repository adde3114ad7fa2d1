"""Data parallel: per-device trace memory and time per step on 1, 2, 4 and 8 forced CPU devices.

For every device count ``n`` a fresh process with ``jax_num_cpu_devices=n``
compiles the ``gru`` model (``_models.py``) with ``mesh=jax.make_mesh((n,),
('data',))`` and measures

* the bytes of the traces that each device holds (``addressable_shards``:
  D-RTRL's trace is ``B·|θ|``, split over the devices), and of the hidden state;
* XLA's temporary memory of the ``etrace_grad`` program per device
  (``memory_analysis``);
* the time per step of ``etrace_grad`` after compilation (median of
  ``--repeats`` passes of ``T`` steps) and of an ``OnlineTrainer`` step.

Forced host devices (``jax_num_cpu_devices``) are one CPU's cores seen as
several devices: they share the same cores (two on the machine these results
come from), so the time per step shows the cost of the partitioning, not a
speed-up; the memory per device is what a real multi-device run would hold.

Usage::

    python benchmarks/sharding.py            # B = 16, hidden 256 (minutes)
    python benchmarks/sharding.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "sharding"
DEVICES = (1, 2, 4, 8)
METHODS = ("d_rtrl", "es_d_rtrl")


def _child(devices: int, quick: bool, steps: int, repeats: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    sys.path.insert(0, HERE)
    import _models

    mesh = jax.make_mesh((devices,), ("data",))
    # --quick: the quick sizes with a batch that 8 devices can split.
    size = {**_models.QUICK, "batch": 8} if quick else _models.FULL
    records = [_measure(method, size, mesh, steps, repeats) for method in METHODS]
    return {"records": records, "environment": _models.environment()}


def _measure(method: str, size: dict, mesh, steps: int, repeats: int) -> dict:
    """Trace bytes per device and time per step of one method on ``mesh``."""
    import _models
    import jax
    import numpy as np
    import optax

    import braintrace

    model = _models.build("gru", size["inputs"], size["hidden"], size["outputs"], size["batch"])
    xs, ys = _models.data("gru", steps, size["inputs"], size["outputs"], size["batch"])
    learner = braintrace.compile(model, method, xs[0], mesh=mesh)

    def grad():
        return learner.etrace_grad(xs, ys, _models.mse, return_losses=True)

    analysis = learner.lower_etrace_grad(xs, ys, _models.mse).compile().memory_analysis()
    first_s = _models.timed(grad)
    grad_s = float(np.median([_models.timed(grad) for _ in range(repeats)]))
    losses = grad()[1]
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-3), loss_fn=_models.mse)

    def train():
        return trainer.step(xs, ys)

    _models.timed(train)
    train_s = float(np.median([_models.timed(train) for _ in range(repeats)]))
    return {
        "devices": mesh.size, "method": method, "batch": size["batch"], "T": steps,
        "params": _models.count_params(model),
        "trace_bytes_total": sum(a.nbytes for a in jax.tree.leaves(learner.traces)),
        "trace_bytes_per_device": _per_device(learner.traces),
        "hidden_bytes_per_device": _per_device(learner.leaves().hidden),
        "xla_temp_bytes_per_device": analysis.temp_size_in_bytes,
        "first_call_s": first_s,
        "etrace_grad_ms_per_step": 1e3 * grad_s / steps,
        "trainer_ms_per_step": 1e3 * train_s / steps,
        "loss_finite": bool(np.isfinite(np.asarray(losses)).all()),
    }


def _per_device(tree) -> int:
    """The bytes of ``tree`` held by the first device (every device holds as many)."""
    import jax

    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, temp, time) = plt.subplots(1, 3, figsize=(15, 4))
    for method in METHODS:
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["devices"])
        n = [r["devices"] for r in rows]
        mem.plot(n, [r["trace_bytes_per_device"] / 2**20 for r in rows], "o-", label=method)
        temp.plot(n, [r["xla_temp_bytes_per_device"] / 2**20 for r in rows], "o-", label=method)
        time.plot(n, [r["etrace_grad_ms_per_step"] for r in rows], "o-",
                  label=f"{method} etrace_grad")
        time.plot(n, [r["trainer_ms_per_step"] for r in rows], "s--",
                  label=f"{method} OnlineTrainer")
    mem.set(xlabel="devices (forced CPU)", ylabel="trace MiB per device", xticks=DEVICES,
            title="traces are split over the data axis")
    temp.set(xlabel="devices (forced CPU)", ylabel="XLA temp MiB per device", xticks=DEVICES,
             title="etrace_grad's temporary memory")
    time.set(xlabel="devices (forced CPU)", ylabel="ms per step", xticks=DEVICES,
             title="time per step (the devices share 2 cores)")
    for ax in (mem, temp, time):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 50)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.child is not None:
        print("RESULT" + json.dumps(_child(args.child, args.quick, steps, repeats)))
        return

    sys.path.insert(0, HERE)
    import _models

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    records, environment = [], None
    for devices in DEVICES:
        command = [sys.executable, __file__, "--child", str(devices), "--steps", str(steps),
                   "--repeats", str(repeats), *(["--quick"] if args.quick else [])]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True,
                              timeout=1800)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
        child = json.loads(line[len("RESULT"):])
        records += child["records"]
        environment = child["environment"]
        for r in child["records"]:
            print(f"{devices} device(s) {r['method']:>9}: traces "
                  f"{r['trace_bytes_per_device'] / 2**20:8.3f} MiB per device of "
                  f"{r['trace_bytes_total'] / 2**20:8.3f} MiB, XLA temp "
                  f"{r['xla_temp_bytes_per_device'] / 2**20:7.3f} MiB, etrace_grad "
                  f"{r['etrace_grad_ms_per_step']:7.3f} ms/step, OnlineTrainer "
                  f"{r['trainer_ms_per_step']:7.3f} ms/step")
    note = ("Forced host devices (jax_num_cpu_devices) share the same CPU cores: times show "
            "the cost of partitioning on one CPU, not a multi-device speed-up. Trace bytes per "
            "device are what each device of a real mesh holds between calls. The data-parallel "
            "programs hold all-reduces only (of gradients and losses; no trace row moves "
            "between devices: tests/test_devices_four.py reads their compiled HLO).")
    _models.write_json(os.path.join(args.out, f"{NAME}.json"), {
        "benchmark": NAME, "quick": args.quick, "note": note, "results": records,
        "environment": environment})
    _plot(records, os.path.join(args.out, f"{NAME}.png"))


if __name__ == "__main__":
    main()
