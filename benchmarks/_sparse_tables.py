"""The tables of the sparse network's TPU runs: its step against the analytic floor, and the
sparse product's sums alone (``_sparse_probe.py``, ``sparse_kernels_tpu.py``), each Pallas
kernel against XLA's gathers. Nothing here holds a measured number.
"""

from __future__ import annotations

from typing import Any

from _table_format import MISSING, Results, captioned, ratio, source, table, wrap

SCALE_RUN = "scale_tpu.json"
"""The ``scale.py`` run whose floors ``scale_tpu_floor`` breaks down."""


def scale_tpu_floor(results: Results) -> str:
    run = results(SCALE_RUN)
    records = [r for r in run["results"] if "floor" in r]
    rows = [(f"{r['neurons']:,}", str(r["T"]), f"`{r['method']}`",
             f"{r['s_per_step'] * 1e3:.2f} ms", f"{r['floor']['s_bytes'] * 1e3:.2f} ms",
             f"{r['floor']['s_indices'] * 1e3:.2f} ms", ratio(r["floor"]["measured_over_floor"]),
             f"{r['bandwidth']['gb_per_s']:.0f} GB/s",
             f"{r['index_rate']['rows_per_s'] / 1e6:.0f} M rows/s") for r in records]
    formulas = [f"- `{r['method']}`: `{r['floor']['formula']}`" for r in records]
    return captioned(
        f"{source(results, SCALE_RUN)}: batch {run['config']['batch']}, "
        f"{run['config']['degree']} synapses per neuron. Per step: the measured time, the bytes "
        "the step must move over the probed bandwidth, the rows its sparse sums gather over the "
        "probed gather rate (the floor is the larger; `benchmarks/_scale_floor.py`), and the "
        "measured time over the floor.",
        *table(("neurons", "T", "method", "time per step", "bytes floor", "gather floor",
                "× floor", "probed bandwidth", "probed gather rate"), rows), "",
        wrap("What each floor counts (`B` batch, `N` neurons, `S` states per neuron, `I` "
             "inputs, `P` Params, `nnz` synapses, `K` steps per time block):"), "",
        *(wrap(f) for f in formulas))


PROBE = "sparse_probe.json"
_VARIANTS = {"before": "before", "autodiff": "JAX's transpose of the gather", "now": "now",
             "tables": "the weights' gather alone"}
_SUMS = {"forward": "forward `y`", "x_bar": "input pullback `x̄`",
         "dw": "weight pullback `dw`", "dw_block": "`dw` over a time block"}


def sparse_probe(results: Results) -> str:
    run = results(PROBE)
    config = run["config"]
    variants = [v for v in _VARIANTS if any(v in run[s] for s in _SUMS)]

    def time(entry: dict[str, Any] | None) -> str:
        return MISSING if entry is None else f"{entry['ms_median']:.2f} ms"

    rows = [(label, str(run[s]["rows"]), *(time(run[s].get(v)) for v in variants),
             ratio(run[s]["before_over_now"])) for s, label in _SUMS.items()]
    return captioned(
        f"{source(results, PROBE)}: the recurrent sparse product of `scale.py` alone, in plain "
        f"JAX: {config['neurons']:,} neurons, {config['degree']} synapses each, over `rows` "
        f"rows (the batch `B`, or ES-D-RTRL's block product's `(K + 1)·B`, `K = "
        f"{config['block']}`); median of {config['repeats']} calls. Before: the forward and `dw` gather each output's "
        "connections from `x`'s columns, `x̄` scatter-adds; now: gathers over each output's "
        "incoming and each input's outgoing connections (`benchmarks/_sparse_probe.py`).",
        *table(("sum", "rows", *(_VARIANTS[v] for v in variants), "before ÷ now"), rows))


KERNELS = ("sparse_kernels_tpu_own.json", "sparse_kernels_tpu.json")
"""The runs of ``sparse_kernels_tpu.py``, newest first, a table each: each sparse sum, Pallas
kernels against XLA's."""
_KERNEL_SUMS = {"forward": "forward `y`", "x_bar": "input pullback `x̄`",
                "dw": "weight pullback `dw`", "dw_block": "`dw` over a time block"}


def _kernel_label(label: str) -> str:
    """A kernels' column: ``pallas`` (the default of the run's commit), ``pallas_staged``,
    ``pallas_small`` (its fallback sizes), ``pallas:NAME`` (a variant of
    ``_sparse_tpu.VARIANTS``)."""
    named = {"pallas": "Pallas", "pallas_staged": "Pallas, staged",
             "pallas_small": "Pallas, small blocks"}
    return named.get(label) or f"Pallas `{label.partition(':')[2]}`"


KERNEL_TOLERANCE = 1e-4
"""The largest difference to XLA's values, over XLA's largest, of a kernel counted right."""


def sparse_kernels(results: Results) -> str:
    """A table per present run of :data:`KERNELS`, newest first (:func:`_sparse_kernels`)."""
    names = results.present(KERNELS)
    if not names:
        raise FileNotFoundError(f"none of {KERNELS} in {results.folder}: run "
                                "benchmarks/sparse_kernels_tpu.py or remove the table's block")
    return "\n\n".join(_sparse_kernels(results, name, first=name == names[0])
                       for name in names)


def _sparse_kernels(results: Results, file: str, first: bool) -> str:
    """Per size, batch and sum of run ``file``: XLA's time, each kernel variant's, the XLA
    gather of the tables that the fastest variant's call makes (the weights into slot order,
    hoisted out of a time loop; or the pullback's values into connection order), the row-rate
    floor and the fastest variant's time over it, XLA's over it, and its largest difference to
    XLA's values (relative to its largest). ``first``: with the caption that says what each
    column is; a later run's caption refers to it."""
    run = results(file)
    config = run["config"]
    labels = list(dict.fromkeys(
        label for record in run["results"] for name in _KERNEL_SUMS if name in record
        for label in record[name] if label.startswith("pallas")))

    def right(entry: dict[str, Any]) -> bool:
        return entry.get("max_rel_error", 0.0) <= KERNEL_TOLERANCE

    def time(entry: dict[str, Any] | None) -> str:
        if entry is None or "ms_median" not in entry:
            return "failed" if entry and "error" in entry else MISSING
        if not right(entry):
            return f"{entry['ms_median']:.2f} ms, wrong values ({entry['max_rel_error']:.0e})"
        return f"{entry['ms_median']:.2f} ms"

    rows = []
    for record in run["results"]:
        for name, what in _KERNEL_SUMS.items():
            entry = record.get(name)
            if entry is None:
                continue
            timed = {k: entry[k] for k in labels
                     if "ms_median" in entry.get(k, {}) and right(entry[k])}
            fastest = min(timed, key=lambda k: timed[k]["ms_median"]) if timed else None
            best = timed.get(fastest)
            tables = entry.get("tables") or entry.get(f"tables:{str(fastest).partition(':')[2]}")
            xla = entry.get("xla", {})
            rows.append((
                f"{record['neurons']:,}", str(record["batch"]), what, str(entry["rows"]),
                time(xla), *(time(entry.get(k)) for k in labels), time(tables),
                f"{entry['floor_ms']:.2f} ms",
                MISSING if best is None else ratio(best["ms_median"] / entry["floor_ms"]),
                MISSING if best is None or "ms_median" not in xla
                else ratio(xla["ms_median"] / best["ms_median"]),
                MISSING if best is None else f"{best['max_rel_error']:.0e}"))
    header = ("neurons", "batch", "sum", "rows", "XLA", *map(_kernel_label, labels),
              "tables alone", "floor", "fastest × floor", "XLA ÷ fastest", "error")
    if not first:
        return captioned(
            f"{source(results, file)}: as above, the sums ({config['degree']} synapses per "
            f"neuron, `K = {config['block']}`, median of {config['repeats']} calls, floor at "
            f"{config['row_ns']} ns a row) with the variants of that run.",
            *table(header, rows))
    return captioned(
        f"{source(results, file)}: the recurrent sparse sums of `scale.py` ({config['degree']}"
        " synapses per neuron) alone, on `rows` rows (the batch, or ES-D-RTRL's block product's "
        f"`(K + 1)·B`, `K = {config['block']}`); median of {config['repeats']} calls. XLA: "
        "its gathers (`_sparse_accelerator.py`); Pallas: "
        + ("each variant of the kernels (`_sparse_tpu.KERNELS`: `cells`, `_sparse_pallas.py`; "
           "`staged`, `_sparse_staged.py`; `packed`, the staged ones with up to 4 sources per "
           "table row where that saves source chunks; `+chunked_pair`: the weight pullback over "
           "several chunks by the staged pair-sum, in connection order; `+own_pair`: that, "
           "each chunk's call staging its own connections alone; `@ROWS`: that many "
           "target rows per block), "
           if all(":" in label for label in labels) else "the kernels (`_sparse_pallas.py`), ")
        + "each call with the XLA gather of its tables (the weights into slot order, which a time "
        "loop computes once, before the loop; or the weight pullback's values into connection "
        "order), the fastest variant's also timed alone. Floor: one row load per "
        f"synapse and per 128 values at {config['row_ns']} ns "
        "(`benchmarks/sparse_kernels_tpu.py`); the fastest kernels' time over it, XLA's time "
        "over theirs, and their largest difference to XLA's values over XLA's largest value; "
        f"a variant whose difference exceeds {KERNEL_TOLERANCE:.0e} is marked wrong and is "
        "never the fastest.",
        *table(header, rows))
