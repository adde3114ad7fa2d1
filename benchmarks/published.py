"""Our online gradients against the published braintrace 0.2.8 on the same models, in one run.

The paired models are ``_models.py``'s GRU (one ``GRUCell``, a linear readout) and SNN (two
recurrent LIF layers, a leaky readout); hidden 256, input 64, output 10, batch 16, ``T = 250``,
float32. The orchestrator (run with *our* virtual environment) draws the inputs and targets and
our seed-0 initial weights once and saves them to an ``.npz``; in each of ``--rounds`` rounds it
starts one child process per side (the first side alternating):

* a *published* child in a separate Python 3.12 environment holding ``braintrace==0.2.8``
  (``--published-python``): 0.2.8's ``pp_prop`` (ES-D-RTRL, ``decay_or_rank=0.9`` as ours),
  its ``D_RTRL`` and a BPTT of the same model (``brainstate.transform.grad`` through
  ``for_loop``), each ``etrace_grad`` under ``brainstate.transform.jit``;
* an *ours* child: our BPTT (``_models.bptt_grad_fn``), ``ESDRTRL`` and ``DRTRL`` with
  ``signal='exact'`` and ``'fast'`` (``etrace_grad``, default time blocks).

Each child compiles its passes (keeping each method's first gradient: zero hidden state and
traces) and then times one pass of every method whenever asked; the orchestrator asks the two
sides in turn, ``--repeats`` times (the first side alternating), so that a change of machine
load hits both alike. It reports, per model and method: ms per step (median pass / ``T``, median
over rounds); ratios ours / 0.2.8's counterpart per round (medians of the round's passes) and
their median; the cosine and relative error of each gradient to *our* float32 BPTT gradient over
the whole Param tree, and per Param the cosine and norm ratio; and ``zero_params``, the Params
whose gradient is all zero (for 0.2.8's methods in 0.2.8's own Param names, where one fused
block of ours maps to several of theirs).

The models in 0.2.8 are built to match ours (0.2.8's own ``GRUCell`` computes
``n = tanh(W_h [x, r ⊙ h])``, ours ``n = tanh(W_in x + b_in + r ⊙ (W_hn h))``, and its
``LeakyRateReadout`` has no bias), from ``braintrace.nn.Linear`` (the ETP ``matmul``):

* GRU: ``r = σ(W_r [x, h] + b_r)``, ``z = σ(W_z [x, h] + b_z)``,
  ``n = tanh(W_in x + b_in + r ⊙ (W_hn h))``, ``h' = (1 - z) ⊙ n + z ⊙ h``, readout
  ``W_o h' + b_o``. 0.2.8's compiler refuses a fused ``(h, 3h)`` kernel (its output is not
  shaped like the hidden state), so our fused ``dense_i`` / ``dense_h`` are split by gate and
  the ``r`` and ``z`` blocks of both stacked (``W_r = [W_ir; W_hr]``): the same function and
  the same Params, in four matmuls where ours has two (and 0.2.8's ``GRUCell`` three).
* LIF layer: ``z_{t-1} = H(v_{t-1} - 1)``, ``v_t = α (v_{t-1} - z_{t-1}) + W [x_t, z_{t-1}] + b``
  (``W = [W_i; W_h]``, soft reset, ``α = e^{-1/20}``), spikes ``H(v_t - 1)`` with our
  ``fast_sigmoid`` surrogate ``1 / (1 + 10 |x|)^2`` (a ``braintools.surrogate.Surrogate``;
  its forward is ``x >= 0`` where ours is ``x > 0``: equal unless ``v`` sits exactly on the
  threshold). Readout ``y_t = α y_{t-1} + W_o z_t + b_o`` with ``y`` a hidden state.

0.2.8's BPTT against ours (``pub:bptt``: cosine and relative error) checks the mapping. The JSON
states each side's jax version: 0.2.8 accepts jax >= 0.9, so installing it with jax 0.10.2 (as
below) runs both sides on the same XLA.

Usage::

    python benchmarks/published.py --published-python /path/to/py312/bin/python
    python benchmarks/published.py --ours-only --quick      # our side alone, seconds

The 3.12 environment (outside this repository and its dependencies)::

    ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/bt028 && /tmp/bt028/bin/pip install \\
        braintrace==0.2.8 brainstate==0.6.0 braintools==0.4.0 'jax[cpu]==0.10.2'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = ("bptt", "es_d_rtrl", "es_d_rtrl:fast", "d_rtrl", "d_rtrl:fast")
PUBLISHED = ("pub:bptt", "pub:pp_prop", "pub:d_rtrl")
PAIRS = {"es_d_rtrl:fast": "pub:pp_prop", "es_d_rtrl": "pub:pp_prop",
         "d_rtrl:fast": "pub:d_rtrl", "d_rtrl": "pub:d_rtrl", "bptt": "pub:bptt"}
INSTALL = ("braintrace 0.2.8 needs Python 3.12 in its own environment, e.g.\n"
           "  ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/bt028 && /tmp/bt028/bin/pip install "
           "braintrace==0.2.8 brainstate==0.6.0 braintools==0.4.0 'jax[cpu]==0.10.2'\n"
           "then pass --published-python /tmp/bt028/bin/python (or --ours-only).")


# ------------------------------------------------------------------------- shared by both sides

def _compile_passes(runs: dict, block) -> dict:
    """Compiles each pass (its first call, kept for the gradient) and a timer of one pass each."""
    out = {"compile_s": {}, "zero": {}, "grads": {}, "first": {}}
    for method, run in runs.items():
        start = time.perf_counter()
        out["first"][method] = block(run())
        out["compile_s"][method] = time.perf_counter() - start

    def time_all() -> dict:
        seconds = {}
        for method, run in runs.items():
            start = time.perf_counter()
            block(run())
            seconds[method] = time.perf_counter() - start
        return seconds

    out["time_all"] = time_all
    return out


# -------------------------------------------------------------------------------- our side

def ours_child(spec: dict) -> dict:
    sys.path.insert(0, HERE)
    import jax
    from _models import block, bptt_grad_fn, build, mse
    from fast_signal import algorithm
    from flax import nnx

    import braintrace

    cfg, name = spec["config"], spec["model"]
    data = dict(np.load(spec["npz"]))
    xs, ys = jax.numpy.asarray(data["xs"]), jax.numpy.asarray(data["ys"])
    runs = {}
    for method in spec["methods"]:
        model = build(name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
        for path, value in _dotted(nnx.state(model, nnx.Param)).items():
            np.testing.assert_array_equal(value, data["w:" + path], err_msg=path)
        if method == "bptt":
            grad_fn, params, hidden = bptt_grad_fn(model)
            runs[method] = lambda f=grad_fn, p=params, h=hidden: f(p, h, xs, ys)
        else:
            learner = braintrace.compile(model, algorithm(method), xs[0], batch_size=cfg["batch"])
            runs[method] = lambda lr=learner: lr.etrace_grad(xs, ys, mse)

    def blocked(tree):
        block(tree)
        return tree

    result = _compile_passes(runs, blocked)
    for method in runs:
        grads = _dotted(result["first"].pop(method))
        result["zero"][method] = sorted(k for k, a in grads.items() if not np.any(a))
        result["grads"][method] = grads
    result["versions"] = {"braintrace": "this repository", "jax": jax.__version__,
                          "python": sys.version.split()[0]}
    return result


def _dotted(state) -> dict:
    """``{'rnn.cell.dense_i.kernel': array, ...}`` from an ``nnx.State`` of Params or gradients."""
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        while parts and parts[-1].strip(".") in ("", "value"):
            parts.pop()
        out[".".join(parts)] = np.asarray(leaf)
    return out


def _child_main(side: str, spec_path: str, result_path: str) -> None:
    """Compiles one side's passes, writes ``result_path`` (.json) and the gradients (.npz),
    then times one pass of every method for each ``time`` line on stdin until ``quit``."""
    with open(spec_path) as f:
        spec = json.load(f)
    if side == "published":
        try:
            from _published_side import published_child
        except ImportError as err:
            raise SystemExit(f"--published-python cannot import 0.2.8 ({err}).\n{INSTALL}") from err

        result = published_child(spec, _compile_passes)
    else:
        result = ours_child(spec)
    grads, time_all = result.pop("grads"), result.pop("time_all")
    result.pop("first")
    flat = {f"{m}|{p}": a for m, g in grads.items() for p, a in g.items()}
    np.savez(result_path + ".npz", **flat)
    with open(result_path, "w") as f:
        json.dump(result, f)
    print("@@ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "time":
            break
        print("@@" + json.dumps(time_all()), flush=True)


# --------------------------------------------------------------------------- the orchestrator

class _Child:
    """A child process of one side: compiled at start, then timed pass by pass on request."""

    def __init__(self, python: str, side: str, spec: dict, work: str, tag: str):
        spec_path, self.result_path = (os.path.join(work, f"{tag}.spec.json"),
                                       os.path.join(work, tag))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.side, self.tag, self.err = side, tag, open(  # noqa: SIM115
            os.path.join(work, f"{tag}.err"), "w+")  # open while the child lives
        # the published child runs away from the repository so that `import braintrace` is 0.2.8
        cwd = work if side == "published" else os.path.dirname(HERE)
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--child", side, spec_path, self.result_path],
            cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self._reply()

    def _reply(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:]
        self.err.seek(0)
        raise RuntimeError(f"{self.side} child ({self.tag}) failed:\n{self.err.read()[-4000:]}")

    def time_all(self) -> dict:
        self.proc.stdin.write("time\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())

    def finish(self) -> tuple[dict, dict]:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()
        self.err.close()
        with open(self.result_path) as f:
            result = json.load(f)
        with np.load(self.result_path + ".npz") as z:
            grads: dict = {}
            for key in z.files:
                method, path = key.split("|")
                grads.setdefault(method, {})[path] = z[key]
        return result, grads


def _write_inputs(name: str, cfg: dict, length: int, path: str) -> dict:
    """Our seed-0 weights (dotted paths) and the benchmark data, saved for both sides."""
    sys.path.insert(0, HERE)
    from _models import build, data
    from flax import nnx

    model = build(name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
    weights = _dotted(nnx.state(model, nnx.Param))
    xs, ys = data(name, length, cfg["inputs"], cfg["outputs"], cfg["batch"])
    np.savez(path, xs=np.asarray(xs), ys=np.asarray(ys),
             **{"w:" + k: v for k, v in weights.items()})
    return {k: list(v.shape) for k, v in weights.items()}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom else 0.0


def _compare(grads: dict, reference: dict) -> dict:
    """Cosine to the reference over the whole Param tree and per Param (dotted path), and each
    Param's gradient norm over the reference's."""
    paths = sorted(reference)
    if set(grads) != set(paths):
        raise AssertionError(f"gradient Params {sorted(grads)} differ from {paths}")
    whole = np.concatenate([np.ravel(grads[p]) for p in paths])
    ref = np.concatenate([np.ravel(reference[p]) for p in paths])
    return {"cosine": _cosine(whole, ref),
            "relative_error": float(np.linalg.norm(whole - ref) / np.linalg.norm(ref)),
            "cosine_per_param": {p: _cosine(grads[p], reference[p]) for p in paths},
            "norm_ratio_per_param": {p: float(np.linalg.norm(grads[p]) / np.linalg.norm(
                reference[p])) if np.any(reference[p]) else None for p in paths}}


def run_model(name: str, args, cfg: dict, length: int, work: str) -> dict:
    """``--rounds`` rounds of fresh children; in each, ``--repeats`` passes of every method,
    the two sides taking turns pass by pass (the first side alternating) so that a change of
    machine load hits both alike."""
    spec = {"model": name, "config": cfg, "methods": args.methods,
            "npz": os.path.join(work, f"{name}.npz")}
    shapes = _write_inputs(name, cfg, length, spec["npz"])
    sides = ["ours"] if args.published_python is None else ["published", "ours"]
    pythons = {"ours": sys.executable,  # abspath, not realpath: a venv's python is a link
               "published": args.published_python and os.path.abspath(args.published_python)}
    rounds, grads = [], {}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        children = {side: _Child(pythons[side], side, spec, work, f"{name}.{side}.{r}")
                    for side in order}
        passes = {side: {} for side in order}
        for k in range(args.repeats):
            for side in order if k % 2 == 0 else order[::-1]:
                for method, sec in children[side].time_all().items():
                    passes[side].setdefault(method, []).append(sec)
        results = {}
        for side, child in children.items():
            results[side], g = child.finish()
            results[side]["pass_s"] = passes[side]
            grads.update(g if r == 0 else {})
            print(name, "round", r, side, {m: round(1e3 * float(np.median(t)) / length, 3)
                                           for m, t in passes[side].items()}, flush=True)
        rounds.append(results)
    return _summarise(rounds, grads, length, shapes)


def _summarise(rounds: list, grads: dict, length: int, shapes: dict) -> dict:
    per_round = [{m: 1e3 * float(np.median(t)) / length for res in rnd.values()
                  for m, t in res["pass_s"].items()} for rnd in rounds]
    methods = list(per_round[0])
    out = {"param_shapes": shapes, "rounds_ms_per_step": per_round,
           "versions": {side: res["versions"] for side, res in rounds[0].items()},
           "compile_s": {m: s for res in rounds[0].values() for m, s in res["compile_s"].items()},
           "methods": {}}
    reference = grads["bptt"]
    for m in methods:
        entry = {"ms_per_step": float(np.median([r[m] for r in per_round])),
                 "zero_params": next(res["zero"][m] for res in rounds[0].values()
                                     if m in res["zero"]),
                 **_compare(grads[m], reference)}
        pair = PAIRS.get(m)
        if pair in per_round[0]:
            ratios = [r[m] / r[pair] for r in per_round]
            entry["ratio_to_published"] = {pair: float(np.median(ratios))}
            entry["ratio_to_published_per_round"] = ratios
        entry["ratio_to_our_bptt"] = float(np.median([r[m] / r["bptt"] for r in per_round]))
        out["methods"][m] = entry
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 6.4), squeeze=False)
    for col, name in enumerate(models):
        entries = results["models"][name]["methods"]
        names = list(entries)
        colours = ["tab:orange" if n.startswith("pub:") else "tab:blue" for n in names]
        for row, key, label in ((0, "ms_per_step", "ms per time step"),
                                (1, "cosine", "cosine to our BPTT")):
            ax = axes[row][col]
            ax.bar(range(len(names)), [entries[n][key] for n in names], color=colours)
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set(title=f"{name}: {label}" + (" (orange: 0.2.8)" if row == 0 else ""),
                   ylabel=label)
            if row == 0:
                ax.set_yscale("log")
            else:
                ax.set_ylim(min(0.5, min(entries[n][key] for n in names)), 1.01)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--published-python", help="python of a venv with braintrace==0.2.8")
    parser.add_argument("--ours-only", action="store_true", help="skip 0.2.8 (no 3.12 venv)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, T = 20")
    parser.add_argument("--length", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["gru", "snn"], choices=["gru", "snn"])
    parser.add_argument("--methods", nargs="+", default=list(OURS), choices=list(OURS))
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="published")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "SPEC", "RESULT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child_main(*args.child)
        return {}
    if args.published_python is None and not args.ours_only:
        print(INSTALL, file=sys.stderr)
        raise SystemExit(2)
    if "bptt" not in args.methods:
        args.methods = ["bptt", *args.methods]
    sys.path.insert(0, HERE)
    from _models import FULL, QUICK, environment, write_json

    cfg, length = (QUICK, 20) if args.quick else (FULL, args.length)
    with tempfile.TemporaryDirectory(prefix="published_") as work:
        models = {name: run_model(name, args, cfg, length, work) for name in args.models}
    results = {"config": {**cfg, "T": length}, "rounds": args.rounds, "repeats": args.repeats,
               "environment": environment(), "command": " ".join(sys.argv),
               "note": ("ms per step: median over rounds of each child's median pass / T; ratios "
                        "per round (children launched alternately), median over rounds; cosine "
                        "to our float32 BPTT on the same weights and data; shared 2-core CPU"),
               "models": models}
    write_json(os.path.join(args.out, f"{args.name}.json"), results)
    plot(results, os.path.join(args.out, f"{args.name}.png"))
    return results


if __name__ == "__main__":
    main()
