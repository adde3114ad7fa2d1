"""Why D-RTRL learns the two-layer minGRU stack on MNIST-1D worse than ES-D-RTRL (issue 33, 12).

``tasks.py`` reports, on MNIST-1D with ``mingru2`` (two stacked ``MinGRUCell`` s and a
linear readout, hidden 64, batch 64, 500 Adam steps, rate chosen from {0.003, 0.01}): BPTT
0.660, D-RTRL 0.297, ES-D-RTRL 0.366 test accuracy. This script measures the gradients
behind those numbers, with the public API only (``braintrace.compile(model, algorithm,
example_x, batch_size=B)``, ``learner.etrace_grad(xs, ys, loss_fn, mask=mask)``,
``learner.reset()``, ``learner.report()``; BPTT is the algorithm ``'bptt'``).

**Gradient fidelity along training trajectories.** A model of ``tasks.py`` (same seed, same
training batches ``task.sample(fold_in(key(seed), step))``, same Adam rate) is trained by one
method (``--trajectories``: BPTT, D-RTRL, ES-D-RTRL); at the checkpoints (``--checkpoints``,
Adam steps done) the gradients of every method (``--methods``) are taken **at the same
Params** on the same ``--eval-batches`` held-out training batches (fixed across checkpoints),
and compared with BPTT's per Param and per layer (``l1``, ``l2``, ``readout``: the layer's
Params concatenated):

* ``cos``: cosine similarity to BPTT's gradient, mean ± std over the evaluation batches;
* ``cos_of_mean``: cosine of the gradient averaged over the evaluation batches (its bias,
  less the batch noise);
* ``norm_ratio``: ``|g| / |g_BPTT|``, mean over the batches;
* ``rel_err``: ``|g - g_BPTT| / |g_BPTT|``, mean over the batches;
* ``sign_agree``: share of the coordinates whose sign is BPTT's, weighted by ``|g_BPTT|``
  (Adam's step is nearly the sign of a consistent gradient, so this is closer to what the
  optimiser does with a gradient than its norm).

**Hybrid training runs** (``--hybrids``): one method's gradient with layer 1's Params
(``l1.*``) taken from another (``d_rtrl+l1:bptt``), or frozen (``d_rtrl+l1:zero``); they say
which layer's gradient decides the test accuracy. Every trajectory and hybrid reports the
validation and test accuracy after its last step, measured as in ``tasks.py``.

Usage::

    python benchmarks/mingru_credit.py           # default: a few minutes on 2 cores
    python benchmarks/mingru_credit.py --quick   # seconds
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
import optax
from _models import environment, write_json
from flax import nnx
from tasks import EVAL_CHUNK, MinGRU2, cross_entropy, scan_fn

import braintrace
from braintrace import tasks as bt_tasks

NAME = "mingru_credit"
FULL = {"hidden": 64, "batch": 64, "steps": 500, "lr": 1e-2, "seeds": (0,),
        "checkpoints": (0, 50, 150, 300, 500), "eval_batches": 8,
        "trajectories": ("bptt", "d_rtrl", "es_d_rtrl"),
        "methods": ("bptt", "d_rtrl", "es_d_rtrl"),
        "hybrids": ("d_rtrl+l1:bptt", "d_rtrl+l1:zero", "d_rtrl+l1:es_d_rtrl",
                    "es_d_rtrl+l1:d_rtrl", "bptt+l1:d_rtrl", "bptt+l1:es_d_rtrl",
                    "es_d_rtrl+l1:zero")}
QUICK = {"hidden": 4, "batch": 4, "steps": 2, "lr": 1e-2, "seeds": (0,), "checkpoints": (0, 2),
         "eval_batches": 2, "trajectories": ("bptt", "d_rtrl"),
         "methods": ("bptt", "d_rtrl", "es_d_rtrl"), "hybrids": ("d_rtrl+l1:bptt",)}
LAYERS = ("l1", "l2", "readout")
EVAL_KEY = 10_000  # evaluation batches: task.sample(fold_in(key(EVAL_KEY), i)), not a train step


def flat(state) -> dict[str, jax.Array]:
    """``{'l1.cell.dense_z.kernel': array, ...}`` of an ``nnx.State`` of Params."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        out[".".join(str(k) for k in keys if k != "value")] = jnp.ravel(leaf)
    return out


def groups(paths) -> dict[str, list[str]]:
    """Each Param on its own, then each layer (its Params concatenated), then all."""
    g = {p: [p] for p in paths}
    for layer in LAYERS:
        g[layer] = [p for p in paths if p.split(".")[0] == layer]
    g["all"] = list(paths)
    return g


def compare(g: dict, ref: dict, members: list[str]) -> dict[str, float]:
    a = jnp.concatenate([g[p] for p in members]).astype(jnp.float64 if jax.config.x64_enabled
                                                          else jnp.float32)
    b = jnp.concatenate([ref[p] for p in members]).astype(a.dtype)
    na, nb = jnp.linalg.norm(a), jnp.linalg.norm(b)
    return {"cos": float(jnp.vdot(a, b) / (na * nb + 1e-30)),
            "norm_ratio": float(na / (nb + 1e-30)),
            "rel_err": float(jnp.linalg.norm(a - b) / (nb + 1e-30)),
            "sign_agree": float(jnp.sum(jnp.abs(b) * (jnp.sign(a) == jnp.sign(b)))
                                / (jnp.sum(jnp.abs(b)) + 1e-30))}


class Grads:
    """Gradients of the masked last-step cross-entropy, one compiled learner per method,
    all on the same model (so at the same Params)."""

    def __init__(self, model: nnx.Module, methods, batch: int, num_inputs: int):
        example = jnp.zeros((batch, num_inputs))
        self.learners = {m: braintrace.compile(model, m, example, batch_size=batch)
                         for m in methods}

    def __call__(self, method: str, batch) -> dict:
        learner = self.learners[method]
        learner.reset()
        return learner.etrace_grad(batch.xs, batch.ys, cross_entropy, mask=batch.mask)


def hybrid(spec: str, grads: Grads, batch):
    """``'a'``: method ``a``'s gradient; ``'a+l1:b'``: with layer 1's Params from ``b``
    (``'zero'``: frozen)."""
    base, _, swap = spec.partition("+l1:")
    g = grads(base, batch)
    if not swap:
        return g
    other = None if swap == "zero" else grads(swap, batch)

    def pick(path, leaf, *rest):
        if getattr(path[0], "key", None) != "l1":
            return leaf
        return jnp.zeros_like(leaf) if other is None else rest[0]

    return jax.tree_util.tree_map_with_path(pick, g, *(() if other is None else (other,)))


def measure(grads: Grads, methods, eval_batches) -> dict:
    """Every method against BPTT at the model's current Params, per Param / layer / all."""
    per_batch = {m: [] for m in methods}
    means = {m: None for m in methods}
    ref_mean = None
    ref_norms = []
    for batch in eval_batches:
        ref = flat(grads("bptt", batch))
        ref_norms.append({name: float(jnp.linalg.norm(jnp.concatenate([ref[p] for p in members])))
                          for name, members in groups(list(ref)).items()})
        ref_mean = ref if ref_mean is None else {k: ref_mean[k] + ref[k] for k in ref}
        for m in methods:
            g = ref if m == "bptt" else flat(grads(m, batch))
            means[m] = g if means[m] is None else {k: means[m][k] + g[k] for k in g}
            per_batch[m].append({name: compare(g, ref, members)
                                 for name, members in groups(list(ref)).items()})
    out = {}
    for m in methods:
        out[m] = {}
        for name, members in groups(list(ref_mean)).items():
            rows = [r[name] for r in per_batch[m]]
            out[m][name] = {
                "cos": float(np.mean([r["cos"] for r in rows])),
                "cos_std": float(np.std([r["cos"] for r in rows])),
                "cos_of_mean": compare(means[m], ref_mean, members)["cos"],
                "norm_ratio": float(np.mean([r["norm_ratio"] for r in rows])),
                "rel_err": float(np.mean([r["rel_err"] for r in rows])),
                "sign_agree": float(np.mean([r["sign_agree"] for r in rows])),
            }
    # BPTT's own gradient norm (mean over the batches): the scale the ratios refer to
    out["bptt_norm"] = {name: float(np.mean([r[name] for r in ref_norms])) for name in ref_norms[0]}
    return out


class Runner:
    """One model and one compiled learner per method, shared by every run (each run writes
    its seed's initial Params into the model first): a method compiles once."""

    def __init__(self, task, cfg: dict):
        self.task, self.cfg = task, cfg
        self.model = MinGRU2(task.num_inputs, cfg["hidden"], task.num_classes, nnx.Rngs(0))
        braintrace.init_states(self.model, cfg["batch"])
        needed = {"bptt", *cfg["methods"], *cfg["trajectories"]}
        for spec in cfg["hybrids"]:
            needed |= set(spec.split("+l1:"))
        self.grads = Grads(self.model, sorted(needed - {"zero"}), cfg["batch"], task.num_inputs)
        self.tx = optax.adam(cfg["lr"])
        tx = self.tx

        @jax.jit
        def apply(params, opt_state, g):
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.apply = apply
        self.eval_batches = [
            task.sample(jax.random.fold_in(jax.random.key(EVAL_KEY), i), cfg["batch"])
            for i in range(cfg["eval_batches"])]
        run = scan_fn(self.model, EVAL_CHUNK)
        self.last_logits = jax.jit(lambda p, xs: run(p, xs)[-1])

    def initial_params(self, seed: int):
        """The Params ``tasks.py`` starts from with this seed."""
        fresh = MinGRU2(self.task.num_inputs, self.cfg["hidden"], self.task.num_classes,
                        nnx.Rngs(seed))
        return nnx.state(fresh, nnx.Param)

    def accuracy(self, params) -> dict[str, float]:
        """Validation and test accuracy and loss at the last step, as ``tasks.train``."""
        out = {}
        for name in ("validation", "test"):
            b = self.task.split(name)
            n = b.xs.shape[1]
            xs = jnp.pad(b.xs, ((0, 0), (0, -n % EVAL_CHUNK), (0, 0)))
            logits = jnp.concatenate([self.last_logits(params, xs[:, i:i + EVAL_CHUNK])
                                      for i in range(0, xs.shape[1], EVAL_CHUNK)])[:n]
            out[f"{name}_accuracy"] = float(jnp.mean(jnp.argmax(logits, -1) == b.ys[-1]))
            out[f"{name}_loss"] = float(cross_entropy(logits, b.ys[-1]))
        return out

    def train(self, spec: str, seed: int, checkpoints=(), methods=()) -> dict:
        """``cfg['steps']`` Adam steps with ``spec``'s gradients (``tasks.py``'s loop: same
        initialisation, batches and rate); measures the methods at the checkpoints."""
        cfg, task, grads = self.cfg, self.task, self.grads
        params = self.initial_params(seed)
        nnx.update(self.model, params)
        opt_state = self.tx.init(params)
        key = jax.random.key(seed)
        out = {"spec": spec, "seed": seed, "checkpoints": {}}
        start = time.perf_counter()
        for step in range(cfg["steps"] + 1):
            if step in checkpoints:
                t = time.perf_counter()
                at = out["checkpoints"][str(step)] = measure(grads, methods, self.eval_batches)
                line = "  ".join(f"{m}: " + " ".join(
                    f"{layer} {at[m][layer]['cos']:+.3f}" for layer in LAYERS)
                    for m in methods if m != "bptt")
                print(f"  [{spec} seed {seed}] step {step:4d} cos  {line}  "
                      f"({time.perf_counter() - t:.1f}s)", flush=True)
            if step == cfg["steps"]:
                break
            g = hybrid(spec, grads, task.sample(jax.random.fold_in(key, step), cfg["batch"]))
            params, opt_state = self.apply(params, opt_state, g)
            nnx.update(self.model, params)
        jax.block_until_ready(params)
        out["train_wall_s"] = time.perf_counter() - start
        out.update(self.accuracy(params))
        print(f"{spec:22s} seed {seed}: test {out['test_accuracy']:.3f}  validation "
              f"{out['validation_accuracy']:.3f}  ({out['train_wall_s']:.0f}s)", flush=True)
        return out


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in payload["trajectories"] if r["checkpoints"]]
    if not runs:
        return
    methods = [m for m in payload["config"]["methods"] if m != "bptt"]
    metrics = (("cos", "cosine to BPTT"), ("norm_ratio", "|g| / |g_BPTT|"))
    fig, axes = plt.subplots(len(metrics) * len(runs), len(LAYERS),
                             figsize=(4.2 * len(LAYERS), 2.8 * len(metrics) * len(runs)),
                             squeeze=False)
    colors = {"d_rtrl": "C1", "es_d_rtrl": "C2", "bptt": "C0"}
    for i, run in enumerate(runs):
        steps = sorted(int(s) for s in run["checkpoints"])
        for k, (metric, label) in enumerate(metrics):
            row = axes[i * len(metrics) + k]
            for ax, layer in zip(row, LAYERS):
                for m in methods:
                    y = [run["checkpoints"][str(s)][m][layer][metric] for s in steps]
                    ax.plot(steps, y, "o-", color=colors.get(m), label=m)
                    if metric == "cos":
                        sd = [run["checkpoints"][str(s)][m][layer]["cos_std"] for s in steps]
                        ax.fill_between(steps, np.subtract(y, sd), np.add(y, sd),
                                        color=colors.get(m), alpha=0.15)
                ax.axhline(1.0, color="k", lw=0.5, ls=":")
                if metric == "cos":
                    ax.axhline(0.0, color="k", lw=0.5)
                ax.set_title(f"{layer}: trained by {run['spec']} (seed {run['seed']})",
                             fontsize=9)
                ax.set_xlabel("Adam steps")
                ax.set_ylabel(label)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=NAME, help="file name of the JSON and plot")
    for key in ("hidden", "batch", "steps", "eval_batches"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="Adam rate (tasks.py chose 0.01)")
    p.add_argument("--seeds", default=None, help="comma-separated initialisation seeds")
    p.add_argument("--checkpoints", default=None, help="comma-separated Adam steps")
    p.add_argument("--trajectories", default=None,
                   help="comma-separated methods that train the measured runs")
    p.add_argument("--methods", default=None, help="comma-separated methods measured")
    p.add_argument("--hybrids", default=None,
                   help="comma-separated training runs such as d_rtrl+l1:bptt ('' for none)")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("hidden", "batch", "steps", "eval_batches", "lr"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    for key in ("seeds", "checkpoints"):
        if getattr(args, key) is not None:
            cfg[key] = tuple(int(x) for x in getattr(args, key).split(",") if x)
    for key in ("trajectories", "methods", "hybrids"):
        if getattr(args, key) is not None:
            cfg[key] = tuple(x for x in getattr(args, key).split(",") if x)
    if "bptt" not in cfg["methods"]:
        cfg["methods"] = ("bptt", *cfg["methods"])
    start = time.perf_counter()
    task = bt_tasks.MNIST1D()
    payload = {"benchmark": NAME, "quick": args.quick, "config": cfg,
               "task": "MNIST1D (T = 40, class scored at the last step)",
               "model": "tasks.MinGRU2: two Stateful(MinGRUCell) and an ETPLinear readout",
               "loss": "softmax cross-entropy at the last step (mask); Adam",
               "environment": environment(), "trajectories": [], "hybrids": []}

    def save():
        payload["total_wall_s"] = time.perf_counter() - start
        write_json(os.path.join(args.out, f"{args.name}.json"), payload)

    runner = Runner(task, cfg)
    payload["reports"] = {m: learner.report() for m, learner in runner.grads.learners.items()
                          if m != "bptt"}
    for seed in cfg["seeds"]:
        for spec in cfg["trajectories"]:
            payload["trajectories"].append(
                runner.train(spec, seed, cfg["checkpoints"], cfg["methods"]))
            save()
        for spec in cfg["hybrids"]:
            payload["hybrids"].append(runner.train(spec, seed))
            save()
    save()
    plot(payload, os.path.join(args.out, f"{args.name}.png"))
    print(f"total {payload['total_wall_s']:.0f}s", flush=True)
    return payload


if __name__ == "__main__":
    main()
