"""Scale: a sparse recurrent spiking network of up to 1,048,576 neurons, BPTT vs online learning.

The model is the published pp_prop benchmark's shape (``PPPROP`` below):
``ETPLinear(64 -> N)`` plus ``ETPSparseLinear(N -> N)`` with ``degree`` random
recurrent synapses into each neuron, driving ``ALIF(N)`` neurons read out by
``LeakyReadout(N -> 10)``; Poisson input spikes, batch 32, cross-entropy on
the last 5 of ``T`` steps. For every (N, T, method) a fresh Python process
(one at a time, so memory is measured alone; ``_scale_child.py``):

1. compiles one update (``jax.grad`` through ``lax.scan`` for ``bptt``;
   ``learner.lower_etrace_grad`` for the online methods; ``name@K`` is
   ``block_size=K``, ``@1`` the per-step form, ``name:fast`` the fast learning
   signal ``signal='fast'``; without ``@K`` the default block size, chosen by
   its memory budget) and reads XLA's memory analysis; ``--batch auto`` takes
   the largest batch (from 8 to ``--max-batch``) whose XLA peak fits
   ``--memory-limit-gib``; a program above the limit is not executed, nor is any
   with ``--compile-only``;
2. runs it once (warm-up), then ``--repeats`` times: seconds per update
   (median), and the process peak RSS (``ru_maxrss``, glibc's mmap threshold
   fixed at 1 MiB as in ``memory_vs_length.py``);
3. sets the step against its **analytic floor** (``_scale_floor.py``): the bytes
   it must move (state, traces, weights, gathered rows; the formula in the JSON)
   over a streaming-bandwidth probe, and the rows the sparse sums gather over a
   gather probe, both run in the same process: ``floor.measured_over_floor``.

``--batch 32,128`` runs every configuration at each batch (the records say which; the
summary of a batch after the first is keyed ``N=…,T=…,B=…``), and every record and summary
entry has the throughput ``sample_steps_per_s = batch · T / s_per_update``: on a TPU a
row of 128 values costs what a row of 32 does, so a larger batch is nearly free there.

``--ops`` (on by default) also times the sparse operation itself at ``B = 32``
against plain formulations of the same sums (``segment_sum`` unsorted and
sorted, gathers reduced over rows, autodiff's scatter): ``ops`` in the JSON.
``--formulation accelerator`` compiles the accelerators' formulation on the CPU
(with ``--compile-only``: their memory, measured here); on a TPU it runs XLA's
formulation of the sparse sums instead of the Pallas kernels (``--formulation pallas``
runs the kernels in interpret mode off a TPU: slow, for checking).

Usage::

    python benchmarks/scale.py                       # N 4k, 16k, 131k; T 30, 300 (hours)
    python benchmarks/scale.py --sizes 16384 --lengths 30 --methods bptt,es_d_rtrl@1
    python benchmarks/scale.py --sizes 1048576 --lengths 300 --methods es_d_rtrl --batch auto
    python benchmarks/scale.py --sizes 131072 --lengths 30 --methods bptt,es_d_rtrl --batch 32,128
    python benchmarks/scale.py --quick               # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "scale"
PPPROP = {"inputs": 64, "outputs": 10, "degree": 8, "batch": 32, "loss_steps": 5,
          "input_rate": 0.2}
FULL = {"sizes": (4096, 16384, 131072), "lengths": (30, 300), "repeats": 3,
        "probe_elements": 2**25}
QUICK = {"sizes": (256,), "lengths": (8,), "repeats": 2, "batch": 4, "loss_steps": 2,
         "probe_elements": 2**20}
METHODS = ("bptt", "es_d_rtrl", "es_d_rtrl@1", "es_d_rtrl:fast", "d_rtrl", "d_rtrl@1")
QUICK_METHODS = ("bptt", "es_d_rtrl", "es_d_rtrl@1")
PUBLISHED = {"neurons": 131072, "flops_per_step": 2.13e9, "bytes_per_step": 4.40e9,
             "s_per_update": 4.19, "peak_rss_gib": 1.8}
"""The published pp_prop benchmark at 131,072 neurons (braintrace 0.2.x, i9-12900H)."""


# -- the model ---------------------------------------------------------------------------------


def connectivity(n: int, degree: int, seed: int = 0):
    """``degree`` distinct random inputs into each of ``n`` neurons, in output order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pre = rng.integers(0, n, (n, degree))
    while True:
        ordered = np.sort(pre, axis=1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if not repeated.any():
            break
        pre[repeated] = rng.integers(0, n, (int(repeated.sum()), degree))
    return pre.reshape(-1).astype(np.int32), np.repeat(np.arange(n, dtype=np.int32), degree)


def build(n: int, cfg: dict):
    """The model with hidden states for ``cfg['batch']`` samples."""
    from flax import nnx

    import braintrace
    from braintrace import layers

    class SparseSNN(nnx.Module):
        """``z_t = ALIF(W_in x_t + W_rec z_{t-1})``, ``y_t = LeakyReadout(z_t)``."""

        def __init__(self, rngs: nnx.Rngs):
            self.inp = layers.ETPLinear(cfg["inputs"], n, rngs=rngs)
            self.rec = layers.ETPSparseLinear(n, n, connectivity=connectivity(n, cfg["degree"]),
                                              use_bias=False, rngs=rngs)
            self.neuron = layers.ALIF(n)
            self.readout = layers.LeakyReadout(n, cfg["outputs"], rngs=rngs)

        def __call__(self, x):
            return self.readout(self.neuron(self.inp(x) + self.rec(self.neuron.spikes())))

    model = SparseSNN(nnx.Rngs(0))
    braintrace.init_states(model, cfg["batch"])
    return model


def data(T: int, cfg: dict, seed: int = 0):
    """Poisson input spikes ``(T, B, inputs)``, a label per sample ``(T, B)``, the loss mask."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = (rng.random((T, cfg["batch"], cfg["inputs"])) < cfg["input_rate"]).astype(np.float32)
    labels = rng.integers(0, cfg["outputs"], cfg["batch"]).astype(np.int32)
    mask = np.zeros(T, np.float32)
    mask[-min(cfg["loss_steps"], T):] = 1.0
    return xs, np.broadcast_to(labels, (T, cfg["batch"])).copy(), mask


def cross_entropy(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def bptt_program(model, T: int, mask):
    """``(jitted grad(params, hidden, xs, ys), params, hidden)``: the masked mean loss."""
    import jax
    import jax.numpy as jnp
    from _models import split
    from flax import nnx

    graphdef, params, hidden, other = split(model)
    weights = jnp.asarray(mask / mask.sum())

    def total(params, hidden, xs, ys):
        def body(h, step):
            x, y, w = step
            m = nnx.merge(graphdef, params, h, other, copy=True)
            return split(m)[2], w * cross_entropy(m(x), y)

        return jnp.sum(jax.lax.scan(body, hidden, (xs, ys, weights))[1])

    return jax.jit(jax.grad(total)), params, hidden


def method_parts(method: str) -> tuple[str, int | None, bool]:
    """``'d_rtrl@2+donate'`` -> ``('d_rtrl', 2, True)``; ``'d_rtrl'`` -> ``('d_rtrl', None,
    False)`` (the default block size, nothing donated); ``'es_d_rtrl:fast@1'`` ->
    ``('es_d_rtrl:fast', 1, False)``."""
    method, _, donate = method.partition("+")
    name, _, block = method.partition("@")
    return name, (int(block) if block else None), donate == "donate"


def algorithm(name: str):
    """``'es_d_rtrl:fast'`` -> ``ESDRTRL(signal='fast')`` (likewise ``d_rtrl:fast``); a name
    without ``:signal`` as it is (the registry's default, the exact signal)."""
    import braintrace

    name, _, signal = name.partition(":")
    if not signal:
        return name
    return {"es_d_rtrl": braintrace.ESDRTRL, "d_rtrl": braintrace.DRTRL}[name](signal=signal)


LOOPS: dict[str, str] = {}
"""The loop each online method last ran with (``Blocked(size=K)``, ``PerStep()``)."""


def _loop(learner, length: int, block_size: int | None):
    from braintrace._loops import choose_loop

    entry = learner.compiled.entry_of(learner.model, learner.batch_size)
    return choose_loop(entry.rules, length=length, chunk_size=None, block_size=block_size)


def _donating_program(learner, length: int, block_size: int | None):
    """The learner's ``etrace_grad`` program, jitted again with its hidden state and traces
    donated: the measurement of a proposed driver change (outputs reuse the inputs' buffers)."""
    import functools

    import jax

    from braintrace._drivers._programs import grad_program

    entry = learner.compiled.entry_of(learner.model, learner.batch_size)
    spec = _loop(learner, length, block_size)
    jitted = jax.jit(grad_program, static_argnames=("entry", "loss_fn", "spec"),
                     donate_argnames=("hidden", "traces"))
    return functools.partial(jitted.lower, entry, cross_entropy, spec)


def program(model, method: str, xs, ys, mask):
    """``(lowered, args)``: one update over ``xs``, and the arguments to run it with (with
    ``+donate``, a function making fresh ones: donated arguments are consumed)."""
    import jax
    import jax.numpy as jnp

    import braintrace

    if method == "bptt":
        grad_fn, params, hidden = bptt_program(model, xs.shape[0], mask)
        return grad_fn.lower(params, hidden, xs, ys), (params, hidden, xs, ys)
    name, block_size, donate = method_parts(method)
    learner = braintrace.compile(model, algorithm(name), xs[0], batch_size=xs.shape[1])
    args = tuple(learner.grad_args(xs, ys, mask=mask))
    LOOPS[method] = repr(_loop(learner, xs.shape[0], block_size))
    if not donate:
        return (learner.lower_etrace_grad(xs, ys, cross_entropy, mask=mask,
                                          block_size=block_size), args)
    fresh = lambda: jax.tree.map(jnp.copy, args)
    return _donating_program(learner, xs.shape[0], block_size)(*args), fresh


# -- parent ----------------------------------------------------------------------------------


def memory_report(dump_dir: str, rows: int = 12) -> dict:
    """The largest buffers of the update program from XLA's memory-usage report (dumped by
    ``--xla_dump_to``): the dumped module with the most bytes, the bandwidth probe aside."""
    import glob

    best = None
    for path in glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")):
        if "lambda" in os.path.basename(path):  # the bandwidth probe
            continue
        with open(path) as f:
            lines = f.read().splitlines()
        total = next((int(line.split()[2]) for line in lines if line.startswith("Total bytes")),
                     0)
        if best is None or total > best[0]:
            best = (total, lines)
    if best is None:
        return {}
    table = []
    for line in best[1][4:]:
        parts = [p.strip() for p in line.split(";")]
        if len(parts) < 5 or not parts[1]:
            break
        table.append({"size": parts[1], "values": int(parts[3]), "shapes": parts[4]})
    return {"total_bytes": best[0], "largest": table[:rows]}


def run_config(cfg: dict, timeout: float) -> dict:
    import tempfile

    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
    dump = tempfile.mkdtemp(prefix="scale_xla_") if cfg.get("memory_report") else None
    if dump:  # XLA's buffer assignment of every program the child compiles
        env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                            "--xla_dump_hlo_as_text").strip()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                              env=env)
        out, err, failed = proc.stdout, proc.stderr, proc.returncode != 0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, failed = f"timed out after {timeout:.0f} s", True
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    record = results[-1] if results else {k: cfg[k] for k in ("neurons", "T", "method")}
    record["wall_s"] = time.perf_counter() - start
    if dump:
        import shutil

        record["xla_memory_report"] = memory_report(dump)
        shutil.rmtree(dump, ignore_errors=True)
    if failed:
        record["executed"] = record.get("executed", False) and "s_per_update" in record
        record["error"] = err.strip()[-2000:]
    return record


def _gib(r: dict, key: str) -> float | None:
    if key == "rss":
        return r["rss"]["peak_bytes"] / 2**30 if "rss" in r else None
    return r["xla"]["peak_bytes"] / 2**30 if "xla" in r else None


def sample_steps_per_s(record: dict) -> float | None:
    """``batch · T / s_per_update``: samples times steps learned per second."""
    if not record.get("s_per_update") or not record.get("batch"):
        return None
    return record["batch"] * record["T"] / record["s_per_update"]


def summary_key(neurons: int, T: int, batch: int | None, first_batch: int | None) -> str:
    """``N=…,T=…`` for the run's first batch (as runs of one batch always were, and every
    batch of ``--batch auto``: ``first_batch`` None), else ``N=…,T=…,B=…``."""
    key = f"N={neurons},T={T}"
    return key if None in (batch, first_batch) or batch == first_batch else f"{key},B={batch}"


def summarise(records: list[dict], first_batch: int | None = None) -> dict:
    """Per (N, T, batch): each method's time, throughput and memory, over BPTT's, and over
    its floor (:func:`summary_key`)."""
    out = {}
    keys = {(r["neurons"], r["T"], r.get("batch") or first_batch) for r in records}
    for key in sorted(keys, key=lambda k: (k[0], k[1], k[2] or 0)):
        rows = {r["method"]: r for r in records
                if (r["neurons"], r["T"], r.get("batch") or first_batch) == key}
        base = rows.get("bptt", {})
        entry = {}
        for method, r in rows.items():
            floor = r.get("floor", {})
            on_host = r.get("on_host", {}).get("xla", {}).get("peak_bytes")
            e = {"batch": r.get("batch"), "s_per_update": r.get("s_per_update"),
                 "s_per_step": r.get("s_per_step"),
                 "sample_steps_per_s": sample_steps_per_s(r), "peak_rss_gib": _gib(r, "rss"),
                 "xla_peak_gib": _gib(r, "xla"),
                 "xla_needed_gib": (r["xla_needed_bytes"] / 2**30
                                    if r.get("xla_needed_bytes") else None),
                 "xla_peak_on_host_gib": on_host / 2**30 if on_host else None,
                 "floor_s_per_step": floor.get("s_per_step"),
                 "measured_over_floor": floor.get("measured_over_floor"),
                 "measured_over_bytes_floor": floor.get("measured_over_bytes_floor")}
            if e["s_per_update"] and base.get("s_per_update"):
                e["time_ratio_to_bptt"] = e["s_per_update"] / base["s_per_update"]
            if e["peak_rss_gib"] and "rss" in base:
                e["rss_ratio_to_bptt"] = e["peak_rss_gib"] / _gib(base, "rss")
            entry[method] = e
        out[summary_key(*key, first_batch)] = entry
    return out


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("s_per_step", "seconds per step"), ("xla_peak_gib", "XLA peak (GiB)"),
              ("over_floor", "time / analytic floor"))
    value = {"s_per_step": lambda r: r.get("s_per_step"),
             "xla_peak_gib": lambda r: _gib(r, "xla"),
             "over_floor": lambda r: r.get("floor", {}).get("measured_over_floor")}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    methods = list(dict.fromkeys(r["method"] for r in records))
    colours = {m: plt.get_cmap("tab10")(k % 10) for k, m in enumerate(methods)}
    lengths = sorted({r["T"] for r in records})
    styles = dict(zip(lengths, ("o-", "s--", "^:"), strict=False))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for method in methods:
            for T in lengths:
                pts = sorted((r["neurons"], value[key](r)) for r in records
                             if r["method"] == method and r["T"] == T and value[key](r))
                if pts:
                    ax.plot(*zip(*pts), styles.get(T, "o-"), color=colours[method],
                            label=f"{method} T={T}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("neurons N")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.subplots_adjust(right=0.83)
    batches = sorted({r["batch"] for r in records if r.get("batch")})
    fig.suptitle("sparse ALIF network (8 synapses/neuron, batch "
                 f"{', '.join(map(str, batches))}): BPTT vs online")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _batch(value: str) -> list[int] | str:
    return value if value == "auto" else [int(b) for b in value.split(",")]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=NAME, help="the JSON/PNG file name")
    p.add_argument("--sizes", default=None, help="comma-separated neuron counts")
    p.add_argument("--lengths", default=None, help="comma-separated T values")
    p.add_argument("--methods", default=None, help="comma-separated: " + ",".join(METHODS))
    p.add_argument("--repeats", type=int, default=None, help="timed updates per configuration")
    p.add_argument("--batch", type=_batch, default=None,
                   help="samples per update (default 32; comma-separated: each), or 'auto': "
                        "the largest that fits")
    p.add_argument("--max-batch", type=int, default=64, help="the largest batch 'auto' tries")
    p.add_argument("--memory-limit-gib", type=float, default=14.0,
                   help="configurations whose XLA peak exceeds this are compiled, not run")
    p.add_argument("--compile-only", action="store_true",
                   help="compile and analyse each configuration, run none")
    p.add_argument("--host-fallback", action="store_true",
                   help="a program the accelerator does not compile: its memory on the host CPU")
    p.add_argument("--formulation", choices=("cpu", "accelerator", "pallas"), default=None,
                   help="force the sums' formulation (the accelerators' on the CPU; XLA's "
                        "instead of the Pallas kernels on a TPU)")
    p.add_argument("--sparse-staged", action="store_true",
                   help="on a TPU, the uniform sparse forward in its staged form "
                        "(braintrace._primitives._sparse_pallas.STAGED)")
    p.add_argument("--kernels", default=None,
                   help="on a TPU, the Pallas kernels of the sparse sums (default: the "
                        "library's, sparse_kernels_tpu.default_variant()): a variant of "
                        "braintrace._primitives._sparse_tpu.VARIANTS, optionally +chunked_pair "
                        "(the weight pullback over several source chunks by the staged "
                        "pair-sum: _sparse_tpu.CHUNKED_PAIR) or +own_pair (that, each chunk's "
                        "call staging its own connections: _sparse_tpu.OWN_CHUNK_PAIR), then "
                        "optionally @ROWS (target rows per block): cells, staged, packed, "
                        "packed+chunked_pair, packed+own_pair, staged@2048")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per configuration")
    p.add_argument("--memory-report", action="store_true",
                   help="dump XLA's buffer assignment; record each program's largest buffers")
    p.add_argument("--skip", default="",
                   help="comma-separated N:T:method configurations not to run (recorded as such)")
    p.add_argument("--no-ops", dest="ops", action="store_false",
                   help="skip the sparse-operation timings")
    p.add_argument("--replot", default=None,
                   help="redraw the PNG of a results JSON; of several (comma-separated) in one "
                        "figure, written to --out/--name.png")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        sys.path.insert(0, HERE)
        from _scale_child import child

        child(json.loads(args.child))
        return {}
    if args.replot:  # one or more JSONs: their records in one figure
        paths = args.replot.split(",")
        records = []
        for path in paths:
            with open(path) as f:
                records += json.load(f)["results"]
        target = (os.path.splitext(paths[0])[0] if len(paths) == 1
                  else os.path.join(args.out, args.name))
        plot(records, target + ".png")
        return {"results": records}
    sys.path.insert(0, HERE)
    from _models import environment, write_json
    from _scale_ops import measure_ops
    from sparse_kernels_tpu import default_variant, sparse_sums, variant

    args.kernels = args.kernels or default_variant()
    with variant(args.kernels):  # an unknown name fails here, before any configuration
        pass

    base = {**PPPROP, **FULL, **(QUICK if args.quick else {})}
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(base["sizes"])
    lengths = [int(t) for t in args.lengths.split(",")] if args.lengths else list(base["lengths"])
    methods = (args.methods.split(",") if args.methods
               else list(QUICK_METHODS if args.quick else METHODS))
    auto = args.batch == "auto"
    cfg = {k: base[k] for k in PPPROP} | {"repeats": args.repeats or base["repeats"],
                                          "memory_limit_gib": args.memory_limit_gib,
                                          "probe_elements": base["probe_elements"],
                                          "memory_report": args.memory_report,
                                          "batch_auto": auto, "max_batch": args.max_batch,
                                          "compile_only": args.compile_only,
                                          "host_fallback": args.host_fallback,
                                          "formulation": args.formulation,
                                          "sparse_staged": args.sparse_staged,
                                          "kernels": args.kernels}
    batches = [cfg["batch"]] if args.batch is None or auto else args.batch
    cfg["batch"] = batches[0]
    skip = set(filter(None, args.skip.split(",")))
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    records = []
    for n in sizes:
        for T in lengths:
            for batch in batches:
                for method in methods:
                    if f"{n}:{T}:{method}" in skip:
                        records.append({"neurons": n, "T": T, "method": method,
                                        "executed": False, "skipped_reason": "--skip: not run "
                                        "(time on the shared 2-core machine)"})
                        continue
                    rec = run_config({**cfg, "batch": batch, "neurons": n, "T": T,
                                      "method": method}, args.timeout)
                    records.append(rec)
                    _print_record(rec)
    env = environment()
    payload = {
        "benchmark": NAME, "quick": args.quick,
        "config": {**cfg, "sizes": sizes, "lengths": lengths, "methods": methods,
                   "batches": batches,
                   "sparse_sums": sparse_sums(env["backend"], args.formulation, args.kernels)},
        "published_pp_prop": PUBLISHED,
        "environment": {**env, "load_average_1min_before_after":
                        [load_before, os.getloadavg()[0]]},
        "notes": NOTES,
        "results": records, "summary": summarise(records, None if auto else batches[0]),
        "ops": measure_ops(quick=args.quick) if args.ops else None,
        "total_wall_s": time.perf_counter() - start,
    }
    write_json(os.path.join(args.out, f"{args.name}.json"), payload)
    plot(records, os.path.join(args.out, f"{args.name}.png"))
    print(json.dumps(payload["summary"], indent=1))
    return payload


def _print_record(rec: dict) -> None:
    xla = (rec.get("xla", {}).get("peak_bytes") or rec.get("xla_needed_bytes") or 0) / 2**30
    floor = rec.get("floor", {})
    print(f"N={rec['neurons']:7d} T={rec['T']:4d} {rec['method']:14s} B={rec.get('batch', 0):3d}"
          f" s/update={rec.get('s_per_update') or 0:9.3f}"
          f"  sample-steps/s={sample_steps_per_s(rec) or 0:9.0f}  xla_peak={xla:6.2f} GiB"
          f"  floor={floor.get('s_per_step') or 0:.2e} s/step"
          f"  x floor={floor.get('measured_over_floor') or 0:6.2f}"
          + ("" if rec.get("executed") else "  [not executed]"), flush=True)


NOTES = [
    "s_per_update: median of `repeats` runs of the compiled update after one warm-up.",
    ("sample_steps_per_s (summary): batch · T / s_per_update; with several batches, the "
     "summary of each batch after the first is keyed N=…,T=…,B=…."),
    ("rss.peak_bytes: ru_maxrss of a fresh process after compiling and running the update "
     "(JAX runtime, compilation, data and the run; MALLOC_MMAP_THRESHOLD_=1 MiB); "
     "rss_after_build_bytes / rss_after_lower_bytes: after building the model and after "
     "lowering the update (braintrace.compile's graph included)."),
    ("batch: samples per update; with --batch auto the largest that fits the memory limit "
     "(`tried`: each batch compiled and its XLA peak)."),
    ("floor: the bytes and gather indices one step must move (`formula`, `bytes_by_term`), "
     "floor s_per_step = max(bytes / probed bandwidth, indices / probed gather rate), both "
     "probes run in the same process after the timings (_scale_floor.py); "
     "measured_over_floor = s_per_step / floor s_per_step."),
    ("xla_needed_bytes: the memory a program that did not compile asked for (XLA:TPU's "
     "message); compile_error: its last lines; on_host (--host-fallback): the same program "
     "compiled for the host's CPU, XLA:CPU's memory analysis."),
]


if __name__ == "__main__":
    main()
