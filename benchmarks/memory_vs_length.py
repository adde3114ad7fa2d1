"""Peak memory of one training pass against sequence length: BPTT vs online learning.

For every (model, method, T) a fresh Python process:

1. builds the model and lowers one training pass over ``T`` steps with
   ``jax.ShapeDtypeStruct`` inputs, compiles it and reads XLA's memory analysis
   (argument, output, temporary bytes; ``peak = arg + out + temp - alias``);
2. creates the data, executes the pass once and reads the process peak RSS
   (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), with glibc's mmap threshold
   fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``) so that freed buffers leave the RSS.

BPTT is ``jax.grad`` through ``jax.lax.scan`` of the pure step; the online
methods (``d_rtrl``, ``es_d_rtrl`` and the spiking rules ``ottt``, ``sltt``,
``otpe``) are ``learner.etrace_grad`` (one fused scan, hidden state and traces in
the carry) over the whole sequence at once. The ``*_streamed`` methods are how
an online learner meets a long sequence: ``etrace_grad`` is called on
consecutive chunks of ``--stream-chunk`` steps (hidden state and traces carry
over between calls, gradients summed), each chunk's data drawn just before it
is used, so neither the program nor the inputs grow with ``T``; their XLA
analysis is that of the one chunk program. A configuration that cannot execute
within ``--exec-timeout`` keeps its compiled analysis and says why its RSS is
missing.

Usage::

    python benchmarks/memory_vs_length.py            # full: T in 100..10000 (tens of minutes)
    python benchmarks/memory_vs_length.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "memory_vs_length"
STREAMED = ("d_rtrl_streamed", "es_d_rtrl_streamed")
SPIKING_RULES = ("ottt", "sltt", "otpe")
METHODS = ("bptt", "d_rtrl", "es_d_rtrl", "fptt", "osttp", *STREAMED, *SPIKING_RULES)
STREAM_CHUNK = 100
FULL_LENGTHS = (100, 1000, 4000, 10000)
QUICK_LENGTHS = (8, 64)
# --quick keeps to one model and two methods: every configuration is a fresh process
# (a JAX import and a compilation each).
QUICK_MODELS = ("gru",)
QUICK_METHODS = ("bptt", "es_d_rtrl_streamed")


# -- child: one configuration in a fresh process ---------------------------------------------


def _rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return -1


def _emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, HERE)
    import jax
    import jax.numpy as jnp
    from _models import block, bptt_grad_fn, build, data_numpy, mse

    import braintrace

    rss_import = _rss_bytes()
    cfg = json.loads(args.config)
    name, method, T = args.model, args.method, args.length
    H, I, O, B = cfg["hidden"], cfg["inputs"], cfg["outputs"], cfg["batch"]
    streamed = method in STREAMED
    chunk = min(args.stream_chunk, T) if streamed else T
    if T % chunk:
        raise SystemExit(f"T={T} is not a multiple of --stream-chunk={chunk}")
    # The data first, while little else is resident, so creating it does not set the peak.
    # Streamed: only the first chunk now; the others are drawn as they are used.
    xs_np, ys_np = data_numpy(name, chunk, I, O, B)
    xs, ys = jnp.asarray(xs_np), jnp.asarray(ys_np)
    block((xs, ys))
    del xs_np, ys_np
    rss_data = _rss_bytes()
    xs_spec = jax.ShapeDtypeStruct((chunk, B, I), jnp.float32)
    ys_spec = jax.ShapeDtypeStruct((chunk, B, O), jnp.float32)
    model = build(name, I, H, O, B)
    start = time.perf_counter()
    if method == "bptt":
        grad_fn, params, hidden = bptt_grad_fn(model)
        lowered = grad_fn.lower(params, hidden, xs_spec, ys_spec)
    else:
        algorithm = method.removesuffix("_streamed")
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, I)), batch_size=B)
        lowered = learner.lower_etrace_grad(xs_spec, ys_spec, mse)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    ma = compiled.memory_analysis()
    xla = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "generated_code_bytes": int(ma.generated_code_size_in_bytes),
    }
    xla["peak_bytes"] = (xla["argument_bytes"] + xla["output_bytes"] + xla["temp_bytes"]
                         - xla["alias_bytes"])
    record = {"model": name, "method": method, "T": T, "xla": xla,
              "compile_s": compile_s, "input_bytes": 4 * chunk * B * (I + O)}
    if streamed:
        record["stream_chunk"] = chunk
    _emit(record)  # the analysis survives even if execution is killed

    rss_before = _rss_bytes()
    current_before = _current_rss_bytes()
    start = time.perf_counter()
    if method == "bptt":
        grads = compiled(params, hidden, xs, ys)
        via = "compiled BPTT program"
    elif streamed:
        grads = None
        for k in range(T // chunk):
            if k:
                xs_np, ys_np = data_numpy(name, chunk, I, O, B, seed=k)
                xs, ys = jnp.asarray(xs_np), jnp.asarray(ys_np)
                del xs_np, ys_np
            g = learner.etrace_grad(xs, ys, mse, reduction="sum")
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            block(grads)
        via = f"learner.etrace_grad on {T // chunk} chunks of {chunk} steps"
    else:
        # Run the very program that was analysed (etrace_grad would trace and compile it again).
        grads = compiled(*learner.grad_args(xs, ys))
        via = "compiled etrace_grad program"
    block(grads)
    peak = _rss_bytes()
    record.update({
        "executed": True,
        "executed_via": via,
        "exec_s": time.perf_counter() - start,
        "rss": {"after_import_bytes": rss_import, "after_data_bytes": rss_data,
                "peak_before_exec_bytes": rss_before,
                "current_before_exec_bytes": current_before, "peak_bytes": peak,
                # exact when executing raised the peak; otherwise an upper bound
                "exec_increase_bytes": peak - current_before,
                "exec_raised_peak": peak > rss_before},
    })
    _emit(record)


# -- parent ------------------------------------------------------------------------------------


def run_config(model: str, method: str, T: int, config: dict, timeout: float,
               stream_chunk: int = STREAM_CHUNK) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--method",
           method, "--length", str(T), "--config", json.dumps(config),
           "--stream-chunk", str(stream_chunk)]
    # glibc raises its mmap threshold after the first large free and then keeps later large
    # buffers on its heap, where freed memory stays resident: peak RSS would then count the
    # allocator's retention, which grows with the number of etrace_grad calls. A fixed
    # threshold (1 MiB) returns every freed large buffer to the OS, so RSS follows live memory.
    env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc, timed_out = proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc, timed_out = None, True
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    record = results[-1] if results else {"model": model, "method": method, "T": T}
    record["wall_s"] = time.perf_counter() - start
    if not record.get("executed"):
        record["executed"] = False
        if timed_out:
            record["skipped_reason"] = (
                f"execution did not finish within --exec-timeout={timeout:.0f}s on this CPU; "
                "the XLA analysis is from compilation only and peak RSS was not measured")
        else:
            record["skipped_reason"] = f"child failed (rc={rc}): {err.strip()[-2000:]}"
    return record


def _exec_increase(r: dict) -> int | None:
    rss = r.get("rss")
    if not rss or rss.get("current_before_exec_bytes", -1) < 0:
        return None
    return rss["peak_bytes"] - rss["current_before_exec_bytes"]


def _rss_excl_inputs(r: dict) -> int | None:
    rss = r.get("rss")
    return rss["peak_bytes"] - r["input_bytes"] if rss else None


def summarise(records: list[dict], lengths: list[int]) -> dict:
    """Per model and method: memory at the longest T over the shortest (1.0 = flat)."""
    short, long = min(lengths), max(lengths)
    getters = {
        "xla_temp": lambda r: r.get("xla", {}).get("temp_bytes"),
        "xla_peak": lambda r: r.get("xla", {}).get("peak_bytes"),
        "xla_peak_excl_inputs": lambda r: (r["xla"]["peak_bytes"] - r["input_bytes"]
                                           if "xla" in r else None),
        "rss_peak": lambda r: r.get("rss", {}).get("peak_bytes"),
        "rss_peak_excl_inputs": _rss_excl_inputs,
    }
    out = {}
    for model in sorted({r["model"] for r in records}):
        for method in METHODS:
            rows = {r["T"]: r for r in records if r["model"] == model and r["method"] == method}
            if short not in rows or long not in rows:
                continue
            entry = {}
            for key, get in getters.items():
                a, b = get(rows[short]), get(rows[long])
                entry[f"{key}_ratio_T{long}_over_T{short}"] = (b / a) if a and b else None
            a, b = _exec_increase(rows[short]), _exec_increase(rows[long])
            entry[f"rss_exec_increase_MiB_T{short}"] = None if a is None else a / 2**20
            entry[f"rss_exec_increase_MiB_T{long}"] = None if b is None else b / 2**20
            entry[f"input_MiB_T{long}"] = rows[long].get("input_bytes", 0) / 2**20
            if method != "bptt":
                for key in ("xla_temp", "xla_peak", "xla_peak_excl_inputs", "rss_peak",
                            "rss_peak_excl_inputs"):
                    ratio = entry[f"{key}_ratio_T{long}_over_T{short}"]
                    entry[f"{key}_flat_within_10pct"] = None if ratio is None else ratio <= 1.1
            out[f"{model}/{method}"] = entry
    return out


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    colours = {"bptt": "tab:red", "d_rtrl": "tab:blue", "es_d_rtrl": "tab:green",
               "fptt": "tab:brown", "osttp": "tab:pink",
               "d_rtrl_streamed": "tab:cyan", "es_d_rtrl_streamed": "tab:olive",
               "ottt": "tab:purple", "sltt": "tab:gray", "otpe": "tab:orange"}
    for j, model in enumerate(models):
        for i, (key, title) in enumerate((("xla", "XLA compiled peak (arg+out+temp)"),
                                          ("rss", "process peak RSS"))):
            ax = axes[i][j]
            for method in METHODS:
                rows = sorted((r for r in records if r["model"] == model
                               and r["method"] == method), key=lambda r: r["T"])
                pts = [(r["T"], r[key]["peak_bytes"] / 2**20) for r in rows
                       if key in r and r[key].get("peak_bytes")]
                if pts:
                    ax.plot(*zip(*pts), "o-", color=colours[method], label=method)
                if key == "xla":
                    pts = [(r["T"], r["xla"]["temp_bytes"] / 2**20) for r in rows if "xla" in r]
                    if pts:
                        ax.plot(*zip(*pts), "x--", color=colours[method], alpha=0.6,
                                label=f"{method} (temp only)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("MiB")
            ax.set_title(f"{model}: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--models", default=None, help="comma-separated: snn,gru")
    p.add_argument("--methods", default=None, help="comma-separated: " + ",".join(METHODS))
    p.add_argument("--lengths", default=None, help="comma-separated T values")
    p.add_argument("--jobs", type=int, default=None,
                   help="configurations measured at once (each in its own process)")
    p.add_argument("--stream-chunk", type=int, default=None,
                   help=f"steps per etrace_grad call of the *_streamed methods (default "
                        f"{STREAM_CHUNK}; 8 with --quick)")
    p.add_argument("--exec-timeout", type=float, default=3600.0,
                   help="seconds one configuration may take before its RSS is skipped")
    p.add_argument("--from-json", default=None,
                   help="re-summarise and re-plot an existing results JSON (no measurement)")
    # internal: one configuration
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}

    sys.path.insert(0, HERE)
    from _models import FULL, QUICK, environment, write_json

    if args.from_json:
        with open(args.from_json) as f:
            payload = json.load(f)
        payload["summary"] = summarise(payload["results"], payload["config"]["lengths"])
        write_json(args.from_json, payload)
        plot(payload["results"], os.path.splitext(args.from_json)[0] + ".png")
        print(json.dumps(payload["summary"], indent=1))
        return payload

    config = QUICK if args.quick else FULL
    lengths = ([int(t) for t in args.lengths.split(",")] if args.lengths
               else list(QUICK_LENGTHS if args.quick else FULL_LENGTHS))
    jobs = args.jobs or (2 if args.quick else 1)
    models = (args.models.split(",") if args.models
              else list(QUICK_MODELS if args.quick else ("snn", "gru")))
    methods = (args.methods.split(",") if args.methods
               else list(QUICK_METHODS if args.quick else METHODS))
    stream_chunk = args.stream_chunk or (min(QUICK_LENGTHS) if args.quick else STREAM_CHUNK)
    todo = [(m, a, T) for m in models for a in methods for T in lengths]
    start = time.perf_counter()

    def one(job):
        rec = run_config(*job, config, args.exec_timeout, stream_chunk)
        rss = rec.get("rss", {}).get("peak_bytes")
        print(f"{job[0]:4s} {job[1]:10s} T={job[2]:6d}  xla_peak="
              f"{rec.get('xla', {}).get('peak_bytes', 0) / 2**20:9.1f} MiB  temp="
              f"{rec.get('xla', {}).get('temp_bytes', 0) / 2**20:9.1f} MiB  rss="
              f"{(rss or 0) / 2**20:8.1f} MiB  ({rec['wall_s']:.0f}s)"
              + ("" if rec["executed"] else "  [not executed]"), flush=True)
        return rec

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        records = list(pool.map(one, todo))
    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "config": {**config, "lengths": lengths, "dtype": "float32", "loss": "mse",
                   "stream_chunk": stream_chunk,
                   "models": {"snn": "2x RecurrentSpiking(LIF) + LeakyReadout",
                              "gru": "Stateful(GRUCell) + ETPLinear readout"},
                   "jobs": jobs},
        "environment": environment(),
        "notes": [
            ("xla.peak_bytes = argument + output + temp - alias of the compiled training pass; "
             "arguments include xs and ys, which grow with T for every method (input_bytes)."),
            ("rss.peak_bytes is ru_maxrss of a fresh process after one executed pass; it also "
             "includes the JAX runtime, compilation and the input data."),
            ("*_streamed: etrace_grad over consecutive chunks of stream_chunk steps, data drawn "
             "per chunk; xla is the chunk program's analysis and input_bytes one chunk's data."),
        ],
        "results": records,
        "summary": summarise(records, lengths),
        "total_wall_s": time.perf_counter() - start,
    }
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{NAME}.json"), payload)
    plot(records, os.path.join(args.out, f"{NAME}.png"))
    print(json.dumps(payload["summary"], indent=1))
    return payload


if __name__ == "__main__":
    main()
