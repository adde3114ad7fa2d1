"""The sparse product's sums on one TPU: each variant of the Pallas kernels against XLA's.

For ``scale.py``'s recurrent layer (``N`` neurons, ``degree`` random synapses into each,
connections in output order) and batch ``B``, each sum of the sparse primitive, run by XLA's
gathers (``_sparse_accelerator.py``, the reference) and by each variant of the Pallas kernels
(``braintrace/_primitives/_sparse_tpu.py``, ``--variants``):

* ``forward`` ``y = Σ_{post[k]=o} w[k] x[pre[k]]`` (``B`` rows);
* ``x_bar`` ``x̄ = Σ_{pre[k]=i} w[k] ȳ[post[k]]`` (``B`` rows);
* ``dw`` ``dw[k] = Σ_r x[r, pre[k]] d[r, post[k]]`` over ``B`` rows, and ``dw_block`` over
  ``(K + 1)·B`` rows (ES-D-RTRL's block product, ``--block K``).

A variant is a name of ``_sparse_tpu.VARIANTS`` (``cells``: the kernels of
``_sparse_pallas.py``; ``staged``: those of ``_sparse_staged.py``; ``packed``: those with
several sources per row of the gather-sums' tables at batches up to 64), optionally
``+chunked_pair`` (``_sparse_tpu.CHUNKED_PAIR``: the weight pullback over several source
chunks by the staged pair-sum, one call per chunk, instead of the cells' and a gather) or
``+own_pair`` (that, each chunk's call staging its own connections alone:
``_sparse_tpu.OWN_CHUNK_PAIR``), then optionally ``@ROWS``, the target rows per block
(``_sparse_tpu.BLOCK_ROWS``):
``--variants cells,staged,packed,staged+chunked_pair,packed+own_pair,staged@2048``.
Per sum and variant: the largest difference to XLA's values (absolute, and relative to XLA's
largest value), the median and minimum of ``--repeats`` calls (``block_until_ready``, every
program in turn), and the time over the **row-rate floor**: one row load per synapse and per
group of 128 values, ``nnz · ⌈rows / 128⌉ · ROW_NS`` (a VMEM-resident row load measured at
1.2–1.5 ns on a v5e). A program that does not compile or run is recorded with its error and
the rest go on. Where a variant's call gathers its tables with XLA (the weights into slot
order, or the pullback's values back into connection order), ``tables:VARIANT`` times that
gather alone: in a time loop XLA computes the weights' gather once, before the loop.

Usage (one TPU v5e: 131,072 and 1,048,576 neurons, batch 32 and 128, ``cells`` and
``staged``: about 4 minutes; ``--aot``: compile only, for a v5e, on a CPU host with
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
        "repeats": 5, "variants": ("cells", "staged")}
QUICK = {"sizes": (1024,), "batches": (5,), "degree": 8, "block": 3, "repeats": 2,
         "variants": ("cells", "staged")}
ROW_NS = 1.2
"""Nanoseconds per row load from VMEM (the lower end of 1.2–1.5 ns on a v5e)."""
SUMS = ("forward", "x_bar", "dw", "dw_block")


def _fns(module, conn: Connectivity) -> dict:
    return {"forward": lambda x, d, w: module.product(x, w, conn),
            "x_bar": lambda x, d, w: module.transposed_product(d, w, conn),
            "dw": lambda x, d, w: module.weight_pullback(x, d, conn),
            "dw_block": lambda x, d, w: module.weight_pullback(x, d, conn)}


@contextlib.contextmanager
def variant(name: str):
    """The kernels of variant ``name`` (``KERNELS[+chunked_pair|+own_pair][@ROWS]``, module
    docstring) within the block.

    Example:
        >>> with variant("staged+chunked_pair@2048"):
        ...     tpu.KERNELS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR, tpu.BLOCK_ROWS
        ('staged', True, False, 2048)
        >>> with variant("packed+own_pair"):
        ...     tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR
        (True, True)
        >>> tpu.KERNELS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR, tpu.BLOCK_ROWS  # the defaults
        ('packed', True, True, None)
    """
    base, _, rows = name.partition("@")
    kernels, plus, option = base.partition("+")
    if (kernels not in tpu.VARIANTS or (plus and option not in ("chunked_pair", "own_pair"))
            or (rows and not rows.isdigit())):
        raise ValueError(f"unknown variant {name!r}: one of {tpu.VARIANTS}, optionally "
                         "+chunked_pair or +own_pair, then optionally @ROWS")
    saved = tpu.KERNELS, tpu.BLOCK_ROWS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR
    tpu.KERNELS, tpu.BLOCK_ROWS = kernels, int(rows) if rows else None
    tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR = bool(plus), option == "own_pair"
    try:
        yield
    finally:
        tpu.KERNELS, tpu.BLOCK_ROWS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR = saved


def default_variant() -> str:
    """The variant a TPU runs by default, named as :func:`variant` takes it.

    Example:
        >>> default_variant()
        'packed+own_pair'
    """
    return tpu.KERNELS + ("+own_pair" if tpu.CHUNKED_PAIR and tpu.OWN_CHUNK_PAIR else
                          "+chunked_pair" if tpu.CHUNKED_PAIR else "")


def sparse_sums(backend: str, forced: str | None, kernels: str) -> str:
    """What computes the sparse sums of a ``scale.py`` run (``config['sparse_sums']``):
    ``Pallas `KERNELS` `` (a TPU's default, or ``--formulation pallas``) or ``XLA`` (XLA's
    gathers, or the CPU's formulation).

    Example:
        >>> sparse_sums("tpu", None, "staged"), sparse_sums("tpu", "accelerator", "cells")
        ('Pallas `staged`', 'XLA')
    """
    return f"Pallas `{kernels}`" if forced == "pallas" or (forced is None and
                                                           backend == "tpu") else "XLA"


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


def compile_all(conn: Connectivity, rows_of: dict, variants: tuple, aot_device,
                workers: int = 8, kernels_only: bool = False) -> dict:
    """``{sum: {label: compiled or error text, label + '_s': seconds}}``: each sum's XLA
    formulation (``xla``), each variant's kernels (``pallas:VARIANT``) and the XLA gather of
    its tables (``tables:VARIANT``), lowered here one after another (the variant's sizes are
    read while tracing), compiled in ``workers`` threads at once (``rows_of``: the sums and
    their rows)."""
    lowered = {}
    for name, rows in rows_of.items():
        jobs = {} if kernels_only else {("xla", None): _fns(accelerator, conn)[name]}
        for v in variants:
            jobs["pallas:" + v, v] = _fns(tpu, conn)[name]
            with variant(v):
                tables = _tables_fn(name, conn, rows)
            if tables is not None:
                jobs["tables:" + v, v] = tables
        for (label, v), fn in jobs.items():
            try:
                with variant(v) if v else contextlib.nullcontext():
                    lowered[name, label] = _lowered(fn, rows, conn, aot_device)
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
    return out


def _tables_fn(name: str, conn: Connectivity, rows: int):
    """The XLA gather that the kernels' call of sum ``name`` (of ``rows`` rows) makes around
    them under the current variant (the weights into slot order, or the pullback's values
    back into connection order), or ``None`` where there is none."""
    side = "outgoing" if name == "x_bar" else "incoming"
    if tpu.KERNELS in ("staged", "packed"):
        tiles = tpu.staged_tiles(conn, "pair" if name.startswith("dw") else side,
                                 tpu.packing(rows))
        if tiles is not None:
            if tiles.slot is None:
                return None
            from braintrace._primitives._sparse_staged import gather_weights

            return lambda x, d, w: gather_weights(w, tiles)
    cells = tpu.cut(conn, side)
    if cells is None or cells.uniform:
        return None
    if name in ("forward", "x_bar"):
        return lambda x, d, w: pallas.stream_weights(w, cells)
    flat = cells.chunks * cells.blocks * cells.slots
    return lambda x, d, w: pallas._connection_order(jnp.pad(w, (0, flat - conn.nnz)), cells,
                                                    conn.nnz)


def _cells_record(conn: Connectivity, variants: tuple) -> dict:
    """How each variant cuts each side: chunks, blocks, slots per connection, seconds."""
    out = {}
    for v in variants:
        with variant(v):
            for side in ("incoming", "outgoing", "pair"):
                start = time.perf_counter()
                if tpu.KERNELS in ("staged", "packed"):  # 'packed': as at batch 32
                    tiles = tpu.staged_tiles(conn, side, tpu.packing(32))
                    record = None if tiles is None else {
                        "pack": tiles.pack, "quarter": tiles.quarter,
                        "chunks": tiles.chunks, "chunk": tiles.chunk, "blocks": tiles.blocks,
                        "block": tiles.block, "uniform": tiles.uniform,
                        "width_cap": tiles.width_cap,
                        "slots_per_connection": (
                            tiles.positions.size / conn.nnz if tiles.positions is not None
                            else tiles.chunks * tiles.blocks * 128 / conn.nnz
                            * (tiles.slot_rows if side == "pair" else tiles.weight_rows))}
                elif side == "pair":
                    continue
                else:
                    cells = tpu.cut(conn, side)
                    record = None if cells is None else {
                        "chunks": cells.chunks, "chunk": cells.chunk, "blocks": cells.blocks,
                        "block": cells.block, "slots": cells.slots, "uniform": cells.uniform,
                        "slots_per_connection": cells.chunks * cells.blocks * cells.slots
                        / conn.nnz}
                if record is not None:
                    record["cut_s"] = time.perf_counter() - start
                out.setdefault(v, {})[side] = record
    return out


def measure_sum(name: str, conn: Connectivity, rows: int, repeats: int, programs: dict,
                timed: bool = True) -> dict:
    """One sum from its compiled ``programs`` (:func:`compile_all`): each program's error
    against XLA's values and its times (``timed``; else what compiled)."""
    floor_ms = conn.nnz * -(-rows // 128) * ROW_NS * 1e-6
    entry = {"rows": rows, "floor_ms": floor_ms}
    compiled = {}
    for label in [k for k in programs if not k.endswith("_s")]:
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
    for label in [k for k in compiled if k.startswith("pallas")]:
        try:
            value = np.asarray(compiled[label](*args))
        except Exception as e:  # noqa: BLE001 - a kernel that fails at run time is a result
            entry[label] = {"error": _error(e)}
            del compiled[label]
            continue
        difference = float(np.max(np.abs(value - reference)))
        entry[label].update(max_abs_error=difference, max_rel_error=difference / scale)
    for label, times in time_round_robin(compiled, args, repeats).items():
        median = float(np.median(times))
        entry[label].update(ms_median=median, ms_min=float(np.min(times)))
        if not label.startswith("tables"):
            entry[label].update(over_floor=median / floor_ms,
                                ns_per_synapse=median * 1e6 / conn.nnz)
    kernels = {k: e["ms_median"] for k, e in entry.items()
               if k.startswith("pallas") and "ms_median" in e}
    if kernels:
        fastest = min(kernels, key=kernels.get)
        entry["fastest"] = fastest
        entry["xla_over_fastest"] = entry["xla"]["ms_median"] / kernels[fastest]
    return entry


def _line(n: int, batch: int, name: str, entry: dict) -> str:
    parts = [(f"N={n:8d} B={batch:4d} {name:9s} rows={entry['rows']:4d} "
              f"floor={entry['floor_ms']:8.3f}ms")]
    for label, e in entry.items():
        if not isinstance(e, dict):
            continue
        if "error" in e:
            parts.append(f"{label}=ERROR({e['error'].splitlines()[-1][:120]})")
        elif "ms_median" in e and label.startswith("tables"):
            parts.append(f"{label}={e['ms_median']:.3f}ms")
        elif "ms_median" in e:
            parts.append(f"{label}={e['ms_median']:8.3f}ms"
                         + (f" (x{e['over_floor']:.2f} floor, err {e['max_rel_error']:.1e} rel)"
                            if "max_rel_error" in e else ""))
        else:
            parts.append(f"{label}=compiled in {e['compile_s']:.1f}s "
                         f"(temp {e['temp_bytes'] / 2**20:.0f} MiB)")
    if "fastest" in entry:
        parts.append(f"fastest={entry['fastest']} xla/fastest={entry['xla_over_fastest']:.2f}")
    return "  ".join(parts)


def measure(cfg: dict, aot_device, save) -> list[dict]:
    """Every size, batch and sum of ``cfg``; ``save(records)`` after each sum (a run cut short
    keeps what it measured)."""
    from scale import connectivity

    records = []
    for n in cfg["sizes"]:
        conn = Connectivity.from_indices(*connectivity(n, cfg["degree"]), n, n)
        cells = _cells_record(conn, cfg["variants"])
        print(f"N={n}: cells {cells}", flush=True)
        for batch in cfg["batches"]:
            record = {"neurons": n, "batch": batch, "nnz": conn.nnz, "cells": cells}
            records.append(record)
            rows_of = {name: batch * (cfg["block"] + 1 if name == "dw_block" else 1)
                       for name in SUMS}
            start = time.perf_counter()
            programs = compile_all(conn, rows_of, tuple(cfg["variants"]), aot_device,
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
                   help="with --aot: compile the kernels only, not XLA's sums (a timed run "
                        "needs XLA's values as the kernels' reference)")
    p.add_argument("--sizes", default=None, help="comma-separated neuron counts")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--variants", default=None,
                   help="comma-separated kernel variants (module docstring): "
                        "cells,staged,staged@2048")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=NAME)
    args = p.parse_args(argv)
    if args.kernels_only and not args.aot:
        p.error("--kernels-only compiles and times nothing without XLA's sums (the kernels' "
                "reference): add --aot, or leave it out to time the kernels")
    cfg = dict(QUICK if args.quick else FULL)
    if args.sizes:
        cfg["sizes"] = tuple(int(s) for s in args.sizes.split(","))
    if args.batches:
        cfg["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.variants:
        cfg["variants"] = tuple(args.variants.split(","))
    for v in cfg["variants"]:
        with variant(v):  # an unknown name fails here, before any compilation
            pass
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
