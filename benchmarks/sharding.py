"""Data and neuron parallel: per-device memory and time per step on 1, 2, 4 and 8 forced devices.

For every device count ``n`` and mode a fresh process with ``jax_num_cpu_devices=n``
compiles

* ``data``: the ``gru`` model (``_models.py``) with ``mesh=jax.make_mesh((n,),
  ('data',))`` (the batch split over the devices);
* ``neuron``: a spiking network (``ETPLinear`` + ``ETPSparseLinear`` with 8
  synapses per neuron into ``ALIF``, read out by ``LeakyReadout``) with
  ``mesh=jax.make_mesh((n,), ('neuron',))`` and ``neuron_axis='neuron'`` (the
  neurons split over the devices)

and measures

* the bytes of the traces, Params and hidden state that each device holds
  (``addressable_shards``);
* XLA's temporary memory of the ``etrace_grad`` program per device
  (``memory_analysis``);
* the time per step of ``etrace_grad`` after compilation (median of
  ``--repeats`` passes of ``T`` steps) and of an ``OnlineTrainer`` step.

Forced host devices (``jax_num_cpu_devices``) are one CPU's cores seen as
several devices: they share the same cores (two on the machine these results
come from), so the time per step shows the cost of the partitioning, not a
speed-up; the memory per device is what a real multi-device run would hold.

Usage::

    python benchmarks/sharding.py                  # both modes, full sizes (minutes)
    python benchmarks/sharding.py --mode neuron    # one mode
    python benchmarks/sharding.py --quick          # seconds
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
MODES = ("data", "neuron")
# The spiking network of the neuron mode: N neurons, 8 synapses into each.
SPIKING_FULL = {"hidden": 1024, "inputs": 64, "outputs": 16, "batch": 16, "degree": 8}
SPIKING_QUICK = {"hidden": 64, "inputs": 8, "outputs": 8, "batch": 4, "degree": 8}


def _child(devices: int, mode: str, quick: bool, steps: int, repeats: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    sys.path.insert(0, HERE)
    import _models

    if mode == "data":
        mesh = jax.make_mesh((devices,), ("data",))
        # --quick: the quick sizes with a batch that 8 devices can split.
        size = {**_models.QUICK, "batch": 8} if quick else _models.FULL
    else:
        mesh = jax.make_mesh((devices,), ("neuron",))
        size = SPIKING_QUICK if quick else SPIKING_FULL
    records = [_measure(mode, method, size, mesh, steps, repeats) for method in METHODS]
    return {"records": records, "environment": _models.environment()}


def _spiking(size: dict):
    """``z_t = ALIF(W_in x_t + W_rec z_{t-1})``, ``y_t = LeakyReadout(z_t)``; synapses in
    post-synaptic order (whole neurons per device)."""
    import numpy as np
    from flax import nnx

    from braintrace import layers

    n, degree = size["hidden"], size["degree"]
    rng = np.random.default_rng(0)
    pre = np.stack([rng.choice(n, degree, replace=False) for _ in range(n)]).reshape(-1)
    post = np.repeat(np.arange(n), degree)

    class Spiking(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.inp = layers.ETPLinear(size["inputs"], n, rngs=rngs)
            self.rec = layers.ETPSparseLinear(n, n, connectivity=(pre, post), use_bias=False,
                                              rngs=rngs)
            self.neuron = layers.ALIF(n)
            self.readout = layers.LeakyReadout(n, size["outputs"], rngs=rngs)

        def __call__(self, x):
            return self.readout(self.neuron(self.inp(x) + self.rec(self.neuron.spikes())))

    return Spiking(nnx.Rngs(0))


def _measure(mode: str, method: str, size: dict, mesh, steps: int, repeats: int) -> dict:
    """Bytes per device and time per step of one method on ``mesh``."""
    import _models
    import jax
    import numpy as np
    import optax

    import braintrace

    if mode == "data":
        model = _models.build("gru", size["inputs"], size["hidden"], size["outputs"],
                              size["batch"])
        xs, ys = _models.data("gru", steps, size["inputs"], size["outputs"], size["batch"])
        learner = braintrace.compile(model, method, xs[0], mesh=mesh)
    else:
        model = _spiking(size)
        xs, ys = _models.data("alif", steps, size["inputs"], size["outputs"], size["batch"])
        learner = braintrace.compile(model, method, xs[0], batch_size=size["batch"], mesh=mesh,
                                     neuron_axis="neuron")

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
    params, hidden, _ = learner.leaves()
    return {
        "devices": mesh.size, "mode": mode, "model": "gru" if mode == "data" else "spiking",
        "method": method, "batch": size["batch"], "hidden": size["hidden"], "T": steps,
        "params": _models.count_params(model),
        "trace_bytes_total": sum(a.nbytes for a in jax.tree.leaves(learner.traces)),
        "trace_bytes_per_device": _per_device(learner.traces),
        "param_bytes_per_device": _per_device(params),
        "hidden_bytes_per_device": _per_device(hidden),
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

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    columns = [("trace_bytes_per_device", "trace MiB per device", 2**20),
               ("param_bytes_per_device", "Param MiB per device", 2**20),
               ("xla_temp_bytes_per_device", "XLA temp MiB per device", 2**20),
               ("etrace_grad_ms_per_step", "etrace_grad ms per step (2 shared cores)", 1)]
    for mode in MODES:
        for method in METHODS:
            rows = sorted((r for r in records if r["method"] == method
                           and r.get("mode", "data") == mode), key=lambda r: r["devices"])
            if not rows:
                continue
            n = [r["devices"] for r in rows]
            for ax, (key, label, scale) in zip(axes, columns):
                ax.plot(n, [r[key] / scale for r in rows], "o-" if mode == "data" else "s--",
                        label=f"{mode}: {method}")
                ax.set(xlabel="devices (forced CPU)", ylabel=label, xticks=DEVICES)
    for ax in axes:
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--mode", choices=("data", "neuron", "both"), default="both",
                        help="split the batch (data), the neurons, or run both")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-mode", default="data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 50)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.child is not None:
        print("RESULT" + json.dumps(_child(args.child, args.child_mode, args.quick, steps,
                                           repeats)))
        return

    sys.path.insert(0, HERE)
    import _models

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    records, environment = [], None
    modes = MODES if args.mode == "both" else (args.mode,)
    for mode, devices in ((m, d) for m in modes for d in DEVICES):
        command = [sys.executable, __file__, "--child", str(devices), "--child-mode", mode,
                   "--steps", str(steps), "--repeats", str(repeats),
                   *(["--quick"] if args.quick else [])]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True,
                              timeout=1800)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
        child = json.loads(line[len("RESULT"):])
        records += child["records"]
        environment = child["environment"]
        for r in child["records"]:
            print(f"{mode:>6} {devices} device(s) {r['method']:>9}: traces "
                  f"{r['trace_bytes_per_device'] / 2**20:8.3f} MiB per device of "
                  f"{r['trace_bytes_total'] / 2**20:8.3f} MiB, Params "
                  f"{r['param_bytes_per_device'] / 2**20:6.3f} MiB, XLA temp "
                  f"{r['xla_temp_bytes_per_device'] / 2**20:7.3f} MiB, etrace_grad "
                  f"{r['etrace_grad_ms_per_step']:7.3f} ms/step, OnlineTrainer "
                  f"{r['trainer_ms_per_step']:7.3f} ms/step")
    note = ("Forced host devices (jax_num_cpu_devices) share the same CPU cores: times show "
            "the cost of partitioning on one CPU, not a multi-device speed-up. Trace bytes per "
            "device are what each device of a real mesh holds between calls. The data-parallel "
            "programs hold all-reduces only (of gradients and losses; no trace row moves "
            "between devices: tests/test_devices_four.py reads their compiled HLO). Neuron "
            "parallel splits traces, Params and hidden states by neuron; XLA moves the "
            "spikes and the sparse layer's inputs between devices each step.")
    _models.write_json(os.path.join(args.out, f"{NAME}.json"), {
        "benchmark": NAME, "quick": args.quick, "note": note, "results": records,
        "environment": environment})
    _plot(records, os.path.join(args.out, f"{NAME}.png"))


if __name__ == "__main__":
    main()
