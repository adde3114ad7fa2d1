"""Where the device's time of one training pass goes, op by op (for accelerators).

For each configuration ``model:hidden:batch:T:method[,method...]`` the pass is compiled as
``benchmarks/throughput.py`` compiles it (BPTT's grad, the online methods' ``online_grad`` in a
jitted step), run once to warm, then once under ``jax.profiler.trace``; the device's ops
(the Perfetto trace's ``XLA Ops`` lanes) are summed by name and divided by ``T``:

* ``device_us_per_step``: the whole programs' device time per step (``XLA Modules``);
* ``ops``: the ops with the most device time, each with its µs and calls per step;
* the optimised HLO of every program, in ``hlo.tar.gz`` (fusions, layouts, copies).

A configuration ``scale:neurons:batch:T:method[,method...]`` profiles ``scale.py``'s update of
its sparse spiking network instead (compiled as ``scale.py`` compiles it, with the TPU's
default kernels; ``es_d_rtrl:fast`` and ``@K`` as there); its Pallas kernels are the
``branch_0_fun.*`` ops (one per call site; the HLO says which sum each is).

Usage (on a TPU; on the CPU there is no device lane and only the HLO is written)::

    python benchmarks/device_profile.py --out /tmp/prof \\
        gru:1024:64:100:bptt,es_d_rtrl snn:256:16:200:bptt,es_d_rtrl@1 \\
        scale:131072:32:30:bptt,es_d_rtrl
    python benchmarks/device_profile.py --out /tmp/prof --kernels packed+chunked_pair \\
        scale:1048576:32:30:es_d_rtrl
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
from _models import block, bptt_grad_fn, build, data, environment, mse
from flax import nnx
from throughput import method_parts

import braintrace


def compiled_pass(model_name: str, method: str, cfg: dict, xs, ys):
    """``(compiled, run)``: one training pass over ``xs`` as a compiled program and a call of it
    (BPTT's grad; an online method's ``online_grad`` in a jitted step that donates the carried
    state, each call carrying on from the last one's, as ``throughput.jit_step``)."""
    model = build(model_name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
    if method == "bptt":
        grad_fn, params, hidden = bptt_grad_fn(model)
        compiled = grad_fn.lower(params, hidden, xs, ys).compile()
        return compiled, lambda: compiled(params, hidden, xs, ys)
    name, block_size, trace_dtype = method_parts(method)
    learner = braintrace.compile(model, name, xs[0], batch_size=cfg["batch"],
                                 trace_dtype=trace_dtype)
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

    return compiled, run


def scale_pass(neurons: int, batch: int, T: int, method: str, kernels: str | None = None):
    """``(compiled, run)``: one update of ``scale.py``'s network, as ``scale.py`` compiles it
    (donated arguments made fresh before each call, outside the profile), its sparse sums by
    the Pallas kernels ``kernels`` on a TPU (``sparse_kernels_tpu.variant``; ``None``: the
    default)."""
    import contextlib

    from _scale_child import compile_update
    from scale import FULL, PPPROP
    from sparse_kernels_tpu import variant

    cfg = {**{k: {**PPPROP, **FULL}[k] for k in PPPROP}, "neurons": neurons, "T": T,
           "method": method, "batch": batch}
    with variant(kernels) if kernels else contextlib.nullcontext():
        compiled, args, _ = compile_update(cfg)
    if compiled is None:
        raise RuntimeError(f"scale:{neurons}:{batch}:{T}:{method} did not compile")
    fresh = args if callable(args) else (lambda: args)
    pending = [fresh()]

    def run():
        out = compiled(*pending[0])
        pending[0] = fresh()
        return out

    return compiled, run


def op_times(fn, steps: int, top: int) -> dict:
    """``fn()`` once under the profiler: the device's time per step, whole and by op."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            block(fn())
        files = glob.glob(f"{logdir}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
            return {"device_us_per_step": None, "ops": []}
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in e["args"]["name"]}
    if not devices:  # the CPU backend: its programs run on the host
        return {"device_us_per_step": None, "ops": []}
    modules, ops, calls = 0.0, collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in devices:
            continue
        lane = lanes.get((e["pid"], e.get("tid")))
        if lane == "XLA Modules":
            modules += e.get("dur", 0.0)
        elif lane == "XLA Ops":
            ops[e["name"]] += e.get("dur", 0.0)
            calls[e["name"]] += 1
    return {"device_us_per_step": modules / steps,
            "ops_us_per_step": sum(ops.values()) / steps,
            "ops": [{"name": name, "us_per_step": us / steps, "calls_per_step": calls[name] / steps}
                    for name, us in ops.most_common(top)]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", help="model:hidden:batch:T:method[,method...] or "
                   "scale:neurons:batch:T:method[,method...]")
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--outputs", type=int, default=10)
    p.add_argument("--top", type=int, default=40, help="ops kept per program")
    p.add_argument("--kernels", default=None,
                   help="scale configurations on a TPU: the sparse sums' Pallas kernels, a "
                        "variant as scale.py --kernels takes it (default: the TPU's default)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results, hlo = {}, {}
    for config in args.configs:
        model_name, hidden, batch, T, methods = config.split(":", 4)
        cfg = {"hidden": int(hidden), "batch": int(batch), "inputs": args.inputs,
               "outputs": args.outputs}
        if model_name != "scale":
            xs, ys = data(model_name, int(T), args.inputs, args.outputs, int(batch))
        for method in methods.split(","):
            key = (f"scale_n{hidden}_b{batch}_T{T}_{method}" if model_name == "scale" else
                   f"{model_name}_h{hidden}_b{batch}_T{T}_{method}")
            try:
                start = time.perf_counter()
                if model_name == "scale":
                    compiled, run = scale_pass(int(hidden), int(batch), int(T), method,
                                               args.kernels)
                else:
                    compiled, run = compiled_pass(model_name, method, cfg, xs, ys)
                compile_s = time.perf_counter() - start
                hlo[key] = compiled.as_text()
                block(run())
                results[key] = {"compile_s": compile_s, **op_times(run, int(T), args.top)}
            except Exception as e:  # noqa: BLE001  (record and go on: one call, every answer)
                results[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            row = results[key]
            print(key, {k: v for k, v in row.items() if k != "ops"}, flush=True)
            for op in row.get("ops", [])[:8]:
                print(f"    {op['us_per_step']:9.2f} us/step  x{op['calls_per_step']:.1f}  "
                      f"{op['name']}", flush=True)
    payload = {"environment": environment(), "kernels": args.kernels, "results": results}
    with open(os.path.join(args.out, "device_profile.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with (tarfile.open(os.path.join(args.out, "hlo.tar.gz"), "w:gz") as tar,
          tempfile.TemporaryDirectory() as tmp):
        for key, text in hlo.items():
            path = os.path.join(tmp, f"{key}.hlo.txt")
            with open(path, "w") as f:
                f.write(text)
            tar.add(path, arcname=os.path.basename(path))
    return payload


if __name__ == "__main__":
    main()
