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
values back into connection order): ``tables`` times it alone. The forward over uniform cells
is also timed in its staged form (``pallas_staged``, ``_sparse_pallas.STAGED``).

Usage (one TPU v5e: under 4 minutes; ``--aot``: compile only, for a v5e, on a CPU host with
``libtpu`` installed, no chip needed)::

    python benchmarks/sparse_kernels_tpu.py --out $OUT
    python benchmarks/sparse_kernels_tpu.py --aot --kernels-only --out /tmp
    python benchmarks/sparse_kernels_tpu.py --quick --out /tmp   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


@contextlib.contextmanager
def _staged():
    """The uniform gather-sum in its staged form (``_sparse_pallas.STAGED``)."""
    pallas.STAGED = True
    try:
        yield
    finally:
        pallas.STAGED = False


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-3000:]


def _lowered(fn, rows: int, conn: Connectivity, aot_device):
    """``fn(x, d, w)`` lowered for shapes of ``rows`` rows (for ``--aot``, for the topology's
    device)."""
    kwargs = {} if aot_device is None else {
        "sharding": jax.sharding.SingleDeviceSharding(aot_device)}
    specs = [jax.ShapeDtypeStruct(shape, jnp.float32, **kwargs)
             for shape in ((rows, conn.num_in), (rows, conn.num_out), (conn.nnz,))]
    traced = jax.jit(fn).trace(*specs)
    return traced.lower(lowering_platforms=("tpu",)) if aot_device else traced.lower()


def compile_all(conn: Connectivity, rows_of: dict, aot_device, workers: int = 8,
                kernels_only: bool = False) -> dict:
    """``{sum: {label: compiled or error text, label + '_s': seconds}}`` for each sum's XLA
    formulation, kernels and tables: lowered here one after another (the module's sizes are
    read while tracing), compiled in ``workers`` threads at once (``rows_of``: the sums and
    their rows); the kernels whose default
    sizes fail, lowered and compiled again with the small ones (``pallas_small``)."""
    lowered = {}
    for name in rows_of:
        jobs = {"xla": _fns(accelerator, conn)[name], "pallas": _fns(tpu, conn)[name],
                "tables": _tables_fn(name, conn)}
        cells = tpu.cut(conn, "incoming")
        if name == "forward" and cells is not None and cells.uniform:
            jobs["pallas_staged"] = jobs["pallas"]
        for label, fn in jobs.items():
            if fn is None or (kernels_only and label == "xla"):
                continue
            try:
                with _staged() if label == "pallas_staged" else contextlib.nullcontext():
                    lowered[name, label] = _lowered(fn, rows_of[name], conn, aot_device)
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                lowered[name, label] = _error(e)

    def compile_one(item):
        start = time.perf_counter()
        if isinstance(item, str):
            return item, 0.0
        try:
            return item.compile(), time.perf_counter() - start
        except Exception as e:  # noqa: BLE001
            return _error(e), time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        done = dict(zip(lowered, pool.map(compile_one, lowered.values()), strict=True))
    out = {name: {} for name in rows_of}
    for (name, label), (result, seconds) in done.items():
        out[name][label], out[name][f"{label}_s"] = result, seconds
    for name in rows_of:
        if isinstance(out[name]["pallas"], str):
            with _small_sizes():
                try:
                    item = _lowered(_fns(tpu, conn)[name], rows_of[name], conn, aot_device)
                except Exception as e:  # noqa: BLE001
                    item = _error(e)
                out[name]["pallas_small"], out[name]["pallas_small_s"] = compile_one(item)
    return out


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


def measure_sum(name: str, conn: Connectivity, rows: int, repeats: int, programs: dict,
                timed: bool = True) -> dict:
    """One sum from its compiled ``programs`` (:func:`compile_all`): each formulation's error
    against XLA's values and its times (``timed``; else what compiled)."""
    floor_ms = conn.nnz * -(-rows // 128) * ROW_NS * 1e-6
    entry = {"rows": rows, "floor_ms": floor_ms}
    compiled = {}
    for label in ("xla", "pallas", "pallas_small", "pallas_staged", "tables"):
        if label not in programs:
            continue
        program = programs[label]
        if isinstance(program, str):
            entry[label] = {"error": program}
            continue
        entry[label] = {"compile_s": programs[f"{label}_s"],
                        "temp_bytes": int(program.memory_analysis().temp_size_in_bytes)}
        compiled[label] = program
    if not timed or "xla" not in compiled:
        return entry
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    args = (normal(rows, conn.num_in), normal(rows, conn.num_out), normal(conn.nnz))
    reference = np.asarray(compiled["xla"](*args))
    scale = float(np.max(np.abs(reference))) or 1.0
    for label in [k for k in compiled if k != "tables"]:
        try:
            value = np.asarray(compiled[label](*args))
        except Exception as e:  # noqa: BLE001 - a kernel that fails at run time is a result
            entry[label] = {"error": _error(e)}
            del compiled[label]
            continue
        difference = float(np.max(np.abs(value - reference)))
        entry[label].update(max_abs_error=difference, max_rel_error=difference / scale)
    if not any(k in compiled for k in ("pallas", "pallas_small")):
        compiled.pop("tables", None)
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
    for label in ("xla", "pallas", "pallas_small", "pallas_staged", "tables"):
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
            rows_of = {name: batch * (cfg["block"] + 1 if name == "dw_block" else 1)
                       for name in SUMS}
            start = time.perf_counter()
            programs = compile_all(conn, rows_of, aot_device,
                                   kernels_only=cfg.get("kernels_only", False))
            record["compile_all_s"] = time.perf_counter() - start
            for name in SUMS:
                record[name] = measure_sum(name, conn, rows_of[name], cfg["repeats"],
                                           programs[name], timed=aot_device is None)
                print(_line(n, batch, name, record[name]), flush=True)
                save(records)
            programs = None
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
    p.add_argument("--kernels-only", action="store_true",
                   help="compile (and with --aot only compile) the kernels, not XLA's sums")
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
    cfg["kernels_only"] = args.kernels_only
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
