"""Every generated block, by name (:data:`BLOCKS`), and the benchmarks' tables.

Each function of :data:`BLOCKS` takes a :class:`Results` (the folder of JSONs) and returns
the Markdown of one generated block: a line that names its source (file, machine, commit,
configuration) and a table. ``render_tables.py`` writes them into the pages; nothing here
holds a measured number. A method, model or size that a new run adds to a JSON becomes a
row or a column on the next render; a new algorithm of the README's table is one line of
``_readme_tables.ALGORITHMS``, a new rule of the online-rules page one line of
``_online_rules_table.RULES``.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import _accelerator_tables as accelerator
import _readme_tables as readme
import _sparse_tables as sparse_tables
from _online_rules_table import online_rules
from _shd_table import shd_compare
from _spyx_table import spyx_compare
from _table_format import (
    MISSING,
    THROUGHPUT_FIGURES,
    Results,
    captioned,
    machine,
    micro,
    ratio,
    seconds,
    size,
    source,
    table,
    wrap,
)

# -- memory, throughput, fidelity ------------------------------------------------------------

def memory(results: Results) -> str:
    run = results("memory_vs_length.json")
    config = run["config"]
    lengths = config["lengths"]
    cells: dict[tuple[str, str], dict[int, str]] = {}
    for r in run["results"]:
        cell = (f"{size(r['xla']['temp_bytes'])} / {size(r['rss']['peak_bytes'])}"
                if r.get("executed") else f"{size(r['xla']['temp_bytes'])} / not run")
        cells.setdefault((r["model"], r["method"]), {})[r["T"]] = cell
    rows = [(f"`{model}`", f"`{method}`", *(c.get(t, MISSING) for t in lengths))
            for (model, method), c in cells.items()]
    return captioned(
        f"{source(results, 'memory_vs_length.json')}: hidden {config['hidden']}, batch "
        f"{config['batch']}; `_streamed`: chunks of {config['stream_chunk']} steps. Per cell: "
        "XLA temporary memory of the compiled pass / peak RSS of its process.",
        *table(("model", "method", *(f"T = {t:,}" for t in lengths)), rows))


def _throughput(results: Results, names: Sequence[str]) -> str:
    columns = [(name, model) for name in names for model in results(name)["results"]]
    figures = [(key, what) for key, what in THROUGHPUT_FIGURES
               if any(key in e for name, model in columns
                      for e in results(name)["results"][model]["methods"].values())]
    methods = list(dict.fromkeys(m for name, model in columns
                                 for m in results(name)["results"][model]["methods"]))

    def cell(name: str, model: str, method: str) -> str:
        entry = results(name)["results"][model]["methods"].get(method)
        if entry is None:
            return MISSING
        if method == "bptt":
            device = (f" ({micro(entry['device_step_us'])} on the device)"
                      if "device_step_us" in entry else "")
            return f"{micro(entry['step_us_median'])} per step{device}"
        return " / ".join(ratio(entry[key]) if key in entry else MISSING for key, _ in figures)

    def heading(name: str, model: str) -> str:
        config = results(name)["config"]
        sizes = (config["demo_model"] if model == "demo" else config)
        return f"`{model}`, hidden {sizes['hidden']}, batch {sizes['batch']}, T = {config['T']}"

    rows = [(f"`{m}`", *(cell(n, model, m) for n, model in columns)) for m in methods]
    return captioned(
        f"{source(results, *names)}. BPTT's time per step, then each method's over BPTT's: "
        + " / ".join(what for _, what in figures) + ".",
        *table(("method", *(heading(n, model) for n, model in columns)), rows))


def throughput_cpu(results: Results) -> str:
    return _throughput(results, ("throughput.json",))


def fidelity(results: Results) -> str:
    run = results("fidelity.json")
    columns = [(c, m) for c, config in run["results"].items() for m in config["models"]]
    methods = list(dict.fromkeys(a for c, m in columns
                                 for a in run["results"][c]["models"][m]["algorithms"]))

    def cell(c: str, m: str, a: str) -> str:
        entry = run["results"][c]["models"][m]["algorithms"].get(a, {})
        if "cosine" not in entry:
            return MISSING
        return f"{entry['cosine']:.3f} / {entry['cosine_recurrent_layers']:.3f}"

    def heading(c: str, m: str) -> str:
        config = run["results"][c]["config"]
        return f"`{m}`, hidden {config['hidden']}, T = {config['T']}"

    rows = [(f"`{a}`", *(cell(c, m, a) for c, m in columns)) for a in methods]
    rows.append(("random direction (control)", *(
        f"{run['results'][c]['models'][m]['control_random_direction']['cosine']:.3f}"
        for c, m in columns)))
    return captioned(
        f"{source(results, 'fidelity.json')}, {run['dtype']}. Cosine to BPTT's gradient: all "
        "Params / the recurrent layers only.",
        *table(("algorithm", *(heading(c, m) for c, m in columns)), rows))


# -- tasks, devices, scale -------------------------------------------------------------------

def tasks(results: Results) -> str:
    run = results("tasks.json")
    config = run["config"]
    rows_in = [(t, m, row) for t, models in run["results"].items() for m, row in models.items()]
    methods = list(dict.fromkeys(meth for _, _, row in rows_in for meth in row))

    def cell(entry: dict[str, Any] | None) -> str:
        if not entry or "test_accuracy_mean" not in entry:
            return MISSING
        return f"{entry['test_accuracy_mean']:.3f} ± {entry['test_accuracy_std']:.3f}"

    rows = [(t.replace("_", " "), f"`{m}`", *(cell(row.get(meth)) for meth in methods))
            for t, m, row in rows_in]
    return captioned(
        f"{source(results, 'tasks.json')}: test accuracy, mean ± std over {config['seeds']} "
        f"seeds; hidden {config['hidden']} (`@small` and the methods beside it: "
        f"{config['small_hidden']}), batch {config['batch']}, {config['steps']} Adam steps, "
        f"rate per row from {config['lrs']} on the validation split.",
        *table(("task", "model", *(f"`{m}`" for m in methods)), rows))


def training_spiking(results: Results) -> str:
    """``docs/training_spiking.md``: the two-layer LIF network, by its recipe and by the
    layers' defaults, each method's test accuracy per seed and training time."""
    run = results("tasks_lif2.json")
    config = run["config"]

    def row(model: str, method: str, entry: dict[str, Any]) -> tuple[str, ...]:
        if "test_accuracy_mean" not in entry:
            return (f"`{model}`", f"`{method}`", MISSING, MISSING, MISSING)
        seeds = " / ".join(f"{a:.3f}" for a in entry["test_accuracy_per_seed"])
        return (f"`{model}`", f"`{method}`", seeds,
                f"{entry['test_accuracy_mean']:.3f} ± {entry['test_accuracy_std']:.3f}",
                seconds(entry["train_wall_s_mean"]))

    rows = [row(model, method, entry) for models in run["results"].values()
            for model, methods in models.items() for method, entry in methods.items()]
    seeds = " / ".join(str(s) for s in range(config["seeds"]))
    return captioned(
        f"{source(results, 'tasks_lif2.json')}: SpikingDigits, test accuracy at the last step "
        f"after {config['steps']} Adam updates of batch {config['batch']} at rate "
        f"{' or '.join(f'{r:g}' for r in config['lrs'])}; hidden {config['hidden']}; "
        f"{config['seeds']} seeds (initialisation and batches). Training time: one run's "
        "updates, their compilation included.",
        *table(("network", "method", f"test accuracy, seed {seeds}", "mean ± std",
                "training time per run"), rows))


def sharding(results: Results) -> str:
    run = results("sharding.json")
    records = run["results"]
    methods = list(dict.fromkeys(r["method"] for r in records))
    by = {(r["mode"], r["devices"], r["method"]): r for r in records}

    def cell(mode: str, devices: int, show: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(show(by[mode, devices, m]) if (mode, devices, m) in by else MISSING
                          for m in methods)

    rows = []
    for mode, devices in dict.fromkeys((r["mode"], r["devices"]) for r in records):
        model = by[mode, devices, methods[0]]
        rows.append((f"{mode}: `{model['model']}`, hidden {model['hidden']}", str(devices),
                     cell(mode, devices, lambda r: size(r["trace_bytes_per_device"])),
                     cell(mode, devices, lambda r: size(r["param_bytes_per_device"])),
                     cell(mode, devices, lambda r: size(r["xla_temp_bytes_per_device"])),
                     cell(mode, devices, lambda r: f"{r['etrace_grad_ms_per_step']:.2f}"),
                     cell(mode, devices, lambda r: f"{r['trainer_ms_per_step']:.2f}")))
    first = records[0]
    return captioned(
        f"{source(results, 'sharding.json')}: batch {first['batch']}, T = {first['T']}; per "
        "cell " + " / ".join(f"`{m}`" for m in methods) + ". Forced host devices share the "
        "CPU's cores, so times show the cost of partitioning, not a speed-up.",
        *table(("split", "devices", "traces per device", "Params per device",
                "XLA temp per device", "`etrace_grad` ms/step", "`OnlineTrainer` ms/step"),
               rows))


_TIMED_OUT = re.compile(r"timed out after (\d+) s")


def _scale_figures(r: dict[str, Any], summary: dict[str, Any]) -> tuple[str, ...]:
    """s/update, × BPTT, peak RSS, XLA peak, × floor of one record of ``scale.py``."""
    if r.get("executed"):
        return (f"{r['s_per_update']:.3g} s", ratio(summary.get("time_ratio_to_bptt")),
                f"{summary['peak_rss_gib']:.2f} GiB", f"{summary['xla_peak_gib']:.2f} GiB",
                ratio(summary.get("measured_over_floor")))
    timed_out = _TIMED_OUT.fullmatch(r.get("error", ""))
    if "xla" in r and timed_out:
        status = (f"compiled (lowering {seconds(r['lower_s'])}, compilation "
                  f"{seconds(r['compile_s'])}); not finished within {timed_out.group(1)} s (build, "
                  "lowering and compilation included)")
        return status, MISSING, MISSING, f"{summary['xla_peak_gib']:.2f} GiB", MISSING
    return (f"not run: {r.get('skipped_reason', r.get('error', ''))}", *[MISSING] * 4)


def _scale(results: Results, names: Sequence[str], sums: bool = False) -> str:
    """The ``scale.py`` runs ``names``, a row per record; ``sums``: with the batch, the
    formulation of the sparse sums (:func:`_sums`) and the samples-steps per second."""
    rows, ran, floors = [], [], False
    for name in names:
        run = results(name)
        for r in run["results"]:
            key = f"N={r['neurons']},T={r['T']}"
            summaries = run["summary"].get(f"{key},B={r.get('batch')}") or run["summary"].get(key)
            summary = (summaries or {}).get(r["method"], {})
            figures = _scale_figures(r, summary)
            floors |= summary.get("measured_over_floor") is not None
            if r.get("executed") and name not in ran:
                ran.append(name)
            loop = r.get("loop") or MISSING
            batch = r.get("batch") or run["config"]["batch"]
            if sums:
                steps = summary.get("sample_steps_per_s") or (
                    batch * r["T"] / r["s_per_update"] if r.get("executed") else None)
                rows.append((f"{r['neurons']:,}", str(r["T"]), f"`{r['method']}`", str(batch),
                             _sums(name, run), loop, figures[0],
                             MISSING if steps is None else f"{steps:,.0f}", *figures[1:]))
                continue
            method = f"`{r['method']}`" + (f" (batch {batch})" if batch !=
                                          run["config"]["batch"] else "")
            rows.append((f"{r['neurons']:,}", str(r["T"]), method, loop, *figures))
    if not floors:
        rows = [row[:-1] for row in rows]
    config = results(names[0])["config"]
    repeats = ", ".join(f"{results(n)['config']['repeats']} in `{n}`" for n in ran)
    header = ("neurons", "T", "method", *(("batch", "sums") if sums else ()), "loop",
              "s/update", *(("sample-steps/s",) if sums else ()), "× BPTT", "peak RSS",
              "XLA peak", *(("× floor",) if floors else ()))
    return captioned(
        f"{source(results, *names)}: "
        + ("" if sums else f"batch {config['batch']}, ")
        + f"{config['degree']} synapses per neuron; seconds per update, the median of the runs "
        f"after a warm-up ({repeats})."
        + (" Sums: the sparse product's sums as XLA's gathers or as the Pallas kernels; "
           "sample-steps/s: batch · T over the seconds per update; × BPTT: against BPTT's "
           "time in the same run and batch." if sums else "")
        + (" × floor: the time per step over its analytic floor (`benchmarks/_scale_floor.py`)."
           if floors else "")
        + (" Its gather rate is XLA's, probed in the same run: the Pallas kernels gather faster,"
           " so their rows can fall below it." if floors and sums else ""),
        *table(header, rows))


PALLAS_SCALE_RUNS = ("scale_tpu_pallas.json", "scale_tpu_1m_pallas.json")
"""``scale.py`` runs on a TPU whose sparse sums were the Pallas kernels (the default there
since those runs' commit) but whose JSON does not say so (``config['sparse_sums']``, which
later runs record)."""


def _sums(name: str, run: dict[str, Any]) -> str:
    """``XLA`` or ``Pallas`` (``Pallas, staged``: a variant other than the default)."""
    recorded = run["config"].get("sparse_sums")
    if recorded is None:
        return "Pallas" if name in PALLAS_SCALE_RUNS else "XLA"
    return recorded


def scale_cpu(results: Results) -> str:
    return _scale(results, ("scale.json", "scale_t300.json"))


KERNEL_SCALE_RUNS = ("scale_tpu_cells.json", "scale_tpu_staged.json", "scale_tpu_1m_kernels.json",
                     "scale_tpu_1m_t300_pallas.json", "scale_tpu_1m_packed.json")
"""``scale.py --kernels VARIANT`` runs on a TPU (``config['sparse_sums']`` names the kernels),
shown once committed: 131,072 neurons with each variant in one device call, and 1,048,576
(T = 30 and 300)."""
BLOCK_SCALE_RUNS = ("scale_tpu_131k_speed_budget.json", "scale_tpu_131k.json",
                    "scale_tpu_131k_b128.json")
"""``scale.py`` runs on a TPU that set ES-D-RTRL's block sizes side by side (the ``loop``
column: ``es_d_rtrl`` there ran in blocks of 2, a form of ``_loops.BLOCK_SPEED_BUDGET`` that
covered sparse networks, which now keep the memory budget's 3)."""
SCALE_TPU_RUNS = ("scale_tpu.json", "scale_tpu_t300.json", "scale_tpu_1m_t300.json",
                  *PALLAS_SCALE_RUNS, *KERNEL_SCALE_RUNS, *BLOCK_SCALE_RUNS)
"""The ``scale.py`` runs on a TPU that ``scale_tpu`` shows, the XLA formulation's first."""


def scale_tpu(results: Results) -> str:
    return _scale(results, results.present(SCALE_TPU_RUNS), sums=True)


LATEST_SCALE_RUNS = ("scale_tpu_131k_slots.json", "scale_tpu_1m_own.json")
"""The ``scale.py`` runs on a TPU at the latest commits that ``scale_tpu_latest`` shows:
131,072 neurons at batch 32 and 128 with the kernels of that commit's defaults (and a TPU's
one JVP per slot and summed decayed sums), 1,048,576 with ``--kernels packed+own_pair``."""


def _executed(results: Results, names: Sequence[str]) -> list[dict[str, Any]]:
    """The records of ``names`` that ran, each with its batch and sample-steps per second."""
    found = []
    for name in names:
        run = results(name)
        for r in run["results"]:
            if r.get("executed"):
                batch = r.get("batch") or run["config"]["batch"]
                found.append({**r, "batch": batch, "steps": batch * r["T"] / r["s_per_update"]})
    return found


def _scale_relations(records: Sequence[dict[str, Any]]) -> str:
    """Sentences that set the records against each other: a larger batch's sample-steps per
    second over the smallest batch's (same size, length and method), and the largest network's
    step over the smallest's (same length, method and batch)."""
    said = []
    batches: dict[tuple, list[str]] = {}
    by_key = {(r["neurons"], r["T"], r["method"], r["batch"]): r for r in records}
    for (neurons, length, method, batch), r in by_key.items():
        small = min(b for n, t, m, b in by_key if (n, t, m) == (neurons, length, method))
        if batch != small:
            over = r["steps"] / by_key[neurons, length, method, small]["steps"]
            batches.setdefault((neurons, length, small, batch), []).append(
                f"{ratio(over)} with `{method}`")
    for (neurons, length, small, batch), each in batches.items():
        said.append(f"At {neurons:,} neurons and T = {length}, batch {batch}'s sample-steps "
                    f"per second over batch {small}'s: {', '.join(each)}.")
    sizes: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r in records:
        sizes.setdefault((r["T"], r["method"], r["batch"]), {})[r["neurons"]] = r
    for (length, method, batch), by_size in sizes.items():
        if len(by_size) > 1:
            small, large = by_size[min(by_size)], by_size[max(by_size)]
            said.append(
                f"With `{method}` at T = {length} and batch {batch}, the {large['neurons']:,}-"
                f"neuron step ({large['s_per_step'] * 1e3:.3g} ms) is "
                f"{ratio(large['s_per_step'] / small['s_per_step'])} the {small['neurons']:,}-"
                f"neuron step ({small['s_per_step'] * 1e3:.3g} ms), for "
                f"{large['neurons'] / small['neurons']:g} times the neurons (sums as in their "
                "rows).")
    return " ".join(said)


def scale_tpu_latest(results: Results) -> str:
    names = results.present(LATEST_SCALE_RUNS)
    relations = _scale_relations(_executed(results, names))
    block = _scale(results, names, sums=True)
    return block + (f"\n\n{wrap(relations)}" if relations else "")


SCALE_MEMORY_RUNS = ("scale_bptt_1m_compiled.json",)
"""``scale.py`` runs with ``--compile-only --formulation accelerator`` whose records join the
table of ``scale_accelerator_memory.json`` (on the CPU, compiled and analysed, not run)."""


def scale_memory(results: Results) -> str:
    run = results("scale_accelerator_memory.json")
    rows = [(f"{r['neurons']:,}", str(r["T"]), f"`{r['method']}`", str(r["batch"]),
             r["loop"] or MISSING, size(r["xla"]["peak_bytes"]))
            for r in run["rows"] if r["library"] == "after"]
    for name in SCALE_MEMORY_RUNS:
        other = results(name)
        if not (other["config"]["compile_only"]
                and other["config"]["formulation"] == "accelerator"):
            raise ValueError(f"{name} is not a --compile-only --formulation accelerator run of "
                             "scale.py: its peaks are not the accelerators' (rerun it so).")
        rows += [(f"{r['neurons']:,}", str(r["T"]), f"`{r['method']}`", str(r["batch"]),
                  r["loop"] or MISSING, size(r["xla"]["peak_bytes"]))
                 for r in other["results"]]
    return captioned(
        "`benchmarks/results/scale_accelerator_memory.json`; "
        f"{source(results, *SCALE_MEMORY_RUNS)}: XLA's peak memory of one update, compiled on "
        f"{machine(run['environment'])} in the accelerators' formulation (not run).",
        *table(("neurons", "T", "method", "batch", "loop", "XLA peak"), rows))


# -- the smaller benchmarks ------------------------------------------------------------------

def sparse(results: Results) -> str:
    run = results("sparse.json")
    config = run["config"]
    methods = list(run["results"])
    variants = list(dict.fromkeys(v for m in methods for v in run["results"][m]))
    first = run["results"][methods[0]]
    rows = [(f"`{v}`", f"{first[v]['connections']:,}",
             f"{size(first[v]['trace_bytes'])} ({ratio(first[v]['trace_ratio_to_dense'])})",
             *(f"{micro(e['step_us_median'])} ({ratio(e['step_ratio_to_dense'])})"
               for e in (run["results"][m][v] for m in methods)))
            for v in variants]
    return captioned(
        f"{source(results, 'sparse.json')}: {config['inputs']} inputs, hidden "
        f"{config['hidden']}, batch {config['batch']}, T = {config['T']}; in brackets, over "
        "the dense layer's.",
        *table(("connectivity", "connections", "trace",
                *(f"`{m}` time per step" for m in methods)), rows))


def trainer_step(results: Results) -> str:
    run = results("trainer_step.json")
    variants = [*run["variants"], "per_step_floor"]
    rows = [(f"`{model}`", f"`{method}`", *(
        f"{e[v]['step_us']:.0f} µs ({ratio(e[v]['ratio_to_grad'])})" for v in variants))
            for model, methods in run["models"].items() for method, e in methods.items()]
    config = run["config"]
    return captioned(
        f"{source(results, 'trainer_step.json')}: hidden {config['hidden']}, batch "
        f"{config['batch']}, T = {run['T']}; time per step (over the blocked `etrace_grad`'s).",
        *table(("model", "method", *(f"`{v}`" for v in variants)), rows))


def fast_signal(results: Results) -> str:
    run = results("fast_signal.json")
    methods = run["methods"]
    rows = []
    for model, lengths in run["models"].items():
        for length, entries in lengths.items():
            rows.append((f"`{model}`", length, *(
                ratio(entries[m]["ratio_to_bptt"])
                + (f", cosine {entries[m]['cosine']:.3f}" if "cosine" in entries[m] else "")
                for m in methods)))
    config = run["config"]
    return captioned(
        f"{source(results, 'fast_signal.json')}: hidden {config['hidden']}, batch "
        f"{config['batch']}; time per step over BPTT's, cosine of the gradient to BPTT's.",
        *table(("model", "T", *(f"`{m}`" for m in methods)), rows))


def published(results: Results) -> str:
    run = results("published.json")
    models = list(run["models"])
    methods = list(dict.fromkeys(m for e in run["models"].values() for m in e["methods"]))

    def time(e: dict[str, Any]) -> str:
        against = (f" / {ratio(statistics.median(e['ratio_to_published_per_round']))}"
                   if "ratio_to_published_per_round" in e else "")
        return f"{e['ms_per_step']:.3f} ms ({ratio(e['ratio_to_our_bptt'])}{against})"

    def cells(model: str, method: str) -> tuple[str, str]:
        e = run["models"][model]["methods"].get(method)
        return (time(e), f"{e['cosine']:.4f}") if e else (MISSING, MISSING)

    rows = [(f"`{m}`", *(c for model in models for c in cells(model, m))) for m in methods]
    config = run["config"]
    return captioned(
        f"{source(results, 'published.json')}: hidden {config['hidden']}, batch "
        f"{config['batch']}, T = {config['T']}, medians over {run['rounds']} rounds; `pub:` the "
        "published library's methods. Time per step (over our BPTT's / over the published "
        "counterpart's), cosine of the gradient to our BPTT's.",
        *table(("method", *(f"`{model}` {what}" for model in models
                            for what in ("time per step", "cosine"))), rows))


def mingru_credit(results: Results) -> str:
    run = results("mingru_credit.json")
    checkpoints = [str(c) for c in run["config"]["checkpoints"]]
    rows = []
    for t in run["trajectories"]:
        for method in run["config"]["methods"]:
            if method == "bptt":
                continue
            layer = [t["checkpoints"][c][method]["l1"] for c in checkpoints]
            rows.append((f"`{t['spec']}` (seed {t['seed']})", f"`{method}`",
                         *(f"{e['cos']:.3f} / {e['norm_ratio']:.2f}" for e in layer)))
    runs = [*run["trajectories"], *run["hybrids"]]
    return captioned(
        f"{source(results, 'mingru_credit.json')}: {run['task']}; layer 1's gradient at the "
        "Params of one training run (cosine to BPTT's / norm over BPTT's) after each number of "
        "steps:",
        *table(("trained by", "gradient of", *(f"step {c}" for c in checkpoints)), rows), "",
        wrap("Test accuracy after training (`A+l1:B`: A's gradient, layer 1's from B; `zero`: "
             "layer 1 frozen):"), "",
        *table([f"`{r['spec']}`" for r in runs], [[f"{r['test_accuracy']:.3f}" for r in runs]]))


BLOCKS: dict[str, Callable[[Results], str]] = {
    "payoff": readme.payoff,
    "main_job": readme.main_job,
    "main_job_full": lambda r: readme.main_job_run(r, "full", "python -m braintrace"),
    "main_job_quick": lambda r: readme.main_job_run(r, "quick", "python -m braintrace --quick"),
    "algorithms": readme.algorithms,
    "online_rules": online_rules,
    "memory": memory,
    "throughput_cpu": throughput_cpu,
    "throughput_tpu": accelerator.throughput_tpu,
    "throughput_tpu_other": accelerator.throughput_tpu_other,
    "throughput_tpu_floor": accelerator.throughput_tpu_floor,
    "throughput_tpu_fused": accelerator.throughput_tpu_fused,
    "block_sizes_tpu": accelerator.block_sizes_tpu,
    "trace_blocks_tpu": accelerator.trace_blocks_tpu,
    "throughput_tpu_host": accelerator.throughput_tpu_host,
    "fidelity": fidelity,
    "tasks": tasks,
    "training_spiking": training_spiking,
    "sharding": sharding,
    "scale_cpu": scale_cpu,
    "scale_tpu": scale_tpu,
    "scale_tpu_latest": scale_tpu_latest,
    "scale_memory": scale_memory,
    "scale_tpu_floor": sparse_tables.scale_tpu_floor,
    "sparse_probe": sparse_tables.sparse_probe,
    "sparse_kernels": sparse_tables.sparse_kernels,
    "trace_dtype_accuracy": accelerator.trace_dtype_accuracy,
    "sparse": sparse,
    "trainer_step": trainer_step,
    "fast_signal": fast_signal,
    "published": published,
    "mingru_credit": mingru_credit,
    "spyx_compare": spyx_compare,
    "shd_compare": shd_compare,
}
"""Every generated block, by the name its markers carry."""
