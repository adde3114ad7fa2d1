"""Learning real tasks: test accuracy of BPTT and the online rules on the data sets.

Tasks (``braintrace.tasks``, the ``tasks`` extra): ``mnist1d`` (MNIST-1D, T = 40),
``digits`` (sequential 8×8 digits, T = 64) and ``spiking_digits`` (latency-coded
digits, 64 channels, T = 32). Models: ``gru`` (one GRU cell, linear readout),
``mingru2`` (two stacked minGRU cells, linear readout), ``lru2`` (two stacked
``layers.LRU``, GELU between, linear readout) and ``lru_mlp`` (one ``layers.LRU``
and a GELU MLP readout: the architecture on which D-RTRL is exact) on the first
two; ``alif`` (a recurrent layer of adaptive LIF neurons, leaky readout) on the
spiking one and on MNIST-1D (its real-valued samples as input currents); on the spiking
one also ``lif2`` (two recurrent layers of LIF neurons, ``τ = 10``, and a leaky readout;
at ``--hidden 128`` the network of ``docs/training_spiking.md``), built and trained by
that page's recipe (input weights twice LeCun's scale, a fast-sigmoid surrogate of scale
4, the label's cross-entropy at every step, Adam's rate decayed to 0 by a cosine), and
``lif2_defaults`` (the same network with the layers' defaults, trained as every other
model).

Methods: ``bptt`` (``braintrace.BPTT()``: ``jax.grad`` through the scan), ``d_rtrl``,
``es_d_rtrl``, ``eprop`` (``EProp(kappa=0.9)``, SNN only), the spiking rules (SNN only)
``ottt`` (``OTTT`` with the network's membrane leak: ``exp(-1/20)`` on ``alif``,
``exp(-1/10)`` on the ``lif2`` rows), ``sltt`` and ``otpe``
(``OTPE`` with the readout's leak ``exp(-1/10)``), ``osttp`` (SNN only: ``OSTTP()``,
the label's one-hot projected onto the ALIF layer; its loss is the label's cross-entropy at
every step, uniformly weighted, because OSTTP's target ``y*ᵗ`` is given at every step (Ortner
et al. 2023): scored at the last step alone, on ``spiking_digits`` the projection reaches the
layer at that silent step only and the rule stays at chance; see
``docs/online_rules.md``), ``fptt`` (SNN only: ``FPTT()`` with
``fptt_regularizer(0.1)`` before Adam, an update every step from that step's own gradient,
``OnlineTrainer(update_every=1)``; FPTT has no credit over time, so its loss is the label's
cross-entropy at every step weighted ``(t + 1)/T``, the intermediate losses of Yin et al.
2023, instead of the last step's alone), ``d_rtrl@8`` and
``d_rtrl@16`` (D-RTRL in windowed mode, ``chunk_size`` 8 or 16: exact reverse mode
inside each window, traces across windows; a window that does not divide T is
skipped), ``d_rtrl_bf16`` and ``es_d_rtrl_bf16`` (GRU and ALIF: the same rules with their
traces stored in bfloat16, ``compile(..., trace_dtype=jnp.bfloat16)``, next to the float32
rows), and at a small hidden size (``--small-hidden``, where RTRL's ``B·|θ|·N``
influence fits) ``rtrl`` (exact RTRL: BPTT's gradient, on the GRU and the minGRU
stack), ``snap1`` (``SnAp(1)``), ``uoro`` (``UORO``) with their own ``bptt@small``
reference.

Every row of one model and task starts from the same initialisation (seed),
sees the same batches (``task.sample(fold_in(key, step))``), and takes the same
number of Adam steps (``--steps``) with the loss at the last step (cross-entropy; ``osttp``
and the ``lif2`` rows at every step, :data:`TRAINING`); ``fptt`` sees the same batches and
makes ``T`` updates on each.
The learning rate is chosen per row from ``--lrs`` by validation accuracy after
training with seed 0; further seeds (``--seeds``) rerun only the chosen rate.
Reported: test accuracy of each seed (mean and spread), validation accuracy of
every rate tried, wall time of training. Rows run two at a time (``--jobs``), each
in its own process: a row's numbers do not depend on which process ran it.

Usage::

    python benchmarks/tasks.py            # full run, every row: under 30 min on 2 cores
    python benchmarks/tasks.py --quick    # seconds
    python benchmarks/tasks.py --tasks spiking_digits --models lif2,lif2_defaults \
        --methods bptt,es_d_rtrl,ottt --hidden 128 --steps 100 --seeds 3 --lrs 3e-3 \
        --name tasks_lif2                 # the two-layer LIF network (docs/training_spiking.md)
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import environment, write_json
from flax import nnx

import braintrace
from braintrace import layers
from braintrace import tasks as bt_tasks

NAME = "tasks"
TASKS = {
    "mnist1d": (bt_tasks.MNIST1D, ("gru", "mingru2", "lru2", "lru_mlp", "alif")),
    "digits": (bt_tasks.SequentialDigits, ("gru", "mingru2", "lru2", "lru_mlp")),
    "spiking_digits": (bt_tasks.SpikingDigits, ("alif", "lif2", "lif2_defaults")),
}
METHODS = {
    "gru": ("bptt", "d_rtrl", "es_d_rtrl", "d_rtrl_bf16", "es_d_rtrl_bf16", "d_rtrl@8",
            "d_rtrl@16", "bptt@small", "rtrl", "snap1", "uoro"),
    "mingru2": ("bptt", "d_rtrl", "es_d_rtrl", "d_rtrl@8", "d_rtrl@16", "bptt@small", "rtrl"),
    "lru2": ("bptt", "d_rtrl", "es_d_rtrl"),
    "lru_mlp": ("bptt", "d_rtrl"),
    "alif": ("bptt", "d_rtrl", "es_d_rtrl", "d_rtrl_bf16", "es_d_rtrl_bf16", "eprop",
             "d_rtrl@8", "d_rtrl@16", "ottt", "sltt", "otpe", "fptt", "osttp"),
    "lif2": ("bptt", "es_d_rtrl", "ottt"),
    "lif2_defaults": ("bptt", "es_d_rtrl", "ottt"),
}
FULL = {"hidden": 64, "small_hidden": 16, "batch": 64, "steps": 500, "seeds": 2,
        "lrs": (3e-3, 1e-2)}
QUICK = {"hidden": 4, "small_hidden": 4, "batch": 4, "steps": 2, "seeds": 1, "lrs": (1e-2,)}
SMALL = ("rtrl", "bptt@small", "snap1", "uoro")
ALIF_TAU, READOUT_TAU = 20.0, 10.0  # the ALIF network's membrane and readout time constants
LIF2_TAU = 10.0  # the two-layer LIF network's membrane time constant
MEMBRANE_TAU = {"alif": ALIF_TAU, "lif2": LIF2_TAU, "lif2_defaults": LIF2_TAU}
"""Each spiking model's membrane time constant: OTTT's decay is its leak ``exp(-1/τ)``."""
ALGORITHMS = {"eprop": lambda model: braintrace.EProp(kappa=0.9),
              "snap1": lambda model: braintrace.SnAp(1),
              "uoro": lambda model: braintrace.UORO(seed=0),
              "ottt": lambda model: braintrace.OTTT(decay=math.exp(-1 / MEMBRANE_TAU[model])),
              "otpe": lambda model: braintrace.OTPE(decay=math.exp(-1 / READOUT_TAU))}
"""A method's algorithm, made for the model's name, where the method is not its name."""


class Training(NamedTuple):
    """How a model's rows are trained, where it is not the default (:data:`TRAINING`).

    Attributes:
        every_step: The loss is the label's cross-entropy at every step, uniformly weighted
            (else at the last step alone).
        cosine: Adam's rate decays from ``lr`` to 0 by a cosine over the ``--steps`` updates
            (else it is constant).
    """

    every_step: bool = False
    cosine: bool = False


TRAINING = {"lif2": Training(every_step=True, cosine=True)}
"""The models trained by a recipe of their own (``docs/training_spiking.md``)."""
FPTT_ALPHA = 0.1  # fptt_regularizer's α (β = 1/2, the paper's running average); not tuned
TRACE_DTYPES = {"bf16": jnp.bfloat16}  # a method's suffix: '<algorithm>_bf16'
EVAL_CHUNK = 500  # validation and test run in chunks of this many sequences: one compilation
# --quick: one task per model, BPTT or one online rule each (the LRU under an MLP readout
# both: D-RTRL is exact there)
QUICK_TASKS = {"mnist1d": ("gru", "lru_mlp"), "digits": ("mingru2",),
               "spiking_digits": ("alif",)}
QUICK_METHODS = {"gru": ("bptt", "d_rtrl@8"), "lru_mlp": ("bptt", "d_rtrl"),
                 "mingru2": ("es_d_rtrl",), "alif": ("eprop",)}


class GRUNet(nnx.Module):
    """One GRU cell and a linear readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs):
        self.rnn = layers.Stateful(layers.GRUCell(inputs, hidden, rngs=rngs))
        self.readout = layers.ETPLinear(hidden, outputs, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.rnn(x))


class MinGRU2(nnx.Module):
    """Two stacked minGRU cells and a linear readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs):
        self.l1 = layers.Stateful(layers.MinGRUCell(inputs, hidden, rngs=rngs))
        self.l2 = layers.Stateful(layers.MinGRUCell(hidden, hidden, rngs=rngs))
        self.readout = layers.ETPLinear(hidden, outputs, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.l2(self.l1(x)))


class ALIFNet(nnx.Module):
    """A recurrent layer of adaptive LIF neurons and a leaky-integrator readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs):
        self.recurrent = layers.RecurrentSpiking(
            inputs, layers.ALIF(hidden, tau=ALIF_TAU, tau_a=100.0), rngs=rngs)
        self.readout = layers.LeakyReadout(hidden, outputs, tau=READOUT_TAU, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.recurrent(x))


def lif2(inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs, *, input_gain: float = 1.0,
         surrogate_alpha: float | None = None) -> nnx.Sequential:
    """Two recurrent layers of LIF neurons (``τ = 10``) and a leaky readout (``τ = 20``).

    ``input_gain`` scales both layers' input weights over LeCun's normal (the default's
    scale); ``surrogate_alpha`` is the fast-sigmoid surrogate's scale (``None``: the
    default, 10). :data:`MODELS` holds the recipe (``lif2``) and the defaults.
    """
    kernel_init = nnx.initializers.variance_scaling(input_gain ** 2, "fan_in", "truncated_normal")

    def neurons() -> layers.LIF:
        return layers.LIF(hidden, tau=LIF2_TAU, surrogate_alpha=surrogate_alpha)

    return nnx.Sequential(
        layers.RecurrentSpiking(inputs, neurons(), kernel_init=kernel_init, rngs=rngs),
        layers.RecurrentSpiking(hidden, neurons(), kernel_init=kernel_init, rngs=rngs),
        layers.LeakyReadout(hidden, outputs, rngs=rngs))


class LRU2(nnx.Module):
    """Two stacked linear recurrent units (GELU between them) and a linear readout."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs):
        self.l1 = layers.LRU(inputs, hidden, out_features=hidden, r_min=0.5, r_max=0.99,
                             rngs=rngs)
        self.l2 = layers.LRU(hidden, hidden, out_features=hidden, r_min=0.5, r_max=0.99,
                             rngs=rngs)
        self.readout = layers.ETPLinear(hidden, outputs, rngs=rngs)

    def __call__(self, x):
        return self.readout(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


class LRUMLP(nnx.Module):
    """One linear recurrent unit and a GELU MLP readout: no recurrence after a trained layer
    that D-RTRL would drop, so D-RTRL equals BPTT on it."""

    def __init__(self, inputs: int, hidden: int, outputs: int, rngs: nnx.Rngs):
        self.lru = layers.LRU(inputs, hidden, out_features=hidden, r_min=0.5, r_max=0.99,
                              rngs=rngs)
        self.mlp = layers.ETPLinear(hidden, hidden, rngs=rngs)
        self.readout = layers.ETPLinear(hidden, outputs, rngs=rngs)

    def __call__(self, x):
        return self.readout(jax.nn.gelu(self.mlp(jax.nn.gelu(self.lru(x)))))


MODELS = {"gru": GRUNet, "mingru2": MinGRU2, "lru2": LRU2, "lru_mlp": LRUMLP, "alif": ALIFNet,
          "lif2": functools.partial(lif2, input_gain=2.0, surrogate_alpha=4.0),
          "lif2_defaults": lif2}


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def split(model):
    return nnx.split(model, nnx.Param, braintrace.HiddenState, ...)


def scan_fn(model: nnx.Module, batch_size: int):
    """``run(params, xs) -> outputs`` of the model from a fresh state of ``batch_size``."""
    model = nnx.clone(model)
    braintrace.init_states(model, batch_size)
    graphdef, _, hidden, other = split(model)

    def run(params, xs):
        def body(h, x):
            m = nnx.merge(graphdef, params, h, other, copy=True)
            y = m(x)
            return split(m)[2], y

        return jax.lax.scan(body, hidden, xs)[1]

    return run


def masked_loss(outputs, batch):
    losses = jax.vmap(cross_entropy)(outputs, batch.ys)
    return jnp.sum(losses * batch.mask) / jnp.sum(batch.mask)


def grad_function(model: nnx.Module, model_name: str, method: str, task, batch_size: int):
    """``grad(batch) -> nnx.State`` of the masked loss for ``method``."""
    name, _, window = method.partition("@")
    if name == "bptt":  # braintrace.BPTT(): the exact gradient of the masked mean loss
        window = ""     # ('bptt@small' is BPTT at the small size, not a window)
    base, _, suffix = name.rpartition("_")
    name, trace_dtype = (base, TRACE_DTYPES[suffix]) if suffix in TRACE_DTYPES else (name, None)
    algorithm = ALGORITHMS[name](model_name) if name in ALGORITHMS else name
    example = jnp.zeros((batch_size, task.num_inputs))
    learner = braintrace.compile(model, algorithm, example, batch_size=batch_size,
                                 trace_dtype=trace_dtype)
    chunk = int(window) if window else None

    def grad(batch):
        learner.reset()
        every_step = name == "osttp" or TRAINING.get(model_name, Training()).every_step
        mask = None if every_step else batch.mask  # OSTTP: y* at every step (docstring)
        return learner.etrace_grad(batch.xs, batch.ys, cross_entropy, mask=mask,
                                   chunk_size=chunk)

    return grad


def update_function(model: nnx.Module, model_name: str, method: str, task, cfg: dict,
                    lr: float):
    """``update(batch)``: the method's Adam update(s) of the model's Params from one batch."""
    if method == "fptt":
        return fptt_update(model, task, cfg["batch"], lr)
    grad = grad_function(model, model_name, method, task, cfg["batch"])
    cosine = TRAINING.get(model_name, Training()).cosine
    tx = optax.adam(optax.cosine_decay_schedule(lr, cfg["steps"]) if cosine else lr)
    opt_state = tx.init(nnx.state(model, nnx.Param))

    @jax.jit
    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def update(batch):
        nonlocal opt_state
        params, opt_state = apply(nnx.state(model, nnx.Param), opt_state, grad(batch))
        nnx.update(model, params)

    return update


def fptt_update(model: nnx.Module, task, batch_size: int, lr: float):
    """FPTT: an update every step, ``fptt_regularizer`` before Adam, the label's loss at every
    step weighted ``(t + 1)/T`` (module docstring)."""
    example = jnp.zeros((batch_size, task.num_inputs))
    learner = braintrace.compile(model, "fptt", example, batch_size=batch_size)
    tx = optax.chain(braintrace.fptt_regularizer(FPTT_ALPHA), optax.adam(lr))
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=cross_entropy, update_every=1)
    weights = (jnp.arange(task.seq_len) + 1.0) / task.seq_len

    def update(batch):
        learner.reset()
        trainer.step(batch.xs, batch.ys, weights)

    return update


def train(task, model_name: str, method: str, lr: float, cfg: dict, seed: int) -> dict:
    hidden = cfg["small_hidden"] if method in SMALL else cfg["hidden"]
    model = MODELS[model_name](task.num_inputs, hidden, task.num_classes, nnx.Rngs(seed))
    braintrace.init_states(model, cfg["batch"])
    update = update_function(model, model_name, method, task, cfg, lr)
    key = jax.random.key(seed)
    start = time.perf_counter()
    for step in range(cfg["steps"]):
        update(task.sample(jax.random.fold_in(key, step), cfg["batch"]))
    params = nnx.state(model, nnx.Param)
    jax.block_until_ready(params)
    wall = time.perf_counter() - start
    out = {"hidden": hidden, "train_wall_s": wall, "lr": lr, "seed": seed}
    last_logits = jax.jit(lambda p, xs: run(p, xs)[-1])
    run = scan_fn(model, EVAL_CHUNK)
    for name in ("validation", "test"):
        batch = task.split(name)
        n = batch.xs.shape[1]
        xs = jnp.pad(batch.xs, ((0, 0), (0, -n % EVAL_CHUNK), (0, 0)))
        logits = jnp.concatenate([last_logits(params, xs[:, i:i + EVAL_CHUNK])
                                  for i in range(0, xs.shape[1], EVAL_CHUNK)])[:n]
        labels = batch.ys[-1]
        out[f"{name}_accuracy"] = float(jnp.mean(jnp.argmax(logits, -1) == labels))
        out[f"{name}_loss"] = float(cross_entropy(logits, labels))
    return out


def run_row(task, model_name: str, method: str, cfg: dict) -> dict:
    window = method.partition("@")[2]
    if window.isdigit() and task.seq_len % int(window):
        return {"skipped": f"chunk_size {window} does not divide T = {task.seq_len}"}
    tried = {lr: train(task, model_name, method, lr, cfg, seed=0) for lr in cfg["lrs"]}
    lr = max(tried, key=lambda r: tried[r]["validation_accuracy"])
    runs = [tried[lr]] + [train(task, model_name, method, lr, cfg, seed=s)
                          for s in range(1, cfg["seeds"])]
    test = np.array([r["test_accuracy"] for r in runs])
    return {
        "lr": lr,
        "validation_accuracy_per_lr": {str(r): v["validation_accuracy"] for r, v in tried.items()},
        "test_accuracy_mean": float(test.mean()),
        "test_accuracy_std": float(test.std()),
        "test_accuracy_per_seed": test.tolist(),
        "train_wall_s_mean": float(np.mean([r["train_wall_s"] for r in runs])),
        "hidden": runs[0]["hidden"],
        "runs": runs,
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, m) for t in results for m in results[t] if results[t][m]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (task, model) in zip(axes[0], panels):
        rows = {k: v for k, v in results[task][model].items()
                if "skipped" not in v and "error" not in v}
        names = list(rows)
        means = [rows[n]["test_accuracy_mean"] for n in names]
        stds = [rows[n]["test_accuracy_std"] for n in names]
        ax.bar(np.arange(len(names)), means, yerr=stds, capsize=3)
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels(names, rotation=30, fontsize=8)
        ax.set_ylim(0, 1)
        ax.axhline(0.1, color="k", lw=0.5, ls=":")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{task} / {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@functools.cache
def make_task(task_name: str):
    """The task's data set, built once per process."""
    return TASKS[task_name][0]()


def row_job(task_name: str, model_name: str, method: str, cfg: dict) -> tuple[dict, float]:
    """One row (a worker's job): its results, or ``{"error": traceback}``, and its wall time.

    A failing row is recorded and the run goes on (JAX's exceptions do not cross a process
    boundary); :func:`main` exits with an error at the end.
    """
    start = time.perf_counter()
    try:
        row = run_row(make_task(task_name), model_name, method, cfg)
    except Exception:  # noqa: BLE001  (reported by main, which then fails)
        row = {"error": traceback.format_exc()}
    return row, time.perf_counter() - start


def plan(args) -> list[tuple[str, str, str]]:
    """The rows to run, ``(task, model, method)``, in table order."""
    wanted = set(args.methods.split(",")) if args.methods else None
    rows = []
    for task_name in (args.tasks.split(",") if args.tasks else list(TASKS)):
        model_names = TASKS[task_name][1]
        if args.quick and not args.models:
            model_names = QUICK_TASKS[task_name]
        if args.models:
            model_names = [m for m in model_names if m in args.models.split(",")]
        for model_name in model_names:
            methods = (QUICK_METHODS.get(model_name, ()) if args.quick and not wanted
                       else METHODS[model_name])
            rows += [(task_name, model_name, m) for m in methods if not wanted or m in wanted]
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=NAME, help="file name of the JSON and plot")
    p.add_argument("--tasks", default=None, help="comma-separated: " + ",".join(TASKS))
    p.add_argument("--models", default=None, help="comma-separated: " + ",".join(MODELS))
    p.add_argument("--methods", default=None, help="comma-separated subset of each model's")
    for key in ("hidden", "small_hidden", "batch", "steps", "seeds"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    p.add_argument("--lrs", default=None, help="comma-separated Adam learning rates")
    p.add_argument("--jobs", type=int, default=None,
                   help="rows run at once, one process each (default 2; 1 with --quick)")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("hidden", "small_hidden", "batch", "steps", "seeds"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.lrs:
        cfg["lrs"] = tuple(float(x) for x in args.lrs.split(","))
    jobs = args.jobs or (1 if args.quick else 2)
    start_all = time.perf_counter()
    rows = plan(args)
    done: dict[tuple[str, str, str], dict] = {}

    def report(key: tuple[str, str, str], row: dict, wall: float) -> None:
        done[key] = row
        task_name, model_name, method = key
        if "skipped" in row or "error" in row:
            why = row.get("skipped") or "ERROR\n" + row["error"]
            print(f"{task_name:15s} {model_name:8s} {method:14s} {why}", flush=True)
        else:
            print(f"{task_name:15s} {model_name:8s} {method:14s} test "
                  f"{row['test_accuracy_mean']:.3f} ± {row['test_accuracy_std']:.3f}  lr "
                  f"{row['lr']:g}  train {row['train_wall_s_mean']:.1f}s/run  ({wall:.0f}s)",
                  flush=True)
        save(args, cfg, table(rows, done), start_all, complete=False, jobs=jobs)

    if jobs == 1:
        for key in rows:
            report(key, *row_job(*key, cfg))
    else:  # spawn: a forked child would inherit JAX's threads
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            # the table's end first: the digits and LRU rows are the longest, so no worker
            # is left with one long row at the end
            futures = {pool.submit(row_job, *key, cfg): key for key in reversed(rows)}
            for future in as_completed(futures):
                report(futures[future], *future.result())
    payload = save(args, cfg, table(rows, done), start_all, complete=True, jobs=jobs)
    failed = [" ".join(key) for key, row in done.items() if "error" in row]
    if failed:
        raise SystemExit(f"{len(failed)} row(s) failed: {', '.join(failed)} (tracebacks above)")
    return payload


def table(rows: list[tuple[str, str, str]], done: dict) -> dict:
    """``{task: {model: {method: row}}}`` of the finished rows, in table order."""
    results: dict = {}
    for task_name, model_name, method in rows:
        by_model = results.setdefault(task_name, {}).setdefault(model_name, {})
        if (task_name, model_name, method) in done:
            by_model[method] = done[task_name, model_name, method]
    return results


def save(args, cfg: dict, results: dict, start_all: float, complete: bool, jobs: int) -> dict:
    """Writes the JSON (after every row, so an interrupted run keeps its rows) and, at the end,
    the plot."""
    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "complete": complete,
        "config": {**cfg, "lrs": list(cfg["lrs"])},
        "loss": "softmax cross-entropy at the last step (osttp and lif2: every step; fptt: "
                "every step, weighted (t + 1)/T); Adam (lif2: its rate cosine-decayed to 0)",
        "lr_selection": "validation accuracy after training with seed 0, per row",
        "jobs": jobs,
        "environment": environment(),
        "results": results,
        "total_wall_s": time.perf_counter() - start_all,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{args.name}.json"), payload)
    if complete:
        plot(results, os.path.join(args.out, f"{args.name}.png"))
    return payload


if __name__ == "__main__":
    main()
