"""The tables of the accelerator runs of dense networks: time per step, host time per call,
floors, block sizes, bfloat16 traces' accuracy (the sparse network's: ``_sparse_tables.py``).

:data:`LATEST_RUNS` and :data:`OTHER_RUNS` list the TPU runs of ``throughput.py`` the
tables show, one row per run and model, each against BPTT in its own run; a method that a
later run measured again, or whose formulation the library no longer uses, is left out of its
run's row and named in the caption (a run left with BPTT alone shows no row). The floor tables
set a measured time against the analytic floor that its run recorded (``_floor.py``,
``_scale_floor.py``); ``throughput_tpu_fused`` sets D-RTRL's block update in one Pallas pass
against its control, XLA's passes (:data:`FUSED_RUNS`); ``block_sizes_tpu`` sets ES-D-RTRL's
block sizes side by side (:data:`BLOCK_RUNS`), ``trace_blocks_tpu`` D-RTRL's
(:data:`TRACE_BLOCK_RUNS`). Nothing here holds a measured number.
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
                    "throughput_tpu_h1024_long_blocks_snn.json",
                    "throughput_tpu_h256_long_blocks.json", "throughput_tpu_h1024_slots.json",
                    "throughput_tpu_h256_slots.json")
"""D-RTRL at hidden 1024 and 256 in blocks of 32 (its default then) and longer ones
(``_loops.TRACE_BOUND_BLOCK_SIZE``): ``trace_blocks_tpu``."""
HOST_RUNS = ("throughput_tpu_host.json", "throughput_tpu_h256_host.json",
             "throughput_tpu_h256_t100_host.json", "throughput_tpu_h1024_host.json",
             "throughput_tpu_h256_t100_host_b2b.json")
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
        "donated) in time blocks of K steps (`d_rtrl@K`; `d_rtrl` the default's of its commit), "
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
    def over(calls: dict[str, float], bptt: dict[str, float]) -> str:
        stateful, jitted = (calls[key] / bptt["jit_us"] for key in ("stateful_us", "jit_us"))
        return f"{ratio(stateful)} / {ratio(jitted)} ({stateful - jitted:+.2f})"

    rows = []
    for name in HOST_RUNS:
        for model, length, entry in lengths(results(name)):
            bptt = entry["per_call"]["bptt"]
            for method, calls in entry["per_call"].items():
                rows.append((f"`{name}`", _model(results, Run(name), model, length),
                             f"`{method}`",
                             *(f"{calls[key] / 1000:.2f} ms" for key, _ in _PER_CALL),
                             MISSING if method == "bptt" else over(calls, bptt)))
    return captioned(
        f"{source(results, *HOST_RUNS)}: time per call of `T` steps through the stateful "
        "`learner.etrace_grad` (BPTT: a learner compiled with `'bptt'`) and through "
        "`online_grad` in a jitted step (BPTT: the jitted `jax.grad`). Host time: the call's "
        "wall time less the device's; the driver's Python: the stateful call less its compiled "
        "program called directly. Last: per call, the stateful call's time / the jitted step's, "
        "each over BPTT's jitted grad (the difference), each in its own run; a run of calls "
        "back to back (`_b2b`) times 20 calls in a row, blocked once at the end.",
        *table(("run", "model", "method", *(what for _, what in _PER_CALL),
                "× BPTT: `etrace_grad` / jitted step"), rows))


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
