"""Gradient fidelity: how close each online rule's gradient is to BPTT's.

For each model and algorithm, a fresh model (same seed, zero hidden state)
computes the online gradient of the mean loss over one sequence with
``learner.etrace_grad`` (single-step mode), and the same model's BPTT
gradient (``jax.grad`` through ``jax.lax.scan``) is the reference. Reported:

* ``cosine``: cosine similarity of all Params' gradients, concatenated;
* ``cosine_traced``, ``relative_error_traced``: the same over the Params that
  learn by the rule's traces only (a linear readout gets its exact same-step
  gradient under every rule);
* ``cosine_recurrent_layers``, ``relative_error_recurrent_layers``: the same
  without the readout's Params (``readout.*``), which otherwise dominate the
  overall numbers of both models (exact or nearly so under every rule);
* ``relative_error``: ``||g - g_bptt|| / ||g_bptt||``;
* ``norm_ratio``: ``||g|| / ||g_bptt||``;
* ``sign_agreement``: fraction of entries with the BPTT sign, among entries
  whose BPTT magnitude exceeds 1e-3 of that Param's largest;
* ``per_param_cosine``.

``eprop`` is ``braintrace.EProp()`` (``κ = 0``, symmetric feedback: the same
gradient as D-RTRL); ``eprop_random`` uses fixed random feedback
(``EProp(feedback='random')``). The recurrent models are approximate cases for every rule here (D-RTRL drops
the off-diagonal hidden Jacobian), so cosines below 1 are expected; the
``control`` entry (a random gradient of the same shapes) shows what an
unrelated direction scores. ``ostl_recurrent`` computes ``N·S`` JVPs per
step; ``uoro``, ``snap1``/``snap2`` (``SnAp(n)``) and ``rtrl`` keep ``N``-sized
influences: they run on the small configuration only. ``ThreeFactor`` (a
modulator, not a loss, drives it) and ``DNI`` (windowed mode) are checked by
their own tests (``tests/test_three_factor.py``, ``tests/test_dni.py``). Float64 throughout.

Usage::

    python benchmarks/fidelity.py            # small (hidden 32) and full (hidden 256) sizes
    python benchmarks/fidelity.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax

jax.config.update("jax_enable_x64", True)  # a separate process: the oracle in float64 (§7)

import jax.numpy as jnp
import numpy as np
from _models import (
    MODELS,
    bptt_grad_fn,
    build,
    data,
    environment,
    firing_rates,
    flat,
    mse,
    write_json,
)

import braintrace

NAME = "fidelity"
ALGORITHMS = ("d_rtrl", "es_d_rtrl", "eprop", "eprop_random", "ostl_feedforward",
              "ostl_recurrent", "uoro", "snap1", "snap2", "rtrl")
# Names braintrace.compile does not know: the instance to pass instead.
VARIANTS = {"eprop_random": lambda: braintrace.EProp(feedback="random"),
            "snap1": lambda: braintrace.SnAp(1), "snap2": lambda: braintrace.SnAp(2)}
SMALL_ONLY = ("ostl_recurrent", "uoro", "snap1", "snap2", "rtrl")
CONFIGS = {
    "small": {"hidden": 32, "inputs": 16, "outputs": 4, "batch": 8, "T": 100},
    "full": {"hidden": 256, "inputs": 64, "outputs": 10, "batch": 16, "T": 100},
}
QUICK_CONFIGS = {"quick": {"hidden": 8, "inputs": 4, "outputs": 2, "batch": 2, "T": 12}}
QUICK_MODELS = ("snn",)
QUICK_ALGORITHMS = ("d_rtrl", "es_d_rtrl", "ostl_recurrent")


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path if getattr(k, "name", None) != "value")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else float("nan")


def compare(g, ref, traced: set[str] | None = None) -> dict:
    """Cosine, relative error, norm ratio and sign agreement of ``g`` against ``ref``.

    With ``traced`` (Param paths), the ``*_traced`` entries repeat the first two
    over those Params only: the ones that learn by the rule's traces, leaving out
    readouts whose same-step gradient is exact for every rule.
    """
    leaves = [(_name(path), np.ravel(np.asarray(x)), np.ravel(np.asarray(y)))
              for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(g)[0],
                                           jax.tree_util.tree_flatten_with_path(ref)[0],
                                           strict=True)]
    a = np.concatenate([x for _, x, _ in leaves])
    b = np.concatenate([y for _, _, y in leaves])
    per_param, signs = {}, []
    for key, x, y in leaves:
        per_param[key] = _cosine(x, y)
        ny = np.abs(y).max() if y.size else 0.0
        big = np.abs(y) > 1e-3 * ny if ny > 0 else np.zeros_like(y, bool)
        signs.append(np.sign(x[big]) == np.sign(y[big]))
    signs = np.concatenate(signs) if signs else np.zeros(0, bool)
    out = {
        "cosine": _cosine(a, b),
        "relative_error": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        "norm_ratio": float(np.linalg.norm(a) / np.linalg.norm(b)),
        "sign_agreement": float(signs.mean()) if signs.size else float("nan"),
        "per_param_cosine": per_param,
    }
    hidden = [(x, y) for k, x, y in leaves if not k.startswith("readout")]
    if hidden:
        ah, bh = np.concatenate([x for x, _ in hidden]), np.concatenate([y for _, y in hidden])
        out["cosine_recurrent_layers"] = _cosine(ah, bh)
        out["relative_error_recurrent_layers"] = float(np.linalg.norm(ah - bh)
                                                       / np.linalg.norm(bh))
        out["norm_ratio_recurrent_layers"] = float(np.linalg.norm(ah) / np.linalg.norm(bh))
    if traced:
        at = np.concatenate([x for k, x, _ in leaves if k in traced])
        bt = np.concatenate([y for k, _, y in leaves if k in traced])
        out["cosine_traced"] = _cosine(at, bt)
        out["relative_error_traced"] = float(np.linalg.norm(at - bt) / np.linalg.norm(bt))
        out["traced_params"] = sorted(traced)
    return out


def random_like(tree, key: int):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, jnp.shape(x), jnp.result_type(x))
                                        for k, x in zip(keys, leaves)])


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results)
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    lowest = -0.2
    for ax, cname in zip(axes[0], configs):
        models = list(results[cname]["models"])
        width = 0.8 / max(len(models), 1)
        for i, model in enumerate(models):
            algs = results[cname]["models"][model]["algorithms"]
            names = [a for a in ALGORITHMS if "cosine" in algs.get(a, {})]
            cos = [algs[a].get("cosine_recurrent_layers", np.nan) for a in names]
            xs = np.arange(len(names)) + i * width
            ax.bar(xs, cos, width, label=model)
            lowest = min([lowest, *(c - 0.05 for c in cos if np.isfinite(c))])
            ax.set_xticks(np.arange(len(names)) + width * (len(models) - 1) / 2)
            ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylim(lowest, 1.05)
        ax.set_ylabel("cosine to BPTT (recurrent layers' Params)")
        c = results[cname]["config"]
        ax.set_title(f"{cname}: hidden {c['hidden']}, T {c['T']}, batch {c['batch']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--models", default=None, help="comma-separated (default snn,gru)")
    p.add_argument("--algorithms", default=None, help="comma-separated: " + ",".join(ALGORITHMS))
    p.add_argument("--configs", default=None, help="comma-separated: small,full")
    args = p.parse_args(argv)
    if args.quick:
        configs = QUICK_CONFIGS
    else:
        names = args.configs.split(",") if args.configs else list(CONFIGS)
        configs = {n: CONFIGS[n] for n in names}
    models = (args.models.split(",") if args.models
              else list(QUICK_MODELS if args.quick else MODELS))
    algorithms = (args.algorithms.split(",") if args.algorithms
                  else list(QUICK_ALGORITHMS if args.quick else ALGORITHMS))
    dtype = jnp.float64
    start_all = time.perf_counter()
    results = {}
    for cname, cfg in configs.items():
        H, I, O, B, T = cfg["hidden"], cfg["inputs"], cfg["outputs"], cfg["batch"], cfg["T"]
        entry = {"config": cfg, "models": {}}
        for model_name in models:
            xs, ys = data(model_name, T, I, O, B, dtype=dtype)
            model = build(model_name, I, H, O, B, dtype=dtype)
            grad_fn, params, hidden = bptt_grad_fn(model)
            ref = grad_fn(params, hidden, xs, ys)
            ref_norm = float(jnp.linalg.norm(flat(ref)))
            m_entry = {
                "bptt_grad_norm": ref_norm,
                "bptt_per_param_norm": {
                    ".".join(str(getattr(k, "key", k)) for k in path
                             if getattr(k, "name", None) != "value"): float(jnp.linalg.norm(x))
                    for path, x in jax.tree_util.tree_flatten_with_path(ref)[0]},
                "control_random_direction": {
                    k: v for k, v in compare(random_like(ref, 123), ref).items()
                    if k in ("cosine", "sign_agreement")},
                "algorithms": {},
            }
            if model_name == "snn":
                m_entry["firing_rate"] = firing_rates(model, xs)
            for alg in algorithms:
                if alg in SMALL_ONLY and cname == "full":
                    m_entry["algorithms"][alg] = {
                        "skipped": f"{alg} keeps N*S-sized Jacobians or influences; small "
                                   "sizes only"}
                    continue
                t0 = time.perf_counter()
                algorithm = VARIANTS[alg]() if alg in VARIANTS else alg
                learner = braintrace.compile(build(model_name, I, H, O, B, dtype=dtype),
                                             algorithm, xs[0], batch_size=B)
                g = learner.etrace_grad(xs, ys, mse)
                assert jax.tree.structure(g) == jax.tree.structure(ref), "Param trees differ"
                res = compare(g, ref, set(learner.graph.traced_param_paths))
                res["wall_s"] = time.perf_counter() - t0
                m_entry["algorithms"][alg] = res
                print(f"{cname:5s} {model_name:4s} {alg:17s} cos {res['cosine']:+.4f} (recurrent "
                      f"layers {res['cosine_recurrent_layers']:+.4f})  rel.err "
                      f"{res['relative_error']:.3f} ({res['relative_error_recurrent_layers']:.3f})"
                      f"  norm x{res['norm_ratio']:.3f} ({res['norm_ratio_recurrent_layers']:.3f})  sign {res['sign_agreement']:.3f}  "
                      f"({res['wall_s']:.1f}s)", flush=True)
            print(f"{cname:5s} {model_name:4s} {'(random control)':17s} cos "
                  f"{m_entry['control_random_direction']['cosine']:+.4f}   |g_bptt| "
                  f"{ref_norm:.3g}", flush=True)
            entry["models"][model_name] = m_entry
        results[cname] = entry
    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "dtype": "float64",
        "loss": "mse, mean over time",
        "environment": environment(),
        "results": results,
        "total_wall_s": time.perf_counter() - start_all,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{NAME}.json"), payload)
    plot(results, os.path.join(args.out, f"{NAME}.png"))
    return payload


if __name__ == "__main__":
    main()
