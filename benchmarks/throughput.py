"""Time per step and compile time: BPTT vs online learning, measured in the same run.

For each model, one training pass over ``T`` steps is compiled and then run
``--repeats`` times; the methods are run round-robin (BPTT, D_RTRL, ES_D_RTRL,
BPTT, ...) so that a change in machine load hits all of them alike. Reported:

* ``compile_s``: tracing + lowering + XLA compilation of the pass, timed on
  ``.lower(...).compile()`` (for the online methods also ``braintrace.compile``,
  which builds the trace graph: ``graph_compile_s``);
* ``step_us``: median (and min) wall time of a pass / ``T``, after compilation,
  outputs blocked on (``block_until_ready``);
* ``ratio_to_bptt``: median step time / BPTT's median step time.

``--profile`` (on by default, off with ``--quick``) also splits one online step
into its parts, inside the fused scan: the forward pass with the learning
signal (VJP), the hidden Jacobians, the trace update and the gradient
contribution (see :func:`profile_step`).

``--host-time`` adds, per method, the host's time per call of the stateful API
(``per_call``): ``learner.etrace_grad`` (BPTT too, through ``braintrace.compile(model,
'bptt')``) against its own compiled program called directly, and against the device's time
(``--device-time``): ``host_us = wall − device`` per call, next to the jit step's.

Every method also gets an analytic floor (``floor``, see ``_floor.py``): the bytes a step
must move (Params, inputs, hidden state, traces; the formula is in the JSON) over a
bandwidth probe run in the same process, and ``measured ÷ floor`` (of the device time
where there is one, else of the jit step's wall time, else of the stateful call's).

``--length`` takes several lengths (``100,1000``); each model is then measured at each, under
the key ``model@T``.

``--back-to-back N`` times every method as a training loop does: ``N`` calls in a row, blocked
once at the end (a call's time is the whole ÷ ``N``), so that the host prepares a call while the
device runs the one before; without it each call is timed alone, blocked on its outputs, and the
host's time per call adds to the device's.

``--xla-multi-output-fusion`` runs everything (BPTT included) with XLA:CPU's
multi-output fusion pass switched on (``XLA_FLAGS=--xla_backend_extra_options=
xla_cpu_use_multi_output_fusion``; it is off by default in XLA:CPU) and writes
``throughput_xla_mof.json``. It lets XLA update the coupled states of a neuron
with ``S > 1`` (the ``alif`` model) in one loop, in place.

Usage::

    python benchmarks/throughput.py                 # snn, gru, alif; hidden 256, input 64, batch 16
    python benchmarks/throughput.py --quick         # seconds
    python benchmarks/throughput.py --xla-multi-output-fusion
    python benchmarks/throughput.py --models gru,snn --length 100,1000 --repeats 3 \
        --no-profile --jit-step --device-time --host-time   # on an accelerator
    python benchmarks/throughput.py --models gru,snn --length 100,1000 --methods es_d_rtrl \
        --repeats 3 --no-profile --jit-step --host-time --back-to-back 20   # a training loop
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MOF_FLAG = "--xla_backend_extra_options=xla_cpu_use_multi_output_fusion"
if "--xla-multi-output-fusion" in sys.argv[1:]:  # XLA reads XLA_FLAGS once, at backend start
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {MOF_FLAG}".strip()

import jax
import jax.numpy as jnp
import numpy as np
from _floor import TERMS, bandwidth, floor, floor_ratio, model_terms
from _models import (
    DEMO,
    FULL,
    QUICK,
    block,
    bptt_grad_fn,
    build,
    count_params,
    data,
    device_seconds,
    environment,
    mse,
    timed,
    write_json,
)
from flax import nnx

import braintrace
from braintrace._loops import Blocked, choose_loop

NAME = "throughput"
MODELS = ("snn", "gru", "alif", "demo")
METHODS = ("bptt", "d_rtrl", "es_d_rtrl", "d_rtrl@1", "es_d_rtrl@1", "ottt", "sltt", "otpe")
"""``name`` is the default (time-blocked, ``block_size=32``, where the rule has a blocked form)
form, ``name@K`` blocks of ``K`` steps (``@1``: the per-step form); ``ottt``, ``sltt`` and
``otpe`` are the spiking rules by name (``SLTT`` runs per step); ``name_bf16``
(``d_rtrl_bf16``, ``es_d_rtrl_bf16@1``, ...) stores the traces in bfloat16
(``braintrace.compile(..., trace_dtype=jnp.bfloat16)``)."""
TRACE_DTYPES = {"bf16": jnp.bfloat16}
QUICK_METHODS = ("bptt", "d_rtrl", "es_d_rtrl", "d_rtrl@1")
TARGETS = {"es_d_rtrl": 0.6, "d_rtrl": 1.3}


def method_parts(method: str) -> tuple[str, int | None, Any]:
    """``'d_rtrl@1'`` -> ``('d_rtrl', 1, None)``; ``'d_rtrl'`` -> ``('d_rtrl', None, None)`` (the
    default); ``'d_rtrl_bf16'`` -> ``('d_rtrl', None, bfloat16)`` (the traces' dtype)."""
    name, _, block_size = method.partition("@")
    base, _, suffix = name.rpartition("_")
    name, trace_dtype = (base, TRACE_DTYPES[suffix]) if suffix in TRACE_DTYPES else (name, None)
    return name, (int(block_size) if block_size else None), trace_dtype


def jit_step(model, learner, block_size: int | None, xs, ys) -> Callable[[], Any]:
    """The online gradient as a user's own jitted train step computes it: ``online_grad``'s
    pure ``grad`` inside ``jax.jit`` over the model's split state (compiled here), dispatched as
    the BPTT baseline is, without ``learner.etrace_grad``'s host-side checks and write-back.

    The carried state (hidden state and traces) is donated and each call carries on from the
    last one's, as a training loop does: a trace the step may not overwrite is copied whole
    at every call (D-RTRL at hidden 1024, batch 64, T 100 on a TPU v5e: 24 µs per step)."""
    online = braintrace.online_grad(learner, mse, block_size=block_size)
    graphdef, state = nnx.split(model)
    carried = [online.init(model)]

    def step(state, carried, xs, ys):
        grads, carried, stats = online.grad(nnx.merge(graphdef, state), carried, xs, ys)
        return grads, carried, stats.losses

    compiled = jax.jit(step, donate_argnums=1).lower(state, carried[0], xs, ys).compile()

    def run():
        grads, carried[0], losses = compiled(state, carried[0], xs, ys)
        return grads, losses

    return run


def add_dense_block_flags(p: argparse.ArgumentParser) -> None:
    """``--[no-]fused-dense-blocks`` and ``--[no-]fused-narrow-traces``: D-RTRL's block update
    in one pass on a TPU (default: the library's), read by :func:`set_dense_block_flags`."""
    p.add_argument("--fused-dense-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="on a TPU, D-RTRL's time-blocked update of a dense trace in one pass "
                        "(braintrace._algorithms._d_rtrl.FUSED_DENSE_BLOCKS; default: the "
                        "library's, on); --no-fused-dense-blocks: XLA's passes")
    p.add_argument("--fused-narrow-traces", action=argparse.BooleanOptionalAction, default=None,
                   help="that pass also over traces stored in bfloat16 (d_rtrl_bf16; "
                        "braintrace._algorithms._d_rtrl.FUSED_NARROW_TRACES; default: the "
                        "library's, off)")


def set_dense_block_flags(args: argparse.Namespace):
    """Sets the flags of :func:`add_dense_block_flags` that were given; returns the module that
    holds them (``_d_rtrl``), whose values the run records."""
    from braintrace._algorithms import _d_rtrl

    if args.fused_dense_blocks is not None:
        _d_rtrl.FUSED_DENSE_BLOCKS = args.fused_dense_blocks
    if args.fused_narrow_traces is not None:
        _d_rtrl.FUSED_NARROW_TRACES = args.fused_narrow_traces
    return _d_rtrl


def prepare(model_name: str, method: str, cfg: dict, xs, ys, with_jit_step: bool = False,
            with_program: bool = False):
    """Compiles one training pass; returns ``(run, compile_s, extra)``: ``extra['jit_run']``,
    the pass as a jitted train step (with ``with_jit_step``); ``extra['program_run']``, the
    stateful call's compiled program called directly (with ``with_program``); and what the
    floor needs (``extra['floor']``)."""
    H, I, O, B = cfg["hidden"], cfg["inputs"], cfg["outputs"], cfg["batch"]
    model = build(model_name, I, H, O, B)
    terms = model_terms(model, xs[0], ys[0])
    start = time.perf_counter()
    if method == "bptt":
        grad_fn, params, hidden = bptt_grad_fn(model)
        lowered = grad_fn.lower(params, hidden, xs, ys)
        lower_s = time.perf_counter() - start
        compiled = lowered.compile()
        xla_s = time.perf_counter() - start - lower_s

        def run():
            return compiled(params, hidden, xs, ys)

        extra = {"graph_compile_s": 0.0, "floor": floor(terms)}
    else:
        name, block_size, trace_dtype = method_parts(method)
        learner = braintrace.compile(model, name, xs[0], batch_size=B, trace_dtype=trace_dtype)
        graph_s = time.perf_counter() - start
        lowered = learner.lower_etrace_grad(xs, ys, mse, block_size=block_size)
        lower_s = time.perf_counter() - start - graph_s
        program = lowered.compile()
        xla_s = time.perf_counter() - start - graph_s - lower_s
        trace_bytes = sum(int(np.size(a)) * jnp.dtype(a.dtype).itemsize
                          for a in jax.tree.leaves(learner.traces))

        def run():
            return learner.etrace_grad(xs, ys, mse, block_size=block_size)

        spec = choose_loop(learner.rules, length=xs.shape[0], block_size=block_size)
        extra = {"graph_compile_s": graph_s, "trace_bytes": trace_bytes,
                 "floor": floor(terms, traces=learner.traces,
                                block=spec.size if isinstance(spec, Blocked) else 1,
                                length=xs.shape[0])}
        if with_jit_step:
            extra["jit_run"] = jit_step(model, learner, block_size, xs, ys)
        if with_program:
            extra["program_run"] = program_call(program, learner, xs, ys)
    extra.update({"trace_lower_s": lower_s, "xla_compile_s": xla_s})
    compile_s = time.perf_counter() - start
    return run, compile_s, extra


def program_call(program, learner, xs, ys) -> Callable[[], Any]:
    """``run()``: the stateful call's compiled ``program`` on its checked arguments, prepared
    once (the device's work of ``etrace_grad`` without its host-side checks and write-back)."""
    args = learner.grad_args(xs, ys)
    return lambda: program(*args)


def api_bptt(model_name: str, cfg: dict, xs, ys) -> dict[str, Callable[[], Any]]:
    """BPTT through the stateful API (``braintrace.compile(model, 'bptt')``): its
    ``etrace_grad`` and its compiled program called directly."""
    model = build(model_name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
    learner = braintrace.compile(model, "bptt", xs[0], batch_size=cfg["batch"])
    program = learner.lower_etrace_grad(xs, ys, mse).compile()
    return {"bptt:api": lambda: learner.etrace_grad(xs, ys, mse),
            "bptt:api:program": program_call(program, learner, xs, ys)}


def per_call(runs: dict, times: dict, method: str, T: int, device: dict) -> dict[str, Any]:
    """The host's time per call of ``method`` through the stateful API (µs): the stateful
    call's wall time, its program's called directly, the device's (``None`` on the CPU) and
    the differences; and the same for the jit step where there is one."""
    stateful = "bptt:api" if method == "bptt" else method
    jit = "bptt" if method == "bptt" else f"{method}:jit"
    median = lambda name: float(np.median(times[name]) * 1e6) if name in times else None
    row = {"stateful_us": median(stateful), "program_us": median(f"{stateful}:program"),
           "device_us": device.get(stateful), "jit_us": median(jit),
           "jit_device_us": device.get(jit)}
    row["driver_us"] = row["stateful_us"] - row["program_us"]
    row["host_us"] = None if row["device_us"] is None else row["stateful_us"] - row["device_us"]
    row["jit_host_us"] = (None if row["jit_us"] is None or row["jit_device_us"] is None
                          else row["jit_us"] - row["jit_device_us"])
    row["stateful_step_us"] = row["stateful_us"] / T
    return row


def profile_step(model_name: str, method: str, cfg: dict, xs, ys, repeats: int) -> dict:
    """Where the time of one online step goes, measured inside the fused scan.

    Four scans over the same ``T`` steps, each adding one part of
    ``online_step`` (``braintrace/_loops/_per_step.py``): (1) forward pass and
    learning signal (VJP), (2) + hidden Jacobians ``D``, ``Df``, (3) + trace
    update, (4) + gradient contribution (= the full step). The differences are
    each part's marginal cost per step (microseconds). Every stage keeps its
    results alive (summed into the carry) so XLA cannot drop them.
    """
    from braintrace._compiler import StepLeaves, programs
    from braintrace._loops import LoopContext, init_carry, step_jacobians

    H, I, O, B = cfg["hidden"], cfg["inputs"], cfg["outputs"], cfg["batch"]
    name, _, trace_dtype = method_parts(method)
    learner = braintrace.compile(build(model_name, I, H, O, B), name, xs[0], batch_size=B,
                                 trace_dtype=trace_dtype)
    graph, rules = learner.graph, learner.rules
    params, hidden, other = learner.leaves()
    operands = programs.operands(graph, params)
    carry0 = init_carry(LoopContext.build(rules, mse, params), hidden, other, learner.traces)
    T = xs.shape[0]

    def make(stage: int):
        def body(c, xy):
            h, o, traces, summed, keep = c
            x_t, y_t = xy
            x_leaves = [x_t]

            def loss(p, h):
                outs, rel_x = programs.forward(graph, StepLeaves(p, h, o, x_leaves))
                return (mse(jax.tree.unflatten(graph.out_treedef, outs.y), y_t),
                        (outs.hidden, outs.other, rel_x))

            _, pullback, (h2, o2, rel_x) = jax.vjp(loss, list(params), list(h), has_aux=True)
            same, delta = pullback(jnp.ones((), jnp.float32))
            keep = keep + sum(jnp.sum(a) for a in jax.tree.leaves((same, delta)))
            if stage >= 2:
                jac = step_jacobians(rules, StepLeaves(params, h, o, x_leaves))
                if stage == 2:
                    keep = keep + sum(jnp.sum(a) for a in jax.tree.leaves((jac.d, jac.df)))
            if stage >= 3:  # the scan applies the update before the next contribution
                traces = rules.update(traces, jac, rel_x, operands)
            if stage >= 4:
                term = rules.contribution(traces, delta, operands)
                summed = jax.tree.map(jnp.add, summed, term)
            return (list(h2), list(o2), traces, summed, keep), None

        def run(xs, ys):
            c = (carry0.hidden, carry0.other, carry0.traces, carry0.summed, jnp.zeros(()))
            return jax.lax.scan(body, c, (xs, ys))[0]

        return jax.jit(run)

    labels = ("forward_and_learning_signal_vjp", "jacobians", "trace_update", "contribution")
    cumulative = {}
    for stage, label in enumerate(labels, start=1):
        fn = make(stage)
        block(fn(xs, ys))
        cumulative[label] = float(np.median([timed(lambda fn=fn: fn(xs, ys))
                                             for _ in range(repeats)]) / T * 1e6)
    marginal, previous = {}, 0.0
    for label in labels:
        marginal[label] = cumulative[label] - previous
        previous = cumulative[label]
    return {"cumulative_us_per_step": cumulative, "marginal_us_per_step": marginal,
            "full_step_us": cumulative[labels[-1]]}


def plot(results: dict, path: str, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    colours = {"bptt": "tab:red", "d_rtrl": "tab:blue", "es_d_rtrl": "tab:green"}
    for ax, model in zip(axes[0], models):
        methods = list(results[model]["methods"])
        vals = [results[model]["methods"][m]["step_us_median"] for m in methods]
        bars = ax.bar(methods, vals, color=[colours.get(m, "grey") for m in methods])
        for bar, m in zip(bars, methods):
            ratio = results[model]["methods"][m]["ratio_to_bptt"]
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        for m, target in TARGETS.items():
            if m in methods:
                ax.axhline(target * results[model]["methods"]["bptt"]["step_us_median"],
                           color=colours[m], ls=":", lw=1, label=f"{m} target {target}x")
        ax.set_yscale("log")
        ax.set_ylabel("µs per step (median)")
        ax.set_title(f"{model}: time per step{note}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(model_name: str, T: int, cfg: dict, methods: list[str], args: Any, repeats: int,
            probe: dict, do_profile: bool) -> dict:
    """One model at one sequence length: every method's times, ratios, floor (and per-call
    host times, profile) as ``results[model]`` holds them."""
    xs, ys = data(model_name, T, cfg["inputs"], cfg["outputs"], cfg["batch"])
    runs, entry = {}, {}
    for method in methods:
        run, compile_s, extra = prepare(model_name, method, cfg, xs, ys, args.jit_step,
                                        args.host_time)
        runs[method] = run
        for part in ("jit_run", "program_run"):
            if part in extra:
                runs[f"{method}:{part.removesuffix('_run')}"] = extra.pop(part)
        entry[method] = {"compile_s": compile_s, **extra}
    if args.host_time:
        runs.update(api_bptt(model_name, cfg, xs, ys))
    for run in runs.values():
        block(run())  # warm
    times = {m: [] for m in runs}
    for _ in range(repeats):  # round-robin: load changes hit every method alike
        for m, run in runs.items():
            times[m].append(back_to_back(run, args.back_to_back) if args.back_to_back
                            else timed(run))
    device = {}
    if args.device_time:
        device = {m: device_seconds(run) for m, run in runs.items() if ":program" not in m}
        device = {m: None if v is None else v * 1e6 for m, v in device.items()}
    for m in methods:
        t = np.asarray(times[m]) / T * 1e6
        entry[m].update({"step_us_median": float(np.median(t)), "step_us_min": float(t.min()),
                         "step_us_all": t.tolist()})
        if f"{m}:jit" in times:
            jit_s = np.median(times[f"{m}:jit"])
            entry[m]["jit_step_us_median"] = float(jit_s / T * 1e6)
            entry[m]["jit_ratio_to_bptt"] = float(jit_s / np.median(times["bptt"]))
        if args.device_time:
            entry[m]["device_step_us"] = None if device[m] is None else device[m] / T
            if device.get(f"{m}:jit") is not None:
                entry[m]["jit_device_step_us"] = device[f"{m}:jit"] / T
    base = entry["bptt"]["step_us_median"]
    base_min = entry["bptt"]["step_us_min"]
    for m in methods:
        entry[m]["ratio_to_bptt"] = entry[m]["step_us_median"] / base
        entry[m]["ratio_to_bptt_min"] = entry[m]["step_us_min"] / base_min
        if entry[m].get("device_step_us") is not None:
            entry[m]["device_ratio_to_bptt"] = (entry[m]["device_step_us"]
                                                / entry["bptt"]["device_step_us"])
        if entry[m].get("jit_device_step_us") is not None:
            entry[m]["jit_device_ratio_to_bptt"] = (entry[m]["jit_device_step_us"]
                                                    / entry["bptt"]["device_step_us"])
        if m in TARGETS:
            entry[m]["target_ratio"] = TARGETS[m]
            entry[m]["meets_target"] = bool(entry[m]["ratio_to_bptt"] <= TARGETS[m])
        entry[m]["floor"] = floor_ratio(entry[m], probe)
    result = {"num_params": count_params(build(model_name, cfg["inputs"], cfg["hidden"],
                                                cfg["outputs"], cfg["batch"])),
              "T": T, "methods": entry}
    if args.host_time:
        result["per_call"] = {m: per_call(runs, times, m, T, device) for m in methods}
    if do_profile:
        prof = {}
        for m in methods:
            if m == "bptt" or method_parts(m)[1] != 1:  # the per-step forms' parts
                continue
            try:
                prof[m] = profile_step(model_name, m, cfg, xs, ys, max(repeats, 5))
            except Exception as e:  # noqa: BLE001  (internals may move; keep the timings)
                prof[m] = {"error": f"{type(e).__name__}: {e}"}
        result["profile_us"] = prof
    return result


def back_to_back(run: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``run`` in a row, blocked once at the end."""
    start = time.perf_counter()
    for _ in range(calls):
        out = run()
    block(out)
    return (time.perf_counter() - start) / calls


def report(name: str, result: dict) -> None:
    """Prints one model's lines."""
    for m, e in result["methods"].items():
        device = (f"  device {e['device_step_us']:.1f} us x{e['device_ratio_to_bptt']:.2f}"
                  if e.get("device_step_us") is not None else "")
        if "jit_step_us_median" in e:
            device += (f"  jit step {e['jit_step_us_median']:.1f} us "
                       f"x{e['jit_ratio_to_bptt']:.2f}")
        if e.get("jit_device_step_us") is not None:
            device += (f" (device {e['jit_device_step_us']:.1f} us "
                       f"x{e['jit_device_ratio_to_bptt']:.2f})")
        device += f"  floor {e['floor']['us_per_step']:.2f} us x{e['floor']['ratio']:.2f}"
        if "jit_device_ratio" in e["floor"]:
            device += f" (jit step's device x{e['floor']['jit_device_ratio']:.2f})"
        print(f"{name:9s} {m:10s} step {e['step_us_median']:10.1f} us (min "
              f"{e['step_us_min']:.1f})  x{e['ratio_to_bptt']:.2f} BPTT  compile "
              f"{e['compile_s']:.2f}s{device}", flush=True)
    for m, row in result.get("per_call", {}).items():
        shown = {k: v for k, v in row.items() if v is not None and k != "stateful_step_us"}
        print(f"{name:9s} {m:10s} per call (us): " + ", ".join(
            f"{k.removesuffix('_us')} {v:.0f}" for k, v in shown.items()), flush=True)
    for m, parts in result.get("profile_us", {}).items():
        shown = parts.get("marginal_us_per_step", parts)
        print(f"     profile {m} (us/step, marginal): " + ", ".join(
            f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in shown.items()), flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--models", default=None,
                   help="comma-separated (default snn,gru; gru with --quick)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated (default {','.join(METHODS)}; with --quick "
                        f"{','.join(QUICK_METHODS)})")
    p.add_argument("--length", default=None,
                   help="steps per pass (T); several, comma-separated, measure each")
    p.add_argument("--hidden", type=int, default=None, help="hidden units (default 256)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16)")
    p.add_argument("--name", default=None, help=f"the JSON/PNG file name (default {NAME})")
    p.add_argument("--device-time", action="store_true",
                   help="also profile one pass per method: the accelerator's own time per step "
                        "(none on the CPU backend)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per method")
    p.add_argument("--jit-step", action="store_true",
                   help="also time each online method as online_grad inside jax.jit (a user's "
                        "own train step: jit_step_us_median, jit_ratio_to_bptt)")
    p.add_argument("--host-time", action="store_true",
                   help="also the host's time per call of the stateful API (per_call): "
                        "etrace_grad (BPTT through braintrace.compile too) against its program "
                        "called directly and the device's time")
    p.add_argument("--back-to-back", type=int, default=None, metavar="N",
                   help="time N calls in a row, blocked once at the end (a training loop: the "
                        "host prepares a call while the device runs the one before), per call")
    p.add_argument("--probe-mib", type=int, default=None,
                   help="the bandwidth probe's array in MiB (default 512; 32 with --quick)")
    p.add_argument("--xla-multi-output-fusion", action="store_true",
                   help="switch on XLA:CPU's multi-output fusion (for every method); writes "
                        f"{NAME}_xla_mof.json")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the parts of one online step (default: on, off with --quick)")
    add_dense_block_flags(p)
    args = p.parse_args(argv)
    _d_rtrl = set_dense_block_flags(args)
    sizes = {k: v for k, v in (("hidden", args.hidden), ("batch", args.batch)) if v}
    lengths = ([int(t) for t in args.length.split(",")] if args.length
               else [20 if args.quick else 200])
    repeats = args.repeats or (3 if args.quick else 7)
    methods = (args.methods.split(",") if args.methods
               else list(QUICK_METHODS if args.quick else METHODS))
    if args.xla_multi_output_fusion and MOF_FLAG not in os.environ.get("XLA_FLAGS", ""):
        p.error("--xla-multi-output-fusion only works on the command line (XLA reads XLA_FLAGS "
                "when its backend starts, before main() runs)")
    do_profile = (not args.quick) if args.profile is None else args.profile
    if "bptt" not in methods:
        methods = ["bptt", *methods]
    start_all = time.perf_counter()
    probe = bandwidth(args.probe_mib or (32 if args.quick else 512))
    print(f"bandwidth probe: {probe['gb_per_s']:.1f} GB/s ({probe['probe']})", flush=True)
    results = {}
    models = args.models.split(",") if args.models else (["gru"] if args.quick else list(MODELS))
    for model_name in models:
        cfg = DEMO if model_name == "demo" and not args.quick else (QUICK if args.quick else FULL)
        cfg = {**cfg, **sizes}
        for T in lengths:
            key = model_name if len(lengths) == 1 else f"{model_name}@T{T}"
            results[key] = measure(model_name, T, cfg, methods, args, repeats, probe,
                                   do_profile)
            report(key, results[key])

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "config": {**(QUICK if args.quick else FULL), **sizes, "demo_model": DEMO,
                   "T": lengths[0] if len(lengths) == 1 else lengths,
                   "repeats": repeats, "back_to_back": args.back_to_back,
                   "dtype": "float32", "loss": "mse",
                   "xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "fused_dense_blocks": _d_rtrl.FUSED_DENSE_BLOCKS,
                   "fused_narrow_traces": _d_rtrl.FUSED_NARROW_TRACES},
        "environment": {**environment(), "loadavg_at_end": load},
        "bandwidth": probe,
        "floor_terms": TERMS,
        "notes": [
            ("step_us = wall time of one compiled pass over T steps / T (median over repeats, "
             "methods run round-robin; with back_to_back N, of N passes in a row blocked once "
             "at the end, / N)."),
            ("online passes go through learner.etrace_grad (includes its Python-side checks; "
             "its finiteness check is read by the next call, without waiting for the device); "
             "BPTT calls the compiled program directly."),
            ("'d_rtrl'/'es_d_rtrl' run the default time-blocked form (block_size=32, "
             "braintrace/_loops/_blocked.py); 'name@1' the per-step form."),
            ("targets (issue 19): d_rtrl <= 1.3x BPTT (gru, snn), alif <= 2.5x, es_d_rtrl <= "
             "0.6x, demo es_d_rtrl <= 1.2x."),
            ("profile_us: marginal cost per step of each part of online_step, from four scans "
             "that add one part at a time (forward+VJP, +jacobians, +trace update, "
             "+contribution)."),
            ("floor: bytes one step must move (formula and terms per method, floor_terms) over "
             "the bandwidth probe; ratio = measured / floor (ratio_of: device time, else the "
             "jit step's wall time, else the stateful call's; the device time is the stateful "
             "call's, learner.etrace_grad); jit_device_step_us / jit_device_ratio: the jit "
             "step's device time, and over the floor. benchmarks/_floor.py."),
            ("per_call (--host-time), microseconds per call: stateful = learner.etrace_grad "
             "(bptt: a learner compiled with 'bptt'); program = its compiled program called "
             "directly on prepared arguments; driver = stateful - program; device = the "
             "device's time for one call (None on the CPU); host = stateful - device; jit, "
             "jit_device, jit_host the same for the jit step (bptt: the bare jitted grad)."),
        ],
        "targets": TARGETS,
        "results": results,
        "total_wall_s": time.perf_counter() - start_all,
    }
    os.makedirs(args.out, exist_ok=True)
    name = args.name or (f"{NAME}_xla_mof" if args.xla_multi_output_fusion else NAME)
    write_json(os.path.join(args.out, f"{name}.json"), payload)
    plot(results, os.path.join(args.out, f"{name}.png"),
         " (XLA multi-output fusion)" if args.xla_multi_output_fusion else "")
    return payload


if __name__ == "__main__":
    main()
