"""The tables of the accelerator runs: time per step, host time per call, floors, sparse sums.

:data:`LATEST_RUNS` and :data:`OTHER_RUNS` list the TPU runs of ``throughput.py`` the
tables show, one row per run and model, each against BPTT in its own run; a method that a
later run measured again, or whose formulation the library no longer uses, is left out of its
run's row and named in the caption (a run left with BPTT alone shows no row). The floor tables
set a measured time against the analytic floor that its run recorded (``_floor.py``,
``_scale_floor.py``); ``throughput_tpu_fused`` sets D-RTRL's block update in one Pallas pass
against its control, XLA's passes (:data:`FUSED_RUNS`); ``block_sizes_tpu`` sets ES-D-RTRL's
block sizes side by side (:data:`BLOCK_RUNS`); ``sparse_probe`` and
``sparse_kernels`` show the sparse product's sums alone (``_sparse_probe.py``,
``sparse_kernels_tpu.py``). Nothing here holds a measured number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from _floor_bytes import online_bytes_per_step
from _table_format import (
    MISSING,
    THROUGHPUT_FIGURES,
    Results,
    captioned,
    lengths,
    micro,
    ratio,
    source,
    table,
    wrap,
)


class Run(NamedTuple):
    """A TPU run of ``throughput.py`` and the methods of it a table leaves out, with why."""

    name: str
    left_out: tuple[tuple[str, str], ...] = ()


H256_AGAIN = "measured again in `throughput_tpu_h256_gru.json` and `throughput_tpu_h256_snn.json`"
H1024_AGAIN = ("measured again, with the jitted step's device time, in "
               "`throughput_tpu_h1024_jit_device.json`")
LATEST_RUNS = (
    Run("throughput_tpu_h256_gru.json"),
    Run("throughput_tpu_h256_snn.json"),
    Run("throughput_tpu_h1024_bf16.json",
        (("es_d_rtrl", "a block formulation since reverted"),
         ("d_rtrl", "measured again in `throughput_tpu_h1024.json`"),
         ("d_rtrl_bf16", H1024_AGAIN))),
    Run("throughput_tpu_h1024.json",
        (("es_d_rtrl", ("blocks of 32 steps; the default's blocks, now 8, measured again in "
                        "`throughput_tpu_h1024_speed_budget.json`")),
         ("d_rtrl", H1024_AGAIN))),
    Run("throughput_tpu_h1024_speed_budget.json", (("es_d_rtrl", H1024_AGAIN),)),
    Run("throughput_tpu_h1024_jit_device.json"),
)
"""The latest TPU runs of ``throughput.py``: ``throughput_tpu`` and its floors (at hidden 1024
each run's methods that a later run measured again left out)."""
OTHER_RUNS = (
    Run("throughput_tpu_host.json", (("es_d_rtrl", H256_AGAIN), ("es_d_rtrl@1", H256_AGAIN))),
    Run("throughput_tpu.json", (("es_d_rtrl", H256_AGAIN), ("es_d_rtrl@1", H256_AGAIN))),
)
"""Runs of earlier commits, for the methods the latest runs did not measure."""
class FusedPair(NamedTuple):
    """Two runs of one session: D-RTRL's block update in one Pallas pass (the run's
    ``config[flag]`` true), then its control, XLA's passes (false), for ``method``."""

    runs: tuple[str, str]
    method: str
    flag: str


FUSED_RUNS = (
    FusedPair(("throughput_tpu_h1024.json", "throughput_tpu_h1024_xla.json"), "d_rtrl",
              "fused_dense_blocks"),
    FusedPair(("throughput_tpu_h1024_bf16_fused.json", "throughput_tpu_h1024_bf16_xla.json"),
              "d_rtrl_bf16", "fused_narrow_traces"),
    FusedPair(("throughput_tpu_h1024_jit_device_narrow.json",
               "throughput_tpu_h1024_jit_device.json"), "d_rtrl_bf16", "fused_narrow_traces"),
)
"""D-RTRL with the time-blocked update of its dense traces in one Pallas pass against XLA's
passes (``_d_rtrl.FUSED_DENSE_BLOCKS``), float32 traces and traces stored in bfloat16
(``_d_rtrl.FUSED_NARROW_TRACES``): ``throughput_tpu_fused``."""
BLOCK_RUNS = ("throughput_tpu_h256_blocks.json", "throughput_tpu_h1024_blocks.json",
              "throughput_tpu_h1024_speed_budget.json")
"""ES-D-RTRL in time blocks of several sizes (``es_d_rtrl@K``) and the default's
(``_loops.default_block_size``): ``block_sizes_tpu``."""
TRACE_BLOCK_RUNS = ("throughput_tpu_h1024_jit_device.json",
                    "throughput_tpu_h1024_long_blocks_gru.json",
                    "throughput_tpu_h1024_long_blocks_snn.json")
"""D-RTRL at hidden 1024 in blocks of 32 (its default then) and longer ones
(``_loops.TRACE_BOUND_BLOCK_SIZE``): ``trace_blocks_tpu``."""
HOST_RUNS = ("throughput_tpu_host.json", "throughput_tpu_h256_host.json",
             "throughput_tpu_h256_t100_host.json", "throughput_tpu_h1024_host.json")
"""The runs that timed the host's share of each call (``throughput.py --host-time``)."""
LOW_PRECISION = "_bf16"
"""The suffix of a method that stores its traces in bfloat16: ``d_rtrl_bf16``."""


def _rows(results: Results, runs: Sequence[Run]) -> list[tuple[Run, str, int, dict[str, Any]]]:
    """``(run, model, T, methods shown)`` for every model and length of ``runs`` that shows a
    method besides BPTT."""
    found = []
    for run in runs:
        for model, length, entry in lengths(results(run.name)):
            shown = {m: e for m, e in entry["methods"].items() if m not in dict(run.left_out)}
            if set(shown) - {"bptt"}:
                found.append((run, model, length, shown))
    return found


def _shown(rows: Sequence[tuple[Run, str, int, dict[str, Any]]]) -> list[str]:
    """The names of the runs that ``rows`` show, in order."""
    return list(dict.fromkeys(run.name for run, *_ in rows))


def _methods(rows: Sequence[tuple[Run, str, int, dict[str, Any]]]) -> list[str]:
    """The methods of ``rows`` in order of first appearance, each bfloat16 variant after its
    float32 method and the forms in blocks of a given size (``name@K``) last."""
    methods = list(dict.fromkeys(m for *_, shown in rows for m in shown))

    def key(method: str) -> tuple[bool, int, bool]:
        base = method.removesuffix(LOW_PRECISION)
        first = methods.index(base if base in methods else method)
        return "@" in method, first, method.endswith(LOW_PRECISION)

    return sorted(methods, key=key)


def _model(results: Results, run: Run, model: str, length: int) -> str:
    config = results(run.name)["config"]
    return f"`{model}`, hidden {config['hidden']}, batch {config['batch']}, T = {length}"


def _left_out(runs: Sequence[Run]) -> str:
    return "; ".join(f"`{m}` of `{run.name}` ({why})" for run in runs for m, why in run.left_out)


def _throughput(results: Results, runs: Sequence[Run], caption: str) -> str:
    rows_in = _rows(results, runs)
    methods = _methods(rows_in)

    def cell(entry: dict[str, Any] | None, method: str) -> str:
        if entry is None:
            return MISSING
        if method == "bptt":
            return f"{micro(entry['step_us_median'])} ({micro(entry['device_step_us'])})"
        return " / ".join(ratio(entry.get(key)) for key, _ in THROUGHPUT_FIGURES)

    rows = [(f"`{run.name}`", _model(results, run, model, length),
             *(cell(shown.get(m), m) for m in methods)) for run, model, length, shown in rows_in]
    left_out = _left_out(runs)
    return captioned(
        f"{source(results, *_shown(rows_in))}{caption} BPTT's time per step (on "
        "the device), then each method's over BPTT's in that run: "
        + " / ".join(what for _, what in THROUGHPUT_FIGURES) + "."
        + (f" Left out: {left_out}." if left_out else ""),
        *table(("run", "model", *(f"`{m}`" for m in methods)), rows))


def throughput_tpu(results: Results) -> str:
    return _throughput(results, LATEST_RUNS, ".")


def throughput_tpu_other(results: Results) -> str:
    return _throughput(results, OTHER_RUNS, ": the methods that the runs of the table above "
                       "did not measure.")


def throughput_tpu_floor(results: Results) -> str:
    rows_in = _rows(results, LATEST_RUNS)
    methods = _methods(rows_in)

    def cell(run: Run, model: str, length: int, shown: dict[str, Any], method: str) -> str:
        entry = shown.get(method)
        if entry is None:
            return MISSING
        text = f"{micro(entry['device_step_us'])}, {ratio(entry['floor']['ratio'])}"
        measured = {(m, t): e["methods"] for m, t, e in lengths(results(run.name))}
        base = measured[model, length].get(method.removesuffix(LOW_PRECISION))
        if method.endswith(LOW_PRECISION) and base:  # its own run's, left out of the row or not
            text += f", {ratio(entry['device_step_us'] / base['device_step_us'])} float32's"
        if entry["floor"].get("jit_device_ratio") is not None:
            text += (f"; jitted {micro(entry['jit_device_step_us'])}, "
                     f"{ratio(entry['floor']['jit_device_ratio'])}")
        return text

    rows = [(_model(results, run, model, length),
             f"{results(run.name)['bandwidth']['gb_per_s']:.0f} GB/s",
             *(cell(run, model, length, shown, m) for m in methods))
            for run, model, length, shown in rows_in]
    return captioned(
        f"{source(results, *_shown(rows_in))}. The device's time per step of the stateful "
        "call (`etrace_grad`), then over the analytic floor: the bytes one step must move "
        "(Params, inputs, hidden states, and the traces read and written once per time block; "
        "`benchmarks/_floor.py`) over the bandwidth probed in the same run; "
        f"`d_rtrl{LOW_PRECISION}` also over D-RTRL's time with float32 traces in its own run "
        "(where a later run's row shows that method, this run's is in its JSON); where the "
        "run timed it, after `jitted`, the same two for `online_grad` in a jitted step that "
        "donates its carried state (the stateful call keeps its state: its traces are copied "
        "each call).",
        *table(("model", "probed bandwidth", *(f"`{m}`" for m in methods)), rows))


def throughput_tpu_fused(results: Results) -> str:
    """D-RTRL's time-blocked update of a dense trace in one Pallas pass against XLA's passes
    (:data:`FUSED_RUNS`): per model, a row per run, the device's time per step over BPTT's in
    that run and over the analytic floor, and the one pass's time over XLA's."""
    rows = []
    for pair in FUSED_RUNS:
        runs = {name: results(name) for name in pair.runs}
        for name, fused in zip(pair.runs, (True, False)):
            if runs[name]["config"].get(pair.flag) is not fused:
                raise ValueError(f"{name}: its config's {pair.flag} is not {fused}, as "
                                 "FUSED_RUNS lists it")
        control = {(m, t): e["methods"] for m, t, e in lengths(runs[pair.runs[1]])}
        forms = dict(zip(pair.runs, ("one Pallas pass", "XLA's passes")))
        for model, length, entry in lengths(runs[pair.runs[0]]):
            both = (entry["methods"], control[model, length])
            fused_one = both[0][pair.method]
            for name, methods in zip(pair.runs, both):
                d_rtrl = methods[pair.method]
                over = (ratio(fused_one["device_step_us"] / both[1][pair.method]["device_step_us"])
                        if d_rtrl is fused_one else MISSING)
                rows.append((_model(results, Run(name), model, length), f"`{pair.method}`",
                             forms[name], f"`{name}`",
                             f"{methods['bptt']['device_step_us']:.1f} µs",
                             f"{d_rtrl['device_step_us']:.1f} µs",
                             ratio(d_rtrl["device_ratio_to_bptt"]),
                             ratio(d_rtrl["floor"]["ratio"])
                             + (f" (jitted {ratio(d_rtrl['floor']['jit_device_ratio'])})"
                                if "jit_device_ratio" in d_rtrl["floor"] else ""),
                             ratio(d_rtrl.get("jit_ratio_to_bptt")), over))
    names = [name for pair in FUSED_RUNS for name in pair.runs]
    return captioned(
        f"{source(results, *names)}: D-RTRL's time-blocked update of its dense traces "
        "(`_d_rtrl.FUSED_DENSE_BLOCKS`, the run's `fused_dense_blocks`; for traces stored in "
        "bfloat16, `d_rtrl_bf16`, also `_d_rtrl.FUSED_NARROW_TRACES`, `fused_narrow_traces`) "
        "as one Pallas pass (`_dense_block_kernel.py`: each trace read once and written once "
        "per block) and as XLA's passes, the control, run one after the other on the same "
        "chip. Per row: BPTT's and D-RTRL's time per step on the device, D-RTRL's over BPTT's "
        "in that run, over the analytic floor (`benchmarks/_floor.py`; in brackets, where the "
        "run timed it, the jitted step's device time over it), its jitted step over "
        "BPTT's, and the one pass's device time over XLA's passes'.",
        *table(("model", "method", "block update", "run", "`bptt` on the device",
                "D-RTRL on the device", "× BPTT", "× floor", "jitted step × BPTT",
                "÷ XLA's passes"), rows))


def block_sizes_tpu(results: Results) -> str:
    """ES-D-RTRL's time per step over BPTT's by steps per block (:data:`BLOCK_RUNS`): per run
    and model, each method's jitted step and device time over BPTT's, the default's block
    size read from the floor its run recorded."""
    rows_in = []
    for name in BLOCK_RUNS:
        for model, length, entry in lengths(results(name)):
            rows_in.append((name, model, length, entry["methods"]))
    sizes = sorted({int(m.partition("@")[2]) for *_, methods in rows_in for m in methods
                    if "@" in m})

    def cell(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return MISSING
        return f"{ratio(entry.get('jit_ratio_to_bptt'))} / {ratio(entry['device_ratio_to_bptt'])}"

    rows = []
    for name, model, length, methods in rows_in:
        default = methods.get("es_d_rtrl")
        k = default["floor"]["terms"]["K"] if default else MISSING
        rows.append((f"`{name}`", _model(results, Run(name), model, length),
                     *(cell(methods.get(f"es_d_rtrl@{size}")) for size in sizes),
                     f"{cell(default)} (K = {k})"))
    return captioned(
        f"{source(results, *BLOCK_RUNS)}: ES-D-RTRL in time blocks of K steps "
        "(`es_d_rtrl@K`; `@1` the per-step form) and at the default block size "
        "(`_loops.default_block_size`, its K in brackets), each as its jitted step's time over "
        "BPTT's / its device time over BPTT's, in its own run.",
        *table(("run", "model", *(f"`es_d_rtrl@{size}`" for size in sizes), "`es_d_rtrl`"),
               rows))


def trace_blocks_tpu(results: Results) -> str:
    """D-RTRL's time per step by steps per block (:data:`TRACE_BLOCK_RUNS`): per model, method
    and block size, the jitted step's device time, over its floor and over BPTT's device
    time in its run, and the jitted step's wall time over BPTT's."""
    rows = []
    for name in TRACE_BLOCK_RUNS:
        run = results(name)
        for model, length, entry in lengths(run):
            for method, e in entry["methods"].items():
                if not method.startswith("d_rtrl") or method.endswith("@1"):
                    continue
                terms = e["floor"]["terms"]
                passes = -(-length // terms["K"])
                floor_us = online_bytes_per_step(terms, terms["Tr"], terms["K"], length) / run[
                    "bandwidth"]["bytes_per_s"] * 1e6
                rows.append((_model(results, Run(name), model, length), f"`{name}`",
                             f"`{method}`", str(terms["K"]), str(passes),
                             micro(e["jit_device_step_us"]),
                             ratio(e["jit_device_step_us"] / floor_us),
                             ratio(e["jit_device_step_us"] / entry["methods"]["bptt"][
                                 "device_step_us"]),
                             ratio(e["jit_ratio_to_bptt"])))
    rows.sort(key=lambda row: (row[0], LOW_PRECISION in row[2], int(row[3])))
    return captioned(
        f"{source(results, *TRACE_BLOCK_RUNS)}: D-RTRL inside a jitted step (its carried state "
        "donated) in time blocks of K steps (`d_rtrl@K`; `d_rtrl` the default's, then 32), "
        f"traces in float32 and in bfloat16 (`{LOW_PRECISION}`): the passes over the traces "
        "per call (⌈T/K⌉, the last block shorter), the device's time per step, over the "
        "analytic floor with that many passes (`benchmarks/_floor.py`, from its run's terms "
        "and probed bandwidth), over BPTT's device time, and the jitted step's wall time over "
        "BPTT's, each in its own run.",
        *table(("model", "run", "method", "K", "passes", "device per step", "× floor",
                "× BPTT (device)", "jitted step × BPTT"), rows))


_PER_CALL = (("stateful_us", "`etrace_grad`"), ("device_us", "its device time"),
             ("host_us", "its host time"), ("driver_us", "its driver's Python"),
             ("jit_us", "jitted step"), ("jit_device_us", "its device time"),
             ("jit_host_us", "its host time"))


def throughput_tpu_host(results: Results) -> str:
    """Per call of each :data:`HOST_RUNS` run: the stateful call's and the jitted step's times,
    each split into device and host, and both over BPTT's (the stateful call's less the jitted
    step's ratio: what the stateful API costs beyond a jitted step of your own)."""
    def over(entry: dict[str, Any]) -> str:
        stateful, jitted = entry["ratio_to_bptt"], entry.get("jit_ratio_to_bptt")
        if jitted is None:
            return MISSING
        return f"{ratio(stateful)} / {ratio(jitted)} ({stateful - jitted:+.2f})"

    rows = []
    for name in HOST_RUNS:
        for model, length, entry in lengths(results(name)):
            for method, calls in entry["per_call"].items():
                rows.append((f"`{name}`", _model(results, Run(name), model, length),
                             f"`{method}`",
                             *(f"{calls[key] / 1000:.2f} ms" for key, _ in _PER_CALL),
                             MISSING if method == "bptt" else over(entry["methods"][method])))
    return captioned(
        f"{source(results, *HOST_RUNS)}: time per call of `T` steps through the stateful "
        "`learner.etrace_grad` (BPTT: a learner compiled with `'bptt'`) and through "
        "`online_grad` in a jitted step (BPTT: the jitted `jax.grad`). Host time: the call's "
        "wall time less the device's; the driver's Python: the stateful call less its compiled "
        "program called directly. Last: the stateful call's time over BPTT's / the jitted "
        "step's over BPTT's (the difference), each in its own run.",
        *table(("run", "model", "method", *(what for _, what in _PER_CALL),
                "× BPTT: `etrace_grad` / jitted step"), rows))


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


TRACE_DTYPE_TASKS = "tasks_spiking_rules.json"
"""The tasks run with each trace-keeping rule beside its bfloat16-trace twin."""


def trace_dtype_accuracy(results: Results) -> str:
    """Test accuracy of D-RTRL and ES-D-RTRL with float32 and with bfloat16 traces, and the
    difference in points, per task of :data:`TRACE_DTYPE_TASKS` (the ALIF network)."""
    run = results(TRACE_DTYPE_TASKS)
    config = run["config"]
    rows = []
    for task, models in run["results"].items():
        row = models["alif"]
        for method in ("d_rtrl", "es_d_rtrl"):
            if method not in row or f"{method}_bf16" not in row:
                continue
            wide, narrow = row[method], row[f"{method}_bf16"]
            points = round(100 * (narrow["test_accuracy_mean"] - wide["test_accuracy_mean"]), 1)
            rows.append((task.replace("_", " "), f"`{method}`",
                         *(f"{e['test_accuracy_mean']:.3f} ± {e['test_accuracy_std']:.3f}"
                           for e in (wide, narrow)), f"{points + 0.0:+.1f}"))
    return captioned(
        f"{source(results, TRACE_DTYPE_TASKS)}: the `alif` network of `tasks.py`, test accuracy "
        f"(mean ± std over {config['seeds']} seeds; hidden {config['hidden']}, batch "
        f"{config['batch']}, {config['steps']} Adam steps, rate per row from {config['lrs']}) "
        "with the traces in float32 and in bfloat16, and the difference in points.",
        *table(("task", "rule", "float32 traces", "bfloat16 traces", "points"), rows))


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
