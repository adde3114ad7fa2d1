"""The sparse product's sums on one TPU: the Pallas kernels against XLA's formulation.

For ``scale.py``'s recurrent layer (``N`` neurons, ``degree`` random synapses into each,
connections in output order) and batch ``B``, each sum of the sparse primitive, run by the
Pallas kernels (``braintrace/_primitives/_sparse_tpu.py``) and by XLA's gathers
(``_sparse_accelerator.py``, the reference):

* ``forward`` ``y = Σ_{post[k]=o} w[k] x[pre[k]]`` (``B`` rows);
* ``x_bar`` ``x̄ = Σ_{pre[k]=i} w[k] ȳ[post[k]]`` (``B`` rows);
* ``dw`` ``dw[k] = Σ_r x[r, pre[k]] d[r, post[k]]`` over ``B`` rows, and ``dw_block`` over
  ``(K + 1)·B`` rows (ES-D-RTRL's block product, ``--block K``).

Per sum and formulation: the largest difference to XLA's values (absolute, and relative to
XLA's largest value), the median and minimum of ``--repeats`` calls (``block_until_ready``,
the formulations round-robin), and the time over the **row-rate floor**: one row load per
synapse and per group of 128 values, ``nnz · ⌈rows / 128⌉ · ROW_NS`` (a VMEM-resident row
load measured at 1.2–1.5 ns on a v5e). A formulation that does not compile or run is
recorded with its error and the rest go on; when the kernels fail with the default sizes
they are tried again with smaller ones (``fallback``: blocks of 256 targets, chunks of half
the VMEM budget), recorded as ``pallas_small``. Where the cells are not uniform, the
kernels' call includes an XLA gather of the weights into slot order (or of the pullback's
values back into connection order): ``tables`` times it alone.

Usage (one TPU v5e: under 4 minutes; ``--aot``: compile only, for a v5e, on a CPU host with
``libtpu`` installed, no chip needed)::

    python benchmarks/sparse_kernels_tpu.py --out $OUT
    python benchmarks/sparse_kernels_tpu.py --aot --sizes 131072 --out /tmp
    python benchmarks/sparse_kernels_tpu.py --quick --out /tmp   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.numpy as jnp
import numpy as np
from _models import environment, write_json
from _scale_ops import time_round_robin

from braintrace._platform import formulation
from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives import _sparse_pallas as pallas
from braintrace._primitives import _sparse_tpu as tpu
from braintrace._primitives._sparse import Connectivity

NAME = "sparse_kernels_tpu"
FULL = {"sizes": (131072, 1048576), "batches": (32, 128), "degree": 8, "block": 3,
        "repeats": 5}
QUICK = {"sizes": (1024,), "batches": (5,), "degree": 8, "block": 3, "repeats": 2}
ROW_NS = 1.2
"""Nanoseconds per row load from VMEM (the lower end of 1.2–1.5 ns on a v5e)."""
SUMS = ("forward", "x_bar", "dw", "dw_block")


def _fns(module, conn: Connectivity) -> dict:
    return {"forward": lambda x, d, w: module.product(x, w, conn),
            "x_bar": lambda x, d, w: module.transposed_product(d, w, conn),
            "dw": lambda x, d, w: module.weight_pullback(x, d, conn),
            "dw_block": lambda x, d, w: module.weight_pullback(x, d, conn)}


@contextlib.contextmanager
def _small_sizes():
    """The kernels with blocks of 256 targets and half the VMEM budget (the fallback)."""
    saved = tpu.BLOCK_ROWS, pallas.VMEM_BUDGET
    tpu.BLOCK_ROWS, pallas.VMEM_BUDGET = 256, pallas.VMEM_BUDGET // 2
    try:
        yield
    finally:
        tpu.BLOCK_ROWS, pallas.VMEM_BUDGET = saved


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-3000:]


def _compile(fn, args, aot_device):
    """``(compiled, seconds)``; for ``--aot``, compiled for the topology's device."""
    start = time.perf_counter()
    if aot_device is not None:
        sharding = jax.sharding.SingleDeviceSharding(aot_device)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
        compiled = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
    else:
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _tables_fn(name: str, conn: Connectivity):
    """The XLA gather that the kernels' call of sum ``name`` makes around them (the weights
    into slot order, or the pullback's values back into connection order), or ``None``
    where the cells are uniform (no gather)."""
    cells = tpu.cut(conn, "outgoing" if name == "x_bar" else "incoming")
    if cells is None or cells.uniform:
        return None
    if name in ("forward", "x_bar"):
        return lambda x, d, w: pallas.stream_weights(w, cells)
    flat = cells.chunks * cells.blocks * cells.slots
    return lambda x, d, w: pallas._connection_order(jnp.pad(w, (0, flat - conn.nnz)), cells,
                                                    conn.nnz)


def _cells_record(conn: Connectivity) -> dict:
    out = {}
    for side in ("incoming", "outgoing"):
        start = time.perf_counter()
        cells = tpu.cut(conn, side)
        seconds = time.perf_counter() - start
        out[side] = None if cells is None else {
            "cut_s": seconds, "chunks": cells.chunks, "chunk": cells.chunk,
            "blocks": cells.blocks, "block": cells.block, "slots": cells.slots,
            "uniform": cells.uniform,
            "slots_per_connection": cells.chunks * cells.blocks * cells.slots / conn.nnz}
    return out


def measure_sum(name: str, conn: Connectivity, rows: int, repeats: int, aot_device) -> dict:
    """One sum: both formulations (and the kernels' fallback sizes if they fail)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    args = (normal(rows, conn.num_in), normal(rows, conn.num_out), normal(conn.nnz))
    if aot_device is None:  # compile-only: shapes alone, nothing on a device
        args = tuple(jnp.asarray(a) for a in args)
    floor_ms = conn.nnz * -(-rows // 128) * ROW_NS * 1e-6
    entry = {"rows": rows, "floor_ms": floor_ms}
    compiled = {}
    for label, module, context in (("xla", accelerator, contextlib.nullcontext),
                                   ("pallas", tpu, contextlib.nullcontext),
                                   ("pallas_small", tpu, _small_sizes)):
        if label == "pallas_small" and "pallas" in compiled:
            continue  # the fallback only where the default sizes failed
        try:
            with context():
                fn, seconds = _compile(_fns(module, conn)[name], args, aot_device)
                if aot_device is None:
                    jax.block_until_ready(fn(*args))
            compiled[label] = fn
            entry[label] = {"compile_s": seconds,
                            "temp_bytes": int(fn.memory_analysis().temp_size_in_bytes)}
        except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
            entry[label] = {"error": _error(e)}
    if aot_device is not None or "xla" not in compiled:
        return entry
    reference = np.asarray(compiled["xla"](*args))
    scale = float(np.max(np.abs(reference))) or 1.0
    checked = dict(compiled)
    tables = _tables_fn(name, conn)
    if tables is not None and "pallas" in compiled:
        try:
            compiled["tables"], seconds = _compile(tables, args, None)
            entry["tables"] = {"compile_s": seconds}
        except Exception as e:  # noqa: BLE001
            entry["tables"] = {"error": _error(e)}
    for label, fn in checked.items():
        value = np.asarray(fn(*args))
        difference = float(np.max(np.abs(value - reference)))
        entry[label].update(max_abs_error=difference, max_rel_error=difference / scale)
    for label, times in time_round_robin(compiled, args, repeats).items():
        median = float(np.median(times))
        entry[label].update(ms_median=median, ms_min=float(np.min(times)))
        if label != "tables":
            entry[label].update(over_floor=median / floor_ms,
                                ns_per_synapse=median * 1e6 / conn.nnz)
    kernels = next((k for k in ("pallas", "pallas_small") if k in compiled), None)
    if kernels:
        entry["xla_over_pallas"] = entry["xla"]["ms_median"] / entry[kernels]["ms_median"]
    return entry


def _line(n: int, batch: int, name: str, entry: dict) -> str:
    parts = [f"N={n:8d} B={batch:4d} {name:9s} rows={entry['rows']:4d} "
             f"floor={entry['floor_ms']:8.3f}ms"]
    for label in ("xla", "pallas", "pallas_small", "tables"):
        e = entry.get(label)
        if e is None:
            continue
        if label == "tables" and "ms_median" in e:
            parts.append(f"(of which XLA's gather of the tables {e['ms_median']:.3f}ms)")
            continue
        if "error" in e:
            parts.append(f"{label}=ERROR({e['error'].splitlines()[-1][:120]})")
        elif "ms_median" in e:
            parts.append(f"{label}={e['ms_median']:8.3f}ms (x{e['over_floor']:.2f} floor, "
                         f"err {e['max_abs_error']:.1e} abs {e['max_rel_error']:.1e} rel)")
        else:
            parts.append(f"{label}=compiled in {e['compile_s']:.1f}s")
    if "xla_over_pallas" in entry:
        parts.append(f"xla/pallas={entry['xla_over_pallas']:.2f}")
    return "  ".join(parts)


def measure(cfg: dict, aot_device, save) -> list[dict]:
    """Every size, batch and sum of ``cfg``; ``save(records)`` after each sum (a run cut short
    keeps what it measured)."""
    from scale import connectivity

    records = []
    for n in cfg["sizes"]:
        conn = Connectivity.from_indices(*connectivity(n, cfg["degree"]), n, n)
        cells = _cells_record(conn)
        print(f"N={n}: cells {cells}", flush=True)
        for batch in cfg["batches"]:
            record = {"neurons": n, "batch": batch, "nnz": conn.nnz, "cells": cells}
            records.append(record)
            for name in SUMS:
                rows = batch * (cfg["block"] + 1 if name == "dw_block" else 1)
                record[name] = measure_sum(name, conn, rows, cfg["repeats"], aot_device)
                print(_line(n, batch, name, record[name]), flush=True)
                save(records)
    return records


def _aot_device():
    """A v5e's device from a compile-only topology (``libtpu`` on a CPU host)."""
    from jax.experimental import topologies

    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5litepod-4"),
                       ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(key, value)
    device = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]
    jax.config.update("jax_default_device", device)  # Pallas reads the chip from it
    return device


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="1,024 neurons, kernels in interpret mode (CPU): seconds")
    p.add_argument("--aot", action="store_true",
                   help="compile for a TPU v5e only (needs libtpu; no chip), time nothing")
    p.add_argument("--sizes", default=None, help="comma-separated neuron counts")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=NAME)
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.sizes:
        cfg["sizes"] = tuple(int(s) for s in args.sizes.split(","))
    if args.batches:
        cfg["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.repeats:
        cfg["repeats"] = args.repeats
    device = _aot_device() if args.aot else None
    start = time.perf_counter()
    payload = {"benchmark": NAME, "aot": args.aot, "quick": args.quick,
               "environment": environment(), "config": {**cfg, "row_ns": ROW_NS}}

    def save(records: list[dict]) -> None:
        payload.update(results=records, total_wall_s=time.perf_counter() - start)
        write_json(os.path.join(args.out, f"{args.name}.json"), payload)

    context = formulation("pallas") if args.quick else contextlib.nullcontext()
    with context:
        save(measure(cfg, device, save))
    print(f"total {payload['total_wall_s']:.0f} s", flush=True)
    return payload


if __name__ == "__main__":
    main()
