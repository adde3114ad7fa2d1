"""A benchmark's training pass compiled for a TPU v5e on a CPU host: its optimised HLO, copies.

No chip needed, only ``libtpu`` (a compile-only topology, as ``sparse_kernels_tpu.py --aot``).
For each configuration ``model:hidden:batch:T:method[,method...]`` the pass is built as
``device_profile.py`` builds it (``--program jit``: ``online_grad`` in a jitted step that
donates the carried state; ``--program etrace``: the program ``learner.etrace_grad`` runs),
traced with the library's choices for a TPU (``jax.default_backend()`` reads ``'tpu'``
while tracing: steps grouped 8 per loop iteration, the TPU formulations), compiled, and
written out:

* ``KEY.hlo.txt``: the optimised HLO (layouts, fusions, memory spaces);
* ``aot_hlo.json``: per program XLA's memory analysis (bytes), the copies that
  reorder memory (``copy``, ``transpose`` and ``copy_*`` fusions) with their shapes and
  layouts, those inside loops marked ``in_loop``, and the layouts of the loops' carried
  buffers.

Usage (``libtpu`` installed; numbers are XLA's, not timings)::

    python benchmarks/aot_hlo.py --out /tmp/aot gru:1024:64:100:es_d_rtrl \\
        snn:256:16:200:es_d_rtrl gru:256:16:1000:es_d_rtrl --program jit,etrace
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
from _models import build, data, mse
from flax import nnx
from throughput import add_dense_block_flags, method_parts, set_dense_block_flags

import braintrace

COPY = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (copy|transpose|fusion)\(")


def aot_device():
    """A v5e's device from a compile-only topology (``libtpu`` on a CPU host)."""
    from jax.experimental import topologies

    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5litepod-4"),
                       ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(key, value)
    return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]


@contextlib.contextmanager
def traced_as_tpu():
    """``jax.default_backend()`` reads ``'tpu'`` within (the library's choices made while
    tracing: ``_groups.step_group``, ``by_platform``'s TPU formulation)."""
    default = jax.default_backend
    jax.default_backend = lambda: "tpu"
    try:
        yield
    finally:
        jax.default_backend = default


def traced_pass(model_name: str, method: str, cfg: dict, T: int, program: str, device):
    """The pass traced for ``device``: arguments as ``ShapeDtypeStruct`` on it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    xs, ys = data(model_name, T, cfg["inputs"], cfg["outputs"], cfg["batch"])
    model = build(model_name, cfg["inputs"], cfg["hidden"], cfg["outputs"], cfg["batch"])
    name, block_size, trace_dtype = method_parts(method)
    with traced_as_tpu():
        learner = braintrace.compile(model, name, xs[0], batch_size=cfg["batch"],
                                     trace_dtype=trace_dtype)
        if program == "etrace":
            from braintrace._drivers._programs import CHECKED_GRAD_PROGRAM

            entry, loop, args = learner._grad_call(xs, ys, mask=None, chunk_size=None,
                                                   block_size=block_size, reduction="mean",
                                                   signal_inputs={})
            return CHECKED_GRAD_PROGRAM.trace(entry, mse, loop, *spec(tuple(args)),
                                              masked=False)
        online = braintrace.online_grad(learner, mse, block_size=block_size)
        graphdef, state = nnx.split(model)

        def step(state, carried, xs, ys):
            grads, carried, stats = online.grad(nnx.merge(graphdef, state), carried, xs, ys)
            return grads, carried, stats.losses

        return jax.jit(step, donate_argnums=1).trace(spec(state), spec(online.init(model)),
                                                     spec(xs), spec(ys))


def loop_bodies(text: str) -> set[str]:
    """The names of the computations that run as a ``while`` loop's body."""
    return set(re.findall(r" while\(.*?body=%([^\s,]+)", text))


def copies(text: str) -> list[dict]:
    """The ops that reorder memory: ``copy``/``transpose`` ops and ``copy_*`` fusions, at the
    top level of each computation (not inside a fusion), with their shape and layout."""
    bodies, current, found = loop_bodies(text), None, []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head and not line.startswith(" "):
            current = head.group(1)
        m = COPY.match(line)
        if not m or current is None or current.startswith(("fused_", "bitcast_fusion")):
            continue
        name, shape, op = m.groups()
        if op == "fusion" and not name.startswith(("copy", "transpose")):
            continue
        found.append({"name": name, "shape": shape, "in_loop": current in bodies})
    return found


def carried_buffers(text: str) -> list[list[str]]:
    """Each ``while`` loop's carried arrays of rank 3 or more, with their layouts."""
    return [re.findall(r"[a-z0-9]+\[\d+(?:,\d+){2,}\]\{[^}]*\}", line.split(" while(")[0])
            for line in text.splitlines() if " while(" in line]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", help="model:hidden:batch:T:method[,method...]")
    p.add_argument("--program", default="jit", help="comma-separated: jit, etrace")
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--outputs", type=int, default=10)
    p.add_argument("--out", required=True)
    add_dense_block_flags(p)
    args = p.parse_args(argv)
    set_dense_block_flags(args)
    os.makedirs(args.out, exist_ok=True)
    device = aot_device()
    results = {}
    for config in args.configs:
        model_name, hidden, batch, T, methods = config.split(":")
        cfg = {"hidden": int(hidden), "batch": int(batch), "inputs": args.inputs,
               "outputs": args.outputs}
        for method in methods.split(","):
            for program in args.program.split(","):
                key = f"{model_name}_h{hidden}_b{batch}_T{T}_{method}_{program}"
                traced = traced_pass(model_name, method, cfg, int(T), program, device)
                compiled = traced.lower(lowering_platforms=("tpu",)).compile()
                text = compiled.as_text()
                with open(os.path.join(args.out, f"{key}.hlo.txt"), "w") as f:
                    f.write(text)
                memory = compiled.memory_analysis()
                found = copies(text)
                results[key] = {
                    "temp_bytes": memory.temp_size_in_bytes,
                    "argument_bytes": memory.argument_size_in_bytes,
                    "output_bytes": memory.output_size_in_bytes,
                    "alias_bytes": memory.alias_size_in_bytes,
                    "copies_in_loops": sum(c["in_loop"] for c in found),
                    "copies": found, "loop_buffers": carried_buffers(text)}
                print(key, {k: v for k, v in results[key].items()
                            if k not in ("copies", "loop_buffers")}, flush=True)
                for c in found:
                    if c["in_loop"]:
                        print(f"    in a loop: {c['name']} {c['shape']}", flush=True)
    with open(os.path.join(args.out, "aot_hlo.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
